"""Logit-DP (tff_algorithms/algorithms/logit_dp/mechanism.py, issue 26 item 1).

The references here do not share the module's code: the loss, logits and per-pair norms
are rebuilt in the test from plain TF ops, and the worst-case sensitivity search is numpy
(a linear embedding f(x) = Wx with its pair gradients written out by hand), tied to the
module only by one equality check on the clipped gradient itself.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import minimize

from tff_algorithms.algorithms.logit_dp import mechanism as logit_dp
from tff_algorithms.algorithms.logit_dp import sensitivity as sensitivity
from tff_algorithms.privacy.accounting_spec import NeighboringRelation

E2 = math.exp(2.0)
REPLACE = NeighboringRelation.REPLACE_ONE
REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE


# ---------------------------------------------------------------------------------------
# Models and references (independent of the module).


def _mlp(seed: int, p: int = 3, hidden: int = 5, d: int = 3, dtype=tf.float64):
    rng = np.random.default_rng(seed)
    w1 = tf.Variable(rng.normal(size=(p, hidden)), dtype=dtype)
    b1 = tf.Variable(rng.normal(size=(hidden,)) * 0.1, dtype=dtype)
    w2 = tf.Variable(rng.normal(size=(hidden, d)), dtype=dtype)

    def embed(x):
        return tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2)

    return embed, [w1, b1, w2]


def _batch(seed: int, n: int, p: int = 3, dtype=tf.float64):
    rng = np.random.default_rng(seed + 1000)
    x = rng.normal(size=(n, p))
    y = x + 0.3 * rng.normal(size=(n, p))  # two views of one user
    return tf.constant(x, dtype), tf.constant(y, dtype)


def _reference_logits(a, b, scale):
    cos = tf.matmul(a, b, transpose_b=True) / (
        tf.norm(a, axis=1)[:, None] * tf.norm(b, axis=1)[None, :]
    )
    return scale * cos


def _reference_loss(logits):
    n = logits.shape[0]
    log_p = logits - tf.math.log(tf.reduce_sum(tf.exp(logits), axis=1, keepdims=True))
    return -tf.reduce_sum(log_p * tf.eye(n, dtype=logits.dtype))


def _reference_pair_jacobian(embed, variables, x, y, scale):
    # A loop of n² gradients (not the module's vectorised jacobian): another algorithm.
    with tf.GradientTape(persistent=True) as tape:
        logits = _reference_logits(embed(x), embed(y), scale)
    jac = tape.jacobian(logits, variables, experimental_use_pfor=False)
    n = logits.shape[0]
    flat = tf.concat([tf.reshape(j, [n, n, -1]) for j in jac], axis=2)
    return logits, flat


def _flat(grads):
    return np.concatenate([np.ravel(g.numpy()) for g in grads])


# ---------------------------------------------------------------------------------------
# (i) the two routes, and autodiff without clipping.


def test_without_clipping_the_gradient_is_autodiff_of_the_summed_loss():
    embed, variables = _mlp(0)
    x, y = _batch(0, 6)
    with tf.GradientTape() as tape:
        loss = _reference_loss(_reference_logits(embed(x), embed(y), 2.0))
    expected = _flat(tape.gradient(loss, variables))
    explicit = logit_dp.clipped_gradient_explicit(
        embed, variables, x, y, scale=2.0, clip_norm=math.inf
    )
    lam = logit_dp.clipped_gradient_lambda(embed, variables, x, y, scale=2.0, clip_norm=1e12)
    np.testing.assert_allclose(_flat(explicit), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_flat(lam), expected, rtol=1e-10, atol=1e-12)
    rows = logit_dp.clipped_gradient_by_rows(embed, variables, x, y, scale=2.0, clip_norm=1e12)
    np.testing.assert_allclose(_flat(rows), expected, rtol=1e-10, atol=1e-12)
    # The module's loss is the summed loss.
    logits = _reference_logits(embed(x), embed(y), 2.0)
    np.testing.assert_allclose(logit_dp.contrastive_loss(logits), loss, rtol=1e-12)


def test_per_pair_norms_from_the_gram_matrix_equal_the_jacobian_norms():
    embed, variables = _mlp(1)
    x, y = _batch(1, 5)
    _, flat = _reference_pair_jacobian(embed, variables, x, y, 1.5)
    expected = np.linalg.norm(flat.numpy(), axis=2)
    got = logit_dp.per_pair_gradient_norms(embed, variables, x, y, scale=1.5).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-9)


def test_per_pair_norms_match_the_module_logits_for_tiny_embeddings():
    # |f(x)|² below l2_normalize's epsilon: the norms must follow the logits actually used.
    embed, variables = _mlp(6)
    variables[2].assign(variables[2] * 1e-8)
    x, y = _batch(6, 4)
    with tf.GradientTape(persistent=True) as tape:
        logits = logit_dp.cosine_logits(embed(x), embed(y), 2.0)
    jac = tape.jacobian(logits, variables, experimental_use_pfor=False)
    expected = np.linalg.norm(
        np.concatenate([tf.reshape(j, [4, 4, -1]).numpy() for j in jac], axis=2), axis=2
    )
    got = logit_dp.per_pair_gradient_norms(embed, variables, x, y, scale=2.0).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-9)


@pytest.mark.parametrize("dtype,rtol", [(tf.float64, 1e-9), (tf.float32, 2e-4)])
def test_lambda_and_row_routes_equal_explicit_clipping(dtype, rtol):
    embed, variables = _mlp(2, dtype=dtype)
    x, y = _batch(2, 6, dtype=dtype)
    scale = 3.0
    logits, flat = _reference_pair_jacobian(embed, variables, x, y, scale)
    norms = np.linalg.norm(flat.numpy(), axis=2)
    clip = float(np.median(norms))  # about half the pairs clipped
    assert (norms > clip).sum() >= 10 and (norms < clip).sum() >= 10
    # Reference: Σ_ij (∂L/∂S_ij)·clip_B(∇S_ij), ∂L/∂S_ij = softmax − I, from plain numpy.
    s = logits.numpy().astype(np.float64)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    tau = p - np.eye(len(s))
    factor = np.minimum(1.0, clip / norms)
    expected = np.einsum("ij,ijk->k", tau * factor, flat.numpy().astype(np.float64))
    explicit = logit_dp.clipped_gradient_explicit(
        embed, variables, x, y, scale=scale, clip_norm=clip
    )
    lam = logit_dp.clipped_gradient_lambda(embed, variables, x, y, scale=scale, clip_norm=clip)
    np.testing.assert_allclose(_flat(explicit), expected, rtol=rtol, atol=rtol * 1e-2)
    np.testing.assert_allclose(_flat(lam), _flat(explicit), rtol=rtol, atol=rtol * 1e-2)
    rows = logit_dp.clipped_gradient_by_rows(embed, variables, x, y, scale=scale, clip_norm=clip)
    np.testing.assert_allclose(_flat(rows), expected, rtol=rtol, atol=rtol * 1e-2)


# ---------------------------------------------------------------------------------------
# (ii) worst-case sensitivity search, numpy only.


def _np_clipped_sum(w, xs, ys, s, clip):
    """Σ_ij (p_ij − δ_ij) clip(∇_W S_ij) for f(x) = W x, S_ij = s·cos(W x_i, W y_j)."""
    a = xs @ w.T
    b = ys @ w.T
    na = np.linalg.norm(a, axis=1)
    nb = np.linalg.norm(b, axis=1)
    ah = a / na[:, None]
    bh = b / nb[:, None]
    cos = ah @ bh.T
    # ∂cos/∂a_i = (b̂ − cos·â)/|a|, ∂cos/∂b_j = (â − cos·b̂)/|b|, ∂a_i/∂W = · x_iᵀ.
    du = s * (bh[None, :, :] - cos[:, :, None] * ah[:, None, :]) / na[:, None, None]
    dv = s * (ah[:, None, :] - cos[:, :, None] * bh[None, :, :]) / nb[None, :, None]
    grads = np.einsum("ijd,ip->ijdp", du, xs) + np.einsum("ijd,jp->ijdp", dv, ys)
    norms = np.sqrt((grads**2).sum(axis=(2, 3)))
    factor = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
    logits = s * cos
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    return np.einsum("ij,ijdp->dp", (p - np.eye(len(xs))) * factor, grads)


def _np_change(z, n, d, dim, s, clip, replace):
    """|g(D) − g(D')|/B: D' has the last pair replaced (replace) or removed."""
    w = z[: d * dim].reshape(d, dim)
    r = z[d * dim :]
    xs = r[: n * dim].reshape(n, dim)
    ys = r[n * dim : 2 * n * dim].reshape(n, dim)
    g = _np_clipped_sum(w, xs, ys, s, clip)
    if replace:
        xs2, ys2 = xs.copy(), ys.copy()
        xs2[-1] = r[2 * n * dim : 2 * n * dim + dim]
        ys2[-1] = r[2 * n * dim + dim :]
        g2 = _np_clipped_sum(w, xs2, ys2, s, clip)
    else:
        g2 = _np_clipped_sum(w, xs[:-1], ys[:-1], s, clip)
    return np.linalg.norm(g - g2) / clip


def _adversarial_start(n, replace, k):
    """A batch near the proof's equality case, for the optimiser to start from.

    Model f(x) = W x with W = 0.001·[I_2 | 0], inputs in R^3: the tiny W makes every pair
    gradient exceed B, so all are clipped; the third input coordinate is W's null space,
    shared by all inputs, so clipped pair gradients can point the same way. Embedding
    angles put the logits near ±s as the bound's worst case needs: x_i (i < n) and y_n
    near π, x_n and y_j (j < n) near 0 (replacement pair likewise). Seeded by (n, k).
    """
    rng = np.random.default_rng([n, k])

    def point(angle):
        angle += rng.uniform(-0.1, 0.1)
        return [math.cos(angle), math.sin(angle), 5.0 * rng.normal()]

    w = np.zeros((2, 3))
    w[:, :2] = 0.001 * np.eye(2)
    xs = [point(math.pi) for _ in range(n - 1)] + [point(0.0)]
    ys = [point(0.0) for _ in range(n - 1)] + [point(math.pi)]
    parts = [w.ravel(), np.ravel(xs), np.ravel(ys)]
    if replace:
        parts += [point(0.0), point(math.pi)]
    return np.concatenate(parts)


def _optimised(z0, n, replace, clip):
    """L-BFGS ascent of the change from z0; the better of start and end (the kink of the
    clipping can stop the line search at a worse point)."""
    d, dim = 2, 3
    res = minimize(
        lambda z: -_np_change(z, n, d, dim, 1.0, clip, replace),
        z0,
        method="L-BFGS-B",
        options={"maxiter": 800},
    )
    start = _np_change(z0, n, d, dim, 1.0, clip, replace)
    return (res.x, -res.fun) if -res.fun > start else (z0, start)


@functools.cache
def _two_pair_worst_case(replace):
    """The worst n = 2 batch found from the seeded adversarial starts (`_adversarial_start`):
    `TWO_PAIR_SEEDS` are the best of a longer offline run of this search, plus one fresh."""
    seeds = TWO_PAIR_SEEDS[replace] + (1000,)
    found = [_optimised(_adversarial_start(2, replace, k), 2, replace, 1.0) for k in seeds]
    return max(found, key=lambda pair: pair[1])[0]


def _repeat_first_pair(z2, n, replace):
    """An n-pair batch from the n = 2 worst case: its first pair n − 1 times, then the
    pair that changes. Every row i < n then sits at the proof's equality case again."""
    w, rows = z2[:6], z2[6:].reshape(-1, 3)
    xs = [rows[0]] * (n - 1) + [rows[1]]
    ys = [rows[2]] * (n - 1) + [rows[3]]
    return np.concatenate([w, np.ravel(xs), np.ravel(ys), *([rows[4], rows[5]] if replace else [])])


def _worst_case(n, replace, random_draws=300):
    """Max change |g(D) − g(D')|/B over random batches and the adversarial ones (B = 1)."""
    d, dim = 2, 3
    nz = d * dim + 2 * n * dim + (2 * dim if replace else 0)
    rng = np.random.default_rng(n)
    best_random = 0.0
    for _ in range(random_draws):  # random batches, random weight scales
        z = rng.normal(size=nz)
        z[: d * dim] *= 10.0 ** rng.uniform(-3, 1)
        best_random = max(best_random, _np_change(z, n, d, dim, 1.0, 1.0, replace))
    z2 = _two_pair_worst_case(replace)
    adversarial = _np_change(_repeat_first_pair(z2, n, replace), n, d, dim, 1.0, 1.0, replace)
    return max(best_random, adversarial), best_random


def test_numpy_reference_is_the_module_mechanism():
    rng = np.random.default_rng(5)
    n, d, dim, s, clip = 4, 3, 3, 1.7, 0.8
    w = rng.normal(size=(d, dim)) * 0.3
    xs, ys = rng.normal(size=(n, dim)), rng.normal(size=(n, dim))
    var = tf.Variable(w)

    def embed(x):
        return tf.matmul(x, var, transpose_b=True)

    got = logit_dp.clipped_gradient_lambda(
        embed, [var], tf.constant(xs), tf.constant(ys), scale=s, clip_norm=clip
    )
    np.testing.assert_allclose(got[0].numpy(), _np_clipped_sum(w, xs, ys, s, clip), rtol=1e-9)


# The values issue 26 quotes for its own search (removal, s = 1), in units of B.
ISSUE_SEARCH = {2: 3.52, 3: 5.02, 4: 5.98}
# Starts (`_adversarial_start(2, replace, k)`) that a longer offline run found best.
TWO_PAIR_SEEDS = {False: (11,), True: (7,)}


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_worst_case_search_reaches_but_never_exceeds_the_bound(n):
    c_rem = sensitivity.logit_dp_sensitivity(n, 1.0, 1.0, REMOVE)
    c_sub = sensitivity.logit_dp_sensitivity(n, 1.0, 1.0, REPLACE)
    removed, removed_random = _worst_case(n, replace=False)
    replaced, replaced_random = _worst_case(n, replace=True)
    print(
        f"n={n}: removal {removed:.3f} (random {removed_random:.3f}, C_rem {c_rem:.3f}); "
        f"replacement {replaced:.3f} (random {replaced_random:.3f}, C_sub {c_sub:.3f})"
    )
    assert removed <= c_rem * (1 + 1e-9)
    assert replaced <= c_sub * (1 + 1e-9)
    # Both bounds are reached to within a few percent: neither can be tightened ...
    assert removed >= 0.97 * c_rem
    assert replaced >= 0.97 * c_sub
    if n in ISSUE_SEARCH:
        assert removed >= 0.97 * ISSUE_SEARCH[n]
    # ... not back to the paper's Eq. 6, and not, under substitute-one, to the issue's
    # (removal) bound: replacing a pair moves the gradient further than removing one.
    assert removed > sensitivity.paper_eq6_sensitivity(n, 1.0)
    assert replaced > c_rem


def test_issue_numbers_and_limits():
    def c(n, rel):
        return sensitivity.logit_dp_sensitivity(n, 1.0, 1.0, rel)

    issue = [2 * (1 - 1 / (1 + (n - 1) * E2)) + 2 * (n - 1) * E2 / (E2 + n - 1) for n in (2, 3, 4)]
    np.testing.assert_allclose([c(n, REMOVE) for n in (2, 3, 4)], issue, rtol=1e-12)
    assert c(2, REMOVE) == pytest.approx(4 * E2 / (1 + E2)) == pytest.approx(3.5232, abs=1e-4)
    assert c(3, REMOVE) == pytest.approx(5.0212, abs=1e-4)
    # Substitute-one adds the second row term.
    assert c(2, REPLACE) == pytest.approx(6 * E2 / (1 + E2))
    assert sensitivity.paper_eq6_sensitivity(2, 1.0) == pytest.approx(2.0)
    # Monotone in n, bounded by the n-free limit, which it approaches.
    for rel, limit in ((REMOVE, 2 * (1 + E2)), (REPLACE, 4 + 2 * E2)):
        values = [c(n, rel) for n in (2, 3, 10, 1000, 10**8)]
        assert values == sorted(values)
        assert sensitivity.n_free_sensitivity(1.0, 1.0, rel) == pytest.approx(limit)
        assert values[-1] < limit and values[-1] == pytest.approx(limit, rel=1e-6)
    # General scale: e² → e^{2s}; larger scales give larger bounds.
    t = math.exp(6.0)
    assert sensitivity.logit_dp_sensitivity(5, 3.0, 2.0, REMOVE) == pytest.approx(
        2.0 * (2 * 4 * t / (1 + 4 * t) + 2 * 4 * t / (t + 4))
    )
    assert sensitivity.naive_dp_sensitivity(0.5) == 1.0


# ---------------------------------------------------------------------------------------
# (iii) noise.


def test_noise_std_is_sigma_times_c_and_seeded():
    n, scale, clip, sigma = 32, 1.0, 0.5, 1.3
    zeros = [tf.zeros([100, 100], tf.float32), tf.zeros([10_000], tf.float64)]
    noisy = logit_dp.logit_dp_noised_gradient(
        zeros, batch_size=n, scale=scale, clip_norm=clip, noise_multiplier=sigma, seed=(3, 4)
    )
    draws = _flat(noisy)
    c = sensitivity.logit_dp_sensitivity(n, scale, clip)
    # 20,000 draws: the sample std's relative standard error is 1/sqrt(2N) = 0.5%.
    assert np.std(draws) == pytest.approx(sigma * c, rel=0.025)
    assert abs(np.mean(draws)) < 5 * sigma * c / math.sqrt(draws.size)
    assert noisy[0].dtype == tf.float32 and noisy[1].dtype == tf.float64
    again = logit_dp.logit_dp_noised_gradient(
        zeros, batch_size=n, scale=scale, clip_norm=clip, noise_multiplier=sigma, seed=(3, 4)
    )
    np.testing.assert_array_equal(_flat(again), draws)
    other = logit_dp.add_gaussian_noise(zeros, 1.0, seed=(3, 5))
    assert not np.allclose(_flat(other), draws / (sigma * c))


def test_naive_dp_clips_the_whole_gradient_and_noise_is_sigma_times_2b():
    embed, variables = _mlp(3)
    x, y = _batch(3, 5)
    with tf.GradientTape() as tape:
        loss = _reference_loss(_reference_logits(embed(x), embed(y), 1.0))
    full = _flat(tape.gradient(loss, variables))
    clip = 0.25 * np.linalg.norm(full)
    clipped = _flat(
        logit_dp.naive_dp_clipped_gradient(embed, variables, x, y, scale=1.0, clip_norm=clip)
    )
    np.testing.assert_allclose(clipped, full * clip / np.linalg.norm(full), rtol=1e-10)
    noisy = logit_dp.naive_dp_gradient(
        embed, variables, x, y, scale=1.0, clip_norm=clip, noise_multiplier=2.0, seed=(0, 1)
    )
    noise = logit_dp.add_gaussian_noise([tf.zeros_like(v) for v in variables], 1.0, (0, 1))
    np.testing.assert_allclose(_flat(noisy) - clipped, 2.0 * 2 * clip * _flat(noise), rtol=1e-9)


def test_logit_dp_gradient_is_clipped_sum_plus_seeded_noise():
    embed, variables = _mlp(4)
    x, y = _batch(4, 16)
    kwargs = dict(scale=1.0, clip_norm=0.3)
    clipped = _flat(logit_dp.clipped_gradient_lambda(embed, variables, x, y, **kwargs))
    noisy = logit_dp.logit_dp_gradient(
        embed, variables, x, y, noise_multiplier=0.8, seed=(7, 7), **kwargs
    )
    noise = logit_dp.add_gaussian_noise([tf.zeros_like(v) for v in variables], 1.0, (7, 7))
    c = sensitivity.logit_dp_sensitivity(16, 1.0, 0.3)
    np.testing.assert_allclose(_flat(noisy) - clipped, 0.8 * c * _flat(noise), rtol=1e-8)


# ---------------------------------------------------------------------------------------
# (iv) refusals.


def _one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_refuses_a_bound_that_is_not_below_n_times_b():
    # n = 2, s = 1: C = 5.29·B >= 2·B; the message names a batch size that works.
    message = _one_line_error(sensitivity.check_logit_dp_config, 2, 1.0, 1.0)
    assert "batch size of at least" in message
    n_ok = int(message.rsplit("at least ", 1)[1].split()[0])
    assert sensitivity.logit_dp_sensitivity(n_ok, 1.0, 1.0) < n_ok
    assert sensitivity.logit_dp_sensitivity(n_ok - 1, 1.0, 1.0) >= n_ok - 1
    # A large scale at a moderate batch: the message names a scale that works.
    message = _one_line_error(sensitivity.check_logit_dp_config, 64, 5.0, 0.1)
    s_ok = float(message.split("logit scale below ")[1].split()[0])
    assert sensitivity.logit_dp_sensitivity(64, 0.99 * s_ok, 0.1) < 64 * 0.1
    assert sensitivity.logit_dp_sensitivity(64, 1.01 * s_ok, 0.1) >= 64 * 0.1
    # Refused before any gradient work, and in the noise function.
    embed, variables = _mlp(5)
    x, y = _batch(5, 2)
    _one_line_error(
        logit_dp.logit_dp_gradient,
        embed,
        variables,
        x,
        y,
        scale=1.0,
        clip_norm=1.0,
        noise_multiplier=1.0,
        seed=(0, 0),
    )
    _one_line_error(
        logit_dp.logit_dp_noised_gradient,
        [tf.zeros([3])],
        batch_size=2,
        scale=1.0,
        clip_norm=1.0,
        noise_multiplier=1.0,
        seed=(0, 0),
    )
    assert sensitivity.check_logit_dp_config(64, 1.0, 1.0) < 64


@pytest.mark.parametrize(
    "call",
    [
        lambda: sensitivity.logit_dp_sensitivity(1, 1.0, 1.0),
        lambda: sensitivity.logit_dp_sensitivity(8, 0.0, 1.0),
        lambda: sensitivity.logit_dp_sensitivity(8, 1.0, -1.0),
        lambda: sensitivity.logit_dp_sensitivity(8, 1.0, 1.0, "replace_special"),
        lambda: sensitivity.n_free_sensitivity(1e3, 1.0),
        lambda: logit_dp.add_gaussian_noise([tf.zeros([2])], -1.0, (0, 0)),
        lambda: logit_dp.add_gaussian_noise([tf.zeros([2])], 1.0, (0, 0, 0)),
    ],
)
def test_nonsense_input_is_one_line(call):
    _one_line_error(call)
