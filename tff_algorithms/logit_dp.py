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

Two routes compute (*), equal up to float rounding (tests/test_logit_dp.py):

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

Both routes require that an embedding depend only on its own input (no batch norm or other
cross-example coupling): the proof below needs c_ij to depend on (x_i, y_j) and θ only.

Sensitivity (derived here from first principles)
------------------------------------------------
Write t = e^{2s}. Two facts:

(F1) Σ_j |τ_ij| = (1 − p_ii) + Σ_{j≠i} p_ij = 2(1 − p_ii).
(F2) With m columns and logits in [−s, s]: p_ii ≥ e^{−s}/(e^{−s} + (m−1)e^{s}) =
     1/(1 + (m−1)t), and every p_ij ≤ e^{s}/(e^{s} + (m−1)e^{−s}) = t/(t + m − 1).

g is invariant under reordering the pairs, so let the changed pair be the last one, n.

*Substitute-one* (the relation of DESIGN.md §5, fixed n: D' replaces (x_n, y_n) by
(x'_n, y'_n); primes denote D'). c_ij with i, j < n is the same in D and D'. Split
g(D) − g(D') into

- row n of D and of D': Σ_j τ_nj c_nj − Σ_j τ'_nj c'_nj. By (F1), |·| ≤ 2(1 − p_nn)B +
  2(1 − p'_nn)B, and by (F2) ≤ 4(n−1)t/(1 + (n−1)t)·B. p_nn and p'_nn belong to different
  pairs and are independent: both can be minimal at once.
- each row i < n: K_i = Σ_{j<n}(p_ij − p'_ij)c_ij + p_in c_in − p'_in c'_in (the δ's
  cancel). Row i's softmax changes only through column n: p_ij = e^{S_ij}/(Z_i + e^{S_in})
  and p'_ij = e^{S_ij}/(Z_i + e^{S'_in}) with Z_i = Σ_{j<n} e^{S_ij}, so the differences
  p_ij − p'_ij (j < n) share one sign and Σ_{j<n}|p_ij − p'_ij| = |(1 − p_in) −
  (1 − p'_in)| = |p_in − p'_in|. Hence |K_i| ≤ (|p_in − p'_in| + p_in + p'_in)B =
  2·max(p_in, p'_in)·B ≤ 2t/(t + n − 1)·B by (F2).

    C_sub(n, s, B) = [4(n−1)t/(1 + (n−1)t) + 2(n−1)t/(t + n − 1)]·B.

*Add-or-remove-one* (D° = D without pair n, n − 1 pairs): row n exists only in D
(2(1 − p_nn)B), and for i < n, p°_ij = e^{S_ij}/Z_i ≥ p_ij with Σ_{j<n}(p°_ij − p_ij) = p_in,
so |K_i| ≤ 2p_in·B:

    C_rem(n, s, B) = [2(n−1)t/(1 + (n−1)t) + 2(n−1)t/(t + n − 1)]·B.

At s = 1 C_rem is the bound issue 26 states, 2(1 − 1/(1+(n−1)e²))B + 2(n−1)e²/(e²+n−1)B:
3.523·B, 5.021·B, 6.181·B at n = 2, 3, 4 (4e²/(1+e²)·B at n = 2). It is the *removal*
bound. Under substitute-one it is exceeded, so noise here uses C_sub = C_rem +
2(n−1)t/(1+(n−1)t)·B < 2·C_rem: 5.285·B, 6.894·B, 8.095·B at n = 2, 3, 4 with s = 1.
Both bounds are tight: the worst-case search of tests/test_logit_dp.py (linear model, real
clipped pair gradients, in numpy) reaches 3.523, 5.021, 6.180, 9.149·B on removal and
5.267, 6.874, 8.071, 11.076·B on replacement at n = 2, 3, 4, 8 (C_rem 9.151·B, C_sub
11.113·B at n = 8), i.e. within 0.4% of them. The equality case: logits at ±s (row n's
positive at −s, its negatives at +s; rows i < n at +s on column n, −s elsewhere), every
pair gradient clipped, and all clipped pair gradients aligned (inputs sharing a direction
in the null space of the weights make that possible). The paper's Eq. 6,
2(1 + (n−2)e²/(e²+n−1))·B (2·B at n = 2), is below both; it is kept only as the labelled
comparison `paper_eq6_sensitivity` and never used for noise.

Both bounds increase in n and in s. Their limits as n → ∞ bound every batch size:
C_rem → 2(1 + e^{2s})·B (≈ 16.78·B at s = 1) and C_sub → (4 + 2e^{2s})·B (≈ 18.78·B);
`n_free_sensitivity` returns them, for variable batch sizes. Once e^{2s} ≫ n the bound is
≈ (2n + 2)·B (substitute-one; 2n·B for removal): a large logit scale brings back the linear
growth in n of per-example clipping, which is what the method exists to avoid, while the
clipped sum itself is at most Σ_i 2(1 − p_ii)·B < 2n·B. A configuration with C ≥ n·B is
therefore refused (`check_logit_dp_config`, one line naming a scale or batch size that
works). At s = 1 that refuses n ≤ 13 (substitute-one) and n ≤ 10 (removal).

Noise and accounting
--------------------
The released gradient is g(D) + N(0, (σ·C)²) per coordinate, drawn statelessly from an
explicit seed (production callers draw the seed from OS entropy, as training does). σ is
relative to the relation's full L2 sensitivity, the strict convention of accounting.py, so
dp_accounting takes noise multiplier σ for the same relation (no further halving).

Naive-DP baseline: the whole batch gradient ∇_θ L is clipped to B. Under substitute-one
(and add-or-remove) both batches' clipped gradients have norm ≤ B, so they differ by at
most 2B (`naive_dp_sensitivity`); noise std σ·2B.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tff_algorithms.accounting import NeighboringRelation

EmbedFn = Callable[[tf.Tensor], tf.Tensor]

# e^{2s} must stay finite in float64 (e^{2·100} ≈ 7e86); scales this large are refused
# anyway at any realistic batch size.
MAX_SCALE = 100.0
MAX_BATCH_SIZE = 10**9
_RELATIONS = (NeighboringRelation.REPLACE_ONE, NeighboringRelation.ADD_OR_REMOVE_ONE)


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


def _check_clip_norm(clip_norm: float) -> None:
    if not clip_norm > 0:  # also rejects NaN
        raise ValueError(f"clip_norm must be > 0 (got {clip_norm}).")


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
    _check_clip_norm(clip_norm)
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
    _check_clip_norm(clip_norm)
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
# Sensitivity.


def _relation(relation: NeighboringRelation | str) -> NeighboringRelation:
    try:
        value = NeighboringRelation(relation)
    except ValueError:
        value = None
    if value not in _RELATIONS:
        names = ", ".join(r.value for r in _RELATIONS)
        raise ValueError(
            f"Logit-DP has a sensitivity for relation {names} only (got {relation!r})."
        )
    return value


def _check_scale(scale: float) -> None:
    if not 0 < scale <= MAX_SCALE:
        raise ValueError(f"logit scale must be in (0, {MAX_SCALE:g}] (got {scale}).")


def _check_batch_size(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 2 <= n <= MAX_BATCH_SIZE:
        raise ValueError(f"batch size must be an integer in [2, {MAX_BATCH_SIZE}] (got {n!r}).")


def logit_dp_sensitivity(
    n: int,
    scale: float,
    clip_norm: float,
    relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
) -> float:
    """L2 sensitivity C(n, s, B) of the clipped summed gradient (*) (module docstring).

    Substitute-one (default, strict): [4(n−1)t/(1+(n−1)t) + 2(n−1)t/(t+n−1)]·B, t = e^{2s}.
    Add-or-remove-one (n = the larger batch): [2(n−1)t/(1+(n−1)t) + 2(n−1)t/(t+n−1)]·B.
    """
    _check_batch_size(n)
    _check_scale(scale)
    _check_clip_norm(clip_norm)
    rows = {NeighboringRelation.REPLACE_ONE: 4.0, NeighboringRelation.ADD_OR_REMOVE_ONE: 2.0}
    t = math.exp(2.0 * scale)
    m = float(n - 1)
    return (rows[_relation(relation)] * m * t / (1.0 + m * t) + 2.0 * m * t / (t + m)) * clip_norm


def n_free_sensitivity(
    scale: float,
    clip_norm: float,
    relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
) -> float:
    """sup over n of `logit_dp_sensitivity` (its n → ∞ limit), for variable batch sizes.

    Add-or-remove-one: 2(1 + e^{2s})·B. Substitute-one: (4 + 2e^{2s})·B.
    """
    _check_scale(scale)
    _check_clip_norm(clip_norm)
    rows = {NeighboringRelation.REPLACE_ONE: 4.0, NeighboringRelation.ADD_OR_REMOVE_ONE: 2.0}
    return (rows[_relation(relation)] + 2.0 * math.exp(2.0 * scale)) * clip_norm


def paper_eq6_sensitivity(n: int, clip_norm: float) -> float:
    """COMPARISON ONLY, never for noise: the paper's Eq. 6, 2(1 + (n−2)e²/(e²+n−1))·B.

    Its proof shares one probability between the removed row's positive pair and the other
    rows' probabilities of the removed column; it is below the true worst case (2·B at
    n = 2 where a replaced or removed pair can move the gradient by more than 3.5·B).
    """
    _check_batch_size(n)
    _check_clip_norm(clip_norm)
    e2 = math.exp(2.0)
    return 2.0 * (1.0 + (n - 2) * e2 / (e2 + n - 1)) * clip_norm


def naive_dp_sensitivity(clip_norm: float) -> float:
    """Naive-DP: two clipped whole-batch gradients (norm ≤ B each) differ by at most 2B."""
    _check_clip_norm(clip_norm)
    return 2.0 * clip_norm


def _max_working_scale(n: int, relation: NeighboringRelation) -> float | None:
    # C increases in s, so bisect for the largest s with C(n, s, 1) < n.
    if logit_dp_sensitivity(n, 1e-9, 1.0, relation) >= n:
        return None
    lo, hi = 1e-9, MAX_SCALE
    if logit_dp_sensitivity(n, hi, 1.0, relation) < n:
        return hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if logit_dp_sensitivity(n, mid, 1.0, relation) < n else (lo, mid)
    return lo


def _min_working_batch(scale: float, relation: NeighboringRelation) -> int:
    # C(n) < n_free ≤ n for n ≥ n_free, so some batch below that bound works; scan for the
    # smallest when that is cheap.
    limit = math.floor(n_free_sensitivity(scale, 1.0, relation)) + 1
    if limit > 10**6:
        return limit
    ns = np.arange(2, limit + 1, dtype=np.float64)
    t = math.exp(2.0 * scale)
    rows = 4.0 if relation == NeighboringRelation.REPLACE_ONE else 2.0
    c = rows * (ns - 1) * t / (1 + (ns - 1) * t) + 2 * (ns - 1) * t / (t + ns - 1)
    bad = np.nonzero(c >= ns)[0]
    return int(ns[bad[-1] + 1]) if bad.size else 2


def check_logit_dp_config(
    n: int,
    scale: float,
    clip_norm: float,
    relation: NeighboringRelation | str = NeighboringRelation.REPLACE_ONE,
) -> float:
    """Return C(n, s, B); raise a one-line ValueError when C ≥ n·B (module docstring)."""
    rel = _relation(relation)
    c = logit_dp_sensitivity(n, scale, clip_norm, rel)
    if c >= n * clip_norm:
        s_max = _max_working_scale(n, rel)
        n_min = _min_working_batch(scale, rel)
        fixes = []
        if s_max is not None and s_max >= 1e-3:
            # Rounded down, so that the scale named does work.
            fixes.append(f"a logit scale below {math.floor(s_max * 1e3) / 1e3:g} at batch size {n}")
        if n_min <= MAX_BATCH_SIZE:
            fixes.append(f"a batch size of at least {n_min} at scale {scale:g}")
        raise ValueError(
            f"Logit-DP sensitivity {c / clip_norm:.3g}·B >= n·B = {n}·B (batch size {n}, "
            f"scale {scale:g}): the bound gains nothing over per-example clipping; use "
            + (" or ".join(fixes) if fixes else "a smaller scale and a larger batch")
            + "."
        )
    return c


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
    _check_clip_norm(clip_norm)
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
