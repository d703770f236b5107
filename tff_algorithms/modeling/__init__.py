"""The models: backbones and identity heads (`models`), the serving SavedModel
(`export`) and the optimizers the private step loops apply their noised gradient with
(`optimizers`). May import `base` and `config` (docs/design.md, "Layout").
"""
