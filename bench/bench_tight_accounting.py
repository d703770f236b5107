"""What the tight accountant buys in utility, at equal target epsilon (issue 43, item 4).

`bench/bench_training.py`'s setting (the same private photo users, the same public
sketches and pretraining, DP-FedEmb with the default recipe at that size). For each
target epsilon, DP-FedEmb is trained twice on the same schedule and noise seeds:

- tight: `target_epsilon` set, so the job calibrates z itself with the default
  accountant (the PLD of the dominating pair of fixed-size sampling without replacement,
  docs/privacy.md, "Tight accounting of fixed-size sampling");
- rdp: the z that dp_accounting's RDP analysis of sampling without replacement needs
  for the same target (the previous default), given as `noise_multiplier`.

Both runs are (target epsilon, delta)-DP: the rdp run's true cost is lower than its
target, at more noise. The utility difference (tight − rdp) is recall@FAR on the
held-out identities with the paired bootstrap interval over identities
(`scoring.compare_saved_models`), beside the noiseless run of the same schedule.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Mapping

from beam_jobs import partition
from bench.bench_training import FULL, QUICK, base_config, prepare, train_each
from tff_algorithms.config import job_config, job_plan
from tff_algorithms.evaluation import scoring
from tff_algorithms.jobs import job_outputs
from tff_algorithms.privacy import accounting_spec, calibration

# The quick size (64 users, half of them a round) cannot reach the smaller targets.
TARGET_EPSILONS = {"full": (2.0, 4.0, 8.0), "quick": (8.0,)}
RESAMPLES = {"full": 1000, "quick": 200}
TIGHT = "tight"
RDP = "rdp"
NOISELESS = "noiseless"


def _describe(config: job_config.TrainJobConfig, result: job_outputs.TrainJobResult) -> dict:
    return {
        "saved_model": result.saved_model_dir,
        "noise_multiplier": result.metrics["noise_multiplier_source"]["noise_multiplier"],
        "epsilon": result.metrics["epsilon"],
        "epsilon_rdp": result.metrics.get("epsilon_rdp"),
        "delta": result.metrics["delta"],
        "rounds": result.metrics["rounds"],
        "recall_at_far": result.recall_at_far,
    }


def rdp_noise_multiplier(
    config: job_config.TrainJobConfig, num_users: int, target_epsilon: float
) -> float:
    """The z the RDP accountant calibrates `config`'s schedule to for `target_epsilon`."""
    fixed = dataclasses.replace(config, noise_multiplier=1.0, target_epsilon=None)
    spec = dataclasses.replace(
        job_plan.accounting_spec_for(fixed, num_users), accountant=accounting_spec.Accountant.RDP
    )
    return calibration.calibrate_noise_multiplier(spec, target_epsilon)


def run(out_dir: str, quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    work = os.path.join(out_dir, "bench_tight_accounting_work")
    shutil.rmtree(work, ignore_errors=True)
    data, _, pretrained = prepare(work, sizes)
    num_users = partition.read_manifest(data[0])["users"]
    base = base_config(sizes)
    size = "quick" if quick else "full"
    targets = TARGET_EPSILONS[size]
    configs: dict[str, job_config.TrainJobConfig] = {NOISELESS: base}
    for epsilon in targets:
        configs[f"{TIGHT}@eps={epsilon:g}"] = dataclasses.replace(
            base, noise_multiplier=None, target_epsilon=epsilon
        )
        configs[f"{RDP}@eps={epsilon:g}"] = dataclasses.replace(
            base, noise_multiplier=rdp_noise_multiplier(base, num_users, epsilon)
        )
    trained = train_each(
        "bench_tight_accounting", configs, data, work, _describe, pretrained.saved_model_dir
    )
    resamples = RESAMPLES[size]
    rows = {}
    for epsilon in targets:
        names = (f"{TIGHT}@eps={epsilon:g}", f"{RDP}@eps={epsilon:g}", NOISELESS)
        if any("saved_model" not in trained[name] for name in names):
            rows[f"{epsilon:g}"] = {name: trained[name] for name in names}
            continue
        compared = scoring.compare_saved_models(
            {name: trained[name]["saved_model"] for name in names}, data[1], resamples
        )
        tight, rdp = names[0], names[1]
        rows[f"{epsilon:g}"] = {
            "tight": _row(trained[tight], compared[tight]),
            "rdp": _row(trained[rdp], compared[rdp]),
            "noise_ratio_tight_over_rdp": (
                trained[tight]["noise_multiplier"] / trained[rdp]["noise_multiplier"]
            ),
            "tight_minus_rdp": compared[tight]["versus"][rdp],
            "tight_minus_noiseless": compared[tight]["versus"][NOISELESS],
        }
    shutil.rmtree(work, ignore_errors=True)
    return {
        "quick": quick,
        "training_users": num_users,
        "schedule": {
            "users_per_virtual_client": base.users_per_virtual_client,
            "virtual_clients_per_round": base.virtual_clients_per_round,
            "rounds": base.rounds,
            "delta": base.delta,
            "schedule_seed": base.schedule_seed,
            "noise_seed": base.noise_seed,
        },
        "bootstrap_resamples": resamples,
        "pretrained_recall_at_far": pretrained.recall_at_far,
        "noiseless": {k: v for k, v in trained[NOISELESS].items() if k != "saved_model"},
        "by_target_epsilon": rows,
    }


def _row(trained: Mapping, scored: Mapping) -> dict:
    return {
        "noise_multiplier": trained["noise_multiplier"],
        "epsilon": trained["epsilon"],
        "epsilon_rdp": trained["epsilon_rdp"],
        "recall_at_far": scored["recall_at_far"],
        "recall_at_far_interval": scored["recall_at_far_interval"],
    }
