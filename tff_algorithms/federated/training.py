"""The federated training program: rounds, checkpoints, resume, privacy ledger, evaluation.

One loop serves every federated algorithm (DP-FedEmb, DP-FTRL-FedEmb, DP-FedAvg): it
takes a `tff.learning.templates.LearningProcess` whose client argument is a list of
virtual-client ids (data is loaded inside TFF from the id), a function giving the ids
of round r (the schedule), and a privacy ledger. The algorithms that are not a TFF
learning process (the centralized oracle, logit-dp, FDML, user-level DP-SGD) train
through the step loop (`private_steps.run_steps`); both loops take the evaluation
schedule and the noise-seed draw from `loop_schedule`, and recover from a torn newest
checkpoint the same way (docs/design.md section 4, "The step loop").

Checkpoints use `tff.program.FileProgramStateManager`, which writes each version to
a temporary directory and renames it, so a process killed mid-write leaves only a
temporary (removed on the next start) and the previous version. The rename is not
the whole story: nothing is fsynced before it, so after a machine crash the newest
version can exist with truncated files, and on object stores a rename is a copy
that a kill can interrupt. The loader therefore reads the newest version that reads
back, removing newer ones that do not (`_load_newest_intact`).

Each round runs under the runtime's deadline (`runtime.TffRuntime.run_round`): a worker
lost mid-round is replaced or dropped and the round tried again from the same state,
or training stops with one line; only an applied round is checkpointed and charged.

Each version holds everything resume needs: the whole process state (model, server
optimizer and aggregator state, tree-noise state included), the number of completed rounds
(the schedule is a pure function of the round, so that is its position), the
ledger and the evaluation history. Version v is the state after v rounds, saved
together with its ledger, so a round is never counted twice or missed.

Metrics the process computes on training users are not covered by the privacy
guarantee (docs/design.md section 5); they are logged for debugging only and never
stored in the history that reports and exports read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import tensorflow as tf
import tensorflow_federated as tff
from absl import logging

from tff_algorithms.base import owned_files
from tff_algorithms.config import loop_schedule
from tff_algorithms.config.report_policy import ReportPolicy
from tff_algorithms.federated import dropouts, runtime

CHECKPOINT_PREFIX = "round_"


class Ledger(Protocol):
    """What the loop needs of a privacy ledger (tff_algorithms.privacy.ledger.PrivacyLedger)."""

    @property
    def rounds_recorded(self) -> int: ...

    @property
    def epsilon(self) -> float: ...

    def record_round(self, round_number: int) -> object: ...

    def to_json(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class TrainingProgramConfig:
    """Attributes:
    total_rounds: rounds to have completed when the program returns.
    checkpoint_dir: where program state versions live; resuming reads the latest.
    checkpoint_every: save every this many rounds (the last round is always saved).
    evaluate_every: evaluate on held-out data every this many rounds; 0 means only
      after the last round.
    keep_checkpoints: how many recent versions to keep.
    """

    total_rounds: int
    checkpoint_dir: str
    checkpoint_every: int = 1
    evaluate_every: int = 0
    keep_checkpoints: int = 3

    def __post_init__(self) -> None:
        if self.total_rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.total_rounds}")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.evaluate_every < 0:
            raise ValueError(f"evaluate_every must be >= 0, got {self.evaluate_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")


@dataclasses.dataclass
class TrainingResult:
    state: Any
    rounds_completed: int
    resumed_from_round: int
    history: list[dict[str, Any]]
    wall_seconds: float


def _run(coroutine):
    return asyncio.run(coroutine)


def _remove_partial_checkpoints(checkpoint_dir: str) -> None:
    """Deletes temporaries of a save that was killed before its rename."""
    partial = re.compile(rf"^{CHECKPOINT_PREFIX}\d+_temp\d+$")
    for entry in os.listdir(checkpoint_dir):
        if partial.match(entry):
            owned_files.remove_tree(os.path.join(checkpoint_dir, entry), owned_files.SAVED_MODEL)


def _remove_old_checkpoints(checkpoint_dir: str, versions: Sequence[int], keep: int) -> None:
    """Keeps the newest `keep` versions. TFF's manager would remove the others without
    looking inside; `owned_files` refuses a version holding a file it did not write."""
    for version in sorted(versions)[:-keep]:
        path = os.path.join(checkpoint_dir, f"{CHECKPOINT_PREFIX}{version}")
        owned_files.remove_tree(path, owned_files.SAVED_MODEL)


def _read_error(version_dir: str) -> str | None:
    """Why the version at `version_dir` does not read back, or None if it does.

    Reads it once more than resuming needs, so that a torn version (truncated or
    missing files raise assorted TF, OS, protobuf and index errors) is told apart from
    one that reads but does not fit this run's state, which stays an error.
    """
    try:
        module = tf.saved_model.load(version_dir)
        tf.nest.map_structure(
            lambda v: v.read_value() if isinstance(v, tf.Variable) else v, module()
        )
    except Exception as e:  # any failure to read is a torn write
        first_line = str(e).splitlines()[0] if str(e) else ""
        return f"{type(e).__name__}: {first_line}"
    return None


def _load_newest_intact(
    manager: tff.program.FileProgramStateManager, structure: Any, checkpoint_dir: str
) -> tuple[Any, int]:
    """(program state, version) of the newest version that reads back; (None, 0) if none.

    Newer versions that fail to read are torn writes: they are removed, so training
    resumes from the previous version and saves that round again.
    """
    for version in reversed(_run(manager.get_versions()) or []):
        path = os.path.join(checkpoint_dir, f"{CHECKPOINT_PREFIX}{version}")
        error = _read_error(path)
        if error is None:
            return _run(manager.load(version, structure)), version
        logging.warning(
            "checkpoint %s is incomplete (%s); removing it and resuming from an earlier one",
            path,
            error,
        )
        owned_files.remove_tree(path, owned_files.SAVED_MODEL)
    return None, 0


def _as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _program_state(state: Any, ledger: Ledger, history: list[dict[str, Any]]) -> dict[str, Any]:
    return {"state": state, "ledger": ledger.to_json(), "history": json.dumps(history)}


def train(
    process: tff.learning.templates.LearningProcess,
    clients_for_round: Callable[[int], Sequence[str]],
    ledger: Ledger,
    restore_ledger: Callable[[str], Ledger],
    config: TrainingProgramConfig,
    evaluate: Callable[[Any, int], Mapping[str, Any]] | None = None,
    initial_state: Any = None,
    on_round: Callable[[Mapping[str, Any], Any], None] | None = None,
    report_policy: ReportPolicy | None = None,
    before_round: Callable[[int, Any], Any] | None = None,
) -> tuple[TrainingResult, Ledger]:
    """Runs (or resumes) training until `config.total_rounds` rounds are done.

    Args:
      process: its `next` takes (state, list of virtual-client ids).
      clients_for_round: round number (0-based) -> virtual-client ids of that round.
      ledger: a fresh ledger for this run's accounting spec; replaced by the
        checkpointed one when resuming.
      restore_ledger: JSON -> ledger, used on resume.
      config: rounds, checkpoint and evaluation cadence.
      evaluate: (state, rounds completed) -> metrics on held-out identities; called at
        round 0 (the start, recorded first in the history) of a fresh run, every
        `evaluate_every` rounds and after the last.
      initial_state: state to start from instead of `process.initialize()` (e.g. a
        pretrained backbone); ignored when a checkpoint exists.
      on_round: (history record, the process's training-user metrics) after each
        round, before it is saved: for progress and configuration checks. The metrics
        are not private. An exception it raises stops training without saving the round.
      report_policy: the minimum of reporting virtual clients; a round below it is
        retried (`dropouts.run_round`), and `clients_for_round` is then called as
        (round, attempt) for a retry's fresh selection. None: every round is applied.
      before_round: (0-based round, state) -> the state the round starts from, called
        once per round before its first attempt (retries reuse it): for what the server
        broadcasts besides the model, such as released shared negatives (issue 22). The
        state it returns is saved with the round.

    Returns:
      The result (final state, history) and the ledger after the last round.
    """
    os.makedirs(config.checkpoint_dir, exist_ok=True)
    _remove_partial_checkpoints(config.checkpoint_dir)
    manager = tff.program.FileProgramStateManager(
        config.checkpoint_dir,
        prefix=CHECKPOINT_PREFIX,
        keep_total=0,  # every version: `_remove_old_checkpoints` prunes
        keep_first=False,
    )
    state = process.initialize() if initial_state is None else initial_state
    history: list[dict[str, Any]] = []
    saved, start_round = _load_newest_intact(
        manager, _program_state(state, ledger, history), config.checkpoint_dir
    )
    _remove_old_checkpoints(
        config.checkpoint_dir, _run(manager.get_versions()) or [], config.keep_checkpoints
    )
    if saved is not None:
        state = saved["state"]
        ledger = restore_ledger(_as_text(saved["ledger"]))
        history = json.loads(_as_text(saved["history"]))
        if ledger.rounds_recorded != start_round:
            raise ValueError(
                f"checkpoint {start_round} in {config.checkpoint_dir} holds a ledger of "
                f"{ledger.rounds_recorded} rounds; refusing to resume from an inconsistent state"
            )
        if start_round > config.total_rounds:
            raise ValueError(
                f"{config.checkpoint_dir} already holds {start_round} rounds, more than the "
                f"{config.total_rounds} requested"
            )
        logging.info("Resuming from round %d of %d", start_round, config.total_rounds)
    elif ledger.rounds_recorded != 0:
        raise ValueError("a fresh training run needs a ledger with no rounds recorded")
    elif evaluate is not None:
        # Round 0: the start (a pretrained backbone, or the initial weights), so the
        # recall curve shows what training changed. Nothing private is spent yet.
        history.append(
            {"round": 0, "epsilon": 0.0, "round_seconds": 0.0, "eval": dict(evaluate(state, 0))}
        )

    started = time.perf_counter()
    for round_num in range(start_round, config.total_rounds):
        round_start = time.perf_counter()
        if before_round is not None:
            state = before_round(round_num, state)
        round_state = state

        def attempt(round_num: int = round_num, round_state: Any = round_state):
            if report_policy is None:
                client_ids = list(clients_for_round(round_num))
                return process.next(round_state, client_ids), client_ids, None
            applied = dropouts.run_round(
                process, round_state, round_num, clients_for_round, report_policy
            )
            return applied.output, applied.client_ids, applied

        # Under a deadline; a lost worker's round is tried again from the same state.
        workers = runtime.current()
        output, client_ids, applied = (
            attempt() if workers is None else workers.run_round(round_num + 1, attempt)
        )
        state = output.state
        done = round_num + 1
        ledger.record_round(done)
        record: dict[str, Any] = {
            "round": done,
            "epsilon": ledger.epsilon,
            "round_seconds": time.perf_counter() - round_start,
        }
        if applied is not None and applied.discarded_kept_clients:
            record["discarded_attempts_kept_clients"] = list(applied.discarded_kept_clients)
        last = done == config.total_rounds
        if evaluate is not None and loop_schedule.evaluation_due(
            config.total_rounds, config.evaluate_every, done
        ):
            record["eval"] = dict(evaluate(state, done))
        history.append(record)
        logging.info(
            "round %d/%d: %d virtual clients, %.2fs, epsilon %.4g%s",
            done,
            config.total_rounds,
            len(client_ids),
            record["round_seconds"],
            record["epsilon"],
            f", eval {record['eval']}" if "eval" in record else "",
        )
        logging.debug("round %d training-user metrics (not private): %s", done, output.metrics)
        if on_round is not None:
            on_round(record, output.metrics)
        if last or done % config.checkpoint_every == 0:
            try:
                _run(manager.save(_program_state(state, ledger, history), version=done))
            except BaseException:
                # A save stopped by a full disk: its temporary goes (the round is
                # trained again on resume). The save's error is what the user must see.
                with contextlib.suppress(OSError, ValueError):
                    _remove_partial_checkpoints(config.checkpoint_dir)
                raise
            _remove_old_checkpoints(
                config.checkpoint_dir, _run(manager.get_versions()) or [], config.keep_checkpoints
            )
    result = TrainingResult(
        state=state,
        rounds_completed=config.total_rounds,
        resumed_from_round=start_round,
        history=history,
        wall_seconds=time.perf_counter() - started,
    )
    return result, ledger
