"""The checkpointed step loop of the private algorithms that train Keras variables
outside TFF: Logit-DP (`contrastive_training`) and user-level DP-SGD (`user_dp_sgd`).

Each algorithm supplies its step (given the step number and its noise seed) and the
variables to checkpoint; this loop owns what they share:
- the noise seed: the job's testing seed or one from OS entropy, drawn once and kept in
  the checkpoint, so a resumed job redraws the same noise;
- the ledger (one event per step), the history (epsilon, wall time, held-out
  evaluation: nothing else computed from the training users, which would be an
  unaccounted release) and the progress callback;
- a checkpoint every `CHECKPOINT_EVERY` steps and on evaluation steps, holding the
  variables, the step, the noise seed, the ledger and the history together, so a resumed
  job ends where an uninterrupted one ends.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.privacy.ledger import PrivacyLedger

if TYPE_CHECKING:
    from tff_algorithms.jobs.train_job import JobInputs

CHECKPOINT_EVERY = 10


def evaluation_due(rounds: int, evaluate_every: int, done: int) -> bool:
    """Whether held-out evaluation follows round (or step) `done` of `rounds`."""
    return done == rounds or bool(evaluate_every and done % evaluate_every == 0)


def run_steps(
    inputs: JobInputs,
    variables: Mapping[str, Any],
    step: Callable[[int, tf.Tensor], None],
    backbone: Callable[[], tff.learning.models.ModelWeights],
) -> JobOutcome:
    """Runs steps from the last checkpoint to `config.rounds` (module docstring).

    Args:
      inputs: the job's inputs (config, spec, evaluator, checkpoint_dir, progress).
      variables: what the checkpoint holds besides the loop's own state (trackables:
        models, variables, optimizers), by name.
      step: `step(t, seed)` trains step t (0-based); `seed` is the stateless noise seed
        [noise seed, t] (int64[2]).
      backbone: the backbone's current weights, for evaluation and the outcome.
    """
    config = inputs.config
    fresh_noise_seed = config.noise_seed if config.noise_seed is not None else secrets.randbits(62)
    noise_seed = tf.Variable(fresh_noise_seed, dtype=tf.int64)
    done_steps = tf.Variable(0, dtype=tf.int64)
    ledger_text = tf.Variable(PrivacyLedger(inputs.spec).to_json())
    history_text = tf.Variable("[]")
    checkpoint = tf.train.Checkpoint(
        **variables,
        step=done_steps,
        noise_seed=noise_seed,
        ledger=ledger_text,
        history=history_text,
    )
    manager = tf.train.CheckpointManager(checkpoint, inputs.checkpoint_dir, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    ledger = PrivacyLedger.from_json(ledger_text.numpy().decode(), expected_spec=inputs.spec)
    history: list[dict[str, Any]] = json.loads(history_text.numpy().decode())
    start = int(done_steps.numpy())
    for t in range(start, config.rounds):
        began = time.perf_counter()
        step(t, tf.constant([int(noise_seed.numpy()), t], tf.int64))
        done = t + 1
        ledger.record_round(done)
        record: dict[str, Any] = {
            "round": done,
            "epsilon": ledger.epsilon,
            "round_seconds": time.perf_counter() - began,
        }
        evaluate = evaluation_due(config.rounds, config.evaluate_every, done)
        if evaluate:
            record["eval"] = inputs.evaluator(backbone())
        history.append(record)
        if inputs.progress is not None:
            inputs.progress(record)
        if evaluate or done % CHECKPOINT_EVERY == 0:
            done_steps.assign(done)
            ledger_text.assign(ledger.to_json())
            history_text.assign(json.dumps(history))
            manager.save(checkpoint_number=done)
    return JobOutcome(backbone(), ledger, history, start)
