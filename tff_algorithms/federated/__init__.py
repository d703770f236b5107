"""Federated training with TFF: the runtime, client data and work, processes, the
aggregators that hold the privacy mechanism, and one federated round.

`runtime` and `loopback_shim` (the `worker_binary` processes), `client_data` and
`feature_cache` (a virtual client's records, or cached features, loaded inside TFF),
`client_work` and `local_training` (a virtual client's local training), `aggregators`
and `mechanisms` (clipping and noise, built from the accounting spec), `processes`
(the learning processes), `dropouts` and `rounds` (one round as the training loop's
step: deadlines, worker-loss retries, the minimum of reports; the loop and its
checkpoints are `jobs/loop.py`). May import `base`, `privacy`, `config`, `modeling` and `evaluation`
(docs/design.md, "Layout").
"""
