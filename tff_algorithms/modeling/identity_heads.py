"""Identity heads: identity keys and labels, the head's logits (softmax, CosFace, ArcFace,
with fixed shared negatives) and its loss, shared by every algorithm that trains a head
over the embeddings (DP-FedEmb's local heads, DP-FedAvg's and the oracle's global head,
user-level DP-SGD, FDML's monitoring).

Identities become int64 keys (the integer itself, or a 62-bit hash of the string); a
global head's rows are the sorted keys of all training identities
(`identity_keys_vocabulary`), and `labels_in_vocabulary` maps keys to rows. Rows at or
beyond `num_active_rows` are masked out of the softmax.

Shared negatives (issue 22): `head_logits` appends one logit per released cluster center
([Q, d]) after the head's rows: fixed negatives (no label points at them), built from
constants, so no gradient reaches them. All-zero rows (nothing released yet) are masked.
Each center's logit has PrivacyFace's cap margin (issue 42): with θ the angle between the
embedding and the center and ρ the cap, the cosine becomes cos(max(θ − ρ, 0)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tff_algorithms.config.client_config import COSFACE, SOFTMAX, HeadLossConfig

KEY_BUCKETS = 2**62
# Logit for masked head rows: exp() underflows to exactly 0 without producing NaNs.
MASKED_LOGIT = -1e9


def identity_keys(identity: tf.Tensor) -> tf.Tensor:
    """int64 keys of identities: integers as they are, strings as 62-bit hashes."""
    if identity.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(identity, KEY_BUCKETS)
    return tf.cast(identity, tf.int64)


def identity_keys_vocabulary(identities: Sequence[str] | Sequence[int]) -> np.ndarray:
    """Sorted distinct int64 keys of all training identities (the global head's rows)."""
    keys = identity_keys(tf.constant(list(identities))).numpy()
    vocabulary = np.unique(keys)
    if len(vocabulary) != len(set(identities)):
        raise ValueError("identity hashes collide; rename identities or use integer ids")
    return vocabulary


def training_identity_vocabulary(reader: Any, user_ids: Sequence[str]) -> np.ndarray:
    """`identity_keys_vocabulary` of every identity the training users hold, read from a
    `beam_jobs.partition.PartitionReader`: the global head of DP-FedAvg, the oracle and
    user-level DP-SGD has one row per training identity (O(training data), once)."""
    return identity_keys_vocabulary(
        sorted({record.identity for user in user_ids for record in reader.user_records(user)})
    )


def labels_in_vocabulary(
    keys: tf.Tensor, vocabulary: tf.Tensor, num_rows: int
) -> tuple[tf.Tensor, tf.Tensor]:
    """(row index, usable) of each key in a sorted vocabulary; unusable = unknown or row >= num_rows."""
    index = tf.searchsorted(vocabulary, keys, side="left", out_type=tf.int32)
    safe_index = tf.minimum(index, tf.maximum(tf.size(vocabulary) - 1, 0))
    known = tf.logical_and(
        index < tf.size(vocabulary), tf.equal(tf.gather(vocabulary, safe_index), keys)
    )
    usable = tf.logical_and(known, index < num_rows)
    return tf.where(usable, index, 0), usable


def head_logits(
    embeddings: tf.Tensor,
    kernel: tf.Tensor,
    labels: tf.Tensor,
    loss_config: HeadLossConfig,
    num_active_rows: tf.Tensor | int | None = None,
    negatives: tf.Tensor | None = None,
    negative_cap: float = 0.0,
) -> tf.Tensor:
    """Logits [B, rows (+ Q)] of the head loss; rows >= `num_active_rows` are masked out.

    `negatives` [Q, d]: fixed negative rows appended after the head's columns (module
    docstring), never a label. Under the margin losses a negative at angle θ from the
    embedding scores s·cos(max(θ − ρ, 0)), ρ = `negative_cap` (PrivacyFace's μ; ρ = 0:
    s·cos θ, a unit head row). Softmax has no scale s: there the same capped cosine is
    multiplied by the embedding's norm and the mean active head row's norm (ρ = 0: the
    logit of a row that long), so the negatives compete with the local identities on
    the same scale.
    """
    if loss_config.loss == SOFTMAX:
        logits = tf.matmul(embeddings, kernel)
    else:
        cosine = tf.matmul(
            tf.math.l2_normalize(embeddings, axis=1), tf.math.l2_normalize(kernel, axis=0)
        )
        is_label = tf.one_hot(labels, tf.shape(kernel)[1], dtype=cosine.dtype) > 0
        margin = loss_config.margin
        if loss_config.loss == COSFACE:
            target = cosine - margin
        else:
            # cos(θ + m) is only decreasing in θ up to π − m; beyond that use the
            # CosFace-like linear continuation so the target logit stays monotonic.
            sine = tf.sqrt(tf.maximum(1.0 - tf.square(cosine), 0.0))
            shifted = cosine * math.cos(margin) - sine * math.sin(margin)
            target = tf.where(
                cosine > math.cos(math.pi - margin),
                shifted,
                cosine - math.sin(math.pi - margin) * margin,
            )
        logits = loss_config.scale * tf.where(is_label, target, cosine)
    if num_active_rows is not None:
        active = tf.range(tf.shape(kernel)[1]) < tf.cast(num_active_rows, tf.int32)
        logits = tf.where(active[tf.newaxis, :], logits, MASKED_LOGIT)
    if negatives is None:
        return logits
    return tf.concat(
        [
            logits,
            _negative_logits(
                embeddings, kernel, loss_config, num_active_rows, negatives, negative_cap
            ),
        ],
        axis=1,
    )


def _negative_logits(
    embeddings: tf.Tensor,
    kernel: tf.Tensor,
    loss_config: HeadLossConfig,
    num_active_rows: tf.Tensor | int | None,
    negatives: tf.Tensor,
    negative_cap: float,
) -> tf.Tensor:
    # The released centers are inputs, not weights: stop_gradient makes that explicit
    # even when a caller passes a variable.
    negatives = tf.stop_gradient(tf.cast(negatives, embeddings.dtype))
    present = tf.reduce_sum(tf.square(negatives), axis=1) > 0
    directions = tf.math.l2_normalize(negatives, axis=1)
    cosine = tf.matmul(tf.math.l2_normalize(embeddings, axis=1), directions, transpose_b=True)
    if negative_cap > 0:
        cosine = _cap_margin_cosine(cosine, negative_cap)
    if loss_config.loss == SOFTMAX:
        norms = tf.norm(kernel, axis=0)
        if num_active_rows is not None:
            active = tf.range(tf.shape(kernel)[1]) < tf.cast(num_active_rows, tf.int32)
            norms = tf.boolean_mask(norms, active)
        # Scale only: the head's rows get no gradient through their negatives' length.
        length = tf.stop_gradient(tf.reduce_mean(norms))
        logits = cosine * tf.norm(embeddings, axis=1, keepdims=True) * length
    else:
        logits = loss_config.scale * cosine
    return tf.where(present[tf.newaxis, :], logits, MASKED_LOGIT)


def _cap_margin_cosine(cosine: tf.Tensor, cap: float) -> tf.Tensor:
    """cos(max(θ − cap, 0)) of cos θ, θ in [0, π]: 1 inside the cap, else
    cos θ·cos(cap) + sin θ·sin(cap)."""
    outside = cosine < math.cos(cap)
    # The sine only of cosines outside the cap (double where): at cos θ = 1, inside the
    # cap, the untaken branch's gradient would otherwise be 0·∞ = NaN. The floor keeps it
    # finite at cos θ = −1 (value off by at most 1e-6·sin(cap) there).
    safe = tf.where(outside, cosine, tf.zeros_like(cosine))
    sine = tf.sqrt(tf.maximum(1.0 - tf.square(safe), 1e-12))
    return tf.where(outside, safe * math.cos(cap) + sine * math.sin(cap), tf.ones_like(cosine))


def head_loss(logits: tf.Tensor, labels: tf.Tensor, example_mask: tf.Tensor) -> tf.Tensor:
    """Mean cross-entropy over the examples where `example_mask` is true (0 if none)."""
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    weights = tf.cast(example_mask, per_example.dtype)
    return tf.reduce_sum(per_example * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)


def zero_if_not_finite(structure: object) -> tuple[object, tf.Tensor]:
    """(structure, 0) if all finite, else (zeros of the same structure, 1)."""
    flat = tf.nest.flatten(structure)
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in flat])
    zeroed = [tf.where(finite, t, tf.zeros_like(t)) for t in flat]
    return tf.nest.pack_sequence_as(structure, zeroed), tf.cast(tf.logical_not(finite), tf.int32)
