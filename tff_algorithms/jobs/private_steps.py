"""The checkpointed step loop of every algorithm that trains outside a TFF learning
process: the centralized oracle (`algorithms/centralized/training.py`), Logit-DP
(`contrastive_training`), user-level DP-SGD (`user_dp_sgd`) and FDML (`fdml_training`,
its server state held in variables). The federated algorithms keep TFF's program state
(`training.train`) and share the evaluation schedule and noise-seed draw with this loop
(`loop_schedule`).

Each algorithm supplies its step (given the step number and, when it is noisy, its
noise seed) and the trackables to checkpoint; this loop owns what they share:
- the noise seed: the job's testing seed or one from OS entropy
  (`loop_schedule.job_noise_seed`), drawn once and kept in the checkpoint, so a resumed
  job redraws the same noise (FDML keeps its seed in its server state instead, which
  the checkpoint holds; the oracle has no noise);
- the ledger (one event per step), the history (epsilon, wall time, what the step
  reports from the data-independent schedule, held-out evaluation: nothing else
  computed from the training users, which would be an unaccounted release) and the
  progress callback;
- the evaluation schedule (`loop_schedule.evaluation_due`);
- a checkpoint every `checkpoint_every` steps and on evaluation steps, holding the
  variables, the step, the noise seed, the ledger and the history together, so a
  resumed job ends where an uninterrupted one ends.

Checkpoints are `tf.train.Checkpoint` files OUTPUT/checkpoints/ckpt-<step>.* (the
newest two kept). A kill during a save leaves a partial one, and after a machine crash
the newest can exist with files never flushed: on start the newest checkpoint that
does not read back whole (`_read_error`) is removed, with any newer, and training
resumes from the one before it, to the same end. A checkpoint that reads back but does
not fit this job's variables is an error, in one line. Two earlier formats are refused
in one line: FDML's fdml-<round>.npz files, and the oracle's checkpoints whose step
was named "epoch" (docs/design.md section 4, "The step loop").
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import tensorflow as tf
import tensorflow_federated as tff
from absl import logging

from tff_algorithms.config import loop_schedule
from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.privacy.ledger import PrivacyLedger

if TYPE_CHECKING:
    from tff_algorithms.jobs.job_inputs import JobInputs

CHECKPOINT_EVERY = 10
KEEP_CHECKPOINTS = 2
# tf.train.CheckpointManager's names: ckpt-N.index, ckpt-N.data-*, a save's ckpt-N_temp*.
_ENTRY = re.compile(r"^ckpt-(\d+)(?:\.index|\.data-\d+-of-\d+|_temp.*)$")
_STATE_FILE = "checkpoint"
_OLD_FDML = re.compile(r"^fdml-\d+\.npz$")
_OLD_CENTRALIZED_STEP = "epoch/"

# (step t, stateless noise seed [noise seed, t] or None) -> the step's own history fields.
Step = Callable[[int, "tf.Tensor | None"], "Mapping[str, Any] | None"]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _read_error(prefix: str) -> str | None:
    """Why checkpoint `prefix` does not read back whole, or None if it does: every value
    is read (TF checks each one's checksum), so missing or truncated files show here."""
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as e:  # any failure to read is a torn write
        return _first_line(e)
    return None


def _entries_by_step(directory: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for name in tf.io.gfile.listdir(directory):
        name = name.rstrip("/")
        if m := _ENTRY.match(name):
            found.setdefault(int(m.group(1)), []).append(name)
    return found


def _remove_entries(directory: str, names: list[str]) -> None:
    for name in names:
        path = os.path.join(directory, name)
        if tf.io.gfile.isdir(path):
            tf.io.gfile.rmtree(path)
        else:
            tf.io.gfile.remove(path)


def _refuse_old_formats(directory: str, names: list[str]) -> None:
    if any(_OLD_FDML.match(name) for name in names):
        raise ValueError(
            f"{directory} holds FDML checkpoints of an earlier release (fdml-<round>.npz), "
            "which this release does not resume: finish that job with the release that "
            "started it, or train into a new output directory"
        )


def newest_intact_checkpoint(directory: str) -> str | None:
    """The prefix of the newest checkpoint in `directory` that reads back whole, or None.

    Newer ones that do not (torn writes, partial saves) are removed, and the
    checkpoint-state file is rewritten to list the ones that remain, so training
    resumes from the one before and saves the removed steps again.
    """
    tf.io.gfile.makedirs(directory)
    _refuse_old_formats(directory, tf.io.gfile.listdir(directory))
    entries = _entries_by_step(directory)
    newest = None
    for step in sorted(entries, reverse=True):
        prefix = os.path.join(directory, f"ckpt-{step}")
        error = _read_error(prefix) if f"ckpt-{step}.index" in entries[step] else "no index"
        if error is None:
            newest = step
            break
        logging.warning(
            "checkpoint %s is incomplete (%s); removing it and resuming from an earlier one",
            prefix,
            error,
        )
        _remove_entries(directory, entries.pop(step))
    for names in entries.values():  # a save killed before its merge
        _remove_entries(directory, [n for n in names if "_temp" in n])
    kept = [os.path.join(directory, f"ckpt-{step}") for step in sorted(entries)]
    state_file = os.path.join(directory, _STATE_FILE)
    if kept:
        tf.compat.v1.train.update_checkpoint_state(
            directory, kept[-1], all_model_checkpoint_paths=kept
        )
    elif tf.io.gfile.exists(state_file):
        tf.io.gfile.remove(state_file)
    return None if newest is None else kept[-1]


def _restore(checkpoint: tf.train.Checkpoint, prefix: str) -> None:
    names = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
    if any(n.startswith(_OLD_CENTRALIZED_STEP) for n in names) and not any(
        n.startswith("step/") for n in names
    ):
        raise ValueError(
            f"{prefix} is a centralized checkpoint of an earlier release (its step is "
            "named 'epoch'), which this release does not resume: finish that job with the "
            "release that started it, or train into a new output directory"
        )
    try:
        checkpoint.restore(prefix).assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:
        raise ValueError(
            f"checkpoint {prefix} reads back but does not fit this job ({_first_line(e)}): "
            "it was written by another job or release; train into a new output directory"
        ) from None


def run_steps(
    inputs: JobInputs,
    variables: Mapping[str, Any],
    step: Step,
    backbone: Callable[[], tff.learning.models.ModelWeights],
    *,
    noisy: bool = True,
    evaluate: Callable[[], Mapping[str, Any]] | None = None,
    checkpoint_every: int = CHECKPOINT_EVERY,
) -> JobOutcome:
    """Runs steps from the last checkpoint to `config.rounds` (module docstring).

    Args:
      inputs: the job's inputs (config, spec, evaluator, checkpoint_dir, progress).
      variables: what the checkpoint holds besides the loop's own state (trackables:
        models, variables, optimizers), by name.
      step: `step(t, seed)` trains step t (0-based); `seed` is the stateless noise seed
        [noise seed, t] (int64[2]), None when not `noisy`. It returns fields to add to
        the step's history record (only what the data-independent schedule decides),
        or None.
      backbone: the backbone's current weights, for evaluation and the outcome.
      noisy: the loop draws and checkpoints a noise seed for the steps.
      evaluate: the held-out evaluation; None: `inputs.evaluator(backbone())`.
      checkpoint_every: save every this many steps (and on evaluation steps).
    """
    config = inputs.config
    done_steps = tf.Variable(0, dtype=tf.int64)
    ledger_text = tf.Variable(PrivacyLedger(inputs.spec).to_json())
    history_text = tf.Variable("[]")
    own = {"step": done_steps, "ledger": ledger_text, "history": history_text}
    noise_seed = None
    if noisy:
        noise_seed = tf.Variable(loop_schedule.job_noise_seed(config.noise_seed), dtype=tf.int64)
        own["noise_seed"] = noise_seed
    checkpoint = tf.train.Checkpoint(**variables, **own)
    latest = newest_intact_checkpoint(inputs.checkpoint_dir)
    manager = tf.train.CheckpointManager(
        checkpoint, inputs.checkpoint_dir, max_to_keep=KEEP_CHECKPOINTS
    )
    if latest is not None:
        _restore(checkpoint, latest)
    ledger = PrivacyLedger.from_json(ledger_text.numpy().decode(), expected_spec=inputs.spec)
    history: list[dict[str, Any]] = json.loads(history_text.numpy().decode())
    start = int(done_steps.numpy())
    if start > config.rounds:
        raise ValueError(
            f"{inputs.checkpoint_dir} already holds {start} steps, more than the "
            f"{config.rounds} requested"
        )
    for t in range(start, config.rounds):
        began = time.perf_counter()
        seed = None if noise_seed is None else tf.constant([int(noise_seed.numpy()), t], tf.int64)
        reported = step(t, seed)
        done = t + 1
        ledger.record_round(done)
        record: dict[str, Any] = {
            "round": done,
            "epsilon": ledger.epsilon,
            "round_seconds": time.perf_counter() - began,
            **(reported or {}),
        }
        due = loop_schedule.evaluation_due(config.rounds, config.evaluate_every, done)
        if due:
            record["eval"] = dict(
                evaluate() if evaluate is not None else inputs.evaluator(backbone())
            )
        history.append(record)
        if inputs.progress is not None:
            inputs.progress(record)
        if due or done % checkpoint_every == 0:
            done_steps.assign(done)
            ledger_text.assign(ledger.to_json())
            history_text.assign(json.dumps(history))
            manager.save(checkpoint_number=done)
    return JobOutcome(backbone(), ledger, history, start)
