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
counted. tests/test_fdml.py checks it against autodiff of `group_loss` and against an
independent loop over triplets.
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


def mined_triplets(
    embeddings: tf.Tensor, keys: tf.Tensor, valid: tf.Tensor, strategy: str, margin: float
) -> tf.Tensor:
    """0/1 float weights W[..., a, p, n] of the mined triplets whose hinge is positive.

    Args:
      embeddings: float[..., N, d], one group's rows (leading axes: groups).
      keys: int64[..., N] identity keys.
      valid: bool[..., N]; invalid rows are in no triplet.
      strategy: `BATCH_ALL` or `SEMI_HARD`.
      margin: m.
    """
    check_strategy(strategy)
    embeddings = tf.stop_gradient(embeddings)
    distances = _distances(embeddings)
    n = tf.shape(keys)[-1]
    same = tf.equal(keys[..., :, None], keys[..., None, :])
    both_valid = tf.logical_and(valid[..., :, None], valid[..., None, :])
    not_self = tf.logical_not(tf.eye(n, dtype=tf.bool))
    positive_pair = tf.logical_and(tf.logical_and(same, both_valid), not_self)  # [.., a, p]
    negative = tf.logical_and(tf.logical_not(same), both_valid)  # [.., a, n]
    d_ap = distances[..., :, :, None]
    d_an = distances[..., :, None, :]
    candidates = tf.logical_and(positive_pair[..., :, :, None], negative[..., :, None, :])
    if strategy == SEMI_HARD:
        farther = tf.logical_and(candidates, d_an > d_ap)
        big = tf.constant(float("inf"), distances.dtype)
        nearest_farther = tf.argmin(tf.where(farther, d_an + tf.zeros_like(d_ap), big), axis=-1)
        farthest = tf.argmax(tf.where(candidates, d_an + tf.zeros_like(d_ap), -big), axis=-1)
        chosen = tf.where(tf.reduce_any(farther, axis=-1), nearest_farther, farthest)
        candidates = tf.logical_and(
            candidates, tf.cast(tf.one_hot(chosen, n, dtype=tf.int32), tf.bool)
        )
    active = tf.logical_and(candidates, d_ap - d_an + margin > 0)
    return tf.cast(active, embeddings.dtype)


def group_loss(
    embeddings: tf.Tensor, keys: tf.Tensor, valid: tf.Tensor, strategy: str, margin: float
) -> tf.Tensor:
    """Sum over groups of each group's mean hinge over its active mined triplets (Eq. 1).

    Differentiable in `embeddings` (float[..., N, d]); the mining is held constant.
    """
    weights = mined_triplets(embeddings, keys, valid, strategy, margin)
    distances = _distances(embeddings)
    hinge = distances[..., :, :, None] - distances[..., :, None, :] + margin
    count = tf.reduce_sum(weights, axis=[-3, -2, -1])
    total = tf.reduce_sum(weights * hinge, axis=[-3, -2, -1])
    return tf.reduce_sum(tf.math.divide_no_nan(total, count))


def group_derivatives(
    embeddings: tf.Tensor, keys: tf.Tensor, valid: tf.Tensor, strategy: str, margin: float
) -> tuple[tf.Tensor, tf.Tensor]:
    """Alg. 1: d(group_loss)/d(embeddings) in closed form, and each group's active count.

    Returns (float[..., N, d] derivatives, float[...] active triplets per group).
    """
    weights = mined_triplets(embeddings, keys, valid, strategy, margin)
    count = tf.reduce_sum(weights, axis=[-3, -2, -1])
    anchor_positive = tf.reduce_sum(weights, axis=-1)  # A[a, p]
    anchor_negative = tf.reduce_sum(weights, axis=-2)  # B[a, n]
    difference = anchor_positive - anchor_negative
    coefficients = difference + tf.linalg.matrix_transpose(difference)  # M
    distances = _distances(embeddings)
    # Mined pairs have distinct embeddings (else d = 0 and the triplet's unit vector
    # is undefined); a zero distance contributes nothing, as autodiff of `group_loss` does.
    scaled = tf.math.divide_no_nan(coefficients, distances)  # M_ij / d_ij
    rows = tf.reduce_sum(scaled, axis=-1, keepdims=True) * embeddings - tf.matmul(
        scaled, embeddings
    )
    return rows / tf.maximum(count, 1.0)[..., None, None], count


def _grouped(tensor: tf.Tensor, users_per_group: int) -> tf.Tensor:
    """[slots, s, ...] -> [groups, users_per_group * s, ...], padding the last group."""
    slots = tf.shape(tensor)[0]
    groups = (slots + users_per_group - 1) // users_per_group
    pad = groups * users_per_group - slots
    padding = tf.concat([[[0, pad]], tf.zeros([tf.rank(tensor) - 1, 2], tf.int32)], axis=0)
    padded = tf.pad(tensor, padding)
    tail = tf.shape(tensor)[2:]
    return tf.reshape(padded, tf.concat([[groups, users_per_group * tf.shape(tensor)[1]], tail], 0))


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
    rows, counts = group_derivatives(
        _grouped(embeddings, users_per_group),
        _grouped(keys, users_per_group),
        _grouped(valid, users_per_group),
        strategy,
        margin,
    )
    shape = tf.shape(embeddings)
    return _ungrouped(rows, shape[0], shape[1]), tf.reduce_sum(counts)
