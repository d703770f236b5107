"""The privacy ledger: the epsilon a training run has spent, round by round.

Training records each finished round with `record_round(r)`; the ledger is saved as JSON
in every checkpoint and restored with the model. Epsilon after round r is a function of
the accounting spec and r alone (`accounting.compute_privacy(spec.with_rounds(r))`), so a
run restored at round r and continued records exactly the numbers an uninterrupted run
would. Rounds must be recorded in order, each once: a repeat or a gap is an error, since
either would make the recorded epsilon wrong.

Rounds are numbered from 1; round 0 (before training) costs nothing.

Format 1 ledgers predate the accounting convention (`accounting_spec.Convention`): their
epsilons used the paper's arithmetic, which understates substitute-one epsilon. They are
read as the schedule they store, accounted again under the strict convention (the
default); trees, which both conventions account alike, keep their entries.

Shared negatives (issue 22): a run that releases DPLC cluster centers
(`dplc_releases.ReleasePlan`) records each round's epsilon composed with the releases
made by then (`dplc_releases.composed_privacy`: RDP curves add), and stores the plan
under ``shared_negatives``; a ledger without the key has no releases.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from tff_algorithms.base import bounded_load
from tff_algorithms.privacy import accounting_spec, dplc_releases

LEDGER_FORMAT = "dp-fedemb-privacy-ledger/2"
_LEGACY_FORMAT = "dp-fedemb-privacy-ledger/1"


@dataclasses.dataclass(frozen=True)
class LedgerEntry:
    round: int
    epsilon: float
    zcdp_rho: float | None


def _to_json_number(value: float | None) -> float | None:
    # Infinite epsilon (no noise) is stored as null so the file stays strict JSON.
    return value if value is not None and math.isfinite(value) else None


class PrivacyLedger:
    """Per-round privacy spending of one training run under one `AccountingSpec`.

    The spec describes the planned schedule; `spec.rounds` is the last round that may be
    recorded.
    """

    def __init__(
        self,
        spec: accounting_spec.AccountingSpec,
        releases: dplc_releases.ReleasePlan | None = None,
    ) -> None:
        if releases is not None:
            # Refuses, before any round, a spec the releases cannot compose with.
            dplc_releases.composed_privacy(spec, releases, 1)
        self._spec = spec
        self._releases = releases
        self._entries: list[LedgerEntry] = []

    @property
    def releases(self) -> dplc_releases.ReleasePlan | None:
        """The shared-negatives releases composed into every entry, or None."""
        return self._releases

    @property
    def spec(self) -> accounting_spec.AccountingSpec:
        return self._spec

    @property
    def rounds_recorded(self) -> int:
        return len(self._entries)

    @property
    def history(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far (0 before the first round)."""
        return self.epsilon_at(self.rounds_recorded)

    @property
    def delta(self) -> float:
        return self._spec.delta

    @property
    def epsilon_rdp(self) -> float | None:
        """The RDP accountant's epsilon for the rounds recorded, a labelled cross-check
        beside a PLD epsilon; None when the spec is already accounted with RDP."""
        if self._spec.accountant is not accounting_spec.Accountant.PLD:
            return None
        if self.rounds_recorded == 0:
            return 0.0
        rdp_spec = dataclasses.replace(self._spec, accountant=accounting_spec.Accountant.RDP)
        return dplc_releases.composed_privacy(
            rdp_spec, self._releases, self.rounds_recorded
        ).epsilon

    def epsilon_at(self, round_number: int) -> float:
        if not 0 <= round_number <= self.rounds_recorded:
            raise ValueError(
                f"round {round_number} is not recorded (rounds 0..{self.rounds_recorded} are)"
            )
        return 0.0 if round_number == 0 else self._entries[round_number - 1].epsilon

    def record_round(self, round_number: int) -> LedgerEntry:
        """Account for finished round `round_number`, which must be the next one."""
        expected = self.rounds_recorded + 1
        if isinstance(round_number, bool) or not isinstance(round_number, int):
            raise ValueError(f"round number must be an integer, got {round_number!r}")
        if round_number < expected:
            raise ValueError(
                f"round {round_number} is already recorded (last recorded round: "
                f"{self.rounds_recorded}); recording it again would count it twice"
            )
        if round_number > expected:
            raise ValueError(
                f"round {round_number} recorded out of order: round {expected} is missing"
            )
        if round_number > self._spec.rounds:
            raise ValueError(
                f"round {round_number} exceeds the {self._spec.rounds} rounds of the "
                "accounting spec"
            )
        result = dplc_releases.composed_privacy(self._spec, self._releases, round_number)
        entry = LedgerEntry(round_number, result.epsilon, result.zcdp_rho)
        self._entries.append(entry)
        return entry

    def to_dict(self) -> dict[str, Any]:
        releases = {} if self._releases is None else {"shared_negatives": self._releases.to_dict()}
        return {
            "format": LEDGER_FORMAT,
            "spec": self._spec.to_dict(),
            **releases,
            # Written for readers, never read back: a function of the spec and the rounds.
            "epsilon_rdp": _to_json_number(self.epsilon_rdp),
            "history": [
                {
                    "round": entry.round,
                    "epsilon": _to_json_number(entry.epsilon),
                    "zcdp_rho": _to_json_number(entry.zcdp_rho),
                }
                for entry in self._entries
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        expected_spec: accounting_spec.AccountingSpec | None = None,
        expected_releases: dplc_releases.ReleasePlan | None = None,
    ) -> PrivacyLedger:
        """Restore a ledger; with `expected_spec`, refuse one kept under another schedule
        (or, then, other shared-negatives releases than `expected_releases`)."""
        if not isinstance(data, Mapping) or data.get("format") not in (
            LEDGER_FORMAT,
            _LEGACY_FORMAT,
        ):
            raise ValueError(f"not a privacy ledger (expected format {LEDGER_FORMAT!r})")
        legacy = data["format"] == _LEGACY_FORMAT
        spec_dict = dict(data.get("spec") or {})
        if legacy and "convention" in spec_dict:
            raise ValueError("corrupt privacy ledger: a format 1 ledger names a convention")
        spec = accounting_spec.AccountingSpec.from_dict(spec_dict)
        if expected_spec is not None and spec != expected_spec:
            raise ValueError(
                "the saved privacy ledger was kept under a different accounting spec than "
                "this run's; resuming would misreport epsilon"
            )
        releases = data.get("shared_negatives")
        if releases is not None:
            if legacy:
                raise ValueError("corrupt privacy ledger: a format 1 ledger holds releases")
            releases = dplc_releases.ReleasePlan.from_dict(releases)
        if expected_spec is not None and releases != expected_releases:
            raise ValueError(
                "the saved privacy ledger was kept under other shared-negatives releases than "
                "this run's; resuming would misreport epsilon"
            )
        ledger = cls(spec, releases)
        is_tree = spec.release.noise is accounting_spec.Noise.TREE
        for position, item in enumerate(data.get("history") or [], start=1):
            if item.get("round") != position:
                raise ValueError(
                    f"corrupt privacy ledger: entry {position} is for round {item.get('round')}"
                )
            epsilon, rho = item.get("epsilon"), item.get("zcdp_rho")
            ledger._entries.append(
                LedgerEntry(
                    position,
                    math.inf if epsilon is None else float(epsilon),
                    None if not is_tree else (math.inf if rho is None else float(rho)),
                )
            )
        if ledger.rounds_recorded > spec.rounds:
            raise ValueError(
                f"corrupt privacy ledger: {ledger.rounds_recorded} rounds recorded for a "
                f"{spec.rounds}-round spec"
            )
        if legacy and spec.neighboring_relation is accounting_spec.NeighboringRelation.REPLACE_ONE:
            recorded = ledger.rounds_recorded
            ledger._entries = []
            for round_number in range(1, recorded + 1):
                ledger.record_round(round_number)
        return ledger

    @classmethod
    def from_json(
        cls,
        text: str,
        expected_spec: accounting_spec.AccountingSpec | None = None,
        expected_releases: dplc_releases.ReleasePlan | None = None,
    ) -> PrivacyLedger:
        data = bounded_load.load_json(text, "privacy ledger", bound_size=False)
        return cls.from_dict(data, expected_spec, expected_releases)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrivacyLedger):
            return NotImplemented
        return (
            self._spec == other._spec
            and self._releases == other._releases
            and self._entries == other._entries
        )
