"""The cross-run privacy budget: epsilon spent on the same users, over every training.

A `PrivacyLedger` (tff_algorithms.privacy.ledger) accounts for one training run. Training the
same users again spends more of their privacy, so a persistent budget ledger (one JSON
file, shared by every run that should count against the same budget) keeps, per
dataset, the accounting spec of every run charged to it. A run is charged before it
trains, for its whole planned schedule, and refused when the composed epsilon of all
runs on its dataset would exceed the budget, unless the caller explicitly overrides the
budget; an override is written into the ledger entry (and the pipeline puts it in ML
Metadata).

Datasets are identified by `dataset_fingerprint`: SHA-256 over the sorted ids of the
training users. The user, not the image, is the unit of privacy here: a content hash
would give a new fingerprint, and so a fresh budget, to the same people whenever one
image changed (a dedup setting, a re-ingest). Different datasets that reuse user ids are
counted together, which overstates their spending: the safe direction.

Composition (`composed_epsilon`). When every run is accounted with PLD for uniform
sampling (`accounting_spec.default_accountant`), their PLDs (`accounting.uniform_pld`, each
with its releases' Gaussian PLD) are composed, the same pessimistic PLD composition each
run's own epsilon uses: runs on the same users compose adaptively like rounds, each
dominated by its own pair. Otherwise (a ledger holding runs accounted with RDP, a
DP-FTRL run): RDP composes additively, so the RDP curves of all runs
(`accounting.rdp_curve`, the dp_accounting RDP accountant's curve of each run's DpEvent)
are summed order by order and converted to (epsilon, delta) once. This equals
dp_accounting's RDP accountant composing all runs' events in one `ComposedDpEvent`, and
is tighter than adding the runs' epsilons. Runs under the substitute-one relation
(DP-FedEmb, DP-FedAvg) compose under substitute-one. Once a dataset also holds a
DP-FTRL run (add or remove with a special element), everything composes under that
relation: a substitute-one bound holds for the special-element pairs too (replacing a
user by an empty one is one substitution), so the sum is a valid bound there.

A run with shared negatives (issue 22) also released DPLC cluster centers of the same
users: its entry keeps the release plan (``shared_negatives``), and its curve is the
training's plus the releases' (`dplc_releases`, no sampling amplification), so the
budget counts them.
Every run is composed under the strict accounting convention (`accounting_spec.Convention`):
the ledger stores each run's schedule, not its epsilon, so entries written before the
convention existed (specs without a ``convention`` key) are accounted again under strict
when read, never mixed with the paper's arithmetic. A ``paper``-convention run is a
comparison, not a guarantee, and cannot be charged.

The budget itself is fixed by the first charge on a dataset (``budget_epsilon`` in its
entry; a ledger from before kept it per run, and its first run's budget is taken): a
later run that asks for another budget is refused, or, with an explicit override,
charged and recorded as overridden with the budget it asked for. An existing ledger
that is empty, unreadable or read-only is refused, never replaced: a new file would
forget every earlier charge.

Every entry is chained to the one before, and opening the ledger verifies the chains
and, where the caller has them, the product's other records of each charge
(`budget_chain`: a broken chain or a mismatch stops the run in one line, unless the
recorded repair override is given). A `dp-fedemb train` entry names the metrics.json its
run writes (``recorded_in``), which is checked against it when both exist.

Runs are identified by a run id (train_job keeps one per output directory), so a run
that crashes and resumes is charged once.

The ledger file is updated under an exclusive `fcntl` lock (concurrent runs on one
machine or one shared POSIX filesystem serialise) and rewritten atomically: a
temporary file, fsync, rename, fsync of the directory. It must be a local or mounted
path: object stores give neither the lock nor the atomic rename. Its dataset
fingerprints identify users' data, so it is a `secret_files` file: 0600, a directory
created 0700, never written or read through a symlink.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import stat
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from tff_algorithms.base import bounded_load, secret_files, validation
from tff_algorithms.privacy import accounting, accounting_spec, budget_chain, dplc_releases

BUDGET_LEDGER_FORMAT = "dp-fedemb-budget-ledger/1"
FINGERPRINT_SCHEME = "sha256 of sorted training user ids"

_COMPOSABLE_RELATIONS = (
    accounting_spec.NeighboringRelation.REPLACE_ONE,
    accounting_spec.NeighboringRelation.REPLACE_SPECIAL,
)


def dataset_fingerprint(user_ids: Iterable[str]) -> str:
    """The budget key of a training set: SHA-256 over its sorted, distinct user ids."""
    digest = hashlib.sha256(BUDGET_LEDGER_FORMAT.encode())
    for user_id in sorted(set(user_ids)):
        encoded = user_id.encode("utf-8")
        # Length-prefixed, so no two id lists hash the same bytes.
        digest.update(len(encoded).to_bytes(8, "big"))
        digest.update(encoded)
    return digest.hexdigest()


def composition_relation(
    specs: Sequence[accounting_spec.AccountingSpec],
) -> accounting_spec.NeighboringRelation:
    """The relation the runs' joint guarantee holds under (module docstring)."""
    if any(spec.convention is not accounting_spec.Convention.STRICT for spec in specs):
        raise ValueError(
            "a paper-convention run cannot count against a privacy budget (it understates "
            "epsilon): account every run under the strict convention"
        )
    relations = {spec.neighboring_relation for spec in specs}
    unsupported = relations - set(_COMPOSABLE_RELATIONS)
    if unsupported:
        raise ValueError(
            f"no cross-run composition for runs accounted under {sorted(r.value for r in unsupported)}"
        )
    if accounting_spec.NeighboringRelation.REPLACE_SPECIAL in relations:
        return accounting_spec.NeighboringRelation.REPLACE_SPECIAL
    return accounting_spec.NeighboringRelation.REPLACE_ONE


