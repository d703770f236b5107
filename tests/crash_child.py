"""Child process of the every-algorithm crash test (tests/tff_algorithms/jobs/test_crash_safety.py): trains
one algorithm's tiny job and SIGKILLs itself when step (round) K is reported, which is
before that step's checkpoint is saved.

usage: python -m tests.crash_child ALGORITHM PARTITION_DIR EVAL_DIR OUTPUT_DIR K [EXECUTOR]

EXECUTOR: `runtime.RuntimeConfig.executor` (default: worker).

`CRASH_JOBS` holds each registered algorithm's tiny job on `support.small_job_inputs`:
every seed fixed (the schedule and noise seeds behind their testing flags, so two
output directories train the same model), evaluation after every step (so every step
is checkpointed, whatever the loop's cadence), `CRASH_ROUNDS` steps.
"""

import dataclasses
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from tests import support
from tff_algorithms.config import job_config
from tff_algorithms.federated import runtime
from tff_algorithms.jobs import train_job

CRASH_ROUNDS = 4

_FIXED = {
    "rounds": CRASH_ROUNDS,
    "evaluate_every": 1,
    "schedule_seed": 3,
    "testing_fixed_schedule": True,
}
_FEDERATED = dataclasses.replace(support.SMALL_JOB, **_FIXED)
_USER_DP_SGD = job_config.TrainJobConfig(
    algorithm=job_config.DP_SGD_CENTRALIZED,
    noise_multiplier=1.0,
    clip_norm=1.0,
    users_per_virtual_client=1,
    virtual_clients_per_round=8,
    server_learning_rate=0.5,
    server_momentum=0.9,
    head_loss="softmax",
    embedding_size=16,
    seed=1,
    noise_seed=7,
    testing_fixed_noise=True,
    **_FIXED,
)
CRASH_JOBS: Mapping[str, job_config.TrainJobConfig] = {
    job_config.DP_FEDEMB: _FEDERATED,
    job_config.DP_FEDAVG: dataclasses.replace(
        _FEDERATED, algorithm=job_config.DP_FEDAVG, head_capacity=None
    ),
    job_config.DP_FTRL_FEDEMB: dataclasses.replace(_FEDERATED, algorithm=job_config.DP_FTRL_FEDEMB),
    job_config.CENTRALIZED: dataclasses.replace(
        support.SMALL_JOB,
        algorithm=job_config.CENTRALIZED,
        rounds=CRASH_ROUNDS,
        evaluate_every=1,
        server_learning_rate=0.05,
        noise_seed=None,
        testing_fixed_noise=False,
    ),
    job_config.LOGIT_DP: job_config.TrainJobConfig(
        algorithm=job_config.LOGIT_DP,
        noise_multiplier=1.0,
        clip_norm=1.0,
        users_per_virtual_client=1,
        virtual_clients_per_round=14,
        server_learning_rate=0.5,
        server_momentum=0.0,
        embedding_size=16,
        seed=1,
        noise_seed=7,
        testing_fixed_noise=True,
        **_FIXED,
    ),
    job_config.FDML: job_config.TrainJobConfig(
        algorithm=job_config.FDML,
        noise_multiplier=1.0,
        clip_norm=1.0,
        users_per_virtual_client=2,
        virtual_clients_per_round=2,
        settings={"samples_per_user": 4, "derivative_clip": 0.5},
        server_learning_rate=0.01,
        embedding_size=16,
        seed=1,
        noise_seed=7,
        testing_fixed_noise=True,
        **_FIXED,
    ),
    job_config.DP_SGD_CENTRALIZED: _USER_DP_SGD,
    job_config.DP_LAST_LAYER: dataclasses.replace(
        _USER_DP_SGD, algorithm=job_config.DP_LAST_LAYER, trainable_layers=("embedding",)
    ),
}


def _kill_at(step: int) -> Any:
    def progress(record: Mapping[str, Any]) -> None:
        if record["round"] == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return progress


def main(argv: list[str]) -> None:
    algorithm, partition_dir, eval_dir, output_dir, step, *executor = argv
    train_job.run_train_job(
        CRASH_JOBS[algorithm],
        partition_dir,
        eval_dir,
        output_dir,
        progress=_kill_at(int(step)),
        runtime_config=runtime.RuntimeConfig(executor=executor[0]) if executor else None,
    )
    sys.exit(f"step {step} was never reported")


if __name__ == "__main__":
    main(sys.argv[1:])
