"""DP-FedEmb and its two variants, DP-FedAvg and DP-FTRL-FedEmb (`registry.Algorithm`).

Virtual clients of `users_per_virtual_client` users train one round each; the
backbone's update is clipped and noised (`mechanisms`). DP-FedEmb and DP-FTRL-FedEmb
train a local head per virtual client (shared negatives may extend it); DP-FedAvg
trains the backbone and a global head with one optimizer (paper, Alg. 2).
DP-FTRL-FedEmb adds tree-aggregated noise and samples users in epochs. The three
share one section of their own settings, `dp_fedemb` (`settings.SECTION`). The trainers
are `training.train_dp_fedemb` and `train_dp_fedavg`. No TensorFlow here.

The family's implementation lives beside this spec, one builder per process shape as in
TFF: `processes` (`build_fedemb_process`, DP-FedEmb and DP-FTRL-FedEmb, by their
aggregator; `build_fedavg_process`, DP-FedAvg; the server optimizers, with
`server_optimizers`' Adam and LAMB), `client_work` and `local_training` (one virtual
client's round inside TFF), `aggregators` and `mechanisms` (clipping and Gaussian or
tree-aggregated noise, built from the accounting spec), `training` (the trainers),
`shared_negatives` and `shared_negatives_config`. The building blocks other algorithms
use too stay in shared packages: the identity head in `modeling/identity_heads.py`,
client data and the runtime in `federated/`.
"""

from __future__ import annotations

from beam_jobs import schedule
from tff_algorithms.algorithms import registry, rules
from tff_algorithms.algorithms.dp_fedemb import settings
from tff_algorithms.privacy import accounting_spec

DP_FEDEMB = registry.register(
    registry.Algorithm(
        name="dp-fedemb",
        summary="DP-FedEmb: virtual clients train local heads, the backbone's update clipped "
        "and noised",
        private=True,
        trainer="tff_algorithms.algorithms.dp_fedemb.training:train_dp_fedemb",
        accounting_rule=rules.scheduled_accounting,
        mechanism=accounting_spec.Mechanism.DPSGD,
        section=settings.SECTION,
        check_job=settings.check_job,
        check_round_fill=rules.check_schedule_fills,
        local_heads=True,
        cacheable=True,
        pipeline_trains=True,
        canary_audit=True,
        tff_runtime=True,
        server_optimizer=True,
    )
)
DP_FEDAVG = registry.register(
    registry.Algorithm(
        name="dp-fedavg",
        summary="DP-FedAvg: virtual clients train the backbone and a global head",
        private=True,
        trainer="tff_algorithms.algorithms.dp_fedemb.training:train_dp_fedavg",
        accounting_rule=rules.scheduled_accounting,
        mechanism=accounting_spec.Mechanism.DPSGD,
        section=settings.SECTION,
        check_job=settings.check_job,
        check_round_fill=rules.check_schedule_fills,
        # One optimizer trains backbone and global head: at DP-FedEmb's 100 the global
        # head's update fills the clipped delta (BENCHMARKS.md, "Training").
        default_head_lr_scale=1.0,
        cacheable=True,
        pipeline_trains=True,
        tff_runtime=True,
        server_optimizer=True,
    )
)
# Its server step stays momentum SGD: the tree's noise cancels across rounds only in
# a linear step (DP-FTRL), so it refuses server_optimizer adam and lamb.
DP_FTRL_FEDEMB = registry.register(
    registry.Algorithm(
        name="dp-ftrl-fedemb",
        summary="DP-FedEmb with tree-aggregated noise (DP-FTRL), users sampled in epochs",
        private=True,
        trainer="tff_algorithms.algorithms.dp_fedemb.training:train_dp_fedemb",
        accounting_rule=rules.scheduled_accounting,
        mechanism=accounting_spec.Mechanism.DPFTRL,
        schedule_mode=schedule.EPOCH,
        section=settings.SECTION,
        check_job=settings.check_job,
        check_round_fill=rules.check_schedule_fills,
        local_heads=True,
        cacheable=True,
        pipeline_trains=True,
        tff_runtime=True,
    )
)
