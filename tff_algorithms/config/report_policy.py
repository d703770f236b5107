"""How many virtual clients a round selects, how many it needs, and how often it is
retried (`dropouts` applies the policy). No TensorFlow at import."""

from __future__ import annotations

import dataclasses
import math

from beam_jobs import schedule
from tff_algorithms.base import validation


@dataclasses.dataclass(frozen=True)
class ReportPolicy:
    """How many virtual clients a round selects, needs, and how often it is retried.

    Attributes:
      virtual_clients_per_round: M, the planned number (the aggregator's denominator).
      over_selection: o >= 0; the round selects ceil(M * (1 + o)) virtual clients.
      min_report_fraction: a round is applied only if at least ceil(f * M) virtual
        clients are kept; 0 applies every round.
      max_attempts: attempts per round, the first included.
    """

    virtual_clients_per_round: int
    over_selection: float = 0.0
    min_report_fraction: float = 0.0
    max_attempts: int = 1

    def __post_init__(self) -> None:
        validation.check_int("virtual_clients_per_round", self.virtual_clients_per_round, 1)
        if not (math.isfinite(self.over_selection) and self.over_selection >= 0):
            raise ValueError(f"over_selection must be >= 0, got {self.over_selection}")
        if not 0 <= self.min_report_fraction <= 1:
            raise ValueError(
                f"min_report_fraction must be in [0, 1], got {self.min_report_fraction}"
            )
        validation.check_int("max_attempts", self.max_attempts, 1)

    @property
    def selected_per_round(self) -> int:
        return schedule.selected_per_round(self.virtual_clients_per_round, self.over_selection)

    @property
    def min_reports(self) -> int:
        return math.ceil(self.virtual_clients_per_round * self.min_report_fraction - 1e-9)

    @property
    def max_reports(self) -> int | None:
        """Reports to keep: M when over-selecting, else None (keep every report)."""
        if self.selected_per_round > self.virtual_clients_per_round:
            return self.virtual_clients_per_round
        return None
