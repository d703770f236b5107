"""Empirical privacy auditing with one training run (Steinke, Nasr & Jagielski, 2023).

The audit game: m canaries, each included in training independently with probability
1/2 (S_i = +1 included, -1 not). After training, the auditor scores every canary,
guesses "included" for the k+ highest scores and "excluded" for the k- lowest, and
abstains on the rest: r = k+ + k- guesses, v of them correct. If training is (ε, δ)-DP
with respect to flipping any one S_i, the paper's main theorem bounds the chance of v
or more correct guesses:

    P[V >= v] <= P[Bin(r, q) >= v] + 2 m δ · max_{i=1..v} P[v - i <= Bin(r, q) < v] / i,
    q = e^ε / (1 + e^ε)

(q is the accuracy of ε-randomized response, the most any single guess can reach).
`epsilon_lower_bound` inverts it: the largest ε whose p-value is still below
1 - confidence, i.e. training cannot be (ε, δ)-DP for any ε below the returned value,
except with probability 1 - confidence. The bound is a lower bound on the true ε, so it
must never exceed the accountant's ε; without noise a good membership score should push
it well above 0.

Neighbouring relation: the accountant's user-level DP-FedEmb guarantee is for
substituting one user. For the audit to test that guarantee, an excluded canary is
replaced by a filler user (ordinary data, no canary), so flipping S_i substitutes one
user and the population stays the same size.

`run_canary_audit` plays the game on a real training job: it writes the population
(`beam_jobs.canaries`), trains it with `train_job.run_train_job`, scores every slot
from the released backbone (`membership_scores`), and reports the bound next to the
ledger's ε. `audit_train_config` is the DP-FedEmb configuration under which a user
influences the model most, so the attack, and hence the bound, is as strong as it
gets at a given noise multiplier.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from scipy import stats

from beam_jobs import canaries
from tff_algorithms import algorithms
from tff_algorithms.config import job_config, model_config
from tff_algorithms.jobs import train_job
from tff_algorithms.modeling import export, models


def randomized_response_accuracy(epsilon: float) -> float:
    """q = e^ε / (1 + e^ε), computed without overflow for large ε."""
    return 1.0 / (1.0 + math.exp(-epsilon))


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[at least `correct` of `guesses` right] under (ε, δ)-DP (module doc)."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(
            f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}"
        )
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    q = randomized_response_accuracy(epsilon)
    tail = float(stats.binom.sf(correct - 1, guesses, q))
    if delta == 0:
        return min(tail, 1.0)
    # P[v - i <= Bin < v] for i = 1..v, as cumulative sums of the pmf below v.
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q)
    window = np.cumsum(below)
    slack = float(np.max(window / np.arange(1, correct + 1))) if correct else 0.0
    return min(tail + 2 * canaries * delta * slack, 1.0)


def epsilon_lower_bound(
    canaries: int,
    guesses: int,
    correct: int,
    delta: float,
    confidence: float = 0.95,
    *,
    tolerance: float = 1e-6,
) -> float:
    """The largest ε that `correct` right guesses reject at `confidence` (0 if none).

    The p-value grows with ε, so this bisects for the ε where it reaches 1 - confidence.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    level = 1.0 - confidence
    if p_value(canaries, guesses, correct, 0.0, delta) >= level:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(canaries, guesses, correct, high, delta) < level:
        low, high = high, 2 * high
        if high > 1e3:  # every ε is rejected: only possible with δ = 0 and v = r
            return math.inf
    while high - low > tolerance:
        middle = (low + high) / 2
        if p_value(canaries, guesses, correct, middle, delta) < level:
            low = middle
        else:
            high = middle
    return low


@dataclasses.dataclass(frozen=True)
class Guesses:
    """The auditor's guesses: r made, v correct."""

    guesses: int
    correct: int


