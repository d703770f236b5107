"""The privacy of one model trained by several private runs on the same users (issue 26).

A backbone pretrained with Logit-DP on the training users and then trained with
DP-FedEmb on the same users releases their data through both runs: the model's epsilon
is the composition of the two, not the last run's. `model_composition` writes that down
as one JSON document (the pipeline's PrivateTrain publishes it beside the training's
ledger, `job_files.COMPOSITION_FILE`); the gate, the report, the model card and the
lineage read the model's epsilon from it. A model from one private run has a
composition of one run, so every reader takes the same path.

Composition is the budget's (`budget.composed_epsilon`): each run over the rounds it
recorded, its shared-negatives releases included, their PLDs composed (or, when a run is
accounted with RDP, their RDP curves summed), converted once at the training's delta; runs under the strict convention only. One run's epsilon is its
ledger's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tff_algorithms.privacy import budget
from tff_algorithms.privacy.ledger import PrivacyLedger

COMPOSITION_FORMAT = "dp-fedemb-composition/1"


def model_composition(runs: Sequence[tuple[str, PrivacyLedger]], delta: float) -> dict[str, Any]:
    """The composition document of a model trained by `runs` ((stage, ledger), in order)."""
    if not runs:
        raise ValueError("a model composition needs at least one run")
    if len(runs) == 1:
        # The run's own accountant (RDP or PLD), exactly as its ledger recorded it.
        epsilon = runs[0][1].epsilon
    else:
        specs = [ledger.spec.with_rounds(ledger.rounds_recorded) for _, ledger in runs]
        epsilon = budget.composed_epsilon(specs, delta, [ledger.releases for _, ledger in runs])
    return {
        "format": COMPOSITION_FORMAT,
        "epsilon": epsilon if math.isfinite(epsilon) else None,
        "delta": delta,
        "method": (
            "RDP curves of every run summed order by order (shared-negatives releases "
            "included), then converted once; strict convention"
        ),
        "runs": [
            {
                "stage": stage,
                "mechanism": ledger.spec.mechanism.value,
                "rounds": ledger.rounds_recorded,
                "epsilon": ledger.epsilon if math.isfinite(ledger.epsilon) else None,
                "delta": ledger.delta,
                "spec": ledger.spec.to_dict(),
            }
            for stage, ledger in runs
        ],
    }


def composition_epsilon(composition: Mapping[str, Any]) -> float:
    """The model's epsilon in a composition document (null: infinite, no noise)."""
    value = composition["epsilon"]
    return math.inf if value is None else float(value)
