"""The models: backbones and identity heads (`models`) and the serving SavedModel
(`export`). May import `base` and `config` (docs/design.md, "Layout").
"""
