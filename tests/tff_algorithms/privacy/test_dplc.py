"""DPLC (tff_algorithms/privacy/dplc.py, issue 22 item 1).

The reference cluster mean here shares no code with the module: neighbour counts from
arccos angles, ranking by a Python sort on (−similarity, row), clipping by spherical
interpolation (slerp). It is tied to the module by one equality check, then the worst-case
sensitivity search (random, hill-climbing and hand-built adversarial neighbours, including
ones that change cluster membership or the query) runs on it in numpy.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest

from tff_algorithms.privacy import dplc

# ---------------------------------------------------------------------------------------
# Independent reference.


def _unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _angle(a, b):
    return math.acos(max(-1.0, min(1.0, float(np.dot(a, b)))))


def _slerp_into_cap(w, q, rho):
    theta = _angle(w, q)
    if theta <= rho:
        return w
    # Point at angle rho from q on the great circle from q to w.
    return (math.sin(theta - rho) * q + math.sin(rho) * w) / math.sin(theta)


def _ref_cap_mean(rows, q, rho, t):
    order = sorted(range(len(rows)), key=lambda i: (-float(np.dot(rows[i], q)), i))
    members = order[:t]
    return np.mean([_slerp_into_cap(rows[i], q, rho) for i in members], axis=0), members


def _ref_means(centers, rho, t, queries=None, num_clusters=1):
    rows = list(_unit(centers))
    if queries is not None:
        return np.array([_ref_cap_mean(rows, q, rho, t)[0] for q in _unit(queries)])
    out = []
    for _ in range(num_clusters):
        counts = [sum(_angle(a, b) <= rho for b in rows) for a in rows]
        best = max(range(len(rows)), key=lambda i: (counts[i], -i))
        mean, members = _ref_cap_mean(rows, rows[best], rho, t)
        out.append(mean)
        rows = [r for i, r in enumerate(rows) if i not in members]
    return np.array(out)


def _random_sphere(rng, n, d):
    return _unit(rng.normal(size=(n, d)))


def _around(rng, q, n, max_angle):
    """n unit vectors at uniform angles in [0, max_angle] from q, random tangents."""
    tangents = rng.normal(size=(n, q.size))
    tangents -= np.outer(tangents @ q, q)
    tangents = _unit(tangents)
    angles = rng.uniform(0.0, max_angle, size=n)
    return np.cos(angles)[:, None] * q[None, :] + np.sin(angles)[:, None] * tangents


def _at_angle(q, tangent, angle):
    tangent = _unit(tangent - np.dot(tangent, q) * q)
    return math.cos(angle) * q + math.sin(angle) * tangent


# ---------------------------------------------------------------------------------------
# The module computes what the reference computes.


@pytest.mark.parametrize("num_clusters", [1, 2])
def test_selected_means_match_reference(num_clusters):
    rng = np.random.default_rng(0)
    for _ in range(20):
        q = _random_sphere(rng, 1, 4)[0]
        w = np.concatenate([_around(rng, q, 7, 0.9), _random_sphere(rng, 5, 4)])
        w = w * rng.uniform(0.5, 2.0, size=(w.shape[0], 1))  # module normalises rows
        got = dplc.cluster_means(w, rho=0.8, cluster_size=4, num_clusters=num_clusters)
        np.testing.assert_allclose(
            got, _ref_means(w, 0.8, 4, num_clusters=num_clusters), atol=1e-12
        )


def test_public_means_match_reference():
    rng = np.random.default_rng(1)
    for rho in (0.3, 1.0, 1.7, math.pi):
        w = _random_sphere(rng, 9, 3)
        queries = _random_sphere(rng, 3, 3)
        got = dplc.cluster_means(w, rho=rho, cluster_size=4, queries=queries)
        np.testing.assert_allclose(got, _ref_means(w, rho, 4, queries=queries), atol=1e-12)


# ---------------------------------------------------------------------------------------
# Worst-case search on the reference: never above the bound, and close to it.


def _public_pair(rng, t, m, d, rho):
    q = np.zeros(d)
    q[0] = 1.0
    n = t + int(rng.integers(0, 4))
    w = _around(rng, q, n, min(math.pi, 1.5 * rho))
    w2 = w.copy()
    idx = rng.choice(n, size=min(m, n), replace=False)
    kind = rng.integers(3)
    if kind == 0:
        w2[idx] = _random_sphere(rng, idx.size, d)
    elif kind == 1:  # inside the cap, usually near its boundary
        w2[idx] = _around(rng, q, idx.size, rho)
    else:  # mirror images across q: the farthest points within the cap's reach
        w2[idx] = 2 * np.outer(w[idx] @ q, q) - w[idx]
    return q, w, w2, idx


def _membership_changed(w, w2, q, t, idx):
    """Did an untouched row enter or leave the T nearest?"""
    a = set(_ref_cap_mean(list(w), q, 0.1, t)[1]) - set(idx.tolist())
    b = set(_ref_cap_mean(list(w2), q, 0.1, t)[1]) - set(idx.tolist())
    return a != b


@pytest.mark.parametrize(("t", "m", "rho"), [(1, 1, 1.0), (3, 1, 1.3), (4, 2, 0.7), (3, 1, 2.2)])
def test_public_random_search_never_exceeds_bound(t, m, rho):
    rng = np.random.default_rng(10 + t + m)
    bound = dplc.dplc_sensitivity(
        rho=rho, cluster_size=t, public_queries=True, max_centers_per_user=m
    )
    worst, flips = 0.0, 0
    for _ in range(600):
        q, w, w2, idx = _public_pair(rng, t, m, 3, rho)
        diff = np.linalg.norm(
            _ref_cap_mean(list(w), q, rho, t)[0] - _ref_cap_mean(list(w2), q, rho, t)[0]
        )
        worst = max(worst, diff / bound)
        flips += _membership_changed(w, w2, q, t, idx)
    assert worst <= 1 + 1e-9
    assert flips > 20  # the search does exercise membership changes
    assert worst > 0.98, worst  # random pairs alone come within 2% of the bound


def _hill_climb(rng, t, n, rho, steps):
    """Maximise |p(D) − p(D')| over D and the replaced row, public query e_0, d = 3."""
    q = np.array([1.0, 0.0, 0.0])
    w = _around(rng, q, n, 1.5 * rho)
    new = _random_sphere(rng, 1, 3)[0]

    def gap(w, new):
        w2 = w.copy()
        w2[0] = new
        return np.linalg.norm(
            _ref_cap_mean(list(w), q, rho, t)[0] - _ref_cap_mean(list(w2), q, rho, t)[0]
        )

    best = gap(w, new)
    for step in range(steps):
        scale = 0.3 * (1 - step / steps) + 0.01
        w_try = _unit(w + scale * rng.normal(size=w.shape) * (rng.random((n, 1)) < 0.5))
        new_try = _unit(new + scale * rng.normal(size=3))
        g = gap(w_try, new_try)
        if g >= best:
            best, w, new = g, w_try, new_try
    return best


def test_public_hill_climb_approaches_bound():
    t, rho = 3, 1.0
    bound = dplc.dplc_sensitivity(rho=rho, cluster_size=t, public_queries=True)
    rng = np.random.default_rng(3)
    best = max(_hill_climb(rng, t, t + 2, rho, 300) for _ in range(4))
    assert best <= bound * (1 + 1e-9)
    assert best >= 0.99 * bound, best / bound


@pytest.mark.parametrize(("t", "m", "rho"), [(1, 1, 0.4), (5, 1, 1.3), (5, 3, 1.3), (4, 6, 0.9)])
def test_public_adversarial_membership_flip_attains_bound(t, m, rho):
    """The user's rows sit at the cap edge on one side; moving them far away pulls in
    untouched rows from just beyond the opposite edge (clipped onto it)."""
    q = np.array([1.0, 0.0, 0.0])
    edge_a = _at_angle(q, np.array([0.0, 1.0, 0.0]), rho)
    beyond_b = _at_angle(q, np.array([0.0, -1.0, 0.0]), rho + 1e-3)
    k = min(m, t)
    w = np.array([edge_a] * t + [beyond_b] * k)  # rows 0..k-1 are the user's
    w2 = w.copy()
    w2[:k] = -q
    diff = np.linalg.norm(
        _ref_cap_mean(list(w), q, rho, t)[0] - _ref_cap_mean(list(w2), q, rho, t)[0]
    )
    bound = dplc.dplc_sensitivity(
        rho=rho, cluster_size=t, public_queries=True, max_centers_per_user=m
    )
    assert diff == pytest.approx(bound, rel=1e-9)
    # The module agrees on the same pair.
    mod = dplc.cluster_means(w, rho=rho, cluster_size=t, queries=q[None]) - dplc.cluster_means(
        w2, rho=rho, cluster_size=t, queries=q[None]
    )
    assert np.linalg.norm(mod) == pytest.approx(bound, rel=1e-9)


def test_paper_bound_understates_wide_caps():
    """ρ > π/2: two antipodal points lie in one cap; the paper's 2|sin ρ|/T is exceeded."""
    t, rho = 2, 2.8
    q = np.array([1.0, 0.0, 0.0])
    w = np.array([[0.0, 1.0, 0.0], q])
    w2 = np.array([[0.0, -1.0, 0.0], q])
    diff = np.linalg.norm(
        _ref_means(w, rho, t, queries=q[None]) - _ref_means(w2, rho, t, queries=q[None])
    )
    assert diff == pytest.approx(
        dplc.dplc_sensitivity(rho=rho, cluster_size=t, public_queries=True)
    )
    assert diff > 2.5 * dplc.paper_sensitivity(t, rho)  # 1/sin(2.8) ≈ 3


@pytest.mark.parametrize(("t", "rho"), [(1, 1.0), (4, 1.3), (16, 0.5)])
def test_selected_query_switch_attains_two(t, rho):
    """Alg. 1's data-chosen query jumps across the sphere: Δ = 2, not 2 sin ρ/T."""
    rng = np.random.default_rng(t)
    a = _random_sphere(rng, 1, 5)[0]
    w = np.array([a] * t + [-a] * (t - 1))
    w2 = w.copy()
    w2[0] = -a  # one user's center moves to the other group, taking the query with it
    diff = np.linalg.norm(_ref_means(w, rho, t) - _ref_means(w2, rho, t))
    assert diff == pytest.approx(2.0, abs=1e-12)
    assert diff <= dplc.dplc_sensitivity(rho=rho, cluster_size=t, public_queries=False) + 1e-12
    mod = dplc.cluster_means(w, rho=rho, cluster_size=t) - dplc.cluster_means(
        w2, rho=rho, cluster_size=t
    )
    assert np.linalg.norm(mod) == pytest.approx(2.0, abs=1e-12)
    assert diff / dplc.paper_sensitivity(t, rho) == pytest.approx(t / math.sin(rho))


def test_selected_random_search_never_exceeds_two():
    rng = np.random.default_rng(7)
    worst = 0.0
    for _ in range(200):
        a = _random_sphere(rng, 1, 3)[0]
        w = np.concatenate([_around(rng, a, 3, 0.6), _around(rng, -a, 3, 0.6)])
        w2 = w.copy()
        w2[rng.integers(6)] = _around(rng, -a if rng.random() < 0.5 else a, 1, 0.6)[0]
        worst = max(worst, float(np.linalg.norm(_ref_means(w, 0.7, 3) - _ref_means(w2, 0.7, 3))))
    assert worst <= 2.0
    assert worst > 1.9  # query switches occur in the random pairs too (≈ 1.99 here)


# ---------------------------------------------------------------------------------------
# Noise.


@pytest.mark.parametrize("public", [False, True])
def test_noise_matches_sigma_times_sensitivity(public):
    rng = np.random.default_rng(5)
    d, t, rho, sigma = 6, 3, 1.2, 0.7
    w = _random_sphere(rng, 8, d)
    queries = _random_sphere(rng, 2, d) if public else None
    kwargs = dict(rho=rho, cluster_size=t, queries=queries, num_clusters=1 if public else 2)
    p = dplc.cluster_means(w, **kwargs)
    delta = dplc.dplc_sensitivity(rho=rho, cluster_size=t, public_queries=public)
    draws = np.stack(
        [dplc.dplc_release(w, noise_multiplier=sigma, seed=s, **kwargs) - p for s in range(2500)]
    )
    std = sigma * delta
    # 2500 draws: the std estimate's relative error is ~1.4%; 5% is > 3.5 of those.
    np.testing.assert_allclose(draws.std(axis=0), std, rtol=0.05)
    assert np.abs(draws.mean(axis=0)).max() < 5 * std / math.sqrt(2500)
    sq_norms = np.sum(draws**2, axis=-1)  # E|v|² = d(σΔ)² per cluster
    np.testing.assert_allclose(sq_norms.mean(axis=0), d * std**2, rtol=0.05)


def test_noise_is_seeded_and_stateless():
    w = _random_sphere(np.random.default_rng(2), 5, 4)
    kw = dict(rho=1.0, cluster_size=2, noise_multiplier=1.0)
    a = dplc.dplc_release(w, seed=[3, 4], **kw)
    np.testing.assert_array_equal(a, dplc.dplc_release(w, seed=[3, 4], **kw))
    assert not np.allclose(a, dplc.dplc_release(w, seed=[3, 5], **kw))
    np.testing.assert_array_equal(
        dplc.dplc_release(w, seed=9, noise_multiplier=0.0, rho=1.0, cluster_size=2),
        dplc.cluster_means(w, rho=1.0, cluster_size=2),
    )


# ---------------------------------------------------------------------------------------
# Sensitivity formulas and accounting.


def test_sensitivity_formulas():
    assert dplc.dplc_sensitivity(rho=1.3, cluster_size=512, public_queries=True) == pytest.approx(
        2 * math.sin(1.3) / 512
    )
    # Paper's formula coincides with the public-query bound for m = 1, ρ ≤ π/2.
    assert dplc.paper_sensitivity(512, 1.3) == pytest.approx(
        dplc.dplc_sensitivity(rho=1.3, cluster_size=512, public_queries=True)
    )
    assert dplc.dplc_sensitivity(
        rho=2.5, cluster_size=4, public_queries=True, max_centers_per_user=9
    ) == pytest.approx(2.0)
    assert dplc.dplc_sensitivity(rho=0.5, cluster_size=512, public_queries=False) == 2.0


def test_dp_event_composes_clusters():
    assert dplc.dplc_dp_event(1.5) == dp_accounting.GaussianDpEvent(1.5)
    event = dplc.dplc_dp_event(1.5, num_clusters=4)
    assert event == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.5), 4)

    def eps(e):
        acc = dp_accounting.rdp.RdpAccountant()
        acc.compose(e)
        return acc.get_epsilon(1e-5)

    # Q Gaussians of multiplier σ = one Gaussian of multiplier σ/√Q.
    assert eps(event) == pytest.approx(eps(dp_accounting.GaussianDpEvent(1.5 / 2)), rel=1e-6)


