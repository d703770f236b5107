"""Held-out evaluation: `scoring` (records in, backbones and SavedModels scored),
`metrics` (recall@FAR, ROC, intervals) and `eer` (the FDML paper's EER accuracy).
May import `base`, `config` and `modeling` (docs/design.md, "Layout").
"""
