"""User-level privacy accounting for DP-FedEmb and DP-FTRL-FedEmb (docs/design.md section 5).

This is the one module that holds the accounting conventions. As in TF Privacy, the
mechanism is described separately from its accounting: an `AccountingSpec` describes a
training schedule, `dp_event_for` turns it into a `dp_accounting` event, and
`compute_privacy` composes that event with an RDP or PLD accountant.

Schedules (paper appendix C):

- ``dpsgd`` (DP-FedEmb, DP-FedAvg): independent Gaussian noise each round.
  * ``uniform`` sampling (a fixed number of users drawn without replacement each round)
    under the substitute-one relation, RDP (dp_accounting's generic bound) or PLD
    (`tff_algorithms.privacy.wor_pld`: the tight dominating pair, proven in docs/privacy.md,
    "Tight accounting of fixed-size sampling"). What training does.
  * ``poisson`` sampling under add-or-remove-one, RDP or PLD. Training does not enforce
    Poisson sampling; this option exists to compare with work that reports it.
  * ``full`` (no sampling: every user in every round, the full-batch steps of
    dp-sgd-centralized and dp-last-layer, issue 42) under substitute-one and the strict
    convention only: each round is the Gaussian mechanism with no amplification, so
    ``rounds`` rounds compose to one Gaussian of noise multiplier
    z / (2·sqrt(rounds)) (sensitivity 2γ, as for uniform sampling: one user's clipped
    update replaced by another's moves the sum by up to 2γ). PLD (exact for a Gaussian
    up to its pessimistic grid) or RDP.
- ``dpftrl`` (DP-FTRL-FedEmb): tree-aggregated noise, users assigned epoch-wise (each
  user at most once per epoch, no amplification), add-or-remove-with-special-element
  relation. ``rounds_per_epoch = floor(population / users_per_round)``.
  * without restart: one tree over all rounds; max participations
    ``ceil(rounds / rounds_per_epoch)`` and a min separation in TF Privacy's sense (rounds
    strictly between two participations of one user; TF Privacy's worst-case sensitivity
    search). The training schedule (`beam_jobs.schedule`, epoch mode) repeats one fixed
    user order every epoch, so consecutive participations are exactly
    ``rounds_per_epoch`` rounds apart: min separation ``rounds_per_epoch - 1``, the
    default here. The paper's DP-FTRL numbers use ``min_separation=rounds_per_epoch``,
    one round more than such a schedule guarantees, which understates epsilon slightly
    (Table 1: rho 1.28 vs 1.36); pass it explicitly only to compare with the paper;
  * with restart every epoch: one `SingleEpochTreeAggregationDpEvent` per epoch.
  Both report zCDP rho and (epsilon, delta). The whole tree release is a Gaussian
  mechanism whose squared L2 sensitivity is the worst-case number of tree nodes a user
  touches (counted with multiplicity), so rho = S / (2 z^2) and PLD is exact for it.

Sensitivity (the ``convention`` switch). z is the noise standard deviation divided by
the clip norm γ of one virtual client's update. dp_accounting's events take a noise
multiplier relative to the L2 sensitivity of the neighbouring relation they are composed
under, so the accountant is given z / (sensitivity / γ). The sensitivity of the noised
sum (the denominator M is fixed, so only the sum moves), per relation and virtual-client
size k:

=============================  ===  =====================  ======================
relation                       k    ``strict`` (default)   ``paper``
=============================  ===  =====================  ======================
substitute-one                 any  2γ: one clipped        γ: the paper's
                                    update replaced by     arithmetic (z passed
                                    another                unchanged)
add-or-remove-one (Poisson)    1    γ: one update added    γ
                                    or removed
add-or-remove-one (Poisson)    >1   2γ: the user's whole   2γ
                                    virtual client's
                                    update can change
add/remove special (trees)     1    γ per tree node        γ per tree node
add/remove special (trees)     >1   2γ per tree node       2γ per tree node
=============================  ===  =====================  ======================

For k > 1 under add-or-remove the bound assumes adding or removing one user changes
only the virtual client that user is in (the schedule groups the sampled users; the
other groups are the same users either way). ``strict`` is the default everywhere:
training, the pipeline, the budget ledger, ``dp-fedemb privacy``, the report. ``paper``
exists only to reproduce published numbers: under substitute-one it understates epsilon
(tests/tff_algorithms/privacy/test_accounting_exact.py shows one round where its epsilon is below the exact
epsilon of a realisable pair of datasets); the same mismatch is
google/differential-privacy issue 378. A budget ledger refuses ``paper`` runs.
Combinations outside the schedules above have no analysis here and raise ValueError, as
does nonsense input.

Bounds (every number the accountant takes; outside them one ValueError line, never an
overflow or an hour-long loop): population 1..`MAX_POPULATION` users, users per round
1..population, rounds 1..`MAX_ROUNDS`, noise multiplier 0..`MAX_NOISE_MULTIPLIER`, delta in
[`MIN_DELTA`, 1), target epsilon in (0, `MAX_TARGET_EPSILON`]. Cost: independent noise and
restarted trees are O(1) in the rounds (one event self-composed); a single tree without
restart uses TF Privacy's exact worst-case search up to `EXACT_TREE_MAX_ROUNDS` rounds
(seconds) and beyond it the closed-form level-wise bound
`tree_sensitivity.tree_sensitivity_bound` (O(log rounds), valid, 8-45% above the exact
value where both were computed).
PLD refuses effective noise multipliers below `MIN_PLD_EVENT_NOISE_MULTIPLIER` (its grid
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
import enum
import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from tff_algorithms.base import validation
from tff_algorithms.privacy import wor_pld
from tff_algorithms.privacy.tree_sensitivity import (
    single_tree_squared_sensitivity,
    tree_depth,
    tree_sensitivity_bound,
)

if TYPE_CHECKING:  # imported where used: dp_accounting and scipy take ~1 s to import
    import dp_accounting


class Mechanism(str, enum.Enum):
    """How noise is added each round."""

    DPSGD = "dpsgd"  # independent Gaussian noise (DP-FedEmb, DP-FedAvg)
    DPFTRL = "dpftrl"  # tree-aggregated noise (DP-FTRL-FedEmb)
    # Logit-DP contrastive steps (issue 26): independent Gaussian noise each step, its
    # multiplier relative to the derived sensitivity C(n, s, B) of the clipped sum
    # (tff_algorithms.algorithms.logit_dp.sensitivity), not to a clip norm.
    LOGIT_DP = "logit_dp"
    # FDML rounds (issue 27, `fdml_privacy`): the noised derivatives then the noised
    # gradient sum, on the same sampled users; the two Gaussians compose to one whose
    # multiplier z (1/z^2 = 1/z_1^2 + 1/z_2^2) is relative to the sensitivities, not a clip.
    FDML = "fdml"


class Sampling(str, enum.Enum):
    """How the users of a round are chosen."""

    UNIFORM = "uniform"  # fixed-size sample without replacement, fresh each round
    POISSON = "poisson"  # each user independently with probability M / N
    EPOCH = "epoch"  # each user at most once per epoch of floor(N / M) rounds
    FULL = "full"  # every user in every round: no sampling, no amplification (M = N)


class NeighboringRelation(str, enum.Enum):
    """Which datasets count as neighbours (user level)."""

    REPLACE_ONE = "replace_one"  # substitute one user
    ADD_OR_REMOVE_ONE = "add_or_remove_one"
    REPLACE_SPECIAL = "replace_special"  # add or remove, with a special element


class Convention(str, enum.Enum):
    """Which sensitivity the noise multiplier is taken relative to (module docstring)."""

    STRICT = "strict"  # the relation's true L2 sensitivity: the default everywhere
    PAPER = "paper"  # the paper's arithmetic, to reproduce published numbers only


class Accountant(str, enum.Enum):
    RDP = "rdp"
    PLD = "pld"


def _dp_accounting_relation(relation: NeighboringRelation) -> dp_accounting.NeighboringRelation:
    """dp_accounting's member of the same name (the two enums name the same relations)."""
    import dp_accounting

    return dp_accounting.NeighboringRelation[relation.name]


