"""TFF side of dp-fedemb: models, client work, DP aggregation, accounting, runtime.

Never imports `pipeline` (DESIGN.md section 2).
"""
