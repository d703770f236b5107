"""The budget ledger shows tampering (`tff_algorithms/privacy/budget_chain.py`; issue 63):
each edit the issue reproduced is refused in one line naming the entry; a repair is
accepted only on the recorded override; a ledger from before the chain is sealed."""

import dataclasses
import hashlib
import json
import re

import pytest

from tff_algorithms.privacy import accounting_spec, budget, budget_chain

# The issue's runs: three rounds each, on a budget of 100 first.
SPEC = accounting_spec.AccountingSpec(
    population=1000, users_per_round=50, rounds=3, noise_multiplier=1.2, delta=1e-5
)
FINGERPRINT = budget.dataset_fingerprint(["a", "b", "c"])


def _ledger_with_two_runs(tmp_path, total=100.0):
    path = tmp_path / "ledger.json"
    policy = budget.BudgetPolicy(str(path), total)
    charges = []
    for run in ("run-1", "run-2"):
        metrics = tmp_path / f"{run}-metrics.json"
        charge = budget.charge_run(policy, FINGERPRINT, 1000, run, SPEC, recorded_in=str(metrics))
        # What the train job writes when it finishes (job_outputs: "dataset_budget").
        metrics.write_text(json.dumps({"dataset_budget": charge.to_dict()}))
        charges.append(charge)
    return path, policy, charges


def _edit(path, change) -> None:
    data = json.loads(path.read_text())
    change(data["datasets"][FINGERPRINT], data)
    path.write_text(json.dumps(data))


def _rechain(dataset, fingerprint=FINGERPRINT) -> None:
    """What a tool that knows the scheme would do after editing: recompute every chain."""
    data = {"datasets": {fingerprint: dataset}}
    budget_chain._seal_all(data)


def _refused(action, match: str) -> str:
    with pytest.raises(ValueError, match=match) as refused:
        action()
    assert "\n" not in str(refused.value)
    return str(refused.value)


def _set_budget(dataset, _):
    dataset["budget_epsilon"] = 12.0


def _set_budget_everywhere(dataset, _):
    dataset["budget_epsilon"] = 12.0
    for run in dataset["runs"]:
        run["total_epsilon"] = 12.0


def _first_run_one_round(dataset, _):
    dataset["runs"][0]["spec"]["rounds"] = 1


@pytest.mark.parametrize(
    ("edit", "entry"),
    [
        (_set_budget, "entry 1 (run run-1)"),
        (_set_budget_everywhere, "entry 1 (run run-1)"),
        (_first_run_one_round, "entry 1 (run run-1)"),
        # The second entry is chained to the first: it breaks too when the first is
        # edited and only the first is "fixed" again.
        (lambda d, _: (_first_run_one_round(d, _), _rechain(d), d["runs"][1].update(chain="0")),
         "entry 2 (run run-2)"),
    ],
)  # fmt: skip
def test_each_edit_of_budget_or_spec_is_refused_naming_the_entry(tmp_path, edit, entry):
    path, _, _ = _ledger_with_two_runs(tmp_path)
    _edit(path, edit)
    edited = path.read_bytes()
    message = _refused(
        lambda: budget.charge_run(
            budget.BudgetPolicy(str(path), 12.0), FINGERPRINT, 1000, "r3", SPEC
        ),
        "was changed after it was charged",
    )
    assert entry in message and "--accept-repaired-budget-ledger" in message
    # Reading the ledger is refused too; nothing was written.
    _refused(lambda: budget.dataset_spent(str(path), FINGERPRINT, SPEC.delta), re.escape(entry))
    assert path.read_bytes() == edited


def test_the_issue_sequence_deleting_the_last_run_and_editing_rounds_is_refused(tmp_path):
    """The probe: refused (here at a budget of 5.3: two runs spend 5.08, a third would
    bring 5.56), it deleted the last run and set the first run's rounds to 1 so that the
    same charge would fit."""
    path, policy, _ = _ledger_with_two_runs(tmp_path, total=5.3)
    _refused(
        lambda: budget.charge_run(policy, FINGERPRINT, 1000, "run-3", SPEC), "over the budget 5.3"
    )

    def delete_last_and_edit(dataset, _):
        del dataset["runs"][-1]
        dataset["runs"][0]["spec"]["rounds"] = 1

    _edit(path, delete_last_and_edit)
    message = _refused(
        lambda: budget.charge_run(policy, FINGERPRINT, 1000, "run-3", SPEC), "was changed"
    )
    assert "entry 1 (run run-1)" in message


def test_a_deleted_last_entry_is_refused_against_what_the_product_recorded(tmp_path):
    """The chain of what remains verifies; the run's own record (ML Metadata's, given
    here as `dp-fedemb run` gathers it) names the entry the ledger lost."""
    path, policy, charges = _ledger_with_two_runs(tmp_path)
    _edit(path, lambda dataset, _: dataset["runs"].pop())
    recorded = [
        budget_chain.RecordedCharge(c.fingerprint, c.run_id, c.chain, "ML Metadata (artifact 7)")
        for c in charges
    ]
    budget.check_ledger(str(path), recorded[:1])  # the remaining entries verify
    message = _refused(
        lambda: budget.check_ledger(str(path), recorded), "lacks run run-2, which ML Metadata"
    )
    assert FINGERPRINT[:12] in message


