"""Tamper evidence for the cross-run budget ledger (`budget.py`; issue 63).

The ledger is a file its user can edit: a budget edited from 100 to 12, the last run
deleted and the first run's rounds changed from 3 to 1 once let a refused run train.
Each entry is therefore chained: its ``chain`` is the SHA-256 of the previous entry's
``chain`` and of the entry itself (its accounting spec, releases, run id, budget,
override facts), and the first entry's predecessor is a hash of the dataset fingerprint
and the budget (so the budget is fixed in the first entry, and entries copied from
another dataset do not verify). Opening the ledger verifies every chain, and the caller
cross-checks it against what the product recorded elsewhere when it charged a run
(`RecordedCharge`: ML Metadata's PrivacyLedger properties, each run's metrics.json): a
run recorded there must be in the ledger with the same chain. A broken chain or a
mismatch stops with one line naming the entry.

A user who repairs a ledger on purpose (restored from an older backup, an entry removed
for a run whose data was deleted) re-runs with the repair override: the chains are
sealed again from the ledger as it is, the mismatches found are accepted, and the repair
is recorded in the ledger (``repairs``: when, why, which runs) and in the charge.

A ledger written before the chain (no ``chain`` scheme at its top) is sealed as it is
when first written by this release, recorded as ``migrated_at``: its entries are trusted
as found, and a record elsewhere that disagrees with them still stops the run.

What this cannot stop: someone who rewrites the ledger and every record of it (ML
Metadata, metrics.json) consistently; a hash chain needs no key, so it shows careless
edits, copies and lost entries, not a determined operator (docs/privacy.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

CHAIN_SCHEME = "sha256 of the previous entry's chain and the entry/1"
CHAIN_KEY = "chain"
REPAIRS_KEY = "repairs"
REPAIR_SETTING = (
    "the repaired-ledger override (dp-fedemb train --accept-repaired-budget-ledger, "
    "pipeline budget.accept_repaired_ledger: true; recorded in the ledger)"
)


@dataclasses.dataclass(frozen=True)
class RecordedCharge:
    """A charge as the product recorded it outside the ledger.

    Attributes:
      fingerprint: the dataset fingerprint it was charged to.
      run_id: its run id in the ledger.
      chain: the entry's chain when it was charged (None: recorded before chains).
      source: where it was recorded, for the error line (an artifact, a file).
    """

    fingerprint: str
    run_id: str
    chain: str | None
    source: str


def _digest(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _genesis(fingerprint: str, dataset: Mapping[str, Any]) -> str:
    runs = dataset["runs"]
    budget = dataset.get("budget_epsilon", runs[0]["total_epsilon"] if runs else None)
    return _digest(CHAIN_SCHEME, fingerprint, budget)


def _entry_digest(previous: str, entry: Mapping[str, Any]) -> str:
    return _digest(previous, {k: v for k, v in entry.items() if k != CHAIN_KEY})


def seal_last(fingerprint: str, dataset: MutableMapping[str, Any]) -> str:
    """Chains the dataset's newest entry to the one before; returns its chain."""
    runs = dataset["runs"]
    previous = runs[-2][CHAIN_KEY] if len(runs) > 1 else _genesis(fingerprint, dataset)
    runs[-1][CHAIN_KEY] = _entry_digest(previous, runs[-1])
    return runs[-1][CHAIN_KEY]


def _seal_all(data: MutableMapping[str, Any]) -> None:
    for fingerprint, dataset in data["datasets"].items():
        previous = _genesis(fingerprint, dataset)
        for entry in dataset["runs"]:
            entry[CHAIN_KEY] = previous = _entry_digest(previous, entry)
    data[CHAIN_KEY] = CHAIN_SCHEME


