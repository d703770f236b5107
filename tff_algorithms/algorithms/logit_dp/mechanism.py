"""Logit-DP: private contrastive training with per-pair logit-gradient clipping (issue 26).

The seed paper (dp-non-decomposable-contrastive, "Logit-DP") trains an embedding model f_θ
on the one-way n×n contrastive loss of a batch D = {(x_k, y_k)}, k = 1..n, one positive
pair per user per step. This module holds the mechanism for one step and its sensitivity;
it knows nothing of the pipeline, of sampling or of the accountant (items 2-3 of issue 26).

Loss and gradient
-----------------
Logits are scaled cosine similarities, S_ij = s·<f(x_i), f(y_j)> / (|f(x_i)| |f(y_j)|), so
S_ij ∈ [−s, s] for the logit scale s > 0 (s = 1/temperature). The loss is the **sum**
L = Σ_i ℓ_i, ℓ_i = −log p_ii, p_ij = e^{S_ij} / Σ_k e^{S_ik}; the sensitivity below is for
the sum, not the mean. τ_ij := ∂L/∂S_ij = p_ij − δ_ij. With c_ij := clip_B(∇_θ S_ij)
(clip_B(v) = v·min(1, B/|v|)) the released gradient before noise is

    g(D) = Σ_ij τ_ij · c_ij.                                               (*)

Three routes compute (*), equal up to float rounding (tests/tff_algorithms/algorithms/logit_dp/test_logit_dp.py):

- `clipped_gradient_explicit`: the n² per-pair gradients ∇_θ S_ij as one jacobian of S
  (n² reverse passes, vectorised; memory n²·P for P parameters), clipped, weighted, summed.
- `clipped_gradient_lambda` (the paper's §5.3): λ_ij = τ_ij·min(1, B/|∇_θ S_ij|) held
  constant (stop_gradient), then one reverse pass through Σ λ_ij S_ij. It needs the norms
  |∇_θ S_ij|, computed exactly by `per_pair_gradient_norms` without materialising the n²
  gradients: with a_i = f(x_i), b_j = f(y_j) ∈ R^d, ∇_θ S_ij = J_{a_i}ᵀu_ij + J_{b_j}ᵀv_ij,
  where J are the d×P jacobians of one embedding and u_ij = ∂S_ij/∂a_i,
  v_ij = ∂S_ij/∂b_j are d-vectors (from the d×d jacobian of the logits' own normalisation
  of each embedding, so they match the logits exactly, epsilon included). So
  |∇_θ S_ij|² = uᵀG_{a_i a_i}u + vᵀG_{b_j b_j}v + 2uᵀG_{a_i b_j}v with the Gram matrix
  G = J Jᵀ of the 2n·d embedding outputs. Cost: 2n·d reverse passes (vectorised) and
  2n·d·P memory for J, (2n·d)²·P flops for G, O(n²d²) for the norms, plus one reverse pass
  for the gradient (one forward pass serves both). Cheaper than the explicit route when
  2d < n; for large models a per-layer ghost norm would be needed (not done here). Norms
  are computed in the embeddings' dtype (float32 models: relative error ~1e-6).
- `clipped_gradient_by_rows` (what training uses): ∇_θ S_ij = J_{a_i}ᵀu_ij + J_{b_j}ᵀv_ij
  is the sum of two single-example vector-jacobian products, so row i's n pair gradients
  are 2n per-example backward passes (x_i with cotangents u_i·, each y_j with v_ij),
  vectorised; they are clipped, weighted by τ_i· and summed before the next row. Cost:
  2n² single-example passes and n·P memory, against the explicit route's n² passes
  through the whole 2n-example batch (2n³ example passes) and n²·P memory, and the λ
  route's 2n·d passes and 2n·d·P memory: the cheapest when n < d, which is where a
  backbone with a 128-wide embedding trains (n of 14-64 users a step).

Both routes require that an embedding depend only on its own input (no batch norm or other
cross-example coupling): the proof below needs c_ij to depend on (x_i, y_j) and θ only.

Sensitivity
-----------
The bounds C(n, s, B) are derived in `logit_dp_sensitivity` (TensorFlow-free, so job
configs and the accountant's callers check a configuration without importing TF); the
noise here is σ·C.

Noise and accounting
--------------------
The released gradient is g(D) + N(0, (σ·C)²) per coordinate, drawn statelessly from an
explicit seed (production callers draw the seed from OS entropy, as training does). σ is
relative to the relation's full L2 sensitivity, the strict convention of accounting_spec.py, so
dp_accounting takes noise multiplier σ for the same relation (no further halving).

Naive-DP baseline: the whole batch gradient ∇_θ L is clipped to B. Under substitute-one
(and add-or-remove) both batches' clipped gradients have norm ≤ B, so they differ by at
most 2B (`naive_dp_sensitivity`); noise std σ·2B.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tff_algorithms.algorithms.logit_dp.sensitivity import (
    check_clip_norm,
    check_logit_dp_config,
    naive_dp_sensitivity,
)
from tff_algorithms.privacy.accounting_spec import NeighboringRelation

EmbedFn = Callable[[tf.Tensor], tf.Tensor]


# ---------------------------------------------------------------------------------------
# Loss.


def _normalize(v: tf.Tensor) -> tf.Tensor:
    # The one normalisation of the logits; the per-pair norms differentiate this very
    # function, so their exactness (and with it the clipping) does not rest on a formula.
    return tf.math.l2_normalize(v, axis=1)


def cosine_logits(a: tf.Tensor, b: tf.Tensor, scale: float) -> tf.Tensor:
    """S_ij = scale · cos(a_i, b_j) for embeddings a, b of shape [n, d]."""
    return tf.constant(scale, a.dtype) * tf.matmul(_normalize(a), _normalize(b), transpose_b=True)


def contrastive_loss(logits: tf.Tensor) -> tf.Tensor:
    """Summed (not mean) one-way contrastive loss Σ_i −log softmax(S_i)_i."""
    return tf.reduce_sum(tf.reduce_logsumexp(logits, axis=1) - tf.linalg.diag_part(logits))


def logit_weights(logits: tf.Tensor) -> tf.Tensor:
    """τ_ij = ∂L/∂S_ij = p_ij − δ_ij for the summed loss."""
    n = tf.shape(logits)[0]
    return tf.nn.softmax(logits, axis=1) - tf.eye(n, dtype=logits.dtype)


# ---------------------------------------------------------------------------------------
# Per-pair clipping, two routes.


def _embed(embed_fn: EmbedFn, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    a, b = embed_fn(x), embed_fn(y)
    if a.shape.rank != 2 or b.shape.rank != 2:
        raise ValueError(f"embed_fn must return [n, d] embeddings (got {a.shape}, {b.shape}).")
    return a, b


def _clip_factors(norms: tf.Tensor, clip_norm: float) -> tf.Tensor:
    # min(1, B/|g|); a zero gradient keeps factor 1 (it contributes nothing either way).
    b = tf.constant(clip_norm, norms.dtype)
    return tf.minimum(
        tf.ones_like(norms), tf.math.divide_no_nan(b, norms) + tf.cast(norms == 0, norms.dtype)
    )


def _pair_cotangents(a: tf.Tensor, b: tf.Tensor, scale: float) -> tuple[tf.Tensor, tf.Tensor]:
    """u_ij = ∂S_ij/∂a_i and v_ij = ∂S_ij/∂b_j, both [n(i), n(j), d]."""
    # u_ij = ∂S_ij/∂a_i = s·N(a_i)ᵀ b̂_j and v_ij = ∂S_ij/∂b_j = s·N(b_j)ᵀ â_i, N the d×d
    # jacobian of the normalisation of one embedding (n of them: O(n·d²)).
    a, b = tf.stop_gradient(a), tf.stop_gradient(b)
    with tf.GradientTape(persistent=True) as norm_tape:
        norm_tape.watch([a, b])
        a_hat, b_hat = _normalize(a), _normalize(b)
    n_a = norm_tape.batch_jacobian(a_hat, a)  # [n, d(out), d(in)]
    n_b = norm_tape.batch_jacobian(b_hat, b)
    s = tf.constant(scale, a.dtype)
    u = s * tf.einsum("jk,ikl->ijl", b_hat, n_a)
    v = s * tf.einsum("ik,jkl->ijl", a_hat, n_b)
    return u, v


def _pair_norms(
    tape: tf.GradientTape,
    a: tf.Tensor,
    b: tf.Tensor,
    embeddings: tf.Tensor,
    variables: list[tf.Variable],
    scale: float,
) -> tf.Tensor:
    """|∇_θ S_ij| from the jacobian of `embeddings` = concat(a, b), recorded on `tape`."""
    jac = tape.jacobian(embeddings, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    n, d = a.shape[0], a.shape[1]
    rows = 2 * n * d
    gram = tf.zeros([rows, rows], dtype=a.dtype)
    for j in jac:
        flat = tf.reshape(tf.cast(j, a.dtype), [rows, -1])
        gram += tf.matmul(flat, flat, transpose_b=True)
    gram = tf.reshape(gram, [2 * n, d, 2 * n, d])
    g_aa = tf.stack([gram[i, :, i, :] for i in range(n)])  # [n, d, d]
    g_bb = tf.stack([gram[n + j, :, n + j, :] for j in range(n)])  # [n, d, d]
    g_ab = tf.transpose(gram[:n, :, n:, :], [0, 2, 1, 3])  # [n(i), n(j), d, d]

    u, v = _pair_cotangents(a, b, scale)
    sq = (
        tf.einsum("ijd,ide,ije->ij", u, g_aa, u)
        + tf.einsum("ijd,jde,ije->ij", v, g_bb, v)
        + 2.0 * tf.einsum("ijd,ijde,ije->ij", u, g_ab, v)
    )
    return tf.sqrt(tf.maximum(sq, tf.zeros_like(sq)))  # rounding can make tiny norms < 0


def per_pair_gradient_norms(
    embed_fn: EmbedFn,
    variables: Sequence[tf.Variable],
    x: tf.Tensor,
    y: tf.Tensor,
    *,
    scale: float,
) -> tf.Tensor:
    """Exact |∇_θ S_ij| for all pairs, [n, n], via the embeddings' Gram matrix (docstring).

    Cost: a jacobian of the 2n·d embedding outputs (2n·d reverse passes, vectorised;
    2n·d·P memory) and its Gram matrix ((2n·d)²·P flops), not the n² per-pair gradients.
    """
    variables = list(variables)
    with tf.GradientTape() as tape:
        a, b = _embed(embed_fn, x, y)
        embeddings = tf.concat([a, b], axis=0)
    return _pair_norms(tape, a, b, embeddings, variables, scale)


def clipped_gradient_explicit(
    embed_fn: EmbedFn,
    variables: Sequence[tf.Variable],
    x: tf.Tensor,
    y: tf.Tensor,
    *,
    scale: float,
    clip_norm: float,
) -> list[tf.Tensor]:
    """Σ_ij τ_ij · clip_B(∇_θ S_ij), the n² per-pair gradients materialised (jacobian of S).

    Cost: n² reverse passes (vectorised) and n²·P memory. `clip_norm=math.inf` gives the
    unclipped gradient of the summed loss.
    """
    check_clip_norm(clip_norm)
    variables = list(variables)
    with tf.GradientTape() as tape:
        a, b = _embed(embed_fn, x, y)
        logits = cosine_logits(a, b, scale)
    jac = tape.jacobian(logits, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    sq = tf.add_n(
        [
            tf.reduce_sum(tf.reshape(tf.cast(j, logits.dtype), [*logits.shape, -1]) ** 2, axis=2)
            for j in jac
        ]
    )
    norms = tf.sqrt(sq)
    weights = logit_weights(logits)
    if math.isinf(clip_norm):
        coefficients = weights
    else:
        coefficients = weights * _clip_factors(norms, clip_norm)
    return [tf.tensordot(tf.cast(coefficients, j.dtype), j, axes=[[0, 1], [0, 1]]) for j in jac]


def clipped_gradient_lambda(
    embed_fn: EmbedFn,
    variables: Sequence[tf.Variable],
    x: tf.Tensor,
    y: tf.Tensor,
    *,
    scale: float,
    clip_norm: float,
) -> list[tf.Tensor]:
    """The paper's §5.3 route: ∇_θ Σ_ij λ_ij S_ij with λ_ij = τ_ij·min(1, B/|∇_θ S_ij|) constant.

    Same value as `clipped_gradient_explicit`; the norms come from
    `per_pair_gradient_norms` (its cost), then one ordinary reverse pass.
    """
    check_clip_norm(clip_norm)
    variables = list(variables)
    # One forward pass serves the norms' jacobian and the weighted backward pass.
    with tf.GradientTape(persistent=True) as tape:
        a, b = _embed(embed_fn, x, y)
        embeddings = tf.concat([a, b], axis=0)
        logits = cosine_logits(a, b, scale)
    norms = _pair_norms(tape, a, b, embeddings, variables, scale)
    with tape:
        # λ is a constant of the backward pass: only ∇_θ S_ij flows, weighted by λ_ij.
        lam = tf.stop_gradient(logit_weights(logits) * _clip_factors(norms, clip_norm))
        surrogate = tf.reduce_sum(lam * logits)
    grads = tape.gradient(surrogate, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    del tape
    return grads


# ---------------------------------------------------------------------------------------
# Noise.


def _check_seed(seed: Sequence[int] | tf.Tensor) -> tf.Tensor:
    seed = tf.convert_to_tensor(seed)
    if seed.shape != (2,) or not seed.dtype.is_integer:
        raise ValueError(f"seed must be two integers (got {seed!r}).")
    return tf.cast(seed, tf.int64)


def add_gaussian_noise(
    gradient: Sequence[tf.Tensor], stddev: float, seed: Sequence[int] | tf.Tensor
) -> list[tf.Tensor]:
    """gradient + N(0, stddev²) per coordinate, stateless: a function of (seed, shapes) only."""
    if not stddev >= 0 or math.isinf(stddev):
        raise ValueError(f"noise stddev must be finite and >= 0 (got {stddev}).")
    seed = _check_seed(seed)
    gradient = [tf.convert_to_tensor(g) for g in gradient]
    sizes = [int(np.prod(g.shape)) for g in gradient]
    # One draw split across tensors: distinct tensors never reuse a noise stream.
    noise = tf.random.stateless_normal([sum(sizes)], seed=seed, dtype=tf.float64)
    out = []
    for g, part in zip(gradient, tf.split(noise, sizes), strict=True):
        out.append(g + tf.cast(stddev * tf.reshape(part, g.shape), g.dtype))
    return out


def _check_noise_multiplier(noise_multiplier: float) -> None:
    if not 0 <= noise_multiplier < math.inf:
        raise ValueError(f"noise multiplier must be finite and >= 0 (got {noise_multiplier}).")


def logit_dp_noised_gradient(
    clipped_gradient: Sequence[tf.Tensor],
    *,
    batch_size: int,
    scale: float,
    clip_norm: float,
    noise_multiplier: float,
    seed: Sequence[int] | tf.Tensor,
    relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
) -> list[tf.Tensor]:
    """Clipped sum (*) + N(0, (σ·C(n, s, B))²); refuses C ≥ n·B (`check_logit_dp_config`)."""
    _check_noise_multiplier(noise_multiplier)
    c = check_logit_dp_config(batch_size, scale, clip_norm, relation)
    return add_gaussian_noise(clipped_gradient, noise_multiplier * c, seed)


def logit_dp_gradient(
    embed_fn: EmbedFn,
    variables: Sequence[tf.Variable],
    x: tf.Tensor,
    y: tf.Tensor,
    *,
    scale: float,
    clip_norm: float,
    noise_multiplier: float,
    seed: Sequence[int] | tf.Tensor,
    relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
    explicit: bool = False,
) -> list[tf.Tensor]:
    """One Logit-DP step's released gradient for the batch of pairs (x_k, y_k)."""
    n = int(x.shape[0])
    check_logit_dp_config(n, scale, clip_norm, relation)  # refuse before any work
    route = clipped_gradient_explicit if explicit else clipped_gradient_lambda
    clipped = route(embed_fn, variables, x, y, scale=scale, clip_norm=clip_norm)
    return logit_dp_noised_gradient(
        clipped,
        batch_size=n,
        scale=scale,
        clip_norm=clip_norm,
        noise_multiplier=noise_multiplier,
        seed=seed,
        relation=relation,
    )


