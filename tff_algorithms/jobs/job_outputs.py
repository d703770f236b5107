"""What a training job leaves in its output directory, and how it claims that directory.

OUTPUT/train_job.json records the job (`claim_output_dir`), so re-running the same job
on the same OUTPUT resumes it and a different job is refused; `write_outputs` writes
OUTPUT/saved_model (backbone only, `export`), OUTPUT/ledger.json and OUTPUT/metrics.json
once training ends.

What is published: metrics.json holds only held-out evaluation and privacy figures,
plus per-round counts of dropped and kept virtual clients (`CLIENT_COUNTS`: operations
figures about failed reads and stragglers, labelled as outside the DP guarantee);
training-user losses (not private) are never written. It omits the schedule seed and
the noise seed (`job_config`). OUTPUT/train_job.json and the checkpoints hold both, so
keep them as private as the training data. On a local OUTPUT the job does its part
(`secret_files`): OUTPUT (when the job creates it) and OUTPUT/checkpoints are 0700,
train_job.json, ledger.json and metrics.json 0600, replaced atomically, and a symlink
planted at any of these paths is refused.

The schedule seed is drawn when a job first claims OUTPUT and recorded in
OUTPUT/train_job.json (not in the config: a caller such as a TFX component publishes its
config), so re-running the job resumes with the same virtual clients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import partition, split_protocols
from tff_algorithms import algorithms
from tff_algorithms.base import job_files, owned_files, secret_files
from tff_algorithms.config.job_config import TrainJobConfig, current_layout
from tff_algorithms.config.job_plan import fresh_schedule_seed
from tff_algorithms.federated import dropouts
from tff_algorithms.modeling import export
from tff_algorithms.privacy import accounting, dplc_releases
from tff_algorithms.privacy import budget as budget_lib
from tff_algorithms.privacy.ledger import PrivacyLedger

JOB_FORMAT = "dp-fedemb-train-job/1"

# Fields that may differ when a job is re-run on the same output directory.
_RESUMABLE_CHANGES = frozenset({"evaluate_every", "max_epsilon"})
# The job record's digest of a user's model file or factory (`job_record`).
MODEL_SOURCE_KEY = "model_source"
# Client-work counts of the applied attempt of each round, recorded in the history.
CLIENT_COUNTS = (*dropouts.DROP_REASONS, "dropped_clients", dropouts.KEPT_CLIENTS)


@dataclasses.dataclass(frozen=True)
class TrainJobResult:
    """Where a finished job wrote its outputs, and its metrics.json content."""

    output_dir: str
    saved_model_dir: str
    metrics_path: str
    ledger_path: str
    metrics: dict[str, Any]
    # True when OUTPUT already held this job, finished: nothing was trained or written.
    already_finished: bool = False

    @property
    def epsilon(self) -> float:
        value = self.metrics["epsilon"]
        return math.inf if value is None else value

    @property
    def recall_at_far(self) -> dict[str, float]:
        return self.metrics["recall_at_far"]


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    """What training produced: the trained backbone, the privacy ledger, the round
    history, and the round the run resumed from (0: it started afresh)."""

    backbone: tff.learning.models.ModelWeights
    ledger: PrivacyLedger
    history: list[dict[str, Any]]
    resumed_from_round: int
    # A federated job's feature-cache decision (`algorithms.dp_fedemb.training.feature_cache_decision`).
    feature_cache: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class JobFacts:
    """What the job knew before training, for metrics.json.

    noise_source: where the noise multiplier came from (`TrainJobConfig.calibrated_for`).
    planned: the accountant's result for the planned schedule.
    eval_records / eval_labels: the held-out records and their identity labels.
    training_users: how many users trained.
    budget_charge: the cross-run budget's charge (`budget.charge_run`), or None.
    split_mode: the protocol the held-out records were split by (`split_protocols.MODES`).
    """

    noise_source: dict[str, Any]
    planned: accounting.PrivacyResult
    eval_records: str
    eval_labels: np.ndarray
    training_users: int
    budget_charge: budget_lib.BudgetCharge | None = None
    split_mode: str = split_protocols.IDENTITY_AND_USER


def _json_ready(value: Any) -> Any:
    """Strict JSON: non-finite floats (infinite epsilon) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


# Local outputs hold secrets (the schedule seed, the noise state): `secret_files` keeps
# them owner-only and never writes through a symlink. Cloud paths ("gs://...") have
# neither modes nor symlinks; the bucket's access control applies.
def _is_local(path: str) -> bool:
    return "://" not in path


