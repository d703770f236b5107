"""DPLC: differentially private local clusters of class centers (issue 22, item 1).

The seed paper (privacyface-dp-local-clusters, "PrivacyFace", Alg. 1) releases, per client,
the noisy mean of a dense cluster of its class centers, for other clients to use as fixed
negatives. This module holds the mechanism and its sensitivity; it knows nothing of
training, the pipeline or the ledger (items 2-4 of issue 22). Accounting is separate:
`dplc_dp_event` returns the `dp_accounting` event of one release.

Cluster (the paper's definition)
--------------------------------
Class centers w_1..w_n are rows normalised here to unit L2 norm (the paper assumes unit
rows; normalising makes that true whatever the caller passes). The margin ρ ∈ (0, π]
bounds the **angle**: w lies in the cluster (spherical cap) around a unit query q iff
arccos(wᵀq) ≤ ρ, i.e. wᵀq ≥ cos ρ (cosine similarity at least cos ρ). The paper allows
ρ ∈ [0, π]; ρ = 0 is refused (a cap of one point).

What is computed (and how it differs from Alg. 1)
-------------------------------------------------
For one query q the un-noised cluster mean is

    p(D) = (1/T) Σ_{i ∈ S} clip_ρ(w_i),   S = the T centers with the largest wᵀq
                                              (ties: lower row index first),

where clip_ρ moves a center outside the cap along the great circle through q onto the cap's
boundary (cos ρ·q + sin ρ·u, u the unit tangent from q towards w) and leaves centers inside
unchanged. Two query modes:

- **selected** (Alg. 1, lines 3-5): q is the center with the most neighbours within ρ
  (itself included; ties: lower index). Q clusters are found greedily; each removes
  exactly its T members before the next search.
- **public**: the caller passes Q unit queries that do not depend on this data (a direction
  from public data, a previously released, already accounted center, or a direction drawn
  from a public seed). Each query uses all n centers; nothing is removed.

Departures from Alg. 1, each needed for a valid guarantee:

1. Exactly T members, not all |S| ≥ T neighbours: the divisor is public, so the noise
   scale does not depend on the data (Alg. 1's σ ∝ 1/|S| reveals |S|).
2. No data-dependent refusal. Alg. 1 releases only when the densest cap holds ≥ T centers
   (line 6) and stops otherwise; whether a release happens is then itself a function of
   the data that no Gaussian noise covers: one user can turn "release" into "nothing"
   (probability 1 vs 0, not a small δ). Here a release happens whenever the *public* count
   allows it (n ≥ Q·T for selected queries, n ≥ T for public ones; n is public under
   substitute-one, which fixes the number of users), and members beyond ρ are clipped onto
   the cap instead of disqualifying the cluster. A refusal (ValueError, nothing released)
   depends only on the arguments T, ρ, Q, m, σ and the shapes. Under add-or-remove n is
   not public: a caller must then fix the pool size (or refuse) from public information.
   Zero or non-finite rows also raise; they are upstream bugs, not a release decision.
3. Alg. 1 removes "the centers within ρ of p/|p|" after each query, a data-dependent count;
   here exactly the T members are removed, so the next query's public count is n − T.

Sensitivity (derived here, privacy unit = a user)
-------------------------------------------------
One user's data shapes the class centers of the identities that user holds: at most m
rows of W (m = 1 when each user is one identity, as in DP-FedEmb's virtual clients;
``max_centers_per_user`` otherwise). *Substitute-one* (docs/design.md section 5, strict): D' equals
D except that those ≤ m rows are replaced by arbitrary unit vectors (same positions, so n
is the same). *Add-or-remove*: D' adds or removes ≤ m rows. Δ = sup ‖p(D) − p(D')‖₂.

Selected queries: Δ_sel = 2, for every T, ρ and m ≥ 1. Upper bound: p is a mean of unit
vectors, so |p| ≤ 1 and |p − p'| ≤ 2. Attained: D = T centers at a and T − 1 at −a (any
ρ < π): the query is in the first group and p = a. Replacing one center of the first group
by −a moves the query to the second group: p' = −a, |p − p'| = 2. The same holds for
every query of the greedy loop. Membership is data-dependent through the *choice of the
query*, not only through one member swapped in or out, and that choice can jump across
the sphere. Cluster size buys nothing here, so selected queries are a valid but
low-utility release (noise std 2σ per coordinate against a signal of norm ≤ 1).

Public query q (fixed, not a function of D), any relation, one user with ≤ m rows:

(a) Every contribution clip_ρ(w) lies in the cap C_ρ(q), whose Euclidean diameter is
    diam_ρ = 2·sin(min(ρ, π/2)): for x, y ∈ C_ρ, angle(x, y) ≤ angle(x, q) + angle(q, y)
    ≤ 2ρ, and |x − y| = 2 sin(angle/2) grows with the angle up to π, reached at
    ρ ≥ π/2. Equality: x, y on the boundary on opposite sides of q.
(b) Membership. Let U be the rows the user does not touch and R, R' the user's rows in
    D, D'. The ranking of U by wᵀq (ties by position, which keeps U's relative order) is
    the same in D and D'. If a = |S ∩ R| and b = |S' ∩ R'| then S ∩ U is the top T − a of U
    and S' ∩ U the top T − b of U: one contains the other and they differ by |a − b|
    members (those are the members swapped in or out by the change, e.g. a center pushed
    out of the top T). Say a ≥ b. Then T·(p − p') = Σ_{S∩R} c − Σ_{S'∩R'} c' −
    Σ_{(S'∩U)∖(S∩U)} c: a vectors minus a vectors, all in C_ρ. Pairing them, |T(p − p')|
    ≤ a·diam_ρ, and a ≤ min(m, T) (add or remove: one of R, R' is empty, same count).

    Δ_pub(T, ρ, m) = min(m, T) · 2·sin(min(ρ, π/2)) / T.

It is attained: T − 1 members at the boundary point on one side of q, the user's member
at the same point, and a non-member just beyond ρ on the opposite side; moving the
user's center far away brings that non-member in (clipped onto the opposite boundary),
so p moves by diam_ρ/T. tests/tff_algorithms/privacy/test_dplc.py checks this against an independent numpy
reference: 600 random neighbouring pairs per setting (about 1 in 6 change an untouched
row's membership) reach max |p − p'|/Δ_pub = 1.0000 at (T, m, ρ) = (1, 1, 1.0), (3, 1, 1.3),
(3, 1, 2.2) and 0.981 at (4, 2, 0.7), never above; a hill climb over D and D' reaches
1.0000; the construction above gives exactly Δ_pub. For selected queries random pairs
reach 1.989 and the construction exactly 2.

Paper's bound (comparison only, `paper_sensitivity`): √(2 − 2cos 2ρ)/|S| = 2|sin ρ|/|S|.
With a public query, m = 1 and |S| = T it equals Δ_pub for ρ ≤ π/2 (its argument, one
member replaced inside a fixed cap, is the pairing in (b) with a = 1). It is not the
sensitivity of Alg. 1: it ignores the query switch (Δ = 2), the data-dependent |S| and
refusal, and for ρ > π/2 two cap points can be antipodal (Lemma 2 of the paper assumes
angles ≤ π/2), so 2|sin ρ| < 2 understates even a fixed cap. It is never used for noise.

Noise, composition, accounting
------------------------------
Each released cluster is p + N(0, (σ·Δ)² I_d) with σ the noise multiplier, relative to
the full L2 sensitivity Δ of substitute-one (the strict convention of accounting_spec.py;
both relations give the same Δ here). Noise is drawn from a fresh generator seeded by the
explicit ``seed`` (stateless: same seed, same release); production callers pass OS
entropy (e.g. ``secrets.randbits(128)``), never a fixed or logged seed. The paper's
normalisation (p + v)/|p + v| is post-processing and left to the caller.

Q clusters per client per release: the Q noisy means are Q Gaussian mechanisms, each of
sensitivity ≤ Δ as a function of the whole D (the greedy removals are part of that
function), so one release is Q-fold composition: `dplc_dp_event` returns
GaussianDpEvent(σ) self-composed Q times (equivalently one Gaussian of L2 sensitivity
Δ·√Q). Clients holding disjoint users compose in parallel: a user's rows enter one
client's DPLC only. Releases across rounds compose with the training's events in the
ledger (item 2); no subsampling amplification is claimed here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import dp_accounting
import numpy as np

# Rows shorter than this cannot be normalised to a direction; they are input errors.
_MIN_ROW_NORM = 1e-12


def _check_cluster_size(cluster_size: int) -> None:
    if isinstance(cluster_size, bool) or not isinstance(cluster_size, (int, np.integer)):
        raise ValueError(f"cluster size T must be an integer >= 1 (got {cluster_size!r}).")
    if cluster_size < 1:
        raise ValueError(f"cluster size T must be an integer >= 1 (got {cluster_size}).")


def _check_rho(rho: float) -> None:
    if not 0.0 < rho <= math.pi:
        raise ValueError(f"margin rho must be an angle in (0, pi] radians (got {rho}).")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r}).")


def _check_noise_multiplier(noise_multiplier: float) -> None:
    if not 0.0 <= noise_multiplier < math.inf:
        raise ValueError(f"noise multiplier must be finite and >= 0 (got {noise_multiplier}).")


def _unit_rows(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{what} must be a non-empty [rows, dim] array (got shape {x.shape}).")
    norms = np.linalg.norm(x, axis=1)
    if not np.all(np.isfinite(norms)) or np.any(norms < _MIN_ROW_NORM):
        raise ValueError(f"{what} must be finite rows of non-zero norm.")
    return x / norms[:, None]


def _clip_to_cap(w: np.ndarray, q: np.ndarray, rho: float) -> np.ndarray:
    """Rows of w outside the cap {x: xᵀq ≥ cos ρ} moved along the great circle onto it."""
    cos_rho = math.cos(rho)
    dots = w @ q
    outside = dots < cos_rho
    if not np.any(outside):
        return w
    tangent = w[outside] - dots[outside, None] * q[None, :]
    tnorm = np.linalg.norm(tangent, axis=1)
    # w = −q has no great circle through q: any tangent direction keeps the point in the cap.
    fallback = np.zeros_like(q)
    fallback[int(np.argmin(np.abs(q)))] = 1.0
    fallback -= (fallback @ q) * q
    fallback /= np.linalg.norm(fallback)
    tiny = tnorm < 1e-12
    tangent[tiny] = fallback
    tnorm[tiny] = 1.0
    out = w.copy()
    out[outside] = cos_rho * q[None, :] + math.sin(rho) * tangent / tnorm[:, None]
    return out


def _cap_mean(
    w: np.ndarray, q: np.ndarray, rho: float, cluster_size: int
) -> tuple[np.ndarray, np.ndarray]:
    # Stable sort: equal similarities keep row order, as the sensitivity proof assumes.
    members = np.argsort(-(w @ q), kind="stable")[:cluster_size]
    return _clip_to_cap(w[members], q, rho).mean(axis=0), members


def cluster_means(
    centers: np.ndarray,
    *,
    rho: float,
    cluster_size: int,
    num_clusters: int = 1,
    queries: np.ndarray | None = None,
) -> np.ndarray:
    """Un-noised cluster means p, shape [Q, d]. PRIVATE: never release these.

    ``queries`` None: selected queries (Alg. 1's densest center, greedy, Q = num_clusters).
    Otherwise a [Q, d] array of public queries (``num_clusters`` must then be left at 1 or
    equal Q). Refuses (ValueError) when the public count cannot supply the clusters.
    """
    _check_cluster_size(cluster_size)
    _check_rho(rho)
    _check_count("number of clusters Q", num_clusters)
    w = _unit_rows(centers, "class centers")
    n = w.shape[0]
    if queries is not None:
        q = _unit_rows(queries, "queries")
        if q.shape[1] != w.shape[1]:
            raise ValueError(f"queries have dim {q.shape[1]}, class centers {w.shape[1]}.")
        if num_clusters not in (1, q.shape[0]):
            raise ValueError(f"num_clusters {num_clusters} != number of queries {q.shape[0]}.")
        if n < cluster_size:
            raise ValueError(
                f"fewer class centers ({n}) than the cluster size T = {cluster_size}: "
                "nothing released."
            )
        return np.stack([_cap_mean(w, qi, rho, cluster_size)[0] for qi in q])
    if n < num_clusters * cluster_size:
        raise ValueError(
            f"{n} class centers cannot supply {num_clusters} cluster(s) of T = {cluster_size}: "
            "nothing released."
        )
    cos_rho = math.cos(rho)
    remaining = np.arange(n)
    means = []
    for _ in range(num_clusters):
        rest = w[remaining]
        counts = np.sum(rest @ rest.T >= cos_rho, axis=1)
        query = rest[int(np.argmax(counts))]  # argmax: first (lowest-index) maximum
        mean, members = _cap_mean(rest, query, rho, cluster_size)
        means.append(mean)
        remaining = np.delete(remaining, members)
    return np.stack(means)


def dplc_sensitivity(
    *, rho: float, cluster_size: int, public_queries: bool, max_centers_per_user: int = 1
) -> float:
    """L2 sensitivity Δ of one cluster mean under a user's change (module docstring).

    Public queries: min(m, T)·2·sin(min(ρ, π/2))/T. Selected queries: 2. Same under
    substitute-one and add-or-remove.
    """
    _check_cluster_size(cluster_size)
    _check_rho(rho)
    _check_count("max class centers per user m", max_centers_per_user)
    if not public_queries:
        return 2.0
    diameter = 2.0 * math.sin(min(rho, math.pi / 2))
    return min(max_centers_per_user, cluster_size) * diameter / cluster_size


def paper_sensitivity(cluster_size: int, rho: float) -> float:
    """COMPARISON ONLY, never for noise: Theorem 2's √(2 − 2cos 2ρ)/|S|.

    Valid only for one member replaced inside a fixed cap with ρ ≤ π/2; not a bound for
    Alg. 1 (module docstring).
    """
    _check_cluster_size(cluster_size)
    _check_rho(rho)
    return math.sqrt(max(0.0, 2.0 - 2.0 * math.cos(2.0 * rho))) / cluster_size


def dplc_release(
    centers: np.ndarray,
    *,
    rho: float,
    cluster_size: int,
    noise_multiplier: float,
    seed: int | Sequence[int],
    num_clusters: int = 1,
    queries: np.ndarray | None = None,
    max_centers_per_user: int = 1,
) -> np.ndarray:
    """Released noisy cluster means p + N(0, (σΔ)²I), shape [Q, d] (not normalised).

    Each call draws from a fresh generator seeded by ``seed``; pass OS entropy in
    production. Account the call with ``dplc_dp_event(noise_multiplier, Q)``, Q the
    number of rows returned (``num_clusters``, or the number of public queries).
    """
    _check_noise_multiplier(noise_multiplier)
    delta = dplc_sensitivity(
        rho=rho,
        cluster_size=cluster_size,
        public_queries=queries is not None,
        max_centers_per_user=max_centers_per_user,
    )
    means = cluster_means(
        centers, rho=rho, cluster_size=cluster_size, num_clusters=num_clusters, queries=queries
    )
    rng = np.random.default_rng(seed)
    return means + noise_multiplier * delta * rng.standard_normal(means.shape)


def dplc_dp_event(noise_multiplier: float, num_clusters: int = 1) -> dp_accounting.DpEvent:
    """The event of one release: GaussianDpEvent(σ), self-composed Q times when Q > 1.

    σ is relative to the full sensitivity Δ of substitute-one (strict convention), so it
    goes to dp_accounting unchanged.
    """
    _check_noise_multiplier(noise_multiplier)
    _check_count("number of clusters Q", num_clusters)
    event = dp_accounting.GaussianDpEvent(noise_multiplier)
    return event if num_clusters == 1 else dp_accounting.SelfComposedDpEvent(event, num_clusters)
