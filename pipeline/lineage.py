"""Lineage queries over ML Metadata: the privacy cost of a pushed model.

pushed model --(output of)--> Pusher execution --(input "model")--> Model
  --(output of)--> training execution --(output)--> PrivacyLedger: epsilon, delta,
  accounting convention and neighbouring relation.

The query follows recorded events only: it trusts no file and no naming convention,
so it answers for any pushed model in the store, from any run.
"""

from __future__ import annotations

import dataclasses

from ml_metadata.metadata_store import metadata_store
from ml_metadata.proto import metadata_store_pb2

from pipeline.components import artifacts

PRIVACY_LEDGER_TYPE = artifacts.PrivacyLedger.TYPE_NAME
PUSHED_MODEL_TYPE = "PushedModel"


@dataclasses.dataclass(frozen=True)
class PushedModelPrivacy:
    pushed_model_id: int
    pushed_destination: str
    model_uri: str
    ledger_uri: str
    epsilon: float
    delta: float
    accounting_convention: str  # "" for ledgers written before conventions were recorded
    neighboring_relation: str


def _event_key(event: metadata_store_pb2.Event) -> str:
    return event.path.steps[0].key if event.path.steps else ""


def _single(items: list, what: str):
    if len(items) != 1:
        raise ValueError(f"lineage: expected one {what}, found {len(items)}")
    return items[0]


def _producer(store: metadata_store.MetadataStore, artifact_id: int) -> int:
    """The execution that produced the artifact.

    A cached execution records its reused artifacts as its outputs too; all of them are
    executions of the same node with the same inputs, and the first is the producer.
    """
    events = store.get_events_by_artifact_ids([artifact_id])
    outputs = [e.execution_id for e in events if e.type == metadata_store_pb2.Event.OUTPUT]
    if not outputs:
        raise ValueError(f"lineage: artifact {artifact_id} has no producing execution")
    return min(outputs)


def privacy_of_pushed_model(
    store: metadata_store.MetadataStore, pushed_model_id: int
) -> PushedModelPrivacy:
    """epsilon and delta of the model behind PushedModel artifact `pushed_model_id`."""
    [pushed] = store.get_artifacts_by_id([pushed_model_id])
    if pushed.custom_properties["pushed"].int_value != 1:
        raise ValueError(f"artifact {pushed_model_id} records no push (the model was not blessed)")
    pusher_execution = _producer(store, pushed_model_id)
    pusher_events = store.get_events_by_execution_ids([pusher_execution])
    model_event = _single(
        [
            e
            for e in pusher_events
            if e.type == metadata_store_pb2.Event.INPUT and _event_key(e) == "model"
        ],
        "model input of the pusher",
    )
    [model] = store.get_artifacts_by_id([model_event.artifact_id])
    training_execution = _producer(store, model.id)
    training_outputs = [
        e.artifact_id
        for e in store.get_events_by_execution_ids([training_execution])
        if e.type == metadata_store_pb2.Event.OUTPUT
    ]
    ledger_type = store.get_artifact_type(PRIVACY_LEDGER_TYPE)
    ledger = _single(
        [a for a in store.get_artifacts_by_id(training_outputs) if a.type_id == ledger_type.id],
        "privacy ledger output of the training execution",
    )
    return PushedModelPrivacy(
        pushed_model_id=pushed_model_id,
        pushed_destination=pushed.custom_properties["pushed_destination"].string_value,
        model_uri=model.uri,
        ledger_uri=ledger.uri,
        epsilon=ledger.custom_properties[artifacts.EPSILON].double_value,
        delta=ledger.custom_properties[artifacts.DELTA].double_value,
        accounting_convention=ledger.custom_properties[
            artifacts.ACCOUNTING_CONVENTION
        ].string_value,
        neighboring_relation=ledger.custom_properties[artifacts.NEIGHBORING_RELATION].string_value,
    )


def pushed_models(store: metadata_store.MetadataStore) -> list[metadata_store_pb2.Artifact]:
    """PushedModel artifacts that record an actual push, oldest first."""
    found = store.get_artifacts_by_type(PUSHED_MODEL_TYPE)
    return sorted(
        (a for a in found if a.custom_properties["pushed"].int_value == 1), key=lambda a: a.id
    )