def _make_dir(path: str, tighten_existing: bool = False) -> None:
    if _is_local(path):
        secret_files.private_dir(path, tighten_existing=tighten_existing)
    else:
        tf.io.gfile.makedirs(path)


def _read_text(path: str) -> str | None:
    if _is_local(path):
        return secret_files.read_text(path)
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path) as f:
        return f.read()


def _write_text(path: str, text: str) -> None:
    if _is_local(path):
        secret_files.write_text(path, text)
        return
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with tf.io.gfile.GFile(temporary, "w") as f:
        f.write(text)
    tf.io.gfile.rename(temporary, path, overwrite=True)


def make_checkpoint_dir(output_dir: str) -> str:
    """OUTPUT/checkpoints, created if missing.

    Checkpoints carry the noise state and are written with the umask's modes: the
    directory, which this job owns, is what keeps them private (tightened if it exists).
    """
    path = owned_files.create_entry(output_dir, job_files.CHECKPOINT_DIR)
    _make_dir(path, tighten_existing=True)
    return path


def _export(
    config: TrainJobConfig, backbone: tff.learning.models.ModelWeights, output_dir: str
) -> str:
    final = owned_files.create_entry(output_dir, job_files.SAVED_MODEL_DIR)
    # Exports of runs killed midway: recorded as ours, so they can go.
    for name in owned_files.created_entries(output_dir):
        if name.startswith(f"{job_files.SAVED_MODEL_DIR}.tmp-"):
            owned_files.remove_tree(os.path.join(output_dir, name), owned_files.SAVED_MODEL)
    temporary = owned_files.create_entry(
        output_dir, f"{job_files.SAVED_MODEL_DIR}.tmp-{uuid.uuid4().hex[:8]}"
    )
    try:
        export.export_serving_model(config.backbone_config, backbone, temporary)
        owned_files.remove_tree(final, owned_files.SAVED_MODEL)
        tf.io.gfile.rename(temporary, final)
    except BaseException:
        # The export's error is what the user must see.
        with contextlib.suppress(OSError, ValueError):
            owned_files.remove_tree(temporary, owned_files.SAVED_MODEL)
        raise
    return final


def job_record(config: TrainJobConfig, reader: partition.PartitionReader) -> dict[str, Any]:
    """What makes a job this job: its config, its users, and for a backbone the user brings
    the digest of its file or factory (a changed model is a new job, never a resume)."""
    record = {
        "format": JOB_FORMAT,
        "config": config.to_dict(),
        "partition": {"users": reader.manifest["users"], "records": reader.manifest["records"]},
    }
    digest = config.backbone_config.source_digest
    if digest is not None:
        record[MODEL_SOURCE_KEY] = digest
    return record


@dataclasses.dataclass(frozen=True)
class ClaimedJob:
    """What a job keeps in OUTPUT/train_job.json across re-runs.

    run_id: new for a new job, the recorded one on resume, so the cross-run budget
      charges a resumed job once.
    schedule_seed: `config.schedule_seed` (testing), else drawn from OS entropy for a
      new job and the recorded one on resume, so a resumed job samples the same users.
    """

    run_id: str
    schedule_seed: int


def _changed_settings(before: Mapping[str, Any], now: Mapping[str, Any]) -> set[str]:
    """The keys whose values differ; within a section (an algorithm's own settings,
    shared negatives), `section.key`."""
    changed = set()
    for name in set(before) | set(now):
        old, new = before.get(name), now.get(name)
        if old == new:
            continue
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            changed |= {
                f"{name}.{key}" for key in set(old) | set(new) if old.get(key) != new.get(key)
            }
        else:
            changed.add(name)
    return changed


