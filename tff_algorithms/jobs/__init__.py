"""One training job end to end, whatever its algorithm: inputs in, SavedModel, ledger
and metrics out.

`train_job` (`run_train_job`: the budget check, the trainer from the registry, the
outputs), `job_outputs` (what a job leaves in its output directory), `loop` (the one training
loop an algorithm hands its round to), `checkpoints` (its one checkpoint format and
resume), `tensorboard_rounds`,
`audit` (the one-run privacy audit) and `local_heads` (whether a virtual client's
identities fit its local head; no TFF at import, the pipeline checks it after the split). May import every lower package; algorithm
packages are reached through the registry (docs/design.md, "Layout").
"""