# (mechanism, sampling, relation) -> accountants with a valid analysis.
_SUPPORTED = {
    (Mechanism.DPSGD, Sampling.UNIFORM, NeighboringRelation.REPLACE_ONE): (
        Accountant.RDP,
        Accountant.PLD,
    ),
    (Mechanism.DPSGD, Sampling.POISSON, NeighboringRelation.ADD_OR_REMOVE_ONE): (
        Accountant.RDP,
        Accountant.PLD,
    ),
    (Mechanism.DPSGD, Sampling.FULL, NeighboringRelation.REPLACE_ONE): (
        Accountant.RDP,
        Accountant.PLD,
    ),
    (Mechanism.DPFTRL, Sampling.EPOCH, NeighboringRelation.REPLACE_SPECIAL): (
        Accountant.RDP,
        Accountant.PLD,
    ),
    (Mechanism.LOGIT_DP, Sampling.UNIFORM, NeighboringRelation.REPLACE_ONE): (
        Accountant.RDP,
        Accountant.PLD,
    ),
    (Mechanism.FDML, Sampling.UNIFORM, NeighboringRelation.REPLACE_ONE): (
        Accountant.RDP,
        Accountant.PLD,
    ),
}

_DEFAULT_SAMPLING = {
    Mechanism.DPSGD: Sampling.UNIFORM,
    Mechanism.DPFTRL: Sampling.EPOCH,
    Mechanism.LOGIT_DP: Sampling.UNIFORM,
    Mechanism.FDML: Sampling.UNIFORM,
}
# Independent Gaussian noise each round or step, over a sampled set of users.
_SAMPLED_GAUSSIAN = (Mechanism.DPSGD, Mechanism.LOGIT_DP, Mechanism.FDML)
# Mechanisms whose noise multiplier is already relative to the L2 sensitivity.
_RELATIVE_TO_SENSITIVITY = (Mechanism.LOGIT_DP, Mechanism.FDML)
_DEFAULT_RELATION = {
    Sampling.UNIFORM: NeighboringRelation.REPLACE_ONE,
    Sampling.POISSON: NeighboringRelation.ADD_OR_REMOVE_ONE,
    Sampling.EPOCH: NeighboringRelation.REPLACE_SPECIAL,
    Sampling.FULL: NeighboringRelation.REPLACE_ONE,
}