def naive_dp_clipped_gradient(
    embed_fn: EmbedFn,
    variables: Sequence[tf.Variable],
    x: tf.Tensor,
    y: tf.Tensor,
    *,
    scale: float,
    clip_norm: float,
) -> list[tf.Tensor]:
    """Naive-DP: ∇_θ of the summed batch loss, clipped as a whole to global norm B."""
    check_clip_norm(clip_norm)
    variables = list(variables)
    with tf.GradientTape() as tape:
        a, b = _embed(embed_fn, x, y)
        loss = contrastive_loss(cosine_logits(a, b, scale))
    grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    clipped, _ = tf.clip_by_global_norm(grads, clip_norm)
    return clipped


def naive_dp_gradient(
    embed_fn: EmbedFn,
    variables: Sequence[tf.Variable],
    x: tf.Tensor,
    y: tf.Tensor,
    *,
    scale: float,
    clip_norm: float,
    noise_multiplier: float,
    seed: Sequence[int] | tf.Tensor,
) -> list[tf.Tensor]:
    """Naive-DP's released gradient: clipped whole-batch gradient + N(0, (σ·2B)²)."""
    _check_noise_multiplier(noise_multiplier)
    clipped = naive_dp_clipped_gradient(embed_fn, variables, x, y, scale=scale, clip_norm=clip_norm)
    return add_gaussian_noise(clipped, noise_multiplier * naive_dp_sensitivity(clip_norm), seed)


