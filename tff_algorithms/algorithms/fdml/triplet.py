"""The triplet loss of FDML's server step over a masked, grouped buffer, and Alg. 1's derivatives.

The server (the paper's enclave) holds a buffer of embeddings, one slot per participant
and `samples_per_user` rows per slot::

    embeddings  float[slots, s, d]
    keys        int64[slots, s]      identity key of each row (triplets are keyed by it)
    valid       bool[slots, s]       False for padding: a participant that uploaded fewer
                                     than s rows, a dropped embedding (Alg. 2, line 1), an
                                     empty slot (Case A); such rows are in no triplet

Groups. Consecutive slots form groups of `users_per_group` participants (the last group
of a buffer padded with empty slots), and triplets are mined inside a group only. One
participant's embeddings then reach the derivative rows of its own group and no other
row, which is what bounds the sensitivity of the released derivatives
(`fdml_privacy`). `users_per_group` = the number of slots is the paper's single buffer.

Loss (Eq. 1, Euclidean distances d_ij = |e_i - e_j|, margin m), per group G:

    L_G = (1 / k_G) * sum over mined (a, p, n) of max(d_ap - d_an + m, 0)

where k_G counts the mined triplets whose hinge is positive (inactive triplets have zero
derivative, so Alg. 1's counter only makes sense over active ones; a group without one
contributes 0). The buffer's loss is the sum over groups: each group is one centralized
triplet loss, and with one group it is exactly the centralized loss of the round's rows.

Mining (the selection is piecewise constant in the embeddings, so it carries no gradient):
- `batch_all`: every (a, p, n) of valid rows with key_a = key_p, a != p, key_n != key_a.
- `semi_hard`: for each positive pair (a, p), the one negative n with the smallest d_an
  above d_ap (FaceNet's semi-hard negative); if no negative is farther than p, the
  farthest negative. Ties go to the lowest row index.

Derivatives (Alg. 1). With U_ij = (e_i - e_j) / d_ij, a triplet (a, p, n) adds
U_ap - U_an to row a, -U_ap to row p and U_an to row n. Summing over the mined set with
A_ap = #mined (a, p, .) and B_an = #mined (a, ., n), and M = (A - B) + (A - B)^T,
row i's derivative is sum_j M_ij U_ij / k_G, an O(N^2 d) computation once the triplets are
counted. A and B are counted without forming the N^3 triplets (`triplet_counts`: sorted
distances and binary search, O(N^2 log N) time, O(N^2) memory): batch-all over one buffer
of 256 participants x 8 rows (N = 2048, d = 64) takes about 0.5 s on 2 CPU cores (the
paper's Table V: 11 s in SGX). tests/tff_algorithms/algorithms/fdml/test_fdml.py checks the derivatives against autodiff of
`group_loss` and against an independent loop over triplets, ties included.
"""

from __future__ import annotations

import tensorflow as tf

BATCH_ALL = "batch_all"
SEMI_HARD = "semi_hard"
STRATEGIES = (BATCH_ALL, SEMI_HARD)


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"triplet strategy must be one of {STRATEGIES}, got {strategy!r}")


def _distances(embeddings: tf.Tensor) -> tf.Tensor:
    """|e_i - e_j| over the last two axes, with a gradient that is finite at i = j."""
    diff = embeddings[..., :, None, :] - embeddings[..., None, :, :]
    squared = tf.reduce_sum(tf.square(diff), axis=-1)
    positive = squared > 0
    # sqrt has an infinite derivative at 0: take it of 1 there and zero the result.
    return tf.where(positive, tf.sqrt(tf.where(positive, squared, tf.ones_like(squared))), 0.0)


