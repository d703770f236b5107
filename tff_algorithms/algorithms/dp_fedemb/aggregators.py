"""Aggregation factories for the backbone update: where the privacy mechanism lives.

Every factory clips each virtual client's update to L2 norm `clip_norm`, sums the
clipped updates, adds noise to the SUM, and divides by the PLANNED number of
virtual clients per round (a constant): a round where fewer clients report, or
where a client's update was zeroed for being non-finite, is divided by the same
number, so the noise-to-sensitivity ratio the accountant assumes always holds.
A training job takes its aggregator from `mechanisms.aggregator_for_spec`, which picks
`gaussian_fixed` or `tree_aggregation` from the job's accounting spec.

Noise seeds are explicit. A production caller passes fresh OS entropy
(`loop_schedule.job_noise_seed`); tests pass fixed seeds. The seed then lives in the
aggregator state, so a checkpointed state resumes the same noise stream. Keep
checkpoints as private as the raw data: whoever holds the seed can subtract the
noise.

`noise_multiplier` and `clip_norm` go into TF Privacy queries as Python floats
(docs/design.md section 1).
"""

from __future__ import annotations

import collections

import dp_accounting
import tensorflow as tf
import tensorflow_federated as tff
import tensorflow_privacy as tfp


def _positive_float(value: float, name: str) -> float:
    value = float(value)
    if not value > 0.0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _nonnegative_float(value: float, name: str) -> float:
    value = float(value)
    if not value >= 0.0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return value


class SeededGaussianSumQuery(tfp.GaussianSumQuery):
    """`GaussianSumQuery` whose noise comes from a stateless seed kept in its state.

    TF Privacy's `GaussianSumQuery` draws noise from an unseeded initializer; here
    each round's noise is `stateless_normal` under a per-round seed split off the
    state's seed, so runs are reproducible from `noise_seed` and resumable from a
    checkpointed state. Clipping, the noise scale and the DP event
    (`GaussianDpEvent(stddev / clip)`) are those of the parent.
    """

    _GlobalState = collections.namedtuple("_GlobalState", ["l2_norm_clip", "stddev", "noise_seed"])

    def __init__(self, l2_norm_clip: float, stddev: float, noise_seed: int) -> None:
        super().__init__(l2_norm_clip, stddev)
        self._noise_seed = int(noise_seed)

    def make_global_state(self, l2_norm_clip, stddev, noise_seed=None):  # noqa: ANN001, ANN201 - TF Privacy's signature
        if noise_seed is None:
            noise_seed = tf.constant([self._noise_seed, 0], tf.int64)
        return self._GlobalState(
            tf.cast(l2_norm_clip, tf.float32),
            tf.cast(stddev, tf.float32),
            tf.cast(noise_seed, tf.int64),
        )

    def get_noised_result(self, sample_state, global_state):  # noqa: ANN001, ANN201 - TF Privacy's signature
        flat_sum = tf.nest.flatten(sample_state)
        seeds = tf.random.experimental.stateless_split(
            global_state.noise_seed, num=len(flat_sum) + 1
        )
        noised = [
            value
            + tf.random.stateless_normal(
                tf.shape(value), seed=seeds[i], stddev=global_state.stddev, dtype=value.dtype
            )
            for i, value in enumerate(flat_sum)
        ]
        new_state = global_state._replace(noise_seed=seeds[-1])
        event = dp_accounting.GaussianDpEvent(global_state.stddev / global_state.l2_norm_clip)
        return tf.nest.pack_sequence_as(sample_state, noised), new_state, event


def gaussian_fixed(
    *, noise_multiplier: float, clip_norm: float, virtual_clients_per_round: int, noise_seed: int
) -> tff.aggregators.UnweightedAggregationFactory:
    """Fixed clip γ, Gaussian noise N(0, (zγ)²) on the sum, mean over the planned M.

    The released update is (Σ clip(Δ_v, γ) + N(0, (zγ)² I)) / M; its DP event is
    `GaussianDpEvent(z)` (recoverable with
    `tff.aggregators.DifferentiallyPrivateFactory` state helpers).
    """
    noise_multiplier = _nonnegative_float(noise_multiplier, "noise_multiplier")
    clip_norm = _positive_float(clip_norm, "clip_norm")
    query = tfp.NormalizedQuery(
        SeededGaussianSumQuery(clip_norm, clip_norm * noise_multiplier, noise_seed),
        denominator=_positive_float(virtual_clients_per_round, "virtual_clients_per_round"),
    )
    return tff.aggregators.DifferentiallyPrivateFactory(query)