def claim_output_dir(
    output_dir: str, job: dict[str, Any], config: TrainJobConfig, run_id: str | None = None
) -> ClaimedJob:
    """Records the job in OUTPUT, or checks that a re-run is the same job (resume).

    `run_id`: the id a new job is charged under (None: a fresh one); a resumed job keeps
    its recorded id, which must then be the same.
    """
    owned_files.claim(
        output_dir,
        "train",
        legacy_marker=job_files.JOB_FILE,
        legacy_names=job_files.TRAIN_OUTPUT_NAMES,
    )
    path = owned_files.create_entry(output_dir, job_files.JOB_FILE)
    given_run_id = run_id
    run_id, schedule_seed = given_run_id or uuid.uuid4().hex, config.schedule_seed
    previous_text, previous = _read_text(path), None
    if previous_text is not None:
        previous = json.loads(previous_text)
        # A record of the release before (flat keys) in this release's layout.
        previous = {**previous, "config": current_layout(previous.get("config", {}))}
        # Compared as JSON reads them back (tuples become lists).
        config_now = json.loads(json.dumps(job["config"]))
        changed = sorted(
            _changed_settings(previous["config"], config_now) - set(_RESUMABLE_CHANGES)
        )
        if previous.get("partition") != job["partition"]:
            changed.append("partition (users/records)")
        if previous.get(MODEL_SOURCE_KEY) != job.get(MODEL_SOURCE_KEY):
            changed.append(f"backbone ({config.architecture} changed since the job began)")
        if changed:
            raise ValueError(
                f"{output_dir} holds a training job with different {', '.join(changed)}; "
                "use a new output directory"
            )
        run_id = previous.get("run_id") or run_id
        if given_run_id is not None and run_id != given_run_id:
            raise ValueError(
                f"{output_dir} holds a training job charged as run {run_id}, not "
                f"{given_run_id}; use a new output directory"
            )
        if not isinstance(previous.get("schedule_seed"), int):
            raise ValueError(f"{path} records no schedule seed; use a new output directory")
        schedule_seed = previous["schedule_seed"]
    if schedule_seed is None:
        schedule_seed = fresh_schedule_seed()
    _make_dir(output_dir)
    record = {**job, "run_id": run_id, "schedule_seed": schedule_seed}
    text = json.dumps(record, indent=1, sort_keys=True)
    # A re-run of the same job rewrites nothing, a record of the release before included.
    if previous_text is None or json.loads(text) != previous:
        _write_text(path, text)
    return ClaimedJob(run_id, schedule_seed)


def finished_result(output_dir: str, config: TrainJobConfig) -> TrainJobResult | None:
    """The outputs of this job when OUTPUT holds it finished, else None.

    metrics.json is written last (`write_outputs`), so its presence with this job's
    config (all of it, `rounds` included) and the export beside it mean the job is done;
    a re-run then rewrites nothing.
    """
    metrics_path = os.path.join(output_dir, job_files.METRICS_FILE)
    saved_model_dir = os.path.join(output_dir, job_files.SAVED_MODEL_DIR)
    ledger_path = os.path.join(output_dir, job_files.LEDGER_FILE)
    text = _read_text(metrics_path)
    if text is None or not tf.io.gfile.exists(os.path.join(saved_model_dir, "saved_model.pb")):
        return None
    try:
        metrics = json.loads(text)
    except json.JSONDecodeError:
        return None  # torn by a crash while written: the job writes its outputs again
    config_now = json.loads(json.dumps(_json_ready(config.public_dict())))
    if not isinstance(metrics, dict) or not isinstance(metrics.get("config"), dict):
        return None
    if current_layout(metrics["config"]) != config_now:
        return None
    return TrainJobResult(
        output_dir, saved_model_dir, metrics_path, ledger_path, metrics, already_finished=True
    )


def _privacy_summary(
    config: TrainJobConfig, ledger: PrivacyLedger, planned: accounting.PrivacyResult
) -> dict[str, Any]:
    analysis = planned.analysis
    epsilon = ledger.epsilon
    private = config.private and math.isfinite(epsilon)
    algorithm = algorithms.get(config.algorithm)
    if not algorithm.private:
        guarantee = f"non-private: {algorithm.summary}"
    elif not private:
        guarantee = "non-private: noise multiplier 0 (no DP guarantee)"
    else:
        guarantee = f"user-level ({epsilon:.4g}, {ledger.delta:.3g})-DP; {analysis}"
        # The guarantee assumes noise and samples nobody can predict; fixed seeds can be guessed.
        if config.noise_seed is not None:
            guarantee += "; TESTING ONLY: fixed noise seed, not a production guarantee"
        if config.schedule_seed is not None:
            guarantee += "; TESTING ONLY: fixed schedule seed, not a production guarantee"
    return {
        "private": private,
        "privacy": guarantee,
        "noise_seed_source": "os-entropy" if config.noise_seed is None else "fixed (testing)",
        "schedule_seed_source": "os-entropy" if config.schedule_seed is None else "fixed (testing)",
        "epsilon": epsilon,
        # The RDP accountant's epsilon beside the (default) PLD one, a labelled cross-check.
        "epsilon_rdp": ledger.epsilon_rdp if private else None,
        "delta": ledger.delta,
        "zcdp_rho": ledger.history[-1].zcdp_rho if ledger.history else None,
        "accounting": {
            "convention": planned.convention.value,
            "neighboring_relation": planned.neighboring_relation.value,
            "sensitivity_in_clips": planned.sensitivity_in_clips,
            "analysis": analysis,
        },
        **_shared_negatives_summary(ledger),
    }