def _pair_masks(keys: tf.Tensor, valid: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(positive pair [G, a, p], negative [G, a, n]) masks over valid rows."""
    n = tf.shape(keys)[-1]
    same = tf.equal(keys[:, :, None], keys[:, None, :])
    both_valid = tf.logical_and(valid[:, :, None], valid[:, None, :])
    not_self = tf.logical_not(tf.eye(n, dtype=tf.bool))[None]
    positive = tf.logical_and(tf.logical_and(same, both_valid), not_self)
    negative = tf.logical_and(tf.logical_not(same), both_valid)
    return positive, negative


def _flat_rows(tensor: tf.Tensor) -> tf.Tensor:
    """[G, N, N] -> [G * N, N]: tf.searchsorted takes one batch axis."""
    return tf.reshape(tensor, [-1, tf.shape(tensor)[-1]])


def _searchsorted(sorted_rows: tf.Tensor, values: tf.Tensor, side: str) -> tf.Tensor:
    shape = tf.shape(values)
    found = tf.searchsorted(_flat_rows(sorted_rows), _flat_rows(values), side=side)
    return tf.reshape(found, shape)


def triplet_counts(
    embeddings: tf.Tensor, keys: tf.Tensor, valid: tf.Tensor, strategy: str, margin: float
) -> tuple[tf.Tensor, tf.Tensor]:
    """The mined triplets with a positive hinge, counted per anchor pair.

    Returns float (A, B), both [G, N, N]: A[g, a, p] = mined active triplets (a, p, .) and
    B[g, a, n] = mined active triplets (a, ., n) of group g. Never forms the N^3 triplet
    tensor: per anchor, the negatives' (and positives') distances are sorted once and the
    hinge condition d_an < d_ap + m is counted by binary search, O(N^2 log N).

    Args:
      embeddings: float[G, N, d], each group's rows (held constant: the mining is
        piecewise constant in the embeddings).
      keys: int64[G, N] identity keys.
      valid: bool[G, N]; invalid rows are in no triplet.
      strategy: `BATCH_ALL` or `SEMI_HARD`.
      margin: m.
    """
    check_strategy(strategy)
    distances = _distances(tf.stop_gradient(embeddings))
    positive, negative = _pair_masks(keys, valid)
    inf = tf.constant(float("inf"), distances.dtype)
    negative_distances = tf.where(negative, distances, inf)  # [G, a, n]
    if strategy == BATCH_ALL:
        # A[a, p] = #{n negative of a: d_an < d_ap + m}.
        sorted_negatives = tf.sort(negative_distances, axis=-1)
        count_a = _searchsorted(sorted_negatives, distances + margin, "left")
        # B[a, n] = #{p positive of a: d_ap > d_an - m} (non-positives sort as -inf).
        sorted_positives = tf.sort(tf.where(positive, distances, -inf), axis=-1)
        count_b = tf.shape(distances)[-1] - _searchsorted(
            sorted_positives, distances - margin, "right"
        )
        a = tf.where(positive, tf.cast(count_a, distances.dtype), 0.0)
        b = tf.where(negative, tf.cast(count_b, distances.dtype), 0.0)
        return a, b
    # Semi-hard: per (a, p), the first negative in ascending distance farther than p
    # (stable sort: ties go to the lowest row), else the first of the farthest ones.
    order = tf.argsort(negative_distances, axis=-1, stable=True)  # [G, a, rank]
    sorted_negatives = tf.gather(negative_distances, order, batch_dims=2)
    negatives = tf.reduce_sum(tf.cast(negative, tf.int32), axis=-1, keepdims=True)  # [G, a, 1]
    farther = _searchsorted(sorted_negatives, distances, "right")  # [G, a, p]
    last = tf.gather(sorted_negatives, tf.maximum(negatives - 1, 0), batch_dims=2)
    farthest = _searchsorted(sorted_negatives, tf.broadcast_to(last, tf.shape(distances)), "left")
    rank = tf.where(farther < negatives, farther, farthest)
    rank = tf.minimum(rank, tf.shape(distances)[-1] - 1)  # anchors without negatives
    chosen = tf.gather(order, rank, batch_dims=2)  # [G, a, p]: the negative's row
    chosen_distance = tf.gather(sorted_negatives, rank, batch_dims=2)
    active = tf.logical_and(
        tf.logical_and(positive, negatives > 0), distances - chosen_distance + margin > 0
    )
    a = tf.cast(active, distances.dtype)
    # B[a, n] sums A over the (a, p) whose chosen negative is n: a segment sum, not N^3.
    shape = tf.shape(distances)
    rows = tf.range(shape[0] * shape[1], dtype=chosen.dtype)[:, None] * tf.cast(
        shape[2], chosen.dtype
    )
    segments = tf.reshape(rows + tf.reshape(chosen, [-1, shape[2]]), [-1])
    b = tf.math.unsorted_segment_sum(
        tf.reshape(a, [-1]), segments, num_segments=shape[0] * shape[1] * shape[2]
    )
    return a, tf.reshape(b, shape)


def group_loss(
    embeddings: tf.Tensor, keys: tf.Tensor, valid: tf.Tensor, strategy: str, margin: float
) -> tf.Tensor:
    """Sum over groups of each group's mean hinge over its active mined triplets (Eq. 1).

    Differentiable in `embeddings` (float[G, N, d]); the mining is held constant. The
    hinge sum is sum_ap A_ap (d_ap + m) - sum_an B_an d_an.
    """
    a, b = triplet_counts(embeddings, keys, valid, strategy, margin)
    distances = _distances(embeddings)
    total = tf.reduce_sum(a * (distances + margin), axis=[-2, -1]) - tf.reduce_sum(
        b * distances, axis=[-2, -1]
    )
    count = tf.reduce_sum(a, axis=[-2, -1])
    return tf.reduce_sum(tf.math.divide_no_nan(total, count))


def group_derivatives(
    embeddings: tf.Tensor, keys: tf.Tensor, valid: tf.Tensor, strategy: str, margin: float
) -> tuple[tf.Tensor, tf.Tensor]:
    """Alg. 1: d(group_loss)/d(embeddings) in closed form, and each group's active count.

    Returns (float[G, N, d] derivatives, float[G] active triplets per group).
    """
    anchor_positive, anchor_negative = triplet_counts(embeddings, keys, valid, strategy, margin)
    count = tf.reduce_sum(anchor_positive, axis=[-2, -1])
    difference = anchor_positive - anchor_negative
    coefficients = difference + tf.linalg.matrix_transpose(difference)  # M
    distances = _distances(embeddings)
    # Mined pairs have distinct embeddings (else d = 0 and the triplet's unit vector
    # is undefined); a zero distance contributes nothing, as autodiff of `group_loss` does.
    scaled = tf.math.divide_no_nan(coefficients, distances)  # M_ij / d_ij
    rows = tf.reduce_sum(scaled, axis=-1, keepdims=True) * embeddings - tf.matmul(
        scaled, embeddings
    )
    return rows / tf.maximum(count, 1.0)[:, None, None], count


def _grouped(tensor: tf.Tensor, users_per_group: int) -> tf.Tensor:
    """[slots, s, ...] -> [groups, users_per_group * s, ...], padding the last group."""
    slots = tf.shape(tensor)[0]
    groups = (slots + users_per_group - 1) // users_per_group
    pad = groups * users_per_group - slots
    padding = tf.concat([[[0, pad]], tf.zeros([tf.rank(tensor) - 1, 2], tf.int32)], axis=0)
    padded = tf.pad(tensor, padding)
    tail = tf.shape(tensor)[2:]
    return tf.reshape(padded, tf.concat([[groups, users_per_group * tf.shape(tensor)[1]], tail], 0))


def _zero_invalid(embeddings: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """Padding holds zeros: whatever an invalid row held (even NaN) reaches no output."""
    return tf.where(valid[..., None], embeddings, tf.zeros_like(embeddings))


def _ungrouped(tensor: tf.Tensor, slots: tf.Tensor, samples: tf.Tensor) -> tf.Tensor:
    """Inverse of `_grouped`, dropping the padding slots."""
    tail = tf.shape(tensor)[2:]
    flat = tf.reshape(tensor, tf.concat([[-1, samples], tail], 0))
    return flat[:slots]


def buffer_loss(
    embeddings: tf.Tensor,
    keys: tf.Tensor,
    valid: tf.Tensor,
    users_per_group: int,
    strategy: str,
    margin: float,
) -> tf.Tensor:
    """The round's loss over a buffer (module docstring), differentiable in `embeddings`."""
    embeddings = _zero_invalid(embeddings, valid)
    return group_loss(
        _grouped(embeddings, users_per_group),
        _grouped(keys, users_per_group),
        _grouped(valid, users_per_group),
        strategy,
        margin,
    )


def buffer_derivatives(
    embeddings: tf.Tensor,
    keys: tf.Tensor,
    valid: tf.Tensor,
    users_per_group: int,
    strategy: str,
    margin: float,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Alg. 1 over a buffer: (float[slots, s, d] derivatives, total active triplets).

    Invalid rows get zero derivatives (they are in no triplet).
    """
    if users_per_group < 1:
        raise ValueError(f"users_per_group must be >= 1, got {users_per_group}")
    embeddings = _zero_invalid(embeddings, valid)
    rows, counts = group_derivatives(
        _grouped(embeddings, users_per_group),
        _grouped(keys, users_per_group),
        _grouped(valid, users_per_group),
        strategy,
        margin,
    )
    shape = tf.shape(embeddings)
    return _ungrouped(rows, shape[0], shape[1]), tf.reduce_sum(counts)
