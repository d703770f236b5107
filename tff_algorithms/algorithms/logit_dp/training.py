"""Logit-DP contrastive training of the backbone on private users (issue 26, item 2).

`train_job.run_train_job` calls `train_logit_dp` for `algorithm="logit-dp"`; everything
around the loop (budget charge, evaluation, export, metrics.json, ledger.json) is the
job's, as for the other algorithms. Labels are used only to draw each user's pair from
one identity (step 2): two users of one identity in a step remain each other's negatives,
as in any contrastive batch.

The privacy unit is the user. Each step t:

1. The job's schedule (`job_plan.schedule_for`, sampled mode, one user per virtual
   client) draws n = `virtual_clients_per_round` users uniformly without replacement:
   the sampling DP-FedEmb's rounds use, and the one the accountant analyses
   (`accounting_spec.Mechanism.LOGIT_DP`: sampled Gaussian, substitute-one).
2. Each sampled user gives one positive pair, two of its images of one identity drawn
   at random (two distinct records when it holds two of an identity, one image twice
   otherwise; a user holding several identities, a photographer of many landmarks,
   never pairs two of them, which would teach that two landmarks match). No user
   appears twice in a step and a user's whole part in it is one pair, so the
   substitute-one neighbour of a step's batch replaces one pair: the relation
   `logit_dp_sensitivity.logit_dp_sensitivity` bounds.
3. The clipped sum Σ τ_ij·clip_B(∇S_ij) (`logit_dp.clipped_gradient_by_rows`) plus
   N(0, (σ·C(n, s, B))²) (`logit_dp.logit_dp_noised_gradient`), divided by n, is the
   gradient of one step of `logit_dp.optimizer`: momentum SGD, Adam or LAMB
   (`tff_algorithms.modeling.optimizers`; post-processing of the release).

Which images form a pair is drawn from the secret schedule seed and the step (as the
users are); the noise from the noise seed and the step. Both seeds are in the
checkpoint (`jobs/loop.py`), so a resumed job redraws the same pairs and
noise and ends where an uninterrupted run ends. Nothing
computed from the training pairs other than the noised gradient is recorded: the
history holds epsilon, wall time and held-out evaluation only (a per-step training
loss would be an unaccounted release).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from beam_jobs import schema
from tff_algorithms.algorithms.logit_dp import mechanism as logit_dp
from tff_algorithms.config.job_plan import schedule_for
from tff_algorithms.federated import client_data
from tff_algorithms.jobs import loop
from tff_algorithms.jobs.job_outputs import JobOutcome
from tff_algorithms.modeling import models, optimizers

if TYPE_CHECKING:
    from tff_algorithms.jobs.job_inputs import JobInputs

# Stream of the pair draws, apart from the schedule's own streams of the same seed.
_PAIR_STREAM = 0x10617


def _pair_indices(
    identities: list[list[str]], schedule_seed: int, step: int
) -> list[tuple[int, int]]:
    """Two record indices of one identity per user, from each user's records' identities:
    distinct when the user holds two records of an identity."""
    rng = np.random.default_rng([schedule_seed, _PAIR_STREAM, step])
    pairs = []
    for held in identities:
        count = len(held)
        if len(set(held)) == 1 and count >= 2:
            # One identity (faces): any two records.
            first, second = rng.choice(count, size=2, replace=False)
            pairs.append((int(first), int(second)))
            continue
        paired = [i for i in range(count) if held.count(held[i]) >= 2]
        if not paired:
            # No identity held twice: one image twice (the first when there is only one).
            index = int(rng.integers(count)) if count > 1 else 0
            pairs.append((index, index))
            continue
        first = int(rng.choice(paired))
        second = int(rng.choice([i for i in paired if i != first and held[i] == held[first]]))
        pairs.append((first, second))
    return pairs


@tf.function
def _decode(serialized: tf.Tensor, image_shape: tuple[int, int, int]) -> tf.Tensor:
    return tf.map_fn(
        lambda s: client_data.parse_example(s, image_shape)["image"],
        serialized,
        fn_output_signature=tf.TensorSpec(image_shape, tf.float32),
    )


class PairSource:
    """The users and positive pairs of each step (module docstring, steps 1-2).

    A user's records are read from its byte range of the partition (the reader's
    shard index; no tf.data pipeline per user) and only the pair's two are decoded.
    """

    def __init__(self, inputs: JobInputs, schedule_seed: int) -> None:
        config = inputs.config
        self._plan = schedule_for(config, len(inputs.user_ids), schedule_seed)
        self._reader = inputs.reader
        self._user_ids = inputs.user_ids
        self._seed = schedule_seed
        self._shape = config.image_shape

    def users(self, step: int) -> list[str]:
        """The step's sampled users (the schedule's round `step`, one user per group)."""
        return [self._user_ids[int(i)] for i in np.ravel(self._plan.round_user_indices(step))]

    def pairs(self, step: int) -> tuple[tf.Tensor, tf.Tensor]:
        """(x, y), each [n, H, W, C]: row k is the k-th sampled user's two images."""
        examples = [self._reader.user_examples(user) for user in self.users(step)]
        identities = [[schema.parse(r).identity for r in e] for e in examples]
        indices = _pair_indices(identities, self._seed, step)
        first = [e[i] for e, (i, _) in zip(examples, indices, strict=True)]
        second = [e[j] for e, (_, j) in zip(examples, indices, strict=True)]
        images = _decode(tf.constant(first + second), self._shape)
        n = len(first)
        return images[:n], images[n:]


def train_logit_dp(inputs: JobInputs, schedule_seed: int) -> JobOutcome:
    """Trains the backbone with Logit-DP for `config.rounds` steps (module docstring)."""
    config = inputs.config
    model = models.build_backbone(config.backbone_config, seed=config.seed)
    if inputs.pretrained is not None:
        models.assign_backbone_weights(model, inputs.pretrained)
    optimizer = optimizers.from_settings(
        config.settings, config.server_learning_rate, config.server_momentum
    )
    variables = list(model.trainable_variables)
    n = int(config.virtual_clients_per_round)

    def embed(images: tf.Tensor) -> tf.Tensor:
        return model(images, training=False)  # per example: no batch statistics

    @tf.function
    def step_fn(x: tf.Tensor, y: tf.Tensor, seed: tf.Tensor) -> None:
        clipped = logit_dp.clipped_gradient_by_rows(
            embed, variables, x, y, scale=config.settings.scale, clip_norm=config.clip_norm
        )
        noised = logit_dp.logit_dp_noised_gradient(
            clipped,
            batch_size=n,
            scale=config.settings.scale,
            clip_norm=config.clip_norm,
            noise_multiplier=config.noise_multiplier,
            seed=seed,
        )
        optimizer.apply_gradients(zip([g / n for g in noised], variables, strict=True))

    optimizer.build(variables)
    source = PairSource(inputs, schedule_seed)
    return loop.run(
        inputs,
        loop.Round(
            lambda t, seed: step_fn(*source.pairs(t), seed),
            {"model": model, "optimizer": optimizer},
            lambda: models.backbone_weights(model),
        ),
    )
