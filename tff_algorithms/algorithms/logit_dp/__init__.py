"""Logit-DP (issue 26; `registry.Algorithm`): centralized contrastive training of the
backbone under user-level DP. Each step samples `virtual_clients_per_round` single users
(n) by DP-FedEmb's schedule, one positive pair each; per-pair logit gradients clipped
to `clip_norm` (B), noise `noise_multiplier`·C(n, s, B) (`sensitivity`). Its
own field is `logit_scale` (s). The pipeline runs it as private pretraining
(`pretrain.source: private_contrastive`), so `dp-fedemb train --algorithm logit-dp`
starts from that recipe (`recipes.private_contrastive_values`). The trainer is
`training.train_logit_dp`. No TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from beam_jobs import schedule
from tff_algorithms.algorithms import registry, rules
from tff_algorithms.algorithms.logit_dp.sensitivity import MAX_SCALE, check_logit_dp_config
from tff_algorithms.base import validation
from tff_algorithms.config import recipes
from tff_algorithms.privacy import accounting


def _contrastive_values(values: Mapping[str, Any]) -> dict[str, Any]:
    return recipes.private_contrastive_values(values, {})


def _check_logit_scale(config: Any) -> None:
    validation.check_number("logit_scale", config.logit_scale, 0, MAX_SCALE, low_open=True)


def _check_logit_dp_job(config: Any) -> None:
    if config.users_per_virtual_client != 1:
        raise ValueError(
            "logit-dp samples single users, one positive pair each: set "
            f"users_per_virtual_client to 1 (got {config.users_per_virtual_client})"
        )
    for name in ("over_selection", "failure_injection_rate"):
        if getattr(config, name):
            raise ValueError(f"{name} applies to federated rounds, not to logit-dp: set it to 0")
    if config.virtual_clients_per_round != schedule.AUTO:
        try:
            check_logit_dp_config(
                config.virtual_clients_per_round,
                float(config.logit_scale),
                float(config.clip_norm),
            )
        except ValueError as e:
            raise ValueError(
                f"logit-dp with {config.virtual_clients_per_round} users a step "
                f"(virtual_clients_per_round): {str(e).rstrip('.')}"
            ) from None


LOGIT_DP = registry.register(
    registry.Algorithm(
        name="logit-dp",
        summary="private contrastive training: --virtual-clients-per-round users a step, one "
        "positive pair each; takes the private contrastive recipe over --recipe",
        private=True,
        trainer="tff_algorithms.algorithms.logit_dp.training:train_logit_dp",
        accounting_rule=rules.scheduled_accounting,
        mechanism=accounting.Mechanism.LOGIT_DP,
        start_values=_contrastive_values,
        fields=("logit_scale",),
        check_fields=_check_logit_scale,
        check_job=_check_logit_dp_job,
        check_round_fill=rules.check_schedule_fills,
        rounds_are="Logit-DP steps (one positive pair per sampled user)",
    )
)
