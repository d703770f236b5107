"""User-level privacy accounting for DP-FedEmb and DP-FTRL-FedEmb (docs/design.md section 5).

This is the one module that computes epsilons. As in TF Privacy, the mechanism is
described separately from its accounting: an `AccountingSpec`
(`tff_algorithms.privacy.accounting_spec`: the schedules, the sensitivity conventions
and the input bounds) describes a training schedule, `dp_event_for` turns it into a
`dp_accounting` event by its mechanism's `Release` (its noise: sampled Gaussians or a
tree), and `compute_privacy` composes that event with an RDP or PLD accountant. An
algorithm that builds the event of its own release (FDML) has it accounted by
`event_rdp_epsilon`, the same RDP accountant.

Cost: independent noise and restarted trees are O(1) in the rounds (one event
self-composed); a single tree without restart uses TF Privacy's exact worst-case search
up to `EXACT_TREE_MAX_ROUNDS` rounds (seconds) and beyond it the closed-form level-wise
bound `tree_sensitivity.tree_sensitivity_bound` (O(log rounds), valid, 8-45% above the
exact value where both were computed). PLD refuses effective noise multipliers below `MIN_PLD_EVENT_NOISE_MULTIPLIER` (its grid
would need gigabytes). Calibrating the noise to a target epsilon and extrapolating a
schedule to other populations are in `tff_algorithms.privacy.calibration`.

Paper epsilons reproduced to two decimals under ``convention="paper"``
(tests/tff_algorithms/privacy/test_accounting.py checks each; DP-FTRL's are the same under both conventions):

- Table 1 (10M users, 131,072 = 64 x 2048 users per round, 800 rounds, delta 1e-7):
  DP-FedAvg z = 0.015 x 64 -> 5.62; DP-FedEmb z = 0.02 x 64 -> 3.90;
  DP-FTRL-FedEmb z = 0.26 x 64 with 32 users per virtual client (no restart) -> 9.67,
  zCDP 1.28 under the paper's min separation of 76 rounds (our schedule's 75 gives 1.36).
- Section 3.4, DigiFace 98.96K users, 128 virtual clients x 64 users per round, z = 1.39,
  delta 1e-5 -> 24.86 (the paper does not state the rounds there; 800, its default, is
  the count that gives 24.86).
- Section 3.4, iNat 9275 users, 32 virtual clients x 4 users per round, 400 rounds,
  z = 0.5 -> 16.06 (the paper does not state delta there; 1e-4 gives 16.06).

Not reproduced: the EMNIST value in appendix D.6 (6800 users, 32 x 8 users per round,
200 rounds, z = 0.62, delta 1e-4, epsilon 9.28). Under the paper's own convention the
accountant gives 15.33. Poisson add-or-remove with PLD gives 9.27 and with RDP 10.89, so
the 9.28 most likely comes from the add-or-remove accounting of an earlier draft (the
paper's footnote 1), computed with an older PLD implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from tff_algorithms.privacy import wor_pld
from tff_algorithms.privacy.accounting_spec import (
    Accountant,
    AccountingSpec,
    Convention,
    NeighboringRelation,
    Noise,
    Sampling,
)
from tff_algorithms.privacy.tree_sensitivity import (
    single_tree_squared_sensitivity,
    tree_depth,
    tree_sensitivity_bound,
)

if TYPE_CHECKING:  # imported where used: dp_accounting and scipy take ~1 s to import
    import dp_accounting


def _dp_accounting_relation(relation: NeighboringRelation) -> dp_accounting.NeighboringRelation:
    """dp_accounting's member of the same name (the two enums name the same relations)."""
    import dp_accounting

    return dp_accounting.NeighboringRelation[relation.name]


# dp_accounting's DEFAULT_RDP_ORDERS, spelled out so that importing this module (config,
# `--help`) does not import dp_accounting and scipy (~1 s); a test checks they agree.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)
# PLD's grid grows as 1/sigma^2: below this Gaussian noise multiplier (per event, after the
# sensitivity rule) it needs minutes and gigabytes; RDP handles any noise.
MIN_PLD_EVENT_NOISE_MULTIPLIER = 0.02
# TF Privacy's exact single-tree search takes seconds up to here (2 cores), minutes at a
# few thousand rounds; beyond it `tree_sensitivity_bound`.
EXACT_TREE_MAX_ROUNDS = 1000
# PLD grid step: epsilon moves by about 1e-5 between 1e-3 and 1e-4 on the paper's
# schedules, at a tenth of the cost; the PLD bound stays pessimistic (an upper bound).
PLD_DISCRETIZATION = 1e-3


