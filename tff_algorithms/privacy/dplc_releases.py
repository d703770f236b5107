"""Accounting of the shared-negatives releases (issue 22, item 2): DPLC events in the ledger.

With `train.shared_negatives` the server releases, before rounds 0, R, 2R, ... (0-based),
Q noisy cluster centers (`dplc.dplc_release`, public queries) of class centers computed
from a sample of training users with the current backbone. Each release is a user-level
Gaussian mechanism on the same users as the training: Q Gaussian mechanisms of noise
multiplier σ relative to their full substitute-one L2 sensitivity (`dplc.dplc_dp_event`).

Composition (strict convention): RDP curves add. The training's curve is
`accounting.rdp_curve(spec)` (under the spec's relation: substitute-one for DP-FedEmb,
add/remove with a special element for DP-FTRL-FedEmb); a release's curve is Q·α/(2σ²) at
every order α. A Gaussian's RDP is the same under both relations (a special-element
replacement is one substitution, and the release's Δ is the same for both: dplc.py), so
the sum is a valid bound under the training's relation. For DP-FTRL the zCDP ρ adds too:
a release adds Q/(2σ²).

Sampling: the users whose centers enter a release are a sample of the training users,
but NO amplification by that sampling is claimed: every release is charged as a full
Gaussian on every user. That is the safe choice: the sample need not be secret, the
pool is drawn by a public seed, and a user whose data shapes a center is covered by the
release's full event.

Releases by round: a release happens before 0-based round i when i % R == 0, so after
r completed rounds ceil(r / R) releases have been made (`releases_after`). The ledger's
epsilon after round r is a function of (spec, plan, r) alone, like the training's, so a
resumed run records the numbers of an uninterrupted one.

Under the PLD accountant (the default for uniform sampling, `accounting_spec.default_accountant`)
the training's PLD (`accounting.uniform_pld`) composes with the releases' PLD instead: all
of them together are one Gaussian of multiplier σ / sqrt(Q · releases), whose PLD
(dp_accounting's, pessimistic, the same grid) is exact for it under either relation. The
paper's arithmetic is refused (one ValueError line), and so is PLD for schedules other
than uniform sampling. No TensorFlow; dp_accounting is imported
only when something is computed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tff_algorithms.base import validation
from tff_algorithms.privacy import accounting, accounting_spec

if TYPE_CHECKING:  # imported where used: dp_accounting and scipy take ~1 s to import
    import dp_accounting


@dataclasses.dataclass(frozen=True)
class ReleasePlan:
    """The public facts of a run's DPLC releases that its privacy depends on.

    Attributes:
      every_rounds: R, a release before every R-th round (0-based rounds 0, R, 2R, ...).
      num_clusters: Q, noisy centers per release (one Gaussian mechanism each).
      noise_multiplier: σ, relative to the release's L2 sensitivity (dplc.py).
      cluster_size / margin / pool_users: T, ρ and the fixed pool size n of the release
        (they set the sensitivity, hence the noise scale, not the epsilon).
      sensitivity: Δ of one cluster mean (`dplc.dplc_sensitivity`, public queries, m = 1).
    """

    every_rounds: int
    num_clusters: int
    noise_multiplier: float
    cluster_size: int
    margin: float
    pool_users: int
    sensitivity: float

    def __post_init__(self) -> None:
        for name in ("every_rounds", "num_clusters", "cluster_size", "pool_users"):
            validation.check_int(f"shared_negatives.{name}", getattr(self, name), 1)
        validation.check_number(
            "shared_negatives.noise_multiplier", self.noise_multiplier, 0, low_open=False
        )
        validation.check_number(
            "shared_negatives.margin", self.margin, 0, math.pi + 1e-12, low_open=True
        )
        validation.check_number("shared_negatives.sensitivity", self.sensitivity, 0, low_open=True)
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        object.__setattr__(self, "margin", float(self.margin))
        object.__setattr__(self, "sensitivity", float(self.sensitivity))

    def releases_after(self, rounds: int) -> int:
        """Releases made once `rounds` rounds have completed: ceil(rounds / R)."""
        return -(-int(rounds) // self.every_rounds)

    def is_release_round(self, round_num: int) -> bool:
        """Whether a release precedes 0-based round `round_num`."""
        return round_num % self.every_rounds == 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReleasePlan:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, Mapping) or set(data) != names:
            raise ValueError(f"corrupt shared-negatives release plan: {data!r}"[:200])
        return cls(**data)


def _check_composable(spec: accounting_spec.AccountingSpec) -> None:
    if spec.convention is not accounting_spec.Convention.STRICT:
        raise ValueError(
            "shared negatives are accounted under the strict convention only, not the paper's"
        )
    if spec.accountant is accounting_spec.Accountant.PLD and spec.sampling is not (
        accounting_spec.Sampling.UNIFORM
    ):
        raise ValueError(
            "shared negatives compose with the training under PLD for uniform sampling only; "
            "use the RDP accountant"
        )


def release_pld(
    plan: ReleasePlan, releases: int
) -> dp_accounting.pld.privacy_loss_distribution.PrivacyLossDistribution:
    """PLD of `releases` releases (at least one, with noise): one Gaussian of multiplier
    σ / sqrt(Q · releases), on `accounting.PLD_DISCRETIZATION`'s grid."""
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_gaussian_mechanism(
        plan.noise_multiplier / math.sqrt(plan.num_clusters * releases),
        value_discretization_interval=accounting.PLD_DISCRETIZATION,
    )