def _shared_negatives_summary(ledger: PrivacyLedger) -> dict[str, Any]:
    """What the DPLC releases cost (issue 22); their epsilon is already in `epsilon`."""
    plan = ledger.releases
    if plan is None:
        return {}
    rounds = ledger.rounds_recorded
    return {
        "shared_negatives": {
            **plan.to_dict(),
            "releases": plan.releases_after(rounds),
            # The releases alone; the run's epsilon composes them with the training.
            "releases_epsilon": dplc_releases.releases_epsilon(plan, rounds, ledger.delta),
            "sampling_amplification": "none",
        }
    }


def _client_failures(history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Totals of the per-round client counts (None for centralized training)."""
    rounds = [record["clients"] for record in history if "clients" in record]
    if not rounds:
        return None
    return {
        **{name: sum(r[name] for r in rounds) for name in CLIENT_COUNTS},
        # Attempts below min_report_fraction, retried and never released (dropouts.py).
        "discarded_attempts": sum(
            len(record.get("discarded_attempts_kept_clients", ())) for record in history
        ),
        "note": "operations counts of training clients, not covered by the DP guarantee",
    }


def write_outputs(
    output_dir: str,
    config: TrainJobConfig,
    outcome: JobOutcome,
    facts: JobFacts,
    started: float,
) -> TrainJobResult:
    """Writes OUTPUT/saved_model, OUTPUT/ledger.json and OUTPUT/metrics.json.

    `started`: the job's `time.perf_counter()` when it began, for its wall time.
    """
    saved_model_dir = _export(config, outcome.backbone, output_dir)
    ledger_path = owned_files.create_entry(output_dir, job_files.LEDGER_FILE)
    _write_text(ledger_path, outcome.ledger.to_json())
    final_eval = outcome.history[-1]["eval"]
    summary = {
        "algorithm": config.algorithm,
        "recall_at_far": final_eval["recall_at_far"],
        # fdml: the FDML paper's authentication accuracy at the EER threshold (Alg. 4).
        **({"eer_accuracy": final_eval["eer_accuracy"]} if "eer_accuracy" in final_eval else {}),
        **_privacy_summary(config, outcome.ledger, facts.planned),
        "noise_multiplier_source": facts.noise_source,
        "rounds": outcome.ledger.rounds_recorded,
        "rounds_are": algorithms.get(config.algorithm).rounds_are,
        "resumed_from_round": outcome.resumed_from_round,
        "wall_seconds": time.perf_counter() - started,
        "evaluation": {
            "records": facts.eval_records,
            "images": int(len(facts.eval_labels)),
            "identities": int(len(np.unique(facts.eval_labels))),
            # What is held out depends on the split mode (beam_jobs.split_protocols.PROTOCOLS).
            "held_out": split_protocols.PROTOCOLS[facts.split_mode].evaluation,
            "split_mode": facts.split_mode,
        },
        "training_users": facts.training_users,
        # d in the noise norm z*clip*sqrt(d)/M of the averaged update.
        "trained_parameters": sum(int(np.size(v)) for v in outcome.backbone.trainable),
        "frozen_parameters": sum(int(np.size(v)) for v in outcome.backbone.non_trainable),
        "client_failures": _client_failures(outcome.history),
        **({"feature_cache": outcome.feature_cache} if outcome.feature_cache else {}),
        "history": outcome.history,
        "config": config.public_dict(),
        "saved_model": saved_model_dir,
        "ledger": ledger_path,
        "dataset_budget": facts.budget_charge.to_dict()
        if facts.budget_charge is not None
        else None,
    }
    summary = _json_ready(summary)
    metrics_path = owned_files.create_entry(output_dir, job_files.METRICS_FILE)
    _write_text(metrics_path, json.dumps(summary, indent=1, allow_nan=False))
    return TrainJobResult(output_dir, saved_model_dir, metrics_path, ledger_path, summary)
