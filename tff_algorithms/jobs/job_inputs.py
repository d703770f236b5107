"""What a trainer starts from: `JobInputs`, resolved by `train_job.run_train_job`.

Its own module, so the algorithms' trainers import it without importing the job runner
that calls them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow_federated as tff

from beam_jobs import partition
from tff_algorithms.config.job_config import TrainJobConfig
from tff_algorithms.evaluation.scoring import HeldOutEvaluator
from tff_algorithms.privacy import accounting_spec, dplc_releases


@dataclasses.dataclass(frozen=True)
class JobInputs:
    """What both training loops start from, resolved by `run_train_job`.

    Attributes:
      config: the calibrated config (`TrainJobConfig.calibrated_for`).
      partition_dir / reader / user_ids: the training users' partition.
      spec: the accounting spec of the planned schedule.
      releases: the shared-negatives releases the ledger composes with it, or None.
      evaluator: held-out evaluation of backbone weights.
      checkpoint_dir: OUTPUT/checkpoints.
      pretrained: the initial backbone, or None for the seeded initialisation.
      progress: called with each round's history record, or None.
      feature_cache_dir: where caches of frozen-prefix features live (`feature_cache`).
    """

    config: TrainJobConfig
    partition_dir: str
    reader: partition.PartitionReader
    user_ids: list[str]
    spec: accounting_spec.AccountingSpec
    releases: dplc_releases.ReleasePlan | None
    evaluator: HeldOutEvaluator
    checkpoint_dir: str
    pretrained: tff.learning.models.ModelWeights | None
    progress: Callable[[Mapping[str, Any]], None] | None
    feature_cache_dir: str
