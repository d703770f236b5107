"""Logit-DP (issue 26; `registry.Algorithm`): centralized contrastive training of the
backbone under user-level DP. Each step samples `logit_dp.users_per_step` single users
(n) by DP-FedEmb's schedule, one positive pair each; per-pair logit gradients clipped
to `clip_norm` (B), noise `noise_multiplier`·C(n, s, B) (`sensitivity`). Its
own settings are the `logit_dp` section (`SECTION`: users_per_step, scale s). The pipeline runs it as private pretraining
(`pretrain.source: private_contrastive`), so `dp-fedemb train --algorithm logit-dp`
starts from that recipe (`recipes.private_contrastive_values`). The trainer is
`training.train_logit_dp`. No TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from beam_jobs import schedule
from tff_algorithms.algorithms import registry, rules
from tff_algorithms.algorithms.logit_dp.sensitivity import MAX_SCALE, check_logit_dp_config
from tff_algorithms.base import validation
from tff_algorithms.config import model_config, recipes
from tff_algorithms.privacy import accounting_spec


@dataclasses.dataclass(frozen=True)
class LogitDpSettings:
    """logit-dp's settings beside its users per step (`SECTION`).

    Attributes:
      scale: s, the scale of its cosine logits (1/temperature); the sensitivity
        C(n, s, B) grows with it (`logit_dp_sensitivity`).
      optimizer, adam_beta1, adam_beta2, adam_epsilon, weight_decay: what applies the
        noised mean gradient (issue 42; `model_config.check_optimizer_settings`):
        momentum SGD (`server_momentum`), Adam or LAMB; post-processing.
    """

    scale: float = 1.0
    optimizer: str = model_config.SGD
    adam_beta1: float = model_config.ADAM_KEYS["adam_beta1"]
    adam_beta2: float = model_config.ADAM_KEYS["adam_beta2"]
    adam_epsilon: float = model_config.ADAM_KEYS["adam_epsilon"]
    weight_decay: float = model_config.ADAM_KEYS["weight_decay"]

    def __post_init__(self) -> None:
        validation.check_number("logit_dp.scale", self.scale, 0, MAX_SCALE, low_open=True)
        model_config.check_optimizer_settings("logit_dp", self)


SECTION = registry.Section(
    name="logit_dp",
    settings=LogitDpSettings,
    # A step samples single users by the shared schedule (`rules`).
    shape={"users_per_step": "virtual_clients_per_round"},
    implied={"users_per_virtual_client": 1},
    legacy={"virtual_clients_per_round": "users_per_step", "logit_scale": "scale"},
    describe={
        "users_per_step": "users a step, one positive pair each (n; or auto: the most the "
        "users fill)",
        "scale": "scale s of its cosine logits (1/temperature)",
        **model_config.OPTIMIZER_DESCRIBE,
    },
)


def _contrastive_values(values: Mapping[str, Any]) -> dict[str, Any]:
    return recipes.private_contrastive_values(values, {})


def _check_logit_dp_job(config: Any) -> None:
    if config.users_per_virtual_client != 1:
        raise ValueError(
            "logit-dp samples single users, one positive pair each: set "
            f"users_per_virtual_client to 1 (got {config.users_per_virtual_client})"
        )
    for name in ("over_selection", "failure_injection_rate"):
        if getattr(config, name):
            raise ValueError(f"{name} applies to federated rounds, not to logit-dp: set it to 0")
    model_config.check_optimizer_momentum("logit_dp", config.settings, config.server_momentum)
    if config.virtual_clients_per_round != schedule.AUTO:
        try:
            check_logit_dp_config(
                config.virtual_clients_per_round,
                float(config.settings.scale),
                float(config.clip_norm),
            )
        except ValueError as e:
            raise ValueError(
                f"logit-dp with {config.virtual_clients_per_round} users a step "
                f"(logit_dp.users_per_step): {str(e).rstrip('.')}"
            ) from None


LOGIT_DP = registry.register(
    registry.Algorithm(
        name="logit-dp",
        summary="private contrastive training: --logit-dp-users-per-step users a step, one "
        "positive pair each; takes the private contrastive recipe over --recipe",
        private=True,
        trainer="tff_algorithms.algorithms.logit_dp.training:train_logit_dp",
        accounting_rule=rules.scheduled_accounting,
        mechanism=accounting_spec.Mechanism.LOGIT_DP,
        start_values=_contrastive_values,
        section=SECTION,
        check_job=_check_logit_dp_job,
        check_round_fill=rules.check_schedule_fills,
        rounds_are="Logit-DP steps (one positive pair per sampled user)",
    )
)
