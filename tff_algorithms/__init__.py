"""TFF side of dp-fedemb: models, client work, DP aggregation, accounting, runtime.

Never imports `pipeline` (docs/design.md section 2).
"""
