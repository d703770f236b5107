"""The budget ledger checked against ML Metadata before a run charges it (issue 63).

Every PrivateTrain records its charge on its PrivacyLedger artifact (the ledger's path,
the dataset fingerprint, the run id and the entry's chain:
`pipeline/components/training.py`). `dp-fedemb run` reads those records from the
output's ML Metadata store and has the ledger verified against them
(`tff_algorithms.privacy.budget.check_ledger`) before the pipeline starts: a run that
ML Metadata records but the ledger lacks (an entry deleted) or holds with another
chain (an entry edited, the ledger re-chained) stops the run in one line. Artifacts
written before these properties existed, or charged to another ledger, are not used.
"""

from __future__ import annotations

import os

from ml_metadata.metadata_store import metadata_store

from pipeline import config as config_lib
from pipeline import definition
from pipeline.components import artifacts
from tff_algorithms.privacy import budget, budget_chain


def recorded_charges(
    store: metadata_store.MetadataStore, ledger_path: str
) -> list[budget_chain.RecordedCharge]:
    """The charges to `ledger_path` that PrivacyLedger artifacts in `store` record."""
    found = []
    for artifact in store.get_artifacts_by_type(artifacts.PrivacyLedger.TYPE_NAME):
        properties = artifact.custom_properties
        if (
            artifacts.BUDGET_CHAIN not in properties
            or properties[artifacts.BUDGET_LEDGER].string_value != ledger_path
        ):
            continue
        found.append(
            budget_chain.RecordedCharge(
                properties[artifacts.DATASET_FINGERPRINT].string_value,
                properties[artifacts.BUDGET_RUN_ID].string_value,
                properties[artifacts.BUDGET_CHAIN].string_value,
                f"ML Metadata (PrivacyLedger artifact {artifact.id}, {artifact.uri})",
            )
        )
    return found


def check_budget_ledger(config: config_lib.PipelineConfig) -> None:
    """Verifies the run's budget ledger against the output's ML Metadata store
    (ValueError, one line, naming the entry); nothing to check before the first run."""
    policy = config.budget_policy_dict()
    records = []
    if os.path.exists(definition.metadata_path(config)):
        store = metadata_store.MetadataStore(definition.local_metadata_config(config))
        records = recorded_charges(store, policy["ledger_path"])
    budget.check_ledger(
        policy["ledger_path"], records, accept_repair=policy["accept_repaired_ledger"]
    )