@dataclasses.dataclass(frozen=True)
class PrivacyResult:
    """(epsilon, delta) of a schedule, with zCDP rho for tree aggregation."""

    epsilon: float
    delta: float
    zcdp_rho: float | None
    accountant: Accountant
    rdp_order: float | None  # the order that gave epsilon (RDP only)
    effective_noise_multiplier: float
    analysis: str  # one line naming the analysis, for reports
    convention: Convention
    neighboring_relation: NeighboringRelation
    sensitivity_in_clips: float
    # RDP's epsilon of the same schedule beside a PLD epsilon, a labelled cross-check
    # (`compute_privacy(..., rdp_cross_check=True)`); None when not asked or RDP already.
    epsilon_rdp: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: infinite values (no noise) become None."""

        def finite_or_none(value: float | None) -> float | None:
            return value if value is not None and math.isfinite(value) else None

        return {
            "epsilon": finite_or_none(self.epsilon),
            "delta": self.delta,
            "zcdp_rho": finite_or_none(self.zcdp_rho),
            "accountant": self.accountant.value,
            "rdp_order": self.rdp_order,
            "effective_noise_multiplier": self.effective_noise_multiplier,
            "analysis": self.analysis,
            "convention": self.convention.value,
            "neighboring_relation": self.neighboring_relation.value,
            "sensitivity_in_clips": self.sensitivity_in_clips,
            "epsilon_rdp": finite_or_none(self.epsilon_rdp),
        }


def _epoch_step_counts(spec: AccountingSpec) -> list[int]:
    full_epochs, last = divmod(spec.rounds, spec.rounds_per_epoch)
    return [spec.rounds_per_epoch] * full_epochs + ([last] if last else [])


def tree_squared_sensitivity(spec: AccountingSpec) -> float:
    """Squared L2 sensitivity S of a DP-FTRL schedule's whole tree release (per unit clip)."""
    if spec.release.noise is not Noise.TREE:
        raise ValueError("tree sensitivity is defined only for the dpftrl mechanism")
    if spec.restart_every_epoch:
        return float(sum(tree_depth(steps) for steps in _epoch_step_counts(spec)))
    shape = (spec.rounds, spec.max_participations, spec.tree_min_separation)
    if spec.rounds > EXACT_TREE_MAX_ROUNDS:
        return tree_sensitivity_bound(*shape)
    return single_tree_squared_sensitivity(*shape)


def dp_event_for(spec: AccountingSpec) -> dp_accounting.DpEvent:
    """The dp_accounting event of the whole schedule (before the noise-zero shortcut)."""
    import dp_accounting

    z = spec.effective_noise_multiplier
    if spec.release.noise is Noise.GAUSSIAN:
        gaussian = dp_accounting.GaussianDpEvent(z)
        if spec.sampling is Sampling.FULL:  # no sampling: the Gaussian itself each round
            return dp_accounting.SelfComposedDpEvent(gaussian, spec.rounds)
        if spec.sampling is Sampling.UNIFORM:
            round_event = dp_accounting.SampledWithoutReplacementDpEvent(
                source_dataset_size=spec.population,
                sample_size=spec.users_per_round,
                event=gaussian,
            )
        else:
            round_event = dp_accounting.PoissonSampledDpEvent(
                sampling_probability=spec.users_per_round / spec.population, event=gaussian
            )
        return dp_accounting.SelfComposedDpEvent(round_event, spec.rounds)
    if spec.restart_every_epoch:
        # One record at most once per tree, so one single-epoch event per epoch.
        full_epochs, last = divmod(spec.rounds, spec.rounds_per_epoch)
        events: list[dp_accounting.DpEvent] = []
        if full_epochs:
            events.append(
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.SingleEpochTreeAggregationDpEvent(z, spec.rounds_per_epoch),
                    full_epochs,
                )
            )
        if last:
            events.append(dp_accounting.SingleEpochTreeAggregationDpEvent(z, last))
        return dp_accounting.ComposedDpEvent(events)
    # One tree without restart: a Gaussian mechanism of sensitivity sqrt(S).
    return dp_accounting.GaussianDpEvent(z / math.sqrt(tree_squared_sensitivity(spec)))