def composed_epsilon(
    specs: Sequence[accounting_spec.AccountingSpec],
    delta: float,
    releases: Sequence[dplc_releases.ReleasePlan | None] | None = None,
) -> float:
    """Epsilon at `delta` of all runs together: their PLDs composed, or their RDP curves
    summed and converted (module docstring).

    `releases`: each run's shared-negatives release plan (None: none), in `specs` order;
    a run's releases over its whole schedule add to its curve.
    """
    if not specs:
        return 0.0
    composition_relation(specs)
    releases = list(releases) if releases is not None else [None] * len(specs)
    if len(releases) != len(specs):
        raise ValueError("composed_epsilon needs one release plan (or None) per run")
    if any(spec.effective_noise_multiplier == 0 for spec in specs):
        return math.inf  # a run without noise has no guarantee, nor has the whole
    if all(
        spec.accountant is accounting_spec.Accountant.PLD
        and spec.sampling is accounting_spec.Sampling.UNIFORM
        for spec in specs
    ):
        composed = None
        for spec, plan in zip(specs, releases):
            pld = accounting.uniform_pld(spec)
            if plan is not None and plan.releases_after(spec.rounds):
                if plan.noise_multiplier == 0:
                    return math.inf
                pld = pld.compose(dplc_releases.release_pld(plan, plan.releases_after(spec.rounds)))
            composed = pld if composed is None else composed.compose(pld)
        return float(composed.get_epsilon_for_delta(delta))
    curves = [accounting.rdp_curve(spec) for spec in specs]
    for i, (spec, plan) in enumerate(zip(specs, releases)):
        if plan is not None:
            curves[i] = curves[i] + dplc_releases.release_rdp_curve(
                plan, plan.releases_after(spec.rounds)
            )
    total = np.sum(curves, axis=0)
    if not np.all(np.isfinite(total)):
        return math.inf
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(accounting.RDP_ORDERS, total, delta)
    return float(epsilon)


@dataclasses.dataclass(frozen=True)
class BudgetPolicy:
    """Where the cross-run ledger lives and what the users' total budget is.

    Attributes:
      ledger_path: the ledger JSON file (created on first use); a local or mounted path.
      total_epsilon: the most epsilon all runs on one dataset may spend together.
      override: start a run that would exceed the budget anyway; recorded.
      accept_repaired_ledger: accept a ledger whose chain or records disagree (the user
        repaired it on purpose): sealed again as it is, and the repair recorded.
    """

    ledger_path: str
    total_epsilon: float
    override: bool = False
    accept_repaired_ledger: bool = False

    def __post_init__(self) -> None:
        if not self.ledger_path:
            raise ValueError("the budget ledger path must not be empty")
        if "://" in self.ledger_path:
            raise ValueError(
                f"budget ledger {self.ledger_path} must be a local or mounted path "
                "(it needs a file lock and an atomic rename)"
            )
        value = self.total_epsilon
        validation.check_real("dataset budget epsilon", value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"dataset budget epsilon must be finite and > 0, got {value}")
        if not isinstance(self.override, bool):
            raise ValueError(f"budget override must be true or false, got {self.override!r}")
        if not isinstance(self.accept_repaired_ledger, bool):
            raise ValueError(
                "the repaired-ledger override must be true or false, got "
                f"{self.accept_repaired_ledger!r}"
            )


