"""The DP-FedEmb family's own settings: the `dp_fedemb` section of a training job
(issue 64, item 4), shared by dp-fedemb, dp-ftrl-fedemb and dp-fedavg, and its checks.
No TensorFlow.

A job record or a pipeline's `train` holds `dp_fedemb: {restart_every_epoch, ...}`;
`TrainJobConfig.settings` holds a `DpFedEmbSettings`, checked only for the family's
jobs. The flat keys of the release before (`restart_every_epoch`, `max_local_steps`,
`max_client_seconds`, `--restart-every-epoch`) are accepted with one deprecation line
(`registry.user_layer`); records holding them resume (`job_config.current_layout`).
The family's other settings (local training, heads, dropouts, the server step) are
still `TrainJobConfig` fields: the benchmark scripts under bench/ set them by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tff_algorithms.algorithms import registry
from tff_algorithms.base import validation
from tff_algorithms.privacy import accounting_spec


@dataclasses.dataclass(frozen=True)
class DpFedEmbSettings:
    """The family's settings (`SECTION`).

    Attributes:
      restart_every_epoch: restart the noise tree every epoch; tree noise only
        (dp-ftrl-fedemb, `check_job`).
      max_local_steps / max_client_seconds: a virtual client needing more local steps
        or wall-clock seconds is a straggler and is dropped (None: no limit).
    """

    restart_every_epoch: bool = False
    max_local_steps: int | None = None
    max_client_seconds: float | None = None

    def __post_init__(self) -> None:
        validation.check_bool("dp_fedemb.restart_every_epoch", self.restart_every_epoch)
        if self.max_local_steps is not None:
            validation.check_int("dp_fedemb.max_local_steps", self.max_local_steps, 1)
        if self.max_client_seconds is not None:
            validation.check_number(
                "dp_fedemb.max_client_seconds", self.max_client_seconds, 0, low_open=True
            )


SECTION = registry.Section(
    name="dp_fedemb",
    settings=DpFedEmbSettings,
    legacy={f.name: f.name for f in dataclasses.fields(DpFedEmbSettings)},
    describe={
        "restart_every_epoch": "dp-ftrl-fedemb: restart the noise tree every epoch",
        "max_local_steps": "local steps after which a virtual client is a dropped straggler",
        "max_client_seconds": "seconds after which a virtual client is a dropped straggler",
    },
)


def check_job(config: Any) -> None:
    """One line when the job's algorithm cannot honour a setting of the section: tree
    restarts need tree noise (the release's noise shape, `registry.Algorithm.noise`)."""
    if config.settings.restart_every_epoch:
        algorithm = registry.get(config.algorithm)
        if algorithm.noise is not accounting_spec.Noise.TREE:
            tree = registry.names(lambda other: other.noise is accounting_spec.Noise.TREE)
            raise ValueError(
                f"dp_fedemb.restart_every_epoch applies only to {' and '.join(tree)}, not "
                f"{config.algorithm}"
            )