# dp_accounting's DEFAULT_RDP_ORDERS, spelled out so that importing this module (config,
# `--help`) does not import dp_accounting and scipy (~1 s); a test checks they agree.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)

# Documented input ranges (module docstring, "Bounds").
MAX_POPULATION = 10**10
MAX_ROUNDS = 10**9
MAX_NOISE_MULTIPLIER = 1e6
MIN_DELTA = 1e-100
MAX_TARGET_EPSILON = 100.0
# PLD's grid grows as 1/sigma^2: below this Gaussian noise multiplier (per event, after the
# sensitivity rule) it needs minutes and gigabytes; RDP handles any noise.
MIN_PLD_EVENT_NOISE_MULTIPLIER = 0.02
# TF Privacy's exact single-tree search takes seconds up to here (2 cores), minutes at a
# few thousand rounds; beyond it `tree_sensitivity_bound`.
EXACT_TREE_MAX_ROUNDS = 1000
# PLD grid step: epsilon moves by about 1e-5 between 1e-3 and 1e-4 on the paper's
# schedules, at a tenth of the cost; the PLD bound stays pessimistic (an upper bound).
PLD_DISCRETIZATION = 1e-3


def _enum_value(enum_type: type[enum.Enum], value: Any, what: str) -> Any:
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(member.value for member in enum_type)
        raise ValueError(f"unknown {what} {value!r}; expected one of: {choices}") from None


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum:,}, got {value:,}")


