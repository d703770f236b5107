"""Local training of one virtual client: the head loss and the client's hyperparameters.
No TensorFlow at import (`client_work` builds the client work from these)."""

from __future__ import annotations

import dataclasses
import math

SOFTMAX = "softmax"
COSFACE = "cosface"
ARCFACE = "arcface"
HEAD_LOSSES = (SOFTMAX, COSFACE, ARCFACE)
HEAD_INIT_RANDOM = "random"
HEAD_INIT_CLASS_MEANS = "class_means"
HEAD_INITS = (HEAD_INIT_RANDOM, HEAD_INIT_CLASS_MEANS)


@dataclasses.dataclass(frozen=True)
class HeadLossConfig:
    """The loss on head logits.

    `softmax`: cross-entropy on <ω_j, f(x)>. `cosface`: s·(cos θ_j − m·[j = y]).
    `arcface`: s·cos(θ_y + m) for the true row, s·cos θ_j for the others. The
    margins use unit-norm embeddings and unit-norm head rows.
    """

    loss: str = SOFTMAX
    scale: float = 30.0
    margin: float = 0.35

    def __post_init__(self) -> None:
        if self.loss not in HEAD_LOSSES:
            raise ValueError(f"loss must be one of {HEAD_LOSSES}, got {self.loss!r}")
        if self.loss != SOFTMAX and (self.scale <= 0 or not 0 <= self.margin < math.pi / 2):
            raise ValueError(f"margin losses need scale > 0 and 0 <= margin < pi/2, got {self}")


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Local training of one virtual client (paper section 3.3 defaults in brackets).

    Attributes:
      client_learning_rate: β1, the backbone's learning rate [2e-3].
      head_learning_rate_scale: β2 / β1 [100].
      momentum: client SGD momentum, for backbone and head [0.9 in the paper].
      head_capacity: rows of the local head; at least the most identities any
        virtual client holds (DP-FedEmb only).
      local_epochs: passes over the virtual client's data.
      batch_size: local batch size [32].
      max_examples: cap on examples per virtual client [2048].
      shuffle_buffer: local shuffle buffer [2048].
      head_loss: loss on the head logits.
      head_seed: base seed of the local heads' initialisation.
      head_init: how a local head starts: `random` (Glorot uniform from the stateless
        seed, the paper's choice) or `class_means` (each row the mean unit embedding of
        its identity under the received backbone, scaled to `class_means_norm`; one
        extra forward pass over the client's data; DP-FedEmb only).
      class_means_norm: norm of a `class_means` row, i.e. the logit scale of a perfectly
        aligned unit embedding.
      max_local_steps: a virtual client that needs more local steps than this is a
        straggler and is dropped (None: no limit).
      max_seconds: wall-clock budget of one virtual client's local training; a client
        over it is dropped (None: no limit). Not deterministic: prefer
        `max_local_steps` where runs must be reproducible.
      failure_injection_rate: fraction of virtual clients whose read is made to fail
        (deterministic per virtual-client id); for tests and benchmarks only.
      shared_negative_rows: Q, the broadcast shared-negative rows (issue 22) each local
        head appends as fixed negatives; 0: none (the client state has no such field).
      shared_negative_cap: ρ, the cap angle (radians, [0, π]) of the shared negatives'
        logits (issue 42): a released center p̂ at angle θ from the embedding scores
        s·cos(max(θ − ρ, 0)), PrivacyFace's consensus-aware term, so every embedding
        within ρ of p̂ gets the full logit s. 0 scores p̂ as one more head row, s·cos θ.
        The job sets it to the DPLC release's margin under `shared_negatives.logit: cap`.
    """

    client_learning_rate: float
    head_learning_rate_scale: float = 100.0
    momentum: float = 0.0
    head_capacity: int = 64
    local_epochs: int = 1
    batch_size: int = 32
    max_examples: int = 2048
    shuffle_buffer: int = 2048
    head_loss: HeadLossConfig = HeadLossConfig()
    head_seed: int = 0
    head_init: str = HEAD_INIT_RANDOM
    class_means_norm: float = 8.0
    max_local_steps: int | None = None
    max_seconds: float | None = None
    failure_injection_rate: float = 0.0
    shared_negative_rows: int = 0
    shared_negative_cap: float = 0.0

    def __post_init__(self) -> None:
        for name in ("client_learning_rate", "head_learning_rate_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        for name in (
            "head_capacity",
            "local_epochs",
            "batch_size",
            "max_examples",
            "shuffle_buffer",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.head_init not in HEAD_INITS:
            raise ValueError(f"head_init must be one of {HEAD_INITS}, got {self.head_init!r}")
        if not self.class_means_norm > 0:
            raise ValueError(f"class_means_norm must be positive, got {self.class_means_norm}")
        if self.max_local_steps is not None and self.max_local_steps < 1:
            raise ValueError(f"max_local_steps must be >= 1, got {self.max_local_steps}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be positive, got {self.max_seconds}")
        if self.shared_negative_rows < 0:
            raise ValueError(f"shared_negative_rows must be >= 0, got {self.shared_negative_rows}")
        if not 0 <= self.shared_negative_cap <= math.pi:
            raise ValueError(
                f"shared_negative_cap must be in [0, pi] radians, got {self.shared_negative_cap}"
            )
        if not 0 <= self.failure_injection_rate <= 1:
            raise ValueError(
                f"failure_injection_rate must be in [0, 1], got {self.failure_injection_rate}"
            )

    @property
    def head_learning_rate(self) -> float:
        return self.client_learning_rate * self.head_learning_rate_scale