def _rdp_curve_of(event: dp_accounting.DpEvent, relation: NeighboringRelation) -> np.ndarray:
    from dp_accounting.rdp import rdp_privacy_accountant

    rdp_accountant = rdp_privacy_accountant.RdpAccountant(
        orders=RDP_ORDERS, neighboring_relation=_dp_accounting_relation(relation)
    )
    rdp_accountant.compose(event)
    return rdp_accountant.rdp


def event_rdp_epsilon(
    event: dp_accounting.DpEvent,
    delta: float,
    relation: NeighboringRelation = NeighboringRelation.REPLACE_ONE,
) -> float:
    """Epsilon at `delta` of any dp_accounting event, under the RDP accountant at
    `RDP_ORDERS`: how a release whose algorithm builds its own event is accounted (FDML's
    two Gaussians a round, `algorithms/fdml/privacy.py`)."""
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(
        list(RDP_ORDERS), _dp_accounting_relation(relation)
    )
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


# Sampled-Gaussian RDP is the costly part (a fraction of a second per round event);
# events are frozen attrs classes, hence hashable.
@functools.lru_cache(maxsize=512)
def _cached_round_rdp_curve(
    event: dp_accounting.DpEvent, relation: NeighboringRelation
) -> tuple[float, ...]:
    return tuple(_rdp_curve_of(event, relation))


def rdp_curve(spec: AccountingSpec) -> np.ndarray:
    """RDP of the schedule at `RDP_ORDERS`.

    A schedule of T identical rounds costs T times one round, computed as the RDP
    accountant does (count * per-round RDP) but with the per-round curve cached, so the
    ledger can ask for every round cheaply and get identical numbers each time.
    """
    import dp_accounting

    event = dp_event_for(spec)
    relation = spec.neighboring_relation
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return event.count * np.asarray(_cached_round_rdp_curve(event.event, relation))
    return _rdp_curve_of(event, relation)


def _analysis_name(spec: AccountingSpec) -> str:
    release = spec.release
    if release.noise is Noise.GAUSSIAN:
        sampling = {
            Sampling.UNIFORM: "uniform sampling without replacement",
            Sampling.POISSON: "Poisson sampling",
        }.get(spec.sampling)
        what = (
            f"sampled Gaussian ({sampling})"
            if sampling
            else "Gaussian composed over the rounds (every user each round, no amplification)"
        )
        if spec.sampling is Sampling.UNIFORM and spec.accountant is Accountant.PLD:
            what += ", symmetric dominating pair (tight)"
        what += release.analysis_note
    elif spec.restart_every_epoch:
        what = "tree aggregation restarted every epoch"
    else:
        what = "single-tree aggregation without restart"
    relation = {
        NeighboringRelation.REPLACE_ONE: "substitute-one",
        NeighboringRelation.ADD_OR_REMOVE_ONE: "add-or-remove-one",
        NeighboringRelation.REPLACE_SPECIAL: "add-or-remove with special element",
    }[spec.neighboring_relation]
    if release.sensitivity_note is not None and spec.convention is Convention.STRICT:
        convention = f"strict convention ({release.sensitivity_note})"
    elif spec.convention is Convention.STRICT:
        convention = f"strict convention (sensitivity {spec.sensitivity_in_clips:g} x clip)"
    else:
        convention = "PAPER CONVENTION (comparison only: understates substitute-one epsilon)"
    return f"{spec.accountant.value.upper()}, {what}, {relation}, {convention}"


def compute_privacy(spec: AccountingSpec, *, rdp_cross_check: bool = False) -> PrivacyResult:
    """(epsilon, delta) of `spec`; for dpftrl also its zCDP rho.

    `rdp_cross_check`: with the PLD accountant, also the RDP accountant's epsilon of the same
    schedule (`epsilon_rdp`), for reports; it costs an RDP computation (cached per round).
    """
    result = _compute_privacy(spec)
    if rdp_cross_check and spec.accountant is Accountant.PLD:
        rdp = _compute_privacy(dataclasses.replace(spec, accountant=Accountant.RDP))
        return dataclasses.replace(result, epsilon_rdp=rdp.epsilon)
    return result


