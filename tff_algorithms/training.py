"""The federated training program: rounds, checkpoints, resume, privacy ledger, evaluation.

One loop serves every algorithm (DP-FedEmb, DP-FTRL-FedEmb, DP-FedAvg): it takes a
`tff.learning.templates.LearningProcess` whose client argument is a list of
virtual-client ids (data is loaded inside TFF from the id), a function giving the ids
of round r (the schedule), and a privacy ledger.

Checkpoints use `tff.program.FileProgramStateManager` (written to a temporary
directory and renamed, so a kill mid-write leaves the previous one usable). Each
holds everything resume needs: the whole process state (model, server optimizer
and aggregator state, tree-noise state included), the number of completed rounds
(the schedule is a pure function of the round, so that is its position), the
ledger and the evaluation history. Version v is the state after v rounds, saved
together with its ledger, so a round is never counted twice or missed.

Metrics the process computes on training users are not covered by the privacy
guarantee (DESIGN.md section 5); they are logged for debugging only and never
stored in the history that reports and exports read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import tensorflow_federated as tff
from absl import logging

CHECKPOINT_PREFIX = "round_"


class Ledger(Protocol):
    """What the loop needs of a privacy ledger (tff_algorithms.ledger.PrivacyLedger)."""

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
            shutil.rmtree(os.path.join(checkpoint_dir, entry), ignore_errors=True)


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
) -> tuple[TrainingResult, Ledger]:
    """Runs (or resumes) training until `config.total_rounds` rounds are done.

    Args:
      process: its `next` takes (state, list of virtual-client ids).
      clients_for_round: round number (0-based) -> virtual-client ids of that round.
      ledger: a fresh ledger for this run's accounting spec; replaced by the
        checkpointed one when resuming.
      restore_ledger: JSON -> ledger, used on resume.
      config: rounds, checkpoint and evaluation cadence.
      evaluate: (state, rounds completed) -> metrics on held-out identities.
      initial_state: state to start from instead of `process.initialize()` (e.g. a
        pretrained backbone); ignored when a checkpoint exists.
      on_round: (history record, the process's training-user metrics) after each
        round, before it is saved: for progress and configuration checks. The metrics
        are not private. An exception it raises stops training without saving the round.

    Returns:
      The result (final state, history) and the ledger after the last round.
    """
    os.makedirs(config.checkpoint_dir, exist_ok=True)
    _remove_partial_checkpoints(config.checkpoint_dir)
    manager = tff.program.FileProgramStateManager(
        config.checkpoint_dir,
        prefix=CHECKPOINT_PREFIX,
        keep_total=config.keep_checkpoints,
        keep_first=False,
    )
    state = process.initialize() if initial_state is None else initial_state
    history: list[dict[str, Any]] = []
    saved, start_round = _run(manager.load_latest(_program_state(state, ledger, history)))
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

    started = time.perf_counter()
    for round_num in range(start_round, config.total_rounds):
        round_start = time.perf_counter()
        client_ids = list(clients_for_round(round_num))
        output = process.next(state, client_ids)
        state = output.state
        done = round_num + 1
        ledger.record_round(done)
        record: dict[str, Any] = {
            "round": done,
            "epsilon": ledger.epsilon,
            "round_seconds": time.perf_counter() - round_start,
        }
        last = done == config.total_rounds
        if evaluate is not None and (
            last or (config.evaluate_every and done % config.evaluate_every == 0)
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
            _run(manager.save(_program_state(state, ledger, history), version=done))
    result = TrainingResult(
        state=state,
        rounds_completed=config.total_rounds,
        resumed_from_round=start_round,
        history=history,
        wall_seconds=time.perf_counter() - started,
    )
    return result, ledger
