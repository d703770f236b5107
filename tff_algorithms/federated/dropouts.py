"""Stragglers and failures: over-selection, a minimum report fraction, and round retries.

The client work (`client_work`) turns a virtual client that fails its read, runs past
its step or time budget, or returns a non-finite update into a zero update plus a
`dropped` count, and with over-selection keeps only the first M reporting clients.
This module holds the round-level policy around it:

- Over-selection: a round selects `selected_per_round = ceil(M * (1 + over_selection))`
  virtual clients and keeps the first M that report. The aggregator still divides by
  the planned M and adds noise calibrated to it, whatever number reports.
- Accounting: any selected user may end up in the kept set, so the sampling the
  accountant sees is that of the SELECTED set: users per round = selected virtual
  clients x k (`job_plan.schedule_for` builds the schedule with the selected count, and
  the accounting spec follows from the schedule). Dropouts never lower the reported
  epsilon: the ledger charges each applied round as planned, whoever reported. With
  one user changed, the kept set loses or gains that user's virtual client and at most
  one other enters or leaves in its place, so the change of the clipped sum stays
  within two clipped updates, the replace-one bound the accountant already assumes.
- Minimum report fraction: a round whose kept clients number fewer than
  `min_reports = ceil(min_report_fraction * M)` is not applied. It is retried with the
  same round number and a fresh selection (the schedule's draw for (seed, round,
  attempt), `beam_jobs.schedule`), from the same state, up to `max_attempts` attempts
  in all; then training stops with `RoundBelowMinimumReports` (the last checkpoint
  stays usable and a re-run retries the round).

Privacy of a failed attempt: nothing of it is released. Its output state (the only
noised value) is discarded inside the training loop, never checkpointed, logged or
evaluated, and the retry starts from the previous state, so it even draws the same
noise: releasing a failed attempt would therefore be unsound twice over, and the
program never does. The ledger charges one round per applied round. What the retry
decision does reveal is whether the exact number of reporting clients was below the
minimum; like the schedule's sampling, the accounting treats which clients report as
independent of the users' data (failures of machines and reads). A failure that
depends on a user's data (a non-finite update, a straggler slowed by its data size)
is outside that assumption: keep `min_report_fraction` low enough that such clients
cannot alone cause a retry, or treat each attempt as a released round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow_federated as tff
from absl import logging

from tff_algorithms.config.report_policy import ReportPolicy

# The client-work measurement the minimum applies to.
KEPT_CLIENTS = "kept_clients"
# Client-work measurements counting the ways a virtual client is dropped, and their names.
DROP_REASONS = {
    "failed_reads": "failed reads",
    "timed_out_clients": "timed out",
    "non_finite_updates": "non-finite updates",
}


class RoundBelowMinimumReports(ValueError):
    """Every attempt of a round had fewer reporting virtual clients than the minimum."""


@dataclasses.dataclass(frozen=True)
class RoundOutcome:
    """The applied attempt of a round."""

    output: tff.templates.LearningProcessOutput
    client_ids: Sequence[str]
    attempts: int
    kept_clients: int
    # Reporting virtual clients of each discarded attempt before it (operations counts).
    discarded_kept_clients: tuple[int, ...] = ()


def kept_clients(training_metrics: Mapping[str, Any]) -> int:
    """Virtual clients whose updates a round's aggregate holds, from the process metrics."""
    return int(training_metrics["client_work"][KEPT_CLIENTS])


def drop_reasons(training_metrics: Mapping[str, Any]) -> dict[str, int]:
    """Dropped virtual clients of a round by DROP_REASONS key, from the process metrics."""
    work = training_metrics["client_work"]
    return {key: int(work[key]) for key in DROP_REASONS}


def _reasons_text(reasons: Mapping[str, int]) -> str:
    return ", ".join(f"{reasons[key]} {name}" for key, name in DROP_REASONS.items())


def run_round(
    process: tff.learning.templates.LearningProcess,
    state: Any,
    round_num: int,
    clients_for_attempt: Callable[[int, int], Sequence[str]],
    policy: ReportPolicy,
) -> RoundOutcome:
    """Runs round `round_num` from `state`, retrying while too few clients report.

    Args:
      process: its `next` takes (state, virtual-client ids).
      clients_for_attempt: (round, attempt) -> the attempt's virtual-client ids.
      policy: the minimum and the number of attempts.

    Raises:
      RoundBelowMinimumReports: no attempt reached `policy.min_reports`.
    """
    counts = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    for attempt in range(policy.max_attempts):
        client_ids = list(clients_for_attempt(round_num, attempt))
        output = process.next(state, client_ids)
        kept = kept_clients(output.metrics)
        if kept >= policy.min_reports:
            return RoundOutcome(output, client_ids, attempt + 1, kept, tuple(counts))
        counts.append(kept)
        reasons = drop_reasons(output.metrics)
        dropped = {key: dropped[key] + count for key, count in reasons.items()}
        # Only counts are logged: the attempt's output is discarded, never released.
        logging.warning(
            "round %d attempt %d: %d of %d planned virtual clients reported, below the "
            "minimum %d (dropped: %s); %s",
            round_num + 1,
            attempt + 1,
            kept,
            policy.virtual_clients_per_round,
            policy.min_reports,
            _reasons_text(reasons),
            "retrying with a fresh selection"
            if attempt + 1 < policy.max_attempts
            else "no attempts left",
        )
    # Non-finite updates mean local training diverged, which retries cannot mend.
    advice = (
        "local training diverged: lower client_learning_rate or head_lr_scale"
        if dropped["non_finite_updates"] > 0
        else "check the failed reads and timeouts in the log"
    )
    raise RoundBelowMinimumReports(
        f"round {round_num + 1}: {policy.max_attempts} attempts had {counts} reporting "
        f"virtual clients, below the minimum {policy.min_reports} of "
        f"{policy.virtual_clients_per_round} (min_report_fraction "
        f"{policy.min_report_fraction:g}; dropped: {_reasons_text(dropped)}); not applied, "
        f"{advice}; re-running resumes at this round"
    )
