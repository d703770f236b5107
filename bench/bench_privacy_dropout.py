"""Utility under client failures (issue 8 item 2): DP-FedEmb at 0%, 10% and 30% dropout.

Same data, public-pretrained start, schedule and hyperparameters as `bench_training`
(its base config); a
fraction of the virtual clients is made to fail its read (`failure_injection_rate`, a
real op error inside the client computation), so those clients contribute zero while
the aggregate still divides by the planned number and the noise stays calibrated to
it. A round with fewer than half the planned clients reporting is retried
(`min_report_fraction` 0.5, 3 attempts). Reported: recall@FAR on held-out identities,
the ledger's epsilon (the same at every failure rate: accounting follows the plan),
and the dropped / kept client totals.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from bench import bench_training
from tff_algorithms.config import job_config
from tff_algorithms.jobs import job_outputs

_FAILURE_RATES = (0.0, 0.1, 0.3)
# bench_training's largest noise multiplier.
_NOISE = (1.0,)
_MIN_REPORT_FRACTION = 0.5


def run(out_dir: str, quick: bool) -> dict:
    sizes = bench_training.QUICK if quick else bench_training.FULL
    work = os.path.join(out_dir, "bench_privacy_dropout_work")
    shutil.rmtree(work, ignore_errors=True)
    data, _, pretrained = bench_training.prepare(work, sizes)
    base = dataclasses.replace(
        bench_training.base_config(sizes),
        min_report_fraction=_MIN_REPORT_FRACTION,
        max_round_attempts=3,
    )
    configs = {
        f"z={noise:g}@failures={rate:g}": dataclasses.replace(
            base, noise_multiplier=noise, failure_injection_rate=rate
        )
        for noise in _NOISE
        for rate in _FAILURE_RATES
    }
    runs = bench_training.train_each(
        "bench_privacy_dropout", configs, data, work, _describe, pretrained.saved_model_dir
    )
    return {
        "quick": quick,
        "data": {
            "identities": sizes["identities"],
            "images_per_identity": sizes["images"],
            "held_out_fraction": bench_training.HELD_OUT_FRACTION,
        },
        "schedule": {
            "users_per_virtual_client": base.users_per_virtual_client,
            "virtual_clients_per_round": base.virtual_clients_per_round,
            "rounds": base.rounds,
            "clip_norm": base.clip_norm,
            "min_report_fraction": base.min_report_fraction,
            "max_round_attempts": base.max_round_attempts,
        },
        "runs": runs,
    }


def _describe(config: job_config.TrainJobConfig, result: job_outputs.TrainJobResult) -> dict:
    return {
        "noise_multiplier": config.noise_multiplier,
        "failure_injection_rate": config.failure_injection_rate,
        **bench_training.held_out_recall(result),
        "epsilon": result.metrics["epsilon"],
        "delta": result.metrics["delta"],
        "client_failures": result.metrics["client_failures"],
        "wall_seconds": result.metrics["wall_seconds"],
    }
