"""What a training job is asked to do: its configuration, recipes and model choice.

`job_config` (`TrainJobConfig`), `job_plan` (the schedule and accounting spec a
`TrainJobConfig` implies), `recipes` (named sets of its values), `model_config` (which backbone), `client_config` (a virtual
client's local training), `report_policy` (how many virtual clients a round needs) and
`executors` (what runs a round's TFF computation).
No TensorFlow at import. May import `base`, `privacy` and the algorithm registry with its
TensorFlow-free specs (`tff_algorithms.algorithms`; docs/design.md, "Layout").
"""
