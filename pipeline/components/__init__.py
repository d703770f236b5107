"""TFX components of the dp-fedemb pipeline (docs/design.md section 7).

Each module holds thin Python function components over `beam_jobs` and
`tff_algorithms`; they live in importable modules so that compiled pipelines
(Kubeflow, Airflow) can reference them by module path.
"""
