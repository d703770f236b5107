"""Shared negatives (issue 22, item 3, second half): DP-FedEmb with and without DPLC-released
cluster centers as fixed negatives, at equal total epsilon under the strict convention.

`bench_training`'s setting (synthetic default: 800 training users of one identity each,
public sketch pretraining, the default recipe at 12 virtual clients of 8 users a round,
20 rounds, δ 1e-5). The baseline is DP-FedEmb at z = 2 (ε 7.42). Each shared-negatives
row releases every `every_rounds` rounds and its training noise multiplier is calibrated
(`calibration.calibrate_noise_multiplier(..., releases=plan)`) so that training and
releases together cost the baseline's ε: the releases are paid for with training noise.
Two release settings: many noisy centers of clusters of 128, and a few cleaner ones of
clusters of 512 (noise norm per released center about 1.5 and 0.37 of a unit center
before normalisation). The local heads score the released centers with PrivacyFace's cap
margin, s·cos(max(θ − ρ, 0)) at the release's ρ (`shared_negatives.logit: cap`, its Eq. 5;
the default was this until its full run here, now `row`). The rows without training
noise (z = 0, ε ∞) tell whether the negatives help the local heads at all, apart from
the privacy trade; the last two also release with σ = 1e-3 (centers all but noiseless),
under the cap margin and under the plain head-row scoring s·cos θ (`logit: row`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Mapping

from bench import bench_training
from tff_algorithms.algorithms.dp_fedemb import shared_negatives_config
from tff_algorithms.config import job_config, job_plan
from tff_algorithms.jobs import job_outputs
from tff_algorithms.privacy import accounting, calibration, dplc

FULL = {**bench_training.FULL, "baseline_noise": 2.0}
# The release noise multiplier of the nearly noiseless releases (noise norm ~1e-3).
CLEAN_RELEASE_NOISE = 1e-3
QUICK = {**bench_training.QUICK, "baseline_noise": 2.0}

# name -> SharedNegativesConfig fields, at full and quick size (64 training users).
SETTINGS = {
    "Q4 T128": (
        dict(every_rounds=5, pool_users=512, num_clusters=4, cluster_size=128, margin=1.0,
             noise_multiplier=10.0),
        dict(every_rounds=1, pool_users=32, num_clusters=4, cluster_size=8, margin=1.0,
             noise_multiplier=10.0),
    ),
    "Q2 T512": (
        dict(every_rounds=5, pool_users=640, num_clusters=2, cluster_size=512, margin=1.0,
             noise_multiplier=10.0),
        dict(every_rounds=1, pool_users=48, num_clusters=2, cluster_size=32, margin=1.0,
             noise_multiplier=10.0),
    ),
}  # fmt: skip


def _describe(config: job_config.TrainJobConfig, result: job_outputs.TrainJobResult) -> dict:
    row = {
        **bench_training.held_out_recall(result),
        "noise_multiplier": config.noise_multiplier,
        "epsilon": result.metrics["epsilon"],
        "delta": result.metrics["delta"],
    }
    shared = result.metrics.get("shared_negatives")
    if shared is not None:
        row["shared_negatives"] = {
            **{k: shared[k] for k in ("every_rounds", "pool_users", "num_clusters")},
            **{k: shared[k] for k in ("cluster_size", "margin", "noise_multiplier")},
            "logit": config.shared_negatives.logit,
            "releases": shared["releases"],
            "releases_epsilon": shared["releases_epsilon"],
            # Per released center, before normalisation: noise std x sqrt(d) vs norm <= 1.
            "noise_norm": shared["noise_multiplier"]
            * shared["sensitivity"]
            * math.sqrt(config.embedding_size),
        }
    return row


def _matched(
    base: job_config.TrainJobConfig, shared: Mapping, users: int, target: float
) -> job_config.TrainJobConfig:
    """`base` with shared negatives and the smallest z whose total ε is `target`."""
    with_shared = dataclasses.replace(base, shared_negatives=dict(shared))
    spec = job_plan.accounting_spec_for(with_shared, users)
    z = calibration.calibrate_noise_multiplier(
        spec, target, releases=job_plan.release_plan_for(with_shared)
    )
    return dataclasses.replace(with_shared, noise_multiplier=z)


def run(out_dir: str, quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    work = os.path.join(out_dir, "bench_shared_negatives_work")
    shutil.rmtree(work, ignore_errors=True)
    data, _, pretrained = bench_training.prepare(work, sizes)
    users = int(sizes["identities"] * (1 - bench_training.HELD_OUT_FRACTION))
    base = dataclasses.replace(
        bench_training.base_config(sizes), noise_multiplier=sizes["baseline_noise"]
    )
    target = accounting.compute_privacy(job_plan.accounting_spec_for(base, users)).epsilon
    configs = {f"dp-fedemb@z={base.noise_multiplier:g}": base}
    for name, (full, small) in SETTINGS.items():
        setting = dict(small if quick else full, logit=shared_negatives_config.CAP_LOGIT)
        configs[f"dp-fedemb + shared negatives {name} @eps={target:.3g}"] = _matched(
            base, setting, users, target
        )
    noiseless_setting = SETTINGS["Q2 T512"][1 if quick else 0]
    configs["dp-fedemb@z=0"] = dataclasses.replace(base, noise_multiplier=0.0)
    configs["dp-fedemb + shared negatives Q2 T512 @z=0"] = dataclasses.replace(
        base,
        noise_multiplier=0.0,
        shared_negatives=dict(noiseless_setting, logit=shared_negatives_config.CAP_LOGIT),
    )
    # Releases all but noiseless (σ must be > 0): the negatives at their most informative.
    clean = dict(noiseless_setting, noise_multiplier=CLEAN_RELEASE_NOISE)
    for logit in (shared_negatives_config.CAP_LOGIT, shared_negatives_config.ROW_LOGIT):
        name = f"dp-fedemb + shared negatives Q2 T512 @z=0, release σ {CLEAN_RELEASE_NOISE:g}"
        configs[f"{name}, {logit} logit"] = dataclasses.replace(
            base, noise_multiplier=0.0, shared_negatives=dict(clean, logit=logit)
        )
    rows = bench_training.train_each(
        "bench_shared_negatives", configs, data, work, _describe, pretrained.saved_model_dir
    )
    return {
        "quick": quick,
        "setting": "bench_training's data, pretraining and default recipe (see its docstring)",
        "training_users": users,
        "target_epsilon": target,
        "sensitivity_note": (
            "public queries, one center per user: Delta = 2 sin(min(rho, pi/2)) / T "
            f"(T=128: {dplc.dplc_sensitivity(rho=1.0, cluster_size=128, public_queries=True):.4f})"
        ),
        "pretrained": bench_training.held_out_recall(pretrained),
        "rows": rows,
    }
