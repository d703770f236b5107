"""Federated training with TFF, for every federated algorithm: the runtime, client data,
and one federated round.

`runtime` and `loopback_shim` (the `worker_binary` processes, or with
`runtime.executor` in_process `in_process_executor`: TFF's compiled form of a round run
by the job's own TensorFlow), `client_data` and
`feature_cache` (a virtual client's records, or cached features, loaded inside TFF),
`dropouts` and `rounds` (one round as the training loop's step: deadlines, worker-loss
retries, the minimum of reports; the loop and its checkpoints are `jobs/loop.py`). An
algorithm's processes, client work and mechanisms live in its own package
(DP-FedEmb's: `algorithms/dp_fedemb/`). May import `base`, `privacy`, `config`,
`modeling` and `evaluation` (docs/design.md, "Layout").
"""