def test_a_rechained_edit_is_refused_against_the_runs_metrics_json(tmp_path):
    """Recomputing the chains after an edit verifies the chain, not the run's metrics.json,
    which kept the chain of its charge."""
    path, policy, _ = _ledger_with_two_runs(tmp_path)

    def edit_and_rechain(dataset, data):
        _first_run_one_round(dataset, data)
        _rechain(dataset)

    _edit(path, edit_and_rechain)
    message = _refused(
        lambda: budget.charge_run(policy, FINGERPRINT, 1000, "r3", SPEC),
        "entry 1 \\(run run-1\\) differs from what",
    )
    assert str(tmp_path / "run-1-metrics.json") in message


def test_entries_copied_from_another_dataset_do_not_verify(tmp_path):
    path, policy, _ = _ledger_with_two_runs(tmp_path)
    other = budget.dataset_fingerprint(["x"])

    def move(dataset, data):
        data["datasets"][other] = data["datasets"].pop(FINGERPRINT)

    _edit(path, move)
    _refused(
        lambda: budget.charge_run(policy, other, 1000, "r3", SPEC),
        f"entry 1 \\(run run-1\\) of the users {other[:12]} was changed",
    )


def test_a_repaired_ledger_is_accepted_only_on_the_override_and_the_repair_recorded(tmp_path):
    path, policy, charges = _ledger_with_two_runs(tmp_path)
    recorded = [
        budget_chain.RecordedCharge(c.fingerprint, c.run_id, c.chain, "MLMD") for c in charges
    ]
    _edit(path, lambda dataset, _: dataset["runs"].pop())
    budget.check_ledger(str(path), recorded, accept_repair=True)
    (repair,) = json.loads(path.read_text())[budget_chain.REPAIRS_KEY]
    assert repair["accepted_runs"] == ["run-2"] and "lacks run run-2" in repair["reason"]
    budget.check_ledger(str(path), recorded)  # accepted from now on

    _edit(path, _first_run_one_round)
    _refused(lambda: budget.charge_run(policy, FINGERPRINT, 1000, "r3", SPEC), "was changed")
    charge = budget.charge_run(
        dataclasses.replace(policy, accept_repaired_ledger=True), FINGERPRINT, 1000, "r3", SPEC
    )
    assert charge.ledger_repaired and charge.to_dict()["ledger_repaired"] is True
    data = json.loads(path.read_text())
    assert len(data[budget_chain.REPAIRS_KEY]) == 2
    assert data["datasets"][FINGERPRINT]["runs"][0]["spec"]["rounds"] == 1  # as repaired
    # Sealed again: the next run needs no override, and a later edit is caught again.
    assert not budget.charge_run(policy, FINGERPRINT, 1000, "r4", SPEC).ledger_repaired
    _edit(path, _set_budget)
    _refused(lambda: budget.charge_run(policy, FINGERPRINT, 1000, "r5", SPEC), "entry 1")


def test_a_ledger_from_before_the_chain_is_sealed_as_found_and_recorded(tmp_path):
    path, policy, _ = _ledger_with_two_runs(tmp_path)

    def strip(dataset, data):
        del data[budget_chain.CHAIN_KEY]
        for run in dataset["runs"]:
            del run[budget_chain.CHAIN_KEY], run["recorded_in"]

    _edit(path, strip)
    assert budget.dataset_spent(str(path), FINGERPRINT, SPEC.delta) > 0  # read, not written
    assert budget_chain.CHAIN_KEY not in json.loads(path.read_text())
    budget.charge_run(policy, FINGERPRINT, 1000, "run-3", SPEC)
    data = json.loads(path.read_text())
    assert data[budget_chain.CHAIN_KEY] == budget_chain.CHAIN_SCHEME and data["migrated_at"] > 0
    assert all(budget_chain.CHAIN_KEY in run for run in data["datasets"][FINGERPRINT]["runs"])
    _edit(path, _first_run_one_round)
    _refused(lambda: budget.charge_run(policy, FINGERPRINT, 1000, "r4", SPEC), "entry 1")


def test_stripping_the_chain_marker_alone_does_not_make_an_old_ledger(tmp_path):
    path, policy, _ = _ledger_with_two_runs(tmp_path)

    def strip_marker_and_edit(dataset, data):
        del data[budget_chain.CHAIN_KEY]
        _first_run_one_round(dataset, data)

    _edit(path, strip_marker_and_edit)
    _refused(lambda: budget.charge_run(policy, FINGERPRINT, 1000, "r3", SPEC), "entry 1")


def test_the_chain_is_a_hash_of_the_previous_chain_and_the_entry(tmp_path):
    """The scheme docs/privacy.md states, recomputed here without the module."""
    path, _, charges = _ledger_with_two_runs(tmp_path)
    dataset = json.loads(path.read_text())["datasets"][FINGERPRINT]

    def digest(*parts):
        text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    previous = digest(budget_chain.CHAIN_SCHEME, FINGERPRINT, 100.0)
    for run, charge in zip(dataset["runs"], charges):
        previous = digest(previous, {k: v for k, v in run.items() if k != "chain"})
        assert run["chain"] == previous == charge.chain