def uniform_pld(
    spec: AccountingSpec,
) -> dp_accounting.pld.privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD (dp_accounting `PrivacyLossDistribution`) of a uniform-sampling PLD spec
    with noise, for composing with other events (`dplc_releases`, `budget`)."""
    if not (spec.accountant is Accountant.PLD and spec.sampling is Sampling.UNIFORM):
        raise ValueError("uniform_pld needs a uniform-sampling spec under the PLD accountant")
    _check_pld_noise(spec.effective_noise_multiplier)
    return wor_pld.composed(
        spec.users_per_round / spec.population,
        spec.effective_noise_multiplier,
        spec.rounds,
        PLD_DISCRETIZATION,
    )


def _check_pld_noise(event_noise: float) -> None:
    if event_noise < MIN_PLD_EVENT_NOISE_MULTIPLIER:
        raise ValueError(
            f"the PLD accountant needs an effective noise multiplier of at least "
            f"{MIN_PLD_EVENT_NOISE_MULTIPLIER:g}, this schedule has {event_noise:.3g}; "
            "use the RDP accountant"
        )


def _compute_privacy(spec: AccountingSpec) -> PrivacyResult:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    if spec.release.paper_figure is not None and spec.convention is Convention.PAPER:
        # The paper's figure is of another kind (FDML's Theorem V.1: per sample and per
        # round, other parameters): no user-level epsilon to compute.
        raise ValueError(spec.release.paper_figure)
    z = spec.effective_noise_multiplier
    is_tree = spec.release.noise is Noise.TREE
    if z == 0:  # no noise: no guarantee
        return PrivacyResult(
            epsilon=math.inf,
            delta=spec.delta,
            zcdp_rho=math.inf if is_tree else None,
            accountant=spec.accountant,
            rdp_order=None,
            effective_noise_multiplier=z,
            analysis=_analysis_name(spec),
            **_convention_fields(spec),
        )
    zcdp_rho = tree_squared_sensitivity(spec) / (2 * z**2) if is_tree else None
    if spec.accountant is Accountant.RDP:
        epsilon, order = rdp_privacy_accountant.compute_epsilon(
            RDP_ORDERS, rdp_curve(spec), spec.delta
        )
        rdp_order: float | None = float(order)
    else:
        if spec.sampling is Sampling.UNIFORM:
            return PrivacyResult(
                epsilon=float(uniform_pld(spec).get_epsilon_for_delta(spec.delta)),
                delta=spec.delta,
                zcdp_rho=None,
                accountant=spec.accountant,
                rdp_order=None,
                effective_noise_multiplier=z,
                analysis=_analysis_name(spec),
                **_convention_fields(spec),
            )
        pld_accountant = pld_privacy_accountant.PLDAccountant(
            neighboring_relation=_dp_accounting_relation(spec.neighboring_relation),
            value_discretization_interval=PLD_DISCRETIZATION,
        )
        event = dp_event_for(spec)
        if is_tree:
            # PLD has no tree event; the whole release is Gaussian with sensitivity sqrt(S).
            event = dp_accounting.GaussianDpEvent(1 / math.sqrt(2 * zcdp_rho))
        if is_tree:
            _check_pld_noise(event.noise_multiplier)
        elif spec.sampling is Sampling.FULL:  # the rounds compose to one narrower Gaussian
            _check_pld_noise(z / math.sqrt(spec.rounds))
        else:
            _check_pld_noise(z)
        pld_accountant.compose(event)
        epsilon, rdp_order = pld_accountant.get_epsilon(spec.delta), None
    return PrivacyResult(
        epsilon=float(epsilon),
        delta=spec.delta,
        zcdp_rho=zcdp_rho,
        accountant=spec.accountant,
        rdp_order=rdp_order,
        effective_noise_multiplier=z,
        analysis=_analysis_name(spec),
        **_convention_fields(spec),
    )


def _convention_fields(spec: AccountingSpec) -> dict[str, Any]:
    return {
        "convention": spec.convention,
        "neighboring_relation": spec.neighboring_relation,
        "sensitivity_in_clips": spec.sensitivity_in_clips,
    }