def _example_vjps(
    embed_fn: EmbedFn, variables: list[tf.Variable], inputs: tf.Tensor, cotangents: tf.Tensor
) -> list[tf.Tensor]:
    """[m, *variable shape] per variable: ∇_θ <cotangents_k, f(inputs_k)> for each k alone."""

    def one(args: tuple[tf.Tensor, tf.Tensor]) -> list[tf.Tensor]:
        x, cotangent = args
        with tf.GradientTape() as tape:
            out = tf.reduce_sum(embed_fn(x[tf.newaxis])[0] * cotangent)
        return tape.gradient(out, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    # pfor has no vectorised rule for a convolution's filter gradient and says so with a
    # warning each trace; falling back to a loop over the examples is expected here.
    logger = logging.getLogger("tensorflow")
    logger.addFilter(_expected_pfor_fallback)
    try:
        return tf.vectorized_map(one, (inputs, cotangents))
    finally:
        logger.removeFilter(_expected_pfor_fallback)


def _expected_pfor_fallback(record: logging.LogRecord) -> bool:
    return "uses a while_loop. Fix that!" not in record.getMessage()


def clipped_gradient_by_rows(
    embed_fn: EmbedFn,
    variables: Sequence[tf.Variable],
    x: tf.Tensor,
    y: tf.Tensor,
    *,
    scale: float,
    clip_norm: float,
) -> list[tf.Tensor]:
    """Σ_ij τ_ij · clip_B(∇_θ S_ij), one row of pairs at a time (module docstring).

    Same value as `clipped_gradient_explicit`. `embed_fn` must embed each example alone
    (no cross-example coupling), which is also what the sensitivity needs.
    """
    check_clip_norm(clip_norm)
    variables = list(variables)
    a, b = _embed(embed_fn, x, y)
    a, b = tf.stop_gradient(a), tf.stop_gradient(b)
    weights = logit_weights(cosine_logits(a, b, scale))
    u, v = _pair_cotangents(a, b, scale)
    n = tf.shape(x)[0]

    def row(i: tf.Tensor, total: list[tf.Tensor]) -> tuple[tf.Tensor, list[tf.Tensor]]:
        inputs = tf.concat([tf.repeat(x[i][tf.newaxis], n, axis=0), y], axis=0)
        cotangents = tf.concat([u[i], v[i]], axis=0)
        halves = _example_vjps(embed_fn, variables, inputs, cotangents)
        pairs = [h[:n] + h[n:] for h in halves]  # ∇_θ S_ij for j = 1..n, [n, *shape]
        norms = tf.sqrt(
            tf.add_n(
                [
                    tf.reduce_sum(tf.reshape(tf.cast(p, weights.dtype), [n, -1]) ** 2, 1)
                    for p in pairs
                ]
            )
        )
        coefficients = weights[i] * _clip_factors(norms, clip_norm)
        return i + 1, [
            t + tf.tensordot(tf.cast(coefficients, p.dtype), p, axes=1)
            for t, p in zip(total, pairs, strict=True)
        ]

    zeros = [tf.zeros(v_.shape, v_.dtype) for v_ in variables]
    _, total = tf.while_loop(lambda i, _: i < n, row, (tf.constant(0), zeros))
    return total
