"""The one training loop of every algorithm: an algorithm hands it a `Round`, the loop
owns what every algorithm shares (docs/design.md section 4, "The training loop").

A `Round` is what one algorithm brings: its step (`step(t, seed)`: trains step or round
t, returns the history fields only the data-independent schedule decides, such as
client counts), the state to checkpoint (models, optimizers, variables; a TFF state in
a `checkpoints.StructureState`), its backbone, whether the loop draws its noise seed,
its evaluation and how often it checkpoints. The DP event of one step is the job's
accounting spec (`JobInputs.spec`, with the shared-negatives releases): the ledger
charges it once per applied step.

The loop runs the steps from the newest intact checkpoint (`checkpoints`) to
`config.rounds`, and after each step calls, in order:
- the ledger (one event per step, epsilon into the step's record);
- the evaluation schedule (`loop_schedule.evaluation_due`; held-out data only);
- progress (`JobInputs.progress`: the caller's, and TensorBoard's, `train_job`);
- the checkpoint (every `Round.checkpoint_every` steps and on evaluation steps), holding
  the state, the step, the noise seed, the ledger and the history together.
The history holds epsilon, wall time, what the step reports and held-out evaluation:
nothing else computed from the training users, which would be an unaccounted release.
The noise seed is the job's testing seed or one from OS entropy
(`loop_schedule.job_noise_seed`), drawn once and kept in the checkpoint, so a resumed
job redraws the same noise; an algorithm whose noise seed lives in its own state (the
federated aggregators, FDML's server) or that has no noise says `noisy=False`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import tensorflow as tf
import tensorflow_federated as tff
from absl import logging

from tff_algorithms.config import loop_schedule
from tff_algorithms.jobs.checkpoints import Checkpoints
from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.privacy.ledger import PrivacyLedger

if TYPE_CHECKING:
    from tff_algorithms.jobs.job_inputs import JobInputs

CHECKPOINT_EVERY = 10

# (step t, stateless noise seed [noise seed, t] or None) -> the step's own history fields.
Step = Callable[[int, "tf.Tensor | None"], "Mapping[str, Any] | None"]


@dataclasses.dataclass(frozen=True)
class Round:
    """What an algorithm hands the loop.

    Attributes:
      step: `step(t, seed)` trains step t (0-based); `seed` is the stateless noise seed
        [noise seed, t] (int64[2]), None when not `noisy`. It returns fields to add to
        the step's history record (only what the data-independent schedule decides), or
        None. An exception stops training before the step is charged or saved.
      state: what the checkpoint holds besides the loop's own (trackables), by name.
      backbone: the backbone's current weights, for evaluation and the outcome.
      noisy: the loop draws and checkpoints a noise seed for the steps.
      evaluate: the held-out evaluation; None: `inputs.evaluator(backbone())`.
      evaluate_start: a fresh run evaluates its start first (history round 0), so the
        recall curve shows what training changed.
      checkpoint_every: save every this many steps (and on evaluation steps).
    """

    step: Step
    state: Mapping[str, Any]
    backbone: Callable[[], tff.learning.models.ModelWeights]
    noisy: bool = True
    evaluate: Callable[[], Mapping[str, Any]] | None = None
    evaluate_start: bool = False
    checkpoint_every: int = CHECKPOINT_EVERY


def run(inputs: JobInputs, algorithm_round: Round) -> JobOutcome:
    """Runs `algorithm_round`'s steps from the last checkpoint to `config.rounds`
    (module docstring)."""
    config = inputs.config
    done_steps = tf.Variable(0, dtype=tf.int64)
    fresh_ledger = PrivacyLedger(inputs.spec, inputs.releases)
    ledger_text = tf.Variable(fresh_ledger.to_json())
    history_text = tf.Variable("[]")
    own = {"step": done_steps, "ledger": ledger_text, "history": history_text}
    noise_seed = None
    if algorithm_round.noisy:
        noise_seed = tf.Variable(loop_schedule.job_noise_seed(config.noise_seed), dtype=tf.int64)
        own["noise_seed"] = noise_seed
    saved = Checkpoints(inputs.checkpoint_dir, {**algorithm_round.state, **own})
    ledger = PrivacyLedger.from_json(
        ledger_text.numpy().decode(), expected_spec=inputs.spec, expected_releases=inputs.releases
    )
    history: list[dict[str, Any]] = json.loads(history_text.numpy().decode())
    start = int(done_steps.numpy())
    if ledger.rounds_recorded != start:
        raise ValueError(
            f"checkpoint {start} in {inputs.checkpoint_dir} holds a ledger of "
            f"{ledger.rounds_recorded} rounds; refusing to resume from an inconsistent state"
        )
    if start > config.rounds:
        raise ValueError(
            f"{inputs.checkpoint_dir} already holds {start} steps, more than the "
            f"{config.rounds} requested"
        )

    def evaluate() -> dict[str, Any]:
        if algorithm_round.evaluate is not None:
            return dict(algorithm_round.evaluate())
        return dict(inputs.evaluator(algorithm_round.backbone()))

    if saved.resumed:
        logging.info("Resuming from step %d of %d", start, config.rounds)
    elif algorithm_round.evaluate_start:
        # Round 0: the start (a pretrained backbone, or the initial weights). Nothing
        # private is spent yet.
        history.append({"round": 0, "epsilon": 0.0, "round_seconds": 0.0, "eval": evaluate()})
    for t in range(start, config.rounds):
        began = time.perf_counter()
        seed = None if noise_seed is None else tf.constant([int(noise_seed.numpy()), t], tf.int64)
        reported = algorithm_round.step(t, seed)
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
            record["eval"] = evaluate()
        history.append(record)
        logging.info(
            "step %d/%d: %.2fs, epsilon %.4g%s",
            done,
            config.rounds,
            record["round_seconds"],
            record["epsilon"],
            f", eval {record['eval']}" if due else "",
        )
        if inputs.progress is not None:
            inputs.progress(record)
        if due or done % algorithm_round.checkpoint_every == 0:
            done_steps.assign(done)
            ledger_text.assign(ledger.to_json())
            history_text.assign(json.dumps(history))
            saved.save(done)
    return JobOutcome(algorithm_round.backbone(), ledger, history, start)
