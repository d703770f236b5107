"""The lowest layer: checks of one configuration value and the files a job owns.

`validation` (one-value checks every config dataclass shares), `bounded_load` (the one
reader of YAML and JSON a user wrote), `secret_files` (files that hold secrets),
`owned_files` (what a command created and so may remove) and `job_files` (the names in
a training job's output directory). No TensorFlow, and nothing else from
`tff_algorithms`: every other package may import this one (docs/design.md, "Layout").
"""
