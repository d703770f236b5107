"""The sensitivity of Logit-DP's clipped gradient, and the configurations it refuses.

TensorFlow-free (issue 26): `job_config` checks a logit-dp job and the accountant's
callers compute its noise without importing TensorFlow; the gradient routes and the noise
are `tff_algorithms.algorithms.logit_dp.mechanism`, whose docstring defines the loss, τ_ij and c_ij used below.

Sensitivity (derived here from first principles)
------------------------------------------------
Write t = e^{2s}. Two facts:

(F1) Σ_j |τ_ij| = (1 − p_ii) + Σ_{j≠i} p_ij = 2(1 − p_ii).
(F2) With m columns and logits in [−s, s]: p_ii ≥ e^{−s}/(e^{−s} + (m−1)e^{s}) =
     1/(1 + (m−1)t), and every p_ij ≤ e^{s}/(e^{s} + (m−1)e^{−s}) = t/(t + m − 1).

g is invariant under reordering the pairs, so let the changed pair be the last one, n.

*Substitute-one* (the relation of docs/design.md section 5, fixed n: D' replaces (x_n, y_n) by
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
Both bounds are tight: the worst-case search of tests/tff_algorithms/algorithms/logit_dp/test_logit_dp.py (linear model, real
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
"""

from __future__ import annotations

import math

import numpy as np

from tff_algorithms.privacy.accounting_spec import NeighboringRelation

# e^{2s} must stay finite in float64 (e^{2·100} ≈ 7e86); scales this large are refused
# anyway at any realistic batch size.
MAX_SCALE = 100.0
MAX_BATCH_SIZE = 10**9
_RELATIONS = (NeighboringRelation.REPLACE_ONE, NeighboringRelation.ADD_OR_REMOVE_ONE)


def check_clip_norm(clip_norm: float) -> None:
    if not clip_norm > 0:  # also rejects NaN
        raise ValueError(f"clip_norm must be > 0 (got {clip_norm}).")


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
    check_clip_norm(clip_norm)
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
    check_clip_norm(clip_norm)
    rows = {NeighboringRelation.REPLACE_ONE: 4.0, NeighboringRelation.ADD_OR_REMOVE_ONE: 2.0}
    return (rows[_relation(relation)] + 2.0 * math.exp(2.0 * scale)) * clip_norm


def paper_eq6_sensitivity(n: int, clip_norm: float) -> float:
    """COMPARISON ONLY, never for noise: the paper's Eq. 6, 2(1 + (n−2)e²/(e²+n−1))·B.

    Its proof shares one probability between the removed row's positive pair and the other
    rows' probabilities of the removed column; it is below the true worst case (2·B at
    n = 2 where a replaced or removed pair can move the gradient by more than 3.5·B).
    """
    _check_batch_size(n)
    check_clip_norm(clip_norm)
    e2 = math.exp(2.0)
    return 2.0 * (1.0 + (n - 2) * e2 / (e2 + n - 1)) * clip_norm


def naive_dp_sensitivity(clip_norm: float) -> float:
    """Naive-DP: two clipped whole-batch gradients (norm ≤ B each) differ by at most 2B."""
    check_clip_norm(clip_norm)
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