def release_rdp_curve(plan: ReleasePlan, releases: int) -> np.ndarray:
    """RDP at `accounting.RDP_ORDERS` of `releases` releases (0 for none; inf without noise)."""
    if releases == 0:
        return np.zeros(len(accounting.RDP_ORDERS))
    if plan.noise_multiplier == 0:
        return np.full(len(accounting.RDP_ORDERS), math.inf)
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    from tff_algorithms.privacy import dplc

    rdp = rdp_privacy_accountant.RdpAccountant(orders=list(accounting.RDP_ORDERS))
    rdp.compose(
        dp_accounting.SelfComposedDpEvent(
            dplc.dplc_dp_event(plan.noise_multiplier, plan.num_clusters), releases
        )
    )
    return np.asarray(rdp.rdp)


def release_zcdp_rho(plan: ReleasePlan, releases: int) -> float:
    """zCDP ρ of `releases` releases: Q/(2σ²) each."""
    if releases == 0:
        return 0.0
    if plan.noise_multiplier == 0:
        return math.inf
    return releases * plan.num_clusters / (2.0 * plan.noise_multiplier**2)


def composed_privacy(
    spec: accounting_spec.AccountingSpec, plan: ReleasePlan | None, rounds: int | None = None
) -> accounting.PrivacyResult:
    """The training of `spec` over `rounds` (default: spec.rounds) and the releases made
    by then, composed (module docstring). With `plan` None: `accounting.compute_privacy`."""
    rounds = spec.rounds if rounds is None else rounds
    training = accounting.compute_privacy(spec.with_rounds(rounds))
    if plan is None:
        return training
    _check_composable(spec)
    from dp_accounting.rdp import rdp_privacy_accountant

    releases = plan.releases_after(rounds)
    analysis = (
        f"{training.analysis}; composed ({spec.accountant.value.upper()}) with {releases} "
        f"DPLC release(s) of "
        f"{plan.num_clusters} Gaussian cluster center(s), noise multiplier "
        f"{plan.noise_multiplier:g}, no sampling amplification"
    )
    rho = None
    if training.zcdp_rho is not None:
        rho = training.zcdp_rho + release_zcdp_rho(plan, releases)
    if math.isinf(training.epsilon) or (releases and plan.noise_multiplier == 0):
        return dataclasses.replace(
            training, epsilon=math.inf, zcdp_rho=rho, rdp_order=None, analysis=analysis
        )
    if spec.accountant is accounting_spec.Accountant.PLD:
        pld = accounting.uniform_pld(spec.with_rounds(rounds))
        if releases:
            pld = pld.compose(release_pld(plan, releases))
        return dataclasses.replace(
            training, epsilon=float(pld.get_epsilon_for_delta(spec.delta)), analysis=analysis
        )
    curve = accounting.rdp_curve(spec.with_rounds(rounds)) + release_rdp_curve(plan, releases)
    epsilon, order = rdp_privacy_accountant.compute_epsilon(
        accounting.RDP_ORDERS, curve, spec.delta
    )
    return dataclasses.replace(
        training, epsilon=float(epsilon), zcdp_rho=rho, rdp_order=float(order), analysis=analysis
    )


def releases_epsilon(plan: ReleasePlan, rounds: int, delta: float) -> float:
    """Epsilon of the releases alone after `rounds` rounds (for reports)."""
    releases = plan.releases_after(rounds)
    if releases == 0:
        return 0.0
    curve = release_rdp_curve(plan, releases)
    if not np.all(np.isfinite(curve)):
        return math.inf
    from dp_accounting.rdp import rdp_privacy_accountant

    epsilon, _ = rdp_privacy_accountant.compute_epsilon(accounting.RDP_ORDERS, curve, delta)
    return float(epsilon)