# ---------------------------------------------------------------------------------------
# Refusals: one ValueError line, nothing released.


W = _unit(np.arange(12, dtype=float).reshape(4, 3) + 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(cluster_size=0), "cluster size T"),
        (dict(cluster_size=1.5), "cluster size T"),
        (dict(cluster_size=True), "cluster size T"),
        (dict(rho=0.0), "margin rho"),
        (dict(rho=-1.0), "margin rho"),
        (dict(rho=math.pi + 0.01), "margin rho"),
        (dict(rho=float("nan")), "margin rho"),
        (dict(cluster_size=5), "nothing released"),
        (dict(cluster_size=3, num_clusters=2), "nothing released"),
        (dict(cluster_size=5, queries=W[:1]), "nothing released"),
        (dict(queries=np.ones((1, 2))), "dim"),
        (dict(queries=W[:2], num_clusters=3), "num_clusters"),
        (dict(noise_multiplier=-1.0), "noise multiplier"),
        (dict(noise_multiplier=math.inf), "noise multiplier"),
        (dict(max_centers_per_user=0), "max class centers"),
        (dict(num_clusters=0), "number of clusters"),
        (dict(centers=np.zeros((4, 3))), "non-zero norm"),
        (dict(centers=np.zeros((0, 3))), "non-empty"),
    ],
)
def test_refusals(kwargs, message):
    args = dict(centers=W, rho=1.0, cluster_size=2, noise_multiplier=1.0, seed=0) | kwargs
    with pytest.raises(ValueError, match=message) as err:
        dplc.dplc_release(**args)
    assert "\n" not in str(err.value)