def gaussian_adaptive(
    *,
    noise_multiplier: float,
    virtual_clients_per_round: int,
    initial_clip: float = 0.1,
    target_unclipped_quantile: float = 0.5,
    clip_learning_rate: float = 0.2,
) -> tff.aggregators.UnweightedAggregationFactory:
    """Adaptive clipping (Andrew et al.) for the tuning run that estimates γ.

    The paper tunes with quantile 0.5 and zero noise, then trains with the fixed
    estimated clip. TF Privacy's adaptive query has no noise seed, so this one is
    for tuning only; its noise (if any) is not reproducible.
    """
    return tff.aggregators.DifferentiallyPrivateFactory.gaussian_adaptive(
        noise_multiplier=_nonnegative_float(noise_multiplier, "noise_multiplier"),
        clients_per_round=_positive_float(virtual_clients_per_round, "virtual_clients_per_round"),
        initial_l2_norm_clip=_positive_float(initial_clip, "initial_clip"),
        target_unclipped_quantile=float(target_unclipped_quantile),
        learning_rate=float(clip_learning_rate),
    )


def tree_aggregation(
    *,
    noise_multiplier: float,
    clip_norm: float,
    virtual_clients_per_round: int,
    record_specs: object,
    noise_seed: int,
    restart_every_rounds: int | None = None,
    use_efficient: bool = True,
) -> tff.aggregators.UnweightedAggregationFactory:
    """Tree-aggregated (DP-FTRL) noise, residual form, mean over the planned M.

    Each tree node holds N(0, (zγ)² I); round t releases the residual of the
    noised prefix sums, so the sum of the first t releases carries the tree's
    prefix-sum noise. With `restart_every_rounds` (the rounds of one epoch), the
    tree restarts after every that many rounds (TF Privacy `RestartQuery` with
    `PeriodicRoundRestartIndicator`); server momentum is not reset by it.

    Args:
      noise_multiplier: z, per tree node.
      clip_norm: γ.
      virtual_clients_per_round: planned virtual clients per round M (the denominator).
      record_specs: `tf.TensorSpec` structure of one client's update.
      noise_seed: seed of the tree's Gaussian noise generator.
      restart_every_rounds: restart period in rounds, or None for one tree.
      use_efficient: Honaker's variance-reduced prefix sums (same privacy).
    """
    noise_multiplier = _nonnegative_float(noise_multiplier, "noise_multiplier")
    clip_norm = _positive_float(clip_norm, "clip_norm")
    sum_query = tfp.TreeResidualSumQuery.build_l2_gaussian_query(
        clip_norm,
        noise_multiplier,
        record_specs,
        noise_seed=int(noise_seed),
        use_efficient=use_efficient,
    )
    if restart_every_rounds is not None:
        if restart_every_rounds < 1:
            raise ValueError(f"restart_every_rounds must be >= 1, got {restart_every_rounds}")
        sum_query = tfp.RestartQuery(
            sum_query,
            tfp.restart_query.PeriodicRoundRestartIndicator(period=int(restart_every_rounds)),
        )
    query = tfp.NormalizedQuery(
        sum_query,
        denominator=_positive_float(virtual_clients_per_round, "virtual_clients_per_round"),
    )
    return tff.aggregators.DifferentiallyPrivateFactory(query)


def no_dp(*, virtual_clients_per_round: int) -> tff.aggregators.UnweightedAggregationFactory:
    """No clipping, no noise, mean over the planned M: the ablation baseline.

    Its DP event is `NonPrivateDpEvent`, so the ledger records ε = ∞.
    """
    query = tfp.NormalizedQuery(
        tfp.NoPrivacySumQuery(),
        denominator=_positive_float(virtual_clients_per_round, "virtual_clients_per_round"),
    )
    return tff.aggregators.DifferentiallyPrivateFactory(query)