def _broken_chain(path: str, data: Mapping[str, Any]) -> str | None:
    """The error line for the first entry whose chain does not verify, else None."""
    for fingerprint, dataset in data["datasets"].items():
        if not dataset["runs"]:
            continue
        previous = _genesis(fingerprint, dataset)
        for number, entry in enumerate(dataset["runs"], 1):
            expected = _entry_digest(previous, entry)
            if entry.get(CHAIN_KEY) != expected:
                return (
                    f"budget ledger {path}: entry {number} (run {entry.get('run_id')}) of the "
                    f"users {fingerprint[:12]} was changed after it was charged (its chain "
                    "does not match: its spec, its budget or an entry before it was "
                    f"edited); restore the ledger from a backup, or, if you repaired it on "
                    f"purpose, re-run with {REPAIR_SETTING}"
                )
            previous = expected
    return None


def _mismatches(
    path: str, data: Mapping[str, Any], recorded: Iterable[RecordedCharge]
) -> list[tuple[str, str]]:
    """(run id, error line) for each recorded charge the ledger contradicts."""
    accepted = {run for repair in data.get(REPAIRS_KEY, []) for run in repair["accepted_runs"]}
    found = []
    for record in recorded:
        if record.run_id in accepted:
            continue
        dataset = data["datasets"].get(record.fingerprint) or {"runs": []}
        numbered = {e["run_id"]: (n, e) for n, e in enumerate(dataset["runs"], 1)}
        if record.run_id not in numbered:
            found.append(
                (
                    record.run_id,
                    f"budget ledger {path} lacks run {record.run_id}, which {record.source} "
                    f"records as charged to the users {record.fingerprint[:12]} (an entry was "
                    "removed, or this is another ledger); restore the ledger from a backup, "
                    f"or, if you repaired it on purpose, re-run with {REPAIR_SETTING}",
                )
            )
            continue
        number, entry = numbered[record.run_id]
        if record.chain is not None and entry.get(CHAIN_KEY) != record.chain:
            found.append(
                (
                    record.run_id,
                    f"budget ledger {path}: entry {number} (run {record.run_id}) differs from "
                    f"what {record.source} recorded when it was charged; restore the ledger "
                    f"from a backup, or, if you repaired it on purpose, re-run with "
                    f"{REPAIR_SETTING}",
                )
            )
    return found


@dataclasses.dataclass(frozen=True)
class Verified:
    """What `verify` did: `changed` (the ledger must be written: sealed or repaired),
    `repaired` (a repair was accepted and recorded)."""

    changed: bool
    repaired: bool


def verify(
    path: str,
    data: MutableMapping[str, Any],
    recorded: Iterable[RecordedCharge] = (),
    *,
    accept_repair: bool = False,
) -> Verified:
    """Checks the ledger's chains and `recorded` (ValueError, one line, naming the first
    bad entry); seals a ledger from before the chain (module docstring). With
    `accept_repair`, a failing ledger is sealed again as it is and the repair recorded
    instead."""
    recorded = list(recorded)
    entries = [entry for dataset in data["datasets"].values() for entry in dataset["runs"]]
    # Before the chain: no entry has one (a ledger whose marker alone was removed is not).
    if data.get(CHAIN_KEY) != CHAIN_SCHEME and not any(CHAIN_KEY in e for e in entries):
        _seal_all(data)
        data["migrated_at"] = time.time()
        changed = True
    else:
        changed = False
    problem = _broken_chain(path, data)
    if problem is not None and not accept_repair:
        raise ValueError(problem)
    if problem is not None:
        _seal_all(data)
    mismatches = _mismatches(path, data, recorded)
    if mismatches and not accept_repair:
        raise ValueError(mismatches[0][1])
    if problem is None and not mismatches:
        return Verified(changed, repaired=False)
    data.setdefault(REPAIRS_KEY, []).append(
        {
            "at": time.time(),
            "reason": problem or mismatches[0][1],
            "accepted_runs": sorted({run for run, _ in mismatches}),
        }
    )
    return Verified(changed=True, repaired=True)
