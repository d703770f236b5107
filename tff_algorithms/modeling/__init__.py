"""The models: backbones and identity heads (`models`), the identity head's keys, logits
and loss that every algorithm training a head shares (`identity_heads`), the serving SavedModel
(`export`) and the optimizers the private step loops apply their noised gradient with
(`optimizers`). May import `base` and `config` (docs/design.md, "Layout").
"""