@dataclasses.dataclass(frozen=True)
class BudgetCharge:
    """What charging one run did; `to_dict` is what reports and lineage publish."""

    fingerprint: str
    run_id: str
    users: int
    runs: int  # runs charged to the dataset, this one included
    spent_before: float  # composed epsilon of the other runs
    spent_after: float  # composed epsilon with this run
    run_epsilon: float  # this run alone
    delta: float
    total_epsilon: float
    overridden: bool  # this run exceeded the budget and started on an explicit override
    resumed: bool  # the run was already charged (a resumed run is charged once)
    chain: str  # the run's entry's chain (`budget_chain`), what metrics.json and MLMD keep
    ledger_repaired: bool = False  # the ledger was accepted repaired at this charge

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        # Infinite epsilon (no noise) as null: strict JSON.
        return {
            k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in values.items()
        }


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _empty_ledger() -> dict[str, Any]:
    return {"format": BUDGET_LEDGER_FORMAT, "fingerprint": FINGERPRINT_SCHEME, "datasets": {}}


def _check_usable(path: str, *, writing: bool) -> None:
    """A ledger that exists must be readable (and, to be charged, writable) as it is:
    an empty or locked-down one is refused, never replaced by a new one, which would
    forget every earlier charge."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return
    if status.st_size == 0:
        raise ValueError(
            f"budget ledger {path} is empty; it holds the budget's earlier charges, so "
            "restore it from a backup (or remove it on purpose to start a new budget)"
        )
    # Root passes every permission check: the owner's mode bits say what was meant.
    needed = stat.S_IRUSR | (stat.S_IWUSR if writing else 0)
    if status.st_mode & needed != needed or not os.access(
        path, os.R_OK | (os.W_OK if writing else 0)
    ):
        raise ValueError(
            f"budget ledger {path} is not {'readable and writable' if writing else 'readable'} "
            f"(mode {stat.S_IMODE(status.st_mode):04o}); make it so (chmod 600) or give "
            "another ledger"
        )


def _read(path: str, *, writing: bool = True) -> dict[str, Any]:
    _check_usable(path, writing=writing)
    text = secret_files.read_text(path)
    if text is None:
        return {**_empty_ledger(), budget_chain.CHAIN_KEY: budget_chain.CHAIN_SCHEME}
    # The ledger grows with every run: nesting and integers bounded, not its size.
    data = bounded_load.load_json(text, f"budget ledger {path}", bound_size=False)
    if not isinstance(data, dict) or data.get("format") != BUDGET_LEDGER_FORMAT:
        raise ValueError(f"{path} is not a budget ledger (format {BUDGET_LEDGER_FORMAT!r})")
    return data


def _recorded_in_metrics(data: Mapping[str, Any]) -> list[budget_chain.RecordedCharge]:
    """The charges that finished `dp-fedemb train` runs recorded in their metrics.json
    (an entry's ``recorded_in``; a file since removed or not yet written has none)."""
    found = []
    for fingerprint, dataset in data["datasets"].items():
        for entry in dataset["runs"]:
            path = entry.get("recorded_in")
            text = secret_files.read_text(path) if isinstance(path, str) else None
            if text is None:
                continue
            metrics = bounded_load.load_json(text, f"metrics {path}", bound_size=False)
            charge = metrics.get("dataset_budget") if isinstance(metrics, dict) else None
            if isinstance(charge, dict) and charge.get("run_id") == entry["run_id"]:
                found.append(
                    budget_chain.RecordedCharge(
                        fingerprint, entry["run_id"], charge.get("chain"), path
                    )
                )
    return found


def _open(
    path: str,
    recorded: Sequence[budget_chain.RecordedCharge] = (),
    *,
    writing: bool = True,
    accept_repair: bool = False,
) -> tuple[dict[str, Any], budget_chain.Verified]:
    """The ledger, verified (`budget_chain.verify`, with the metrics.json its entries
    name and `recorded`), and what verifying did (a migration, a repair)."""
    data = _read(path, writing=writing)
    verified = budget_chain.verify(
        path, data, [*_recorded_in_metrics(data), *recorded], accept_repair=accept_repair
    )
    return data, verified


def check_ledger(
    path: str,
    recorded: Sequence[budget_chain.RecordedCharge],
    *,
    accept_repair: bool = False,
) -> None:
    """Verifies the ledger at `path` against the charges the product recorded elsewhere
    (`dp-fedemb run`: ML Metadata), before a run charges it; ValueError in one line
    naming the entry. A ledger that does not exist yet has nothing to check."""
    if not os.path.lexists(path):
        return
    with _locked(path):
        data, verified = _open(path, recorded, accept_repair=accept_repair)
        if verified.changed:
            _write_atomically(path, data)


def _write_atomically(path: str, data: Mapping[str, Any]) -> None:
    secret_files.write_text(path, json.dumps(data, indent=1, sort_keys=True, allow_nan=False))


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    secret_files.private_dir(os.path.dirname(os.path.abspath(path)))
    lock = secret_files.open_lock(f"{path}.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        os.close(lock)  # closing releases the lock


def _fixed_budget(dataset: dict[str, Any], policy: BudgetPolicy) -> float:
    """The users' budget, fixed by their first charge (ledgers written before it was kept
    apart: their first run's budget); a later run cannot raise it by asking."""
    if "budget_epsilon" not in dataset:
        runs = dataset["runs"]
        dataset["budget_epsilon"] = runs[0]["total_epsilon"] if runs else policy.total_epsilon
    value = dataset["budget_epsilon"]
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"budget ledger {policy.ledger_path} records a budget of {value!r} for these "
            "users; it is damaged: restore it from a backup"
        )
    return float(value)


def _specs(dataset: Mapping[str, Any]) -> list[accounting_spec.AccountingSpec]:
    return [accounting_spec.AccountingSpec.from_dict(run["spec"]) for run in dataset["runs"]]


def _releases(run: Mapping[str, Any]) -> dplc_releases.ReleasePlan | None:
    plan = run.get("shared_negatives")
    return None if plan is None else dplc_releases.ReleasePlan.from_dict(plan)


def charge_run(
    policy: BudgetPolicy,
    fingerprint: str,
    users: int,
    run_id: str,
    spec: accounting_spec.AccountingSpec,
    releases: dplc_releases.ReleasePlan | None = None,
    recorded_in: str | None = None,
) -> BudgetCharge:
    """Charges a run's planned schedule to its dataset, or refuses it (ValueError).

    `releases`: the run's shared-negatives releases, charged with its schedule.
    `recorded_in`: the metrics.json the run will record its charge in, which later
    openings of the ledger check the entry against.

    A run id already in the ledger is not charged again (a resumed run). Otherwise the
    run is refused when the composed epsilon of the dataset's runs and this one, at this
    run's delta, exceeds `policy.total_epsilon`, unless `policy.override`.
    """
    (charge,) = _charge(
        policy,
        fingerprint,
        users,
        [(run_id, spec, releases)],
        together=False,
        recorded_in=recorded_in,
    )
    return charge


def dataset_spent(ledger_path: str, fingerprint: str, delta: float) -> float:
    """Composed epsilon at `delta` of every run charged to the dataset (0 if none)."""
    with _locked(ledger_path):
        dataset = _open(ledger_path, writing=False)[0]["datasets"].get(fingerprint)
    if not dataset:
        return 0.0
    return composed_epsilon(_specs(dataset), delta, [_releases(run) for run in dataset["runs"]])


def charge_runs(
    policy: BudgetPolicy,
    fingerprint: str,
    users: int,
    runs: Sequence[tuple[str, accounting_spec.AccountingSpec, dplc_releases.ReleasePlan | None]],
) -> float:
    """Charges several planned runs on the same users at once, or none of them.

    For runs that will train one after another from each other's output (private
    pretraining, then the training that starts from its backbone: issue 26): all are
    charged before the first trains, so the first never spends budget that the last
    then cannot get. Refused (ValueError, nothing written) when the composed epsilon of
    the dataset's runs and these, at the last run's delta, exceeds the budget, unless
    `policy.override`. A run id already charged with the same schedule is not charged
    again (a retried execution); `charge_run` with one of these ids later is a resumed
    charge. Returns the composed epsilon after the charge.
    """
    return _charge(policy, fingerprint, users, runs, together=True)[-1].spent_after


def _charge(
    policy: BudgetPolicy,
    fingerprint: str,
    users: int,
    runs: Sequence[tuple[str, accounting_spec.AccountingSpec, dplc_releases.ReleasePlan | None]],
    *,
    together: bool,
    recorded_in: str | None = None,
) -> list[BudgetCharge]:
    """`charge_run` (one run) and `charge_runs` (`together`): charges the runs not yet in
    the ledger, all or none, under one lock, and returns each run's charge.

    A run id already charged must have the same spec and releases (it is resumed, not
    charged again). The composed totals are at the last run's delta, over the dataset's
    other runs (ledger order) and then `runs` (in order): a resumed or retried charge
    composes in the order its first charge did. `together`: the new entries name each
    other (``charged_with``) and a refusal names the runs planned together.
    """
    if not runs:
        raise ValueError("charge_runs needs at least one run")
    delta = runs[-1][1].delta
    with _locked(policy.ledger_path):
        data, verified = _open(policy.ledger_path, accept_repair=policy.accept_repaired_ledger)
        dataset = data["datasets"].setdefault(fingerprint, {"users": users, "runs": []})
        budget_epsilon = _fixed_budget(dataset, policy)
        budget_changed = budget_epsilon != policy.total_epsilon
        charged = {run["run_id"]: run for run in dataset["runs"]}
        for run_id, spec, releases in runs:
            previous = charged.get(run_id)
            if previous is not None and (
                accounting_spec.AccountingSpec.from_dict(previous["spec"]) != spec
                or _releases(previous) != releases
            ):
                raise ValueError(
                    f"run {run_id} is in the budget ledger with another accounting spec; "
                    "refusing to charge it twice"
                )
        ids = {run_id for run_id, _, _ in runs}
        others = [run for run in dataset["runs"] if run["run_id"] not in ids]
        other_specs = [accounting_spec.AccountingSpec.from_dict(run["spec"]) for run in others]
        other_releases = [_releases(run) for run in others]
        spent_before = composed_epsilon(other_specs, delta, other_releases)
        spent_after = composed_epsilon(
            [*other_specs, *(spec for _, spec, _ in runs)],
            delta,
            [*other_releases, *(releases for _, _, releases in runs)],
        )
        new = [run for run in runs if run[0] not in charged]
        if new and budget_changed and not policy.override:
            raise ValueError(
                f"budget ledger {policy.ledger_path} fixed the budget of these {users} "
                f"training users at epsilon {budget_epsilon:g} when they were first charged; "
                f"a budget of {policy.total_epsilon:g} needs an explicit budget override "
                f"(recorded), or give {budget_epsilon:g}"
            )
        over = not spent_after <= budget_epsilon
        if new and over and not policy.override:
            after = "infinite (no noise)" if math.isinf(spent_after) else f"{spent_after:.4g}"
            if together:
                earlier = len(charged)
                before = composed_epsilon(
                    _specs(dataset), delta, [_releases(run) for run in dataset["runs"]]
                )
                planned = f"the {len(runs)} runs planned together would bring"
                start = "start either (an explicit budget override starts them"
            else:
                earlier, before = len(others), spent_before
                planned = "this run would bring"
                start = "start (an explicit budget override starts it"
            raise ValueError(
                f"dataset privacy budget exceeded: {earlier} earlier run(s) on these "
                f"{users} training users (fingerprint {fingerprint[:12]}) spent epsilon "
                f"{before:.4g}; {planned} the composed total to {after} at delta "
                f"{delta:.3g}, over the budget {budget_epsilon:g}; refusing to "
                f"{start} and is recorded)"
            )
        run_epsilons = [
            composed_epsilon([spec], spec.delta, [releases]) for _, spec, releases in runs
        ]
        for (run_id, spec, releases), run_epsilon in zip(runs, run_epsilons):
            if run_id in charged:
                continue
            dataset["runs"].append(
                {
                    "run_id": run_id,
                    "spec": spec.to_dict(),
                    **({} if releases is None else {"shared_negatives": releases.to_dict()}),
                    "run_epsilon": _number(run_epsilon),
                    "spent_after": _number(spent_after),
                    "total_epsilon": budget_epsilon,
                    **({"requested_epsilon": policy.total_epsilon} if budget_changed else {}),
                    "overridden": over or budget_changed,
                    "charged_at": time.time(),
                    **({"charged_with": [r for r, _, _ in runs]} if together else {}),
                    **({} if recorded_in is None else {"recorded_in": recorded_in}),
                }
            )
            budget_chain.seal_last(fingerprint, dataset)
        if new or verified.changed:
            _write_atomically(policy.ledger_path, data)
        chains = {run["run_id"]: run[budget_chain.CHAIN_KEY] for run in dataset["runs"]}
    return [
        BudgetCharge(
            fingerprint,
            run_id,
            users,
            len(dataset["runs"]),
            spent_before,
            spent_after,
            run_epsilon,
            delta,
            budget_epsilon,
            overridden=(
                bool(charged[run_id]["overridden"]) if run_id in charged else over or budget_changed
            ),
            resumed=run_id in charged,
            chain=chains[run_id],
            ledger_repaired=verified.repaired,
        )
        for (run_id, _, _), run_epsilon in zip(runs, run_epsilons)
    ]
