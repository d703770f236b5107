"""One training job: partition in, serving SavedModel + privacy ledger + metrics out.

`run_train_job(config, partition_dir, eval_records, output_dir)` is what `dp-fedemb
train` and the TFX trainer component call, whatever the algorithm. It

1. finds the algorithm's `Algorithm` in the registry (`tff_algorithms/algorithms/`),
   its population (`eligible_users`), the calibrated config, the accounting spec of the
   planned schedule (`job_config`), and refuses to start when the planned rounds cost
   more than `max_epsilon` or a virtual client's identities cannot fit its local head;
2. claims OUTPUT (`job_outputs`: the schedule seed is drawn then), charges the
   cross-run budget, and returns a finished job's outputs untouched;
3. calls the algorithm's trainer (imported now, inside a TFF runtime session where the
   algorithm needs one) with `JobInputs` (`job_inputs`): each trainer checkpoints under
   OUTPUT/checkpoints, so re-running the same job resumes where it stopped and ends
   bit-for-bit where an uninterrupted run ends, and evaluates exact recall@FAR on the
   held-out `eval_records` every `evaluate_every` rounds and after the last;
4. writes OUTPUT/saved_model (backbone only, `export`), OUTPUT/ledger.json and
   OUTPUT/metrics.json (`job_outputs`, which also says what is published and what is
   kept private).

The trainers live with their algorithms: `algorithms/dp_fedemb/training.py` (the
federated TFF process's rounds), `algorithms/centralized/training.py`,
`algorithms/logit_dp/training.py`, `algorithms/user_dp_sgd/training.py` and
`algorithms/fdml/training.py`; each hands the one training loop (`loop.run`) its round.
Both seeds come from OS entropy unless a testing flag
allows a fixed one (`job_config`, `loop_schedule.job_noise_seed`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from beam_jobs import partition, split_protocols
from tff_algorithms import algorithms
from tff_algorithms.base import job_files, owned_files
from tff_algorithms.config.job_config import TrainJobConfig
from tff_algorithms.config.job_plan import accounting_spec_for, release_plan_for
from tff_algorithms.evaluation.scoring import HeldOutEvaluator
from tff_algorithms.federated import (
    runtime,
)
from tff_algorithms.jobs import job_outputs, local_heads, tensorboard_rounds
from tff_algorithms.jobs.job_inputs import JobInputs
from tff_algorithms.jobs.job_outputs import TrainJobResult
from tff_algorithms.modeling import models
from tff_algorithms.privacy import accounting, dplc_releases
from tff_algorithms.privacy import budget as budget_lib


def _check_budget(config: TrainJobConfig, planned: accounting.PrivacyResult) -> None:
    if config.max_epsilon is not None and not planned.epsilon <= config.max_epsilon:
        cost = "infinite (no noise)" if math.isinf(planned.epsilon) else f"{planned.epsilon:.4g}"
        raise ValueError(
            f"over budget: {config.rounds} rounds of {config.algorithm} cost epsilon {cost} at "
            f"delta {planned.delta:.3g}, more than max_epsilon {config.max_epsilon:g}; refusing "
            "to start"
        )


def _each_round(
    *callbacks: Callable[[Mapping[str, Any]], None] | None,
) -> Callable[[Mapping[str, Any]], None] | None:
    given = [callback for callback in callbacks if callback is not None]
    if not given:
        return None

    def each_round(record: Mapping[str, Any]) -> None:
        for callback in given:
            callback(record)

    return each_round


def run_train_job(
    config: TrainJobConfig,
    partition_dir: str,
    eval_records: str,
    output_dir: str,
    pretrained_backbone: str | None = None,
    *,
    progress: Callable[[Mapping[str, Any]], None] | None = None,
    runtime_config: runtime.RuntimeConfig | None = None,
    budget: budget_lib.BudgetPolicy | None = None,
    tensorboard_dir: str | None = None,
    run_id: str | None = None,
    feature_cache_dir: str | None = None,
    split_mode: str = split_protocols.IDENTITY_AND_USER,
) -> TrainJobResult:
    """Trains (or resumes) one job and writes its outputs (module docstring).

    Args:
      config: hyperparameters.
      partition_dir: training users, partitioned by `beam_jobs.partition`.
      eval_records: held-out canonical records (directory or glob;
        `evaluation.record_files`).
      output_dir: checkpoints, saved_model, ledger.json, metrics.json.
      pretrained_backbone: path accepted by `models.load_pretrained_backbone`.
      progress: called with each round's history record (round, epsilon, seconds, eval).
      runtime_config: the TFF workers to train on (several split each round's clients),
        by `runtime.session`: None or the default means the active runtime, or one local
        worker when none is active.
      budget: the cross-run budget of the training users (`budget.charge_run`): the job
        is charged its planned schedule before training, or refused. None: no
        cross-run budget (`max_epsilon` still bounds this run alone).
      tensorboard_dir: where each round's scalars go (`tensorboard_rounds`), or None.
      run_id: the job's id in the budget ledger, for a run charged in advance
        (`budget.charge_runs`: the pipeline charges private pretraining and the training
        after it together); None: a new id (`job_outputs.claim_output_dir`).
      feature_cache_dir: where a job that trains a suffix of the backbone keeps the
        frozen prefix's features (`feature_cache`; keyed, so jobs may share it);
        None: OUTPUT/feature_cache.
      split_mode: the protocol `eval_records` were split by (`beam_jobs.split_protocols.MODES`):
        in held_out_images the evaluation's genuine pairs join two users (`evaluation`).

    Raises:
      ValueError: bad input (not a partition, no evaluation records, too few users for a
        round, over budget, a different job already in `output_dir`, ...).
    """
    started = time.perf_counter()
    reader = partition.PartitionReader(partition_dir)
    user_ids = all_user_ids = reader.user_ids()
    algorithm = algorithms.get(config.algorithm)
    if algorithm.eligible_users is not None:
        # Its population (fdml: the users that can fill s rows).
        user_ids = algorithm.eligible_users(reader, user_ids, config)
    config, noise_source = config.calibrated_for(len(user_ids))
    spec = accounting_spec_for(config, len(user_ids))
    releases = release_plan_for(config)
    # The shared-negatives releases (if any) compose with the training everywhere its
    # epsilon is used: the budget checks, the ledger, metrics.json.
    planned = dplc_releases.composed_privacy(spec, releases)
    _check_budget(config, planned)
    local_heads.check_local_heads_fit(
        config,
        reader.manifest.get(partition.IDENTITIES_PER_USER),
        reader.manifest.get(partition.IDENTITIES),
    )
    evaluator = HeldOutEvaluator(config.backbone_config, eval_records, split_mode)
    pretrained = (
        models.backbone_weights(
            models.load_pretrained_backbone(config.backbone_config, pretrained_backbone)
        )
        if pretrained_backbone
        else None
    )
    claimed = job_outputs.claim_output_dir(
        output_dir, job_outputs.job_record(config, reader), config, run_id
    )
    charge = None
    if budget is not None:  # the centralized oracle, noiseless, exceeds any budget
        charge = budget_lib.charge_run(
            budget,
            # Every training user, so runs on the same users compose whatever they sample.
            budget_lib.dataset_fingerprint(all_user_ids),
            len(all_user_ids),
            claimed.run_id,
            spec,
            releases,
            # Checked against the entry whenever the ledger is opened (budget_chain).
            recorded_in=os.path.join(os.path.abspath(output_dir), job_files.METRICS_FILE),
        )
    # Tightened even when the job is finished: the checkpoints hold the noise state.
    checkpoint_dir = job_outputs.make_checkpoint_dir(output_dir)
    finished = job_outputs.finished_result(output_dir, config)
    if finished is not None:
        if charge is None:
            return finished
        # The files stay as they are; the caller learns the ledger's answer now (resumed,
        # not charged again, or charged in a ledger that had not seen this run).
        metrics = {**finished.metrics, "dataset_budget": charge.to_dict()}
        return dataclasses.replace(finished, metrics=metrics)
    board = None
    if tensorboard_dir is not None:
        # The calibrated noise multiplier: the mechanism as trained.
        board = tensorboard_rounds.TensorBoardRounds(
            tensorboard_dir,
            {"noise_multiplier": config.noise_multiplier, "clip_norm": config.clip_norm},
        )
    inputs = JobInputs(
        config,
        partition_dir,
        reader,
        user_ids,
        spec,
        releases,
        evaluator,
        checkpoint_dir,
        pretrained,
        _each_round(progress, board),
        feature_cache_dir or owned_files.create_entry(output_dir, job_files.FEATURE_CACHE_DIR),
    )
    trainer = algorithm.load_trainer()
    if algorithm.tff_runtime:
        # The caller's runtime, else one for this job; workers that `runtime_config` names
        # run nested over the caller's (stopping them reinstates it).
        with runtime.session(runtime_config, handle_signals=False):
            outcome = trainer(inputs, claimed.schedule_seed)
    else:
        outcome = trainer(inputs, claimed.schedule_seed)
    if board is not None:
        board.close()
    facts = job_outputs.JobFacts(
        noise_source, planned, eval_records, evaluator.labels, len(user_ids), charge, split_mode
    )
    return job_outputs.write_outputs(output_dir, config, outcome, facts, started)
