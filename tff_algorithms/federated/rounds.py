"""One round of a federated TFF process (DP-FedEmb, DP-FTRL-FedEmb, DP-FedAvg), as the
training loop's step runs it (`jobs/loop.py`; `algorithms/dp_fedemb/training.py` hands
the loop a step that calls `run_round`).

The process's client argument is a list of virtual-client ids (data is loaded inside
TFF from the id); `clients_for_round` gives the ids of a round (the schedule). The round
runs under the runtime's deadline (`runtime.TffRuntime.run_round`): a worker lost
mid-round is replaced or dropped and the round tried again from the same state, or
training stops with one line. A round with too few reports is retried with a fresh
selection (`dropouts.run_round`). Only the applied round's output leaves this module:
the loop charges and checkpoints it, never a failed attempt.

Metrics the process computes on training users are not covered by the privacy
guarantee (docs/design.md section 5); they are logged for debugging only, and the
caller keeps only the operations counts of the data-independent schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow_federated as tff
from absl import logging

from tff_algorithms.config.report_policy import ReportPolicy
from tff_algorithms.federated import dropouts, runtime


@dataclasses.dataclass(frozen=True)
class AppliedRound:
    """The round's output (state and training-user metrics), the virtual clients it ran,
    and the kept clients of attempts discarded below the minimum of reports."""

    output: Any
    client_ids: list[str]
    discarded_kept_clients: list[int]


def run_round(
    process: tff.learning.templates.LearningProcess,
    state: Any,
    round_num: int,
    clients_for_round: Callable[..., Sequence[str]],
    report_policy: ReportPolicy | None,
) -> AppliedRound:
    """Round `round_num` (0-based) from `state`, retried as the module docstring says.

    `clients_for_round(round)` gives the round's ids; with a `report_policy` it is
    called as (round, attempt) for a retry's fresh selection. None: every round applies.
    """

    def attempt() -> AppliedRound:
        if report_policy is None:
            client_ids = list(clients_for_round(round_num))
            return AppliedRound(process.next(state, client_ids), client_ids, [])
        applied = dropouts.run_round(process, state, round_num, clients_for_round, report_policy)
        return AppliedRound(
            applied.output, list(applied.client_ids), list(applied.discarded_kept_clients)
        )

    workers = runtime.current()
    result = attempt() if workers is None else workers.run_round(round_num + 1, attempt)
    logging.info("round %d: %d virtual clients", round_num + 1, len(result.client_ids))
    logging.debug(
        "round %d training-user metrics (not private): %s", round_num + 1, result.output.metrics
    )
    return result