def guess_membership(
    scores: np.ndarray, included: np.ndarray, guess_included: int, guess_excluded: int
) -> Guesses:
    """Guess "included" for the top `guess_included` scores and "excluded" for the bottom
    `guess_excluded`; abstain on the rest. Ties are broken by canary index."""
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError("scores and included must be vectors of the same length")
    if guess_included < 0 or guess_excluded < 0 or guess_included + guess_excluded > len(scores):
        raise ValueError(
            f"cannot make {guess_included} + {guess_excluded} guesses on {len(scores)} canaries"
        )
    order = np.argsort(-scores, kind="stable")
    top, bottom = order[:guess_included], order[len(order) - guess_excluded :]
    correct = int(np.sum(included[top])) + int(np.sum(~included[bottom]))
    return Guesses(guess_included + guess_excluded, correct)


# The canary audit of a training job.


def _centered_unit(embeddings: np.ndarray, center: np.ndarray) -> np.ndarray:
    centered = embeddings - center
    return centered / np.maximum(np.linalg.norm(centered, axis=1, keepdims=True), 1e-12)


def separation_scores(embeddings: Sequence[np.ndarray]) -> np.ndarray:
    """How well each canary's images cluster apart from the other canaries' images.

    `embeddings[i]` holds the raw backbone outputs of canary i's images. The score is
    the mean cosine similarity between canary i's own images minus the mean between
    its images and every other canary's, after subtracting the mean embedding of all
    images: raw embeddings share a large common component (cosines near 1 everywhere),
    which would otherwise swamp the differences.
    """
    if len(embeddings) < 2 or any(len(e) < 2 for e in embeddings):
        raise ValueError("need at least two canaries with at least two images each")
    center = np.concatenate(embeddings).mean(axis=0)
    units = [_centered_unit(np.asarray(e, np.float64), center) for e in embeddings]
    totals = np.sum([u.sum(axis=0) for u in units], axis=0)
    total_count = sum(len(u) for u in units)
    scores = []
    for u in units:
        n, own_sum = len(u), u.sum(axis=0)
        # Sums of pairwise cosines through the sums of unit vectors (no n^2 matrices).
        within = (own_sum @ own_sum - n) / (n * (n - 1))
        across = (u @ (totals - own_sum)).sum() / (n * (total_count - n))
        scores.append(within - across)
    return np.array(scores)


def membership_scores(
    backbone_config: model_config.BackboneConfig,
    initial: tff.learning.models.ModelWeights,
    trained: tff.learning.models.ModelWeights,
    canary_images: Sequence[np.ndarray],
    filler_images: Sequence[np.ndarray],
) -> np.ndarray:
    """Higher where training saw canary i rather than its filler.

    Training pulls the images of the users it sees together, so the score of slot i is
    the gain (trained minus initial model, which removes how distinct an identity is
    before training) of canary i's `separation_scores`, minus the same gain of filler
    i: exactly one of the two was trained on, so the difference doubles the signal and
    cancels what training does to every identity alike. The scores depend on the
    trained model and on data the auditor holds, never on the membership bits.
    """
    images = [*canary_images, *filler_images]
    slots = len(canary_images)
    if len(filler_images) != slots:
        raise ValueError(f"{slots} canaries but {len(filler_images)} fillers")

    def scores(weights: tff.learning.models.ModelWeights) -> np.ndarray:
        backbone = models.build_backbone(backbone_config)
        models.assign_backbone_weights(backbone, weights)
        return separation_scores([backbone(batch, training=False).numpy() for batch in images])

    gain = scores(trained) - scores(initial)
    return gain[:slots] - gain[slots:]


def audit_train_config(
    population: canaries.CanaryPopulation,
    noise_multiplier: float,
    *,
    rounds: int = 6,
    delta: float = 1e-5,
    noise_seed: int | None = None,
) -> job_config.TrainJobConfig:
    """DP-FedEmb settings that give each user as much influence as the mechanism allows.

    One virtual client holding every user, every round (users per round = population,
    so sampling adds no amplification and the ledger's ε is that of the plain Gaussian
    mechanism composed over `rounds`), several local epochs at a learning rate that
    keeps local training stable, and a clip above the update norm so that without
    noise nothing dampens the canaries. The ε lower bound is only as strong as the
    attack; this is the configuration where the attack is strongest.

    Every round is applied (`min_report_fraction` 0): at small ε the noise wrecks the
    model, its one client then reports a non-finite update, which is dropped, and the
    round releases noise alone (charged by the ledger like any round). `noise_seed`
    (tests and benchmarks only) fixes the noise and the schedule (the order of the
    users in the one virtual client) behind `TrainJobConfig`'s testing flags, so an
    audit repeats exactly.
    """
    return job_config.TrainJobConfig(
        algorithm=job_config.DP_FEDEMB,
        rounds=rounds,
        noise_multiplier=noise_multiplier,
        clip_norm=5.0,
        users_per_virtual_client=population.canaries,
        virtual_clients_per_round=1,
        client_learning_rate=0.01,
        client_momentum=0.0,
        server_learning_rate=1.0,
        server_momentum=0.0,
        head_lr_scale=10.0,
        local_epochs=3,
        batch_size=16,
        embedding_size=16,
        image_size=population.image_size,
        delta=delta,
        evaluate_every=0,
        min_report_fraction=0.0,
        noise_seed=noise_seed,
        testing_fixed_noise=noise_seed is not None,
        schedule_seed=noise_seed,
        testing_fixed_schedule=noise_seed is not None,
    )


