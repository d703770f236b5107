"""`dp-fedemb run` checks the budget ledger against ML Metadata's records of its charges
before anything is charged (`pipeline/budget_records.py`; issue 63), on a real store."""

import json

import pytest
from ml_metadata.metadata_store import metadata_store

from pipeline import budget_records, definition
from pipeline import config as config_lib
from pipeline.components import artifacts, training
from tff_algorithms.privacy import accounting_spec, budget

SPEC = accounting_spec.AccountingSpec(
    population=1000, users_per_round=50, rounds=3, noise_multiplier=1.2, delta=1e-5
)
FINGERPRINT = budget.dataset_fingerprint(["a", "b"])


def _record(store, config, charge, ledger_path: str) -> None:
    """A PrivacyLedger artifact with the properties PrivateTrain sets."""
    ledger = artifacts.PrivacyLedger()
    ledger.uri = f"{config.pipeline.output_dir}/PrivateTrain/privacy_ledger/{charge.run_id}"
    policy = json.dumps({**config.budget_policy_dict(), "ledger_path": ledger_path})
    training._set_budget_properties(ledger, charge.to_dict(), policy)
    ledger.type_id = store.put_artifact_type(ledger.artifact_type)
    store.put_artifacts([ledger.mlmd_artifact])


def test_a_run_ml_metadata_records_but_the_ledger_lost_stops_the_run(tmp_path):
    config = config_lib.load_config(overrides=[f"pipeline.output_dir={tmp_path}"])
    ledger_path = config.budget_policy_dict()["ledger_path"]
    budget_records.check_budget_ledger(config)  # no ledger, no store yet: nothing to check
    policy = budget.BudgetPolicy(ledger_path, 10.0)
    charges = [budget.charge_run(policy, FINGERPRINT, 1000, r, SPEC) for r in ("r1", "r2")]
    store = metadata_store.MetadataStore(definition.local_metadata_config(config))
    for charge in charges:
        _record(store, config, charge, ledger_path)
    # A charge to another ledger is not this ledger's record.
    other = budget.charge_run(budget.BudgetPolicy(str(tmp_path / "other.json"), 10.0), FINGERPRINT, 1000, "r9", SPEC)  # fmt: skip
    _record(store, config, other, str(tmp_path / "other.json"))
    assert {c.run_id for c in budget_records.recorded_charges(store, ledger_path)} == {"r1", "r2"}
    budget_records.check_budget_ledger(config)

    with open(ledger_path) as f:
        data = json.load(f)
    data["datasets"][FINGERPRINT]["runs"].pop()
    with open(ledger_path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match="lacks run r2, which ML Metadata") as refused:
        budget_records.check_budget_ledger(config)
    assert "\n" not in str(refused.value) and "budget.accept_repaired_ledger" in str(refused.value)

    repaired = config_lib.load_config(
        overrides=[f"pipeline.output_dir={tmp_path}", "budget.accept_repaired_ledger=true"]
    )
    budget_records.check_budget_ledger(repaired)
    budget_records.check_budget_ledger(config)  # the repair is recorded and accepted
    with open(ledger_path) as f:
        assert json.load(f)["repairs"][0]["accepted_runs"] == ["r2"]
