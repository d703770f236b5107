"""One FDML process's configuration: `FdmlConfig` and its checks, and the Case B strategies.

The round that this configures (the two federated computations and the server's step
between them) is `protocol`; a job's `fdml` settings map onto it in
`training.fdml_config`.
"""

from __future__ import annotations

import dataclasses
import math

from tff_algorithms.algorithms.fdml import triplet
from tff_algorithms.base import validation

UC = "uc"  # unconditionally continue with the gradients that arrive
AS = "as"  # abandon the round on any Case B failure
CASE_B_STRATEGIES = (UC, AS)


@dataclasses.dataclass(frozen=True)
class FdmlConfig:
    """One FDML training configuration.

    Attributes:
      samples_per_user: s, rows each participant uploads per round.
      users_per_round: n, buffer slots (Alg. 3's num_required; Eq. 2's denominator / s).
      users_per_group: g, participants per triplet group (`triplet`); None: all n (the
        paper's single buffer, and a derivative sensitivity growing with sqrt(n s)).
      strategy: `triplet.BATCH_ALL` or `triplet.SEMI_HARD`.
      margin: the triplet margin m.
      row_clip: C_r, L2 clip of each derivative row; None: no clipping (non-private).
      derivative_noise_multiplier: z_d; the derivative noise std is z_d * C_r.
      gradient_clip: C_g, L2 clip of each participant's gradient; None: no clipping.
      gradient_noise_multiplier: z_g; the aggregate's noise std is z_g * C_g.
      embedding_drop_rate: r of Alg. 2 (no privacy credit is taken for it).
      response_rate: rate_p of Alg. 3.
      case_b_strategy: `UC` or `AS`.
      server_learning_rate: Adam's learning rate (the paper: 1e-4).
      noise_seed: seed of the noise and of the embedding drop; production callers pass
        `loop_schedule.job_noise_seed`. It lives in the server state: keep checkpoints
        as private as the data.
    """

    samples_per_user: int
    users_per_round: int
    users_per_group: int | None = None
    strategy: str = triplet.BATCH_ALL
    margin: float = 0.2
    row_clip: float | None = None
    derivative_noise_multiplier: float = 0.0
    gradient_clip: float | None = None
    gradient_noise_multiplier: float = 0.0
    embedding_drop_rate: float = 0.0
    response_rate: float = 1.0
    case_b_strategy: str = UC
    server_learning_rate: float = 1e-4
    noise_seed: int = 0

    def __post_init__(self) -> None:
        validation.check_int("samples_per_user", self.samples_per_user, 1)
        validation.check_int("users_per_round", self.users_per_round, 1)
        if self.users_per_group is not None:
            validation.check_int("users_per_group", self.users_per_group, 1)
        triplet.check_strategy(self.strategy)
        if self.case_b_strategy not in CASE_B_STRATEGIES:
            raise ValueError(
                f"case_b_strategy must be one of {CASE_B_STRATEGIES}, got {self.case_b_strategy!r}"
            )
        for name in ("margin", "derivative_noise_multiplier", "gradient_noise_multiplier"):
            value = getattr(self, name)
            validation.check_real(name, value)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        for name in ("row_clip", "gradient_clip"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive or None, got {value}")
        # Noise scales with the clip: noise without a clip has no sensitivity to refer to.
        if self.derivative_noise_multiplier > 0 and self.row_clip is None:
            raise ValueError("derivative_noise_multiplier > 0 needs a row_clip")
        if self.gradient_noise_multiplier > 0 and self.gradient_clip is None:
            raise ValueError("gradient_noise_multiplier > 0 needs a gradient_clip")
        if not 0 <= self.embedding_drop_rate < 1:
            raise ValueError(
                f"embedding_drop_rate must be in [0, 1), got {self.embedding_drop_rate}"
            )
        if not 0 < self.response_rate <= 1:
            raise ValueError(f"response_rate must be in (0, 1], got {self.response_rate}")
        if not (math.isfinite(self.server_learning_rate) and self.server_learning_rate > 0):
            raise ValueError(f"server_learning_rate must be > 0, got {self.server_learning_rate}")

    @property
    def group_size(self) -> int:
        """Participants per triplet group (a group never exceeds the buffer)."""
        if self.users_per_group is None:
            return self.users_per_round
        return min(self.users_per_group, self.users_per_round)

    @property
    def gradients_needed(self) -> int:
        """Alg. 3, line 9: gradients collected before aggregating (rate_p * n, rounded up)."""
        return max(1, math.ceil(self.response_rate * self.users_per_round - 1e-9))
