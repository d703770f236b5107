"""Server side of shared negatives (issue 22, item 2): class centers -> DPLC -> broadcast.

Before a release round (`dplc_releases.ReleasePlan.is_release_round`) the training
program calls `CenterReleaser.release` with the current backbone and puts the result in
the client work's state (`with_shared_negatives`), which the server broadcasts to every
virtual client of the round (`client_work`); clients use the rows as fixed negatives.

What a release reads and how it is protected:

- The pool: `pool_users` training users drawn without replacement by a generator seeded
  with the job's public `seed` and the release index. The draw is public (no sampling
  amplification is claimed, `dplc_releases`), so it needs no secret seed, and a
  resumed run draws the same pool.
- One class center per pool user: the mean unit embedding, under the current backbone,
  of the images of the user's first identity (sorted by name). A user shapes exactly one
  row (m = 1 in dplc.py's sensitivity) and the pool size n = pool_users is public.
- The queries are public (dplc.py's "public" mode, the only one whose sensitivity
  shrinks with the cluster size): the previous release's centers (already released and
  accounted), or, for the first release, directions drawn from the public seed.
- `dplc.dplc_release` with exactly T members per query and clipping onto the cap; the
  noisy means are normalised (post-processing) and broadcast.
- Noise: a fresh OS-entropy seed per release, unless the job's testing noise seed is
  fixed (tests and benchmarks). A crash between a release and the round's checkpoint
  repeats the release with fresh noise; the lost one reached only that round's virtual
  clients, whose outputs were never saved or published.

The released rows live in the server state and its checkpoints; they never enter the
model weights, so the export (the backbone) never holds them.
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from beam_jobs import partition
from tff_algorithms.algorithms.dp_fedemb.shared_negatives_config import SharedNegativesConfig
from tff_algorithms.config import model_config
from tff_algorithms.modeling import export, models
from tff_algorithms.privacy import dplc

STATE_KEY = "shared_negatives"
_EMBED_BATCH = 256
# Seed-sequence tags that keep the release's generators apart.
_POOL_TAG, _QUERY_TAG, _NOISE_TAG = 1, 2, 3


def shared_negatives_of(state: Any) -> np.ndarray:
    """The released rows in a process state (zeros before the first release)."""
    return np.asarray(state.client_work[STATE_KEY])


def with_shared_negatives(state: Any, rows: np.ndarray) -> Any:
    """The process state with the client work's broadcast rows replaced by `rows`."""
    current = shared_negatives_of(state)
    rows = np.asarray(rows, np.float32)
    if rows.shape != current.shape:
        raise ValueError(f"shared negatives of shape {rows.shape}, the state holds {current.shape}")
    work = collections.OrderedDict(state.client_work)
    work[STATE_KEY] = rows
    return state._replace(client_work=work)


class CenterReleaser:
    """Computes a release's class centers with a backbone and runs DPLC on them."""

    def __init__(
        self,
        config: SharedNegativesConfig,
        backbone_config: model_config.BackboneConfig,
        reader: partition.PartitionReader,
        user_ids: Sequence[str],
        *,
        public_seed: int,
        noise_seed: int | None,
        max_examples_per_user: int = 2048,
    ) -> None:
        if config.pool_users > len(user_ids):
            raise ValueError(
                f"shared_negatives.pool_users {config.pool_users} exceeds the "
                f"{len(user_ids)} training users"
            )
        self.config = config
        self._backbone_config = backbone_config
        self._backbone = models.build_backbone(backbone_config)
        self._reader = reader
        self._user_ids = list(user_ids)
        self._public_seed = public_seed
        self._noise_seed = noise_seed
        self._max_examples = max_examples_per_user

    def pool(self, release_index: int) -> list[str]:
        """The users whose centers enter release `release_index` (public draw)."""
        rng = np.random.default_rng([self._public_seed, _POOL_TAG, release_index])
        chosen = rng.choice(len(self._user_ids), self.config.pool_users, replace=False)
        return [self._user_ids[i] for i in sorted(chosen)]

    def class_centers(
        self, backbone: tff.learning.models.ModelWeights, users: Sequence[str]
    ) -> np.ndarray:
        """[len(users), d]: each user's first identity's mean unit embedding, unit norm."""
        models.assign_backbone_weights(self._backbone, backbone)
        images: list[bytes] = []
        owner: list[int] = []
        for index, user in enumerate(users):
            records = self._reader.user_records(user)
            identity = min(r.identity for r in records)
            chosen = [r.image for r in records if r.identity == identity][: self._max_examples]
            images.extend(chosen)
            owner.extend([index] * len(chosen))
        shape = self._backbone_config.image_shape
        batches = (
            tf.data.Dataset.from_tensor_slices(tf.constant(images, tf.string))
            .map(lambda encoded: export.decode_image(encoded, shape))
            .batch(_EMBED_BATCH)
        )
        embeddings = np.concatenate(
            [models.embed(self._backbone, batch).numpy() for batch in batches]
        ).astype(np.float64)
        sums = np.zeros((len(users), embeddings.shape[1]))
        np.add.at(sums, np.asarray(owner), embeddings)
        norms = np.linalg.norm(sums, axis=1, keepdims=True)
        # A user whose images all embed to opposite directions has no direction; any
        # unit row is as valid an input to DPLC (it normalises and clips rows anyway).
        sums[norms[:, 0] < 1e-12, 0] = 1.0
        return sums / np.maximum(norms, 1e-12)

    def _queries(self, release_index: int, previous: np.ndarray | None) -> np.ndarray:
        q, d = self.config.num_clusters, self._backbone_config.embedding_size
        if previous is not None and np.all(np.linalg.norm(previous, axis=1) > 0):
            return np.asarray(previous, np.float64)  # already released and accounted
        rng = np.random.default_rng([self._public_seed, _QUERY_TAG, release_index])
        return rng.standard_normal((q, d))

    def release(
        self,
        release_index: int,
        backbone: tff.learning.models.ModelWeights,
        previous: np.ndarray | None = None,
    ) -> np.ndarray:
        """The noisy, normalised cluster centers of release `release_index`, [Q, d]."""
        config = self.config
        centers = self.class_centers(backbone, self.pool(release_index))
        seed: int | list[int] = (
            secrets.randbits(128)
            if self._noise_seed is None
            else [self._noise_seed, _NOISE_TAG, release_index]
        )
        noisy = dplc.dplc_release(
            centers,
            rho=float(config.margin),
            cluster_size=config.cluster_size,
            noise_multiplier=float(config.noise_multiplier),
            seed=seed,
            queries=self._queries(release_index, previous),
        )
        norms = np.linalg.norm(noisy, axis=1, keepdims=True)
        return (noisy / np.maximum(norms, 1e-12)).astype(np.float32)