@dataclasses.dataclass(frozen=True)
class AccountingSpec:
    """A training schedule and the guarantee it is accounted under.

    `sampling` and `neighboring_relation` default to the paper's convention for the
    mechanism (see the module docstring); explicit values are checked against the
    combinations that have an analysis. `accountant` defaults to `default_accountant`:
    the tight PLD for uniform sampling under the strict convention, RDP otherwise.
    """

    population: int
    users_per_round: int
    rounds: int
    noise_multiplier: float
    delta: float
    mechanism: Mechanism = Mechanism.DPSGD
    users_per_virtual_client: int = 1
    restart_every_epoch: bool = False
    sampling: Sampling | None = None
    neighboring_relation: NeighboringRelation | None = None
    accountant: Accountant | None = None  # None: `default_accountant`
    min_separation: int | None = None
    convention: Convention = Convention.STRICT

    def __post_init__(self) -> None:
        # Frozen: normalise fields through object.__setattr__ so that equal schedules
        # compare equal whether built from enums, strings or JSON.
        mechanism = _enum_value(Mechanism, self.mechanism, "mechanism")
        sampling = (
            _DEFAULT_SAMPLING[mechanism]
            if self.sampling is None
            else _enum_value(Sampling, self.sampling, "sampling")
        )
        relation = (
            _DEFAULT_RELATION[sampling]
            if self.neighboring_relation is None
            else _enum_value(NeighboringRelation, self.neighboring_relation, "relation")
        )
        convention = _enum_value(Convention, self.convention, "accounting convention")
        accountant = (
            default_accountant(mechanism, sampling, relation, convention)
            if self.accountant is None
            else _enum_value(Accountant, self.accountant, "accountant")
        )
        object.__setattr__(self, "convention", convention)
        object.__setattr__(self, "mechanism", mechanism)
        object.__setattr__(self, "sampling", sampling)
        object.__setattr__(self, "neighboring_relation", relation)
        object.__setattr__(self, "accountant", accountant)
        self._validate()
        object.__setattr__(self, "population", int(self.population))
        object.__setattr__(self, "users_per_round", int(self.users_per_round))
        object.__setattr__(self, "rounds", int(self.rounds))
        object.__setattr__(self, "users_per_virtual_client", int(self.users_per_virtual_client))
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        object.__setattr__(self, "delta", float(self.delta))
        object.__setattr__(self, "restart_every_epoch", bool(self.restart_every_epoch))
        if self.min_separation is not None:
            object.__setattr__(self, "min_separation", int(self.min_separation))

    def _validate(self) -> None:
        _check_int("population (users)", self.population, 1, MAX_POPULATION)
        _check_int("users per round", self.users_per_round, 1)
        _check_int("rounds", self.rounds, 1, MAX_ROUNDS)
        _check_int("users per virtual client", self.users_per_virtual_client, 1)
        if self.users_per_round > self.population:
            raise ValueError(
                f"users per round ({self.users_per_round}) exceeds the population "
                f"({self.population})"
            )
        if self.users_per_round % self.users_per_virtual_client:
            raise ValueError(
                f"users per round ({self.users_per_round}) must be a multiple of users per "
                f"virtual client ({self.users_per_virtual_client})"
            )
        validation.check_real("noise multiplier", self.noise_multiplier)
        if not math.isfinite(self.noise_multiplier) or self.noise_multiplier < 0:
            raise ValueError(
                f"noise multiplier must be finite and non-negative, got {self.noise_multiplier}"
            )
        if self.noise_multiplier > MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"noise multiplier must be at most {MAX_NOISE_MULTIPLIER:g}, got "
                f"{self.noise_multiplier:g}"
            )
        validation.check_real("delta", self.delta)
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.delta < MIN_DELTA:
            raise ValueError(f"delta must be at least {MIN_DELTA:g}, got {self.delta:g}")
        if not isinstance(self.restart_every_epoch, (bool, np.bool_)):
            raise ValueError(
                f"restart_every_epoch must be a boolean, got {self.restart_every_epoch!r}"
            )
        if self.min_separation is not None:
            if self.mechanism is not Mechanism.DPFTRL:
                raise ValueError("min separation applies only to the dpftrl mechanism")
            _check_int("min separation", self.min_separation, 0)
            if self.min_separation > self.population // self.users_per_round:
                raise ValueError(
                    f"min separation ({self.min_separation}) cannot exceed the rounds per "
                    f"epoch ({self.population // self.users_per_round}): a user returns "
                    "every epoch"
                )
        if self.restart_every_epoch and self.mechanism is not Mechanism.DPFTRL:
            raise ValueError("tree restart applies only to the dpftrl mechanism")
        if self.mechanism is Mechanism.LOGIT_DP:
            if self.convention is not Convention.STRICT:
                raise ValueError(
                    "the logit_dp mechanism has no paper convention: its noise is calibrated "
                    "to the derived sensitivity C(n, s, B) (the paper's Eq. 6 is below the "
                    "true worst case); use the strict convention"
                )
            if self.users_per_virtual_client != 1:
                raise ValueError(
                    "the logit_dp mechanism samples single users (one positive pair each): "
                    "users per virtual client must be 1"
                )
        if self.sampling is Sampling.FULL:
            if self.users_per_round != self.population:
                raise ValueError(
                    f"full sampling takes every user each round: users per round "
                    f"({self.users_per_round}) must equal the population ({self.population})"
                )
            if self.convention is not Convention.STRICT:
                raise ValueError(
                    "full sampling has no paper convention (no published number to "
                    "reproduce): use the strict convention"
                )
        if self.mechanism is Mechanism.FDML and self.users_per_virtual_client != 1:
            raise ValueError(
                "the fdml mechanism's noise multiplier already counts the triplet group "
                "(sensitivity 2 C_r sqrt(g s)): users per virtual client must be 1"
            )
        combination = (self.mechanism, self.sampling, self.neighboring_relation)
        accountants = _SUPPORTED.get(combination)
        if accountants is None:
            raise ValueError(
                f"no privacy analysis for mechanism {self.mechanism.value} with "
                f"{self.sampling.value} sampling under {self.neighboring_relation.value}; "
                f"supported: {_supported_summary()}"
            )
        if self.accountant not in accountants:
            raise ValueError(
                f"the {self.accountant.value} accountant has no analysis of {self.sampling.value} "
                f"sampling under {self.neighboring_relation.value}; use "
                f"{' or '.join(a.value for a in accountants)}"
            )

    @property
    def sensitivity_in_clips(self) -> float:
        """L2 sensitivity of the noised sum to one user, in clip norms (docstring table).

        logit_dp, fdml: 1, because their noise multiplier is already relative to the
        sensitivity.
        """
        if self.mechanism in _RELATIVE_TO_SENSITIVITY:
            return 1.0
        if self.neighboring_relation is NeighboringRelation.REPLACE_ONE:
            return 1.0 if self.convention is Convention.PAPER else 2.0
        return 2.0 if self.users_per_virtual_client > 1 else 1.0

    @property
    def effective_noise_multiplier(self) -> float:
        """The noise multiplier relative to the relation's sensitivity: what the accountant takes."""
        return self.noise_multiplier / self.sensitivity_in_clips

    @property
    def rounds_per_epoch(self) -> int:
        return self.population // self.users_per_round

    @property
    def tree_min_separation(self) -> int:
        """Rounds strictly between two participations of a user (TF Privacy's convention)."""
        if self.min_separation is not None:
            return self.min_separation
        return self.rounds_per_epoch - 1

    @property
    def max_participations(self) -> int:
        """Most rounds one user can take part in (epoch-wise assignment)."""
        return math.ceil(self.rounds / self.rounds_per_epoch)

    def with_rounds(self, rounds: int) -> AccountingSpec:
        return dataclasses.replace(self, rounds=rounds)

    def with_noise_multiplier(self, noise_multiplier: float) -> AccountingSpec:
        return dataclasses.replace(self, noise_multiplier=noise_multiplier)

    def to_dict(self) -> dict[str, Any]:
        return {
            field.name: (value.value if isinstance(value, enum.Enum) else value)
            for field in dataclasses.fields(self)
            for value in [getattr(self, field.name)]
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AccountingSpec:
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown accounting spec fields: {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:  # a required field is missing
            raise ValueError(f"incomplete accounting spec: {e}") from None


def default_accountant(
    mechanism: Mechanism,
    sampling: Sampling,
    relation: NeighboringRelation,
    convention: Convention,
) -> Accountant:
    """PLD where the tight analysis of fixed-size sampling applies (`wor_pld`: sampled
    Gaussians, uniform sampling, substitute-one, strict convention) and for full
    sampling (the composed Gaussian, exact); RDP elsewhere (the paper convention
    reproduces published RDP numbers; trees and Poisson as before)."""
    if sampling is Sampling.FULL:
        return Accountant.PLD
    if (
        mechanism in _SAMPLED_GAUSSIAN
        and sampling is Sampling.UNIFORM
        and relation is NeighboringRelation.REPLACE_ONE
        and convention is Convention.STRICT
    ):
        return Accountant.PLD
    return Accountant.RDP


def _supported_summary() -> str:
    return "; ".join(
        f"{m.value}+{s.value}+{r.value} ({'/'.join(a.value for a in accountants)})"
        for (m, s, r), accountants in _SUPPORTED.items()
    )


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
    if spec.mechanism is not Mechanism.DPFTRL:
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
    if spec.mechanism in _SAMPLED_GAUSSIAN:
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
    if spec.mechanism in _SAMPLED_GAUSSIAN:
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
        if spec.mechanism is Mechanism.LOGIT_DP:
            what += ", Logit-DP per-pair clipping"
        if spec.mechanism is Mechanism.FDML:
            what += ", FDML derivatives and gradient sum composed per round"
    elif spec.restart_every_epoch:
        what = "tree aggregation restarted every epoch"
    else:
        what = "single-tree aggregation without restart"
    relation = {
        NeighboringRelation.REPLACE_ONE: "substitute-one",
        NeighboringRelation.ADD_OR_REMOVE_ONE: "add-or-remove-one",
        NeighboringRelation.REPLACE_SPECIAL: "add-or-remove with special element",
    }[spec.neighboring_relation]
    if spec.mechanism is Mechanism.LOGIT_DP:
        convention = "strict convention (noise relative to the sensitivity C(n, s, B))"
    elif spec.mechanism is Mechanism.FDML and spec.convention is Convention.STRICT:
        convention = "strict convention (noise relative to 2 C_r sqrt(g s) and 2 C_g)"
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

    if spec.mechanism is Mechanism.FDML and spec.convention is Convention.PAPER:
        # The paper's only privacy figure (Theorem V.1) is per sample and per round, with
        # other parameters (r, T, b): no user-level epsilon to compute.
        raise ValueError(
            "the fdml paper convention is Theorem V.1, per sample and per round, not "
            "user-level (fdml_privacy.paper_theorem_v1_epsilon); use the strict convention"
        )
    z = spec.effective_noise_multiplier
    is_tree = spec.mechanism is Mechanism.DPFTRL
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
