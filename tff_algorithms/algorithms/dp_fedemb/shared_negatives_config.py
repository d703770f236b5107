"""`train.shared_negatives` (issue 22): the configuration of the shared-negatives
releases and its checks. `job_config.TrainJobConfig.shared_negatives` holds one (None:
off); the server side is `shared_negatives.py`, the releases' accounting
`dplc_releases.py`. No TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from tff_algorithms.base import validation
from tff_algorithms.privacy import accounting_spec, dplc_releases

# How a local head scores a released center (`logit`): as one more head row (the default),
# or with PrivacyFace's cap margin (its Eq. 5 as written, a named comparison mode: it
# cost recall in both benchmarks, BENCHMARKS.md).
CAP_LOGIT = "cap"
ROW_LOGIT = "row"
LOGITS = (CAP_LOGIT, ROW_LOGIT)


@dataclasses.dataclass(frozen=True)
class SharedNegativesConfig:
    """`train.shared_negatives` (issue 22): privately released cluster centers that every
    virtual client adds to its local head as fixed negative rows (never trained, never
    sent back).

    Before every `every_rounds`-th round (0-based rounds 0, R, 2R, ...) the server
    samples `pool_users` training users (a fixed pool size: the DPLC divisor and pool
    are public), computes one class center per sampled user (the mean unit embedding of
    the user's first identity, so one user shapes exactly one row) with the current
    backbone, and releases `num_clusters` noisy cluster means (`dplc.dplc_release`,
    public queries: the previous release's centers, the first time directions drawn from
    the public `seed`) of `cluster_size` members within angle `margin` (radians), with
    Gaussian noise of multiplier `noise_multiplier` relative to the mean's sensitivity.
    Each release is charged in the ledger and the budget as `num_clusters` Gaussian
    mechanisms on every user, without sampling amplification (`dplc_releases`).

    `logit`: how a local head scores a released center p̂ at angle θ from an embedding.
    `row` (default): s·cos θ, one more head row. `cap`: PrivacyFace's consensus-aware
    term as its Eq. 5 writes it (issue 42), s·cos(max(θ − ρ, 0)) with ρ = `margin`, the
    same ρ the release's sensitivity uses; a comparison mode: near s for every sample
    within or near a cap, it swamps the local identities' logits, and the class centers
    collapsed (recall@FAR 1e-2 −0.05 at equal ε and −0.09 without noise in DP-FedEmb,
    −0.09 cross-silo; BENCHMARKS.md, "Shared negatives"). Post-processing of the
    released rows either way: the accounting does not depend on it.

    Defaults: a large cluster (the noise scale is σ·2·sin ρ / T per coordinate) and
    high σ so that a release costs little next to the training (BENCHMARKS.md).
    """

    every_rounds: int = 10
    pool_users: int = 512
    num_clusters: int = 2
    cluster_size: int = 128
    margin: float = 1.0
    noise_multiplier: float = 10.0
    logit: str = ROW_LOGIT

    def __post_init__(self) -> None:
        if self.logit not in LOGITS:
            raise ValueError(
                f"shared_negatives.logit must be one of {', '.join(LOGITS)}, got {self.logit!r}"
            )
        for name in ("every_rounds", "pool_users", "num_clusters", "cluster_size"):
            validation.check_int(f"shared_negatives.{name}", getattr(self, name), 1)
        validation.check_number(
            "shared_negatives.margin", self.margin, 0, math.pi + 1e-12, low_open=True
        )
        validation.check_number(
            "shared_negatives.noise_multiplier",
            self.noise_multiplier,
            0,
            accounting_spec.MAX_NOISE_MULTIPLIER,
            low_open=True,
        )
        if self.cluster_size > self.pool_users:
            raise ValueError(
                f"shared_negatives.cluster_size {self.cluster_size} exceeds pool_users "
                f"{self.pool_users}: a cluster takes its members from the pool"
            )

    @classmethod
    def from_value(cls, value: Any) -> SharedNegativesConfig | None:
        """None, a SharedNegativesConfig, or a mapping of its fields (JSON, YAML, --set)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(
                f"shared_negatives must be a mapping of its fields or null, got {value!r}"[:200]
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names), key=str)
        if unknown:
            raise ValueError(
                f"unknown shared_negatives field {unknown[0]!r} (known: {', '.join(names)})"
            )
        return cls(**{k: v for k, v in value.items() if v is not None})

    @property
    def negative_cap(self) -> float:
        """ρ of the local heads' cap margin (`ClientConfig.shared_negative_cap`): the
        release's margin under `cap`, 0 (plain head-row scoring) under `row`."""
        return float(self.margin) if self.logit == CAP_LOGIT else 0.0

    def release_plan(self) -> dplc_releases.ReleasePlan:
        """The public facts the releases' privacy depends on (imports dp_accounting)."""
        from tff_algorithms.privacy import dplc

        return dplc_releases.ReleasePlan(
            every_rounds=self.every_rounds,
            num_clusters=self.num_clusters,
            noise_multiplier=float(self.noise_multiplier),
            cluster_size=self.cluster_size,
            margin=float(self.margin),
            pool_users=self.pool_users,
            sensitivity=dplc.dplc_sensitivity(
                rho=float(self.margin), cluster_size=self.cluster_size, public_queries=True
            ),
        )

    def check_population(self, num_users: int) -> None:
        """One line when the pool is larger than the `num_users` training users."""
        if self.pool_users > num_users:
            raise ValueError(
                f"shared_negatives.pool_users {self.pool_users} exceeds the "
                f"{num_users} training users"
            )