@dataclasses.dataclass(frozen=True)
class CanaryAuditResult:
    """One audited training run: the empirical lower bound next to the ledger's ε."""

    canaries: int
    included: int
    guesses: int
    correct: int
    confidence: float
    delta: float
    epsilon_lower_bound: float
    theoretical_epsilon: float
    accounting_convention: str  # what theoretical_epsilon was accounted under
    noise_multiplier: float
    training_seconds: float

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in dataclasses.asdict(self).items()
        }


def run_canary_audit(
    population: canaries.CanaryPopulation,
    config: job_config.TrainJobConfig,
    work_dir: str,
    guesses_per_side: int,
    confidence: float = 0.95,
) -> CanaryAuditResult:
    """Trains `config` on an audit population and bounds its ε from the canaries.

    The population (`beam_jobs.canaries`) holds each canary with probability 1/2 and
    otherwise its filler, so the audit tests the replace-one-user guarantee the ledger
    reports. The auditor knows the canaries' images and the initial backbone (public:
    seeded by `config.seed`), scores every canary with `membership_scores`, guesses
    "included" for the `guesses_per_side` highest scores and "excluded" for as many
    lowest, and converts the right guesses with `epsilon_lower_bound` at the ledger's δ.
    Needs a running TFF runtime or starts one (as `train_job.run_train_job`).
    """
    if not algorithms.get(config.algorithm).canary_audit:
        audited = " and ".join(algorithms.names(lambda algorithm: algorithm.canary_audit))
        raise ValueError(f"the canary audit runs {audited}, got {config.algorithm}")
    files = canaries.write_population(population, os.path.join(work_dir, "data"))
    result = train_job.run_train_job(
        config, files.partition_dir, files.eval_dir, os.path.join(work_dir, "train")
    )
    trained_variables = [
        v.numpy() for v in tf.saved_model.load(result.saved_model_dir).backbone_variables
    ]
    initial = models.backbone_weights(models.build_backbone(config.backbone_config, config.seed))
    trainable = len(initial.trainable)
    trained = tff.learning.models.ModelWeights(
        trainable=trained_variables[:trainable], non_trainable=trained_variables[trainable:]
    )

    def decoded(encoded_sets: list[list[bytes]]) -> list[np.ndarray]:
        return [
            np.stack([export.decode_image(e, config.image_shape).numpy() for e in encoded])
            for encoded in encoded_sets
        ]

    membership = population.membership()
    scores = membership_scores(
        config.backbone_config,
        initial,
        trained,
        decoded(population.canary_images()),
        decoded(population.filler_images()),
    )
    guesses = guess_membership(scores, membership, guesses_per_side, guesses_per_side)
    delta = float(result.metrics["delta"])
    return CanaryAuditResult(
        canaries=population.canaries,
        included=int(membership.sum()),
        guesses=guesses.guesses,
        correct=guesses.correct,
        confidence=confidence,
        delta=delta,
        epsilon_lower_bound=epsilon_lower_bound(
            population.canaries, guesses.guesses, guesses.correct, delta, confidence
        ),
        theoretical_epsilon=result.epsilon,
        accounting_convention=result.metrics["accounting"]["convention"],
        noise_multiplier=config.noise_multiplier,
        training_seconds=float(result.metrics["wall_seconds"]),
    )
