"""The centralized oracle (`registry.Algorithm`): non-private SGD with momentum over
every training example, one round an epoch; also the pipeline's pretraining on public
data, so `dp-fedemb train --algorithm centralized` starts from the pretraining recipe
(`recipes.pretrain_values`). The trainer is `training.train_centralized`. No TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tff_algorithms.algorithms import registry, rules
from tff_algorithms.config import recipes


def _pretraining_values(values: Mapping[str, Any]) -> dict[str, Any]:
    return recipes.pretrain_values(values, {})


CENTRALIZED = registry.register(
    registry.Algorithm(
        name="centralized",
        summary="centralized oracle (no clipping, no noise)",
        private=False,
        trainer="tff_algorithms.algorithms.centralized.training:train_centralized",
        accounting_rule=rules.every_user_accounting,
        mechanism=None,
        start_values=_pretraining_values,
        rounds_are="epochs over all training users",
    )
)
