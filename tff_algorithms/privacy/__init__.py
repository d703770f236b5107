"""Privacy accounting: every epsilon the product prints is computed here.

`accounting_spec` (the accounting spec of a job: schedule, conventions, bounds),
`accounting` (a spec's epsilon, PLD by default with the RDP cross-check), `wor_pld`
(the tight PLD of fixed-size sampling without replacement), `tree_sensitivity`
(DP-FTRL's tree), `calibration` (noise for a target epsilon),
`ledger` (one run's spending), `budget` and `composition` (spending across runs on the
same users), `dplc` and `dplc_releases` (PrivacyFace's cluster release and its events).
No TensorFlow. May import `base` only (docs/design.md, "Layout" and "Privacy
conventions").
"""
