"""The accounting spec: a training schedule and the guarantee it is accounted under.

`AccountingSpec` with its enums (mechanism, sampling, neighbouring relation, sensitivity
convention, accountant), each mechanism's `Release` (its noise, the combinations that
have an analysis, what it refuses, how reports name it), the input bounds and their
checks, and `default_accountant`. A spec's epsilon is computed by
`tff_algorithms.privacy.accounting` (docs/design.md section 5); this module imports
neither dp_accounting nor scipy, so the config and the command line check a schedule
cheaply.

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
[`MIN_DELTA`, 1), target epsilon in (0, `MAX_TARGET_EPSILON`].
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from tff_algorithms.base import validation


class Mechanism(str, enum.Enum):
    """A release's name in accounting specs and ledgers (its value is what they store).

    What each one is, its noise, analyses, refusals and report wording, is its `Release`
    in `RELEASES`; nothing else tests which one a spec names.
    """

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


class Noise(str, enum.Enum):
    """The shape of a mechanism's noise: what decides its dp_accounting event
    (`accounting.dp_event_for`)."""

    GAUSSIAN = "gaussian"  # independent Gaussian noise each round, on the round's users
    TREE = "tree"  # tree-aggregated Gaussian noise (DP-FTRL)


_BOTH = (Accountant.RDP, Accountant.PLD)


@dataclasses.dataclass(frozen=True)
class Release:
    """What the accountant and the reports know of one mechanism's release, declared
    once here so that no module tests which mechanism (or algorithm) it serves.

    Attributes:
      noise: its noise's shape, which decides its event (`accounting.dp_event_for`).
      analyses: (sampling, relation) -> the accountants with a valid analysis of it;
        the first entry's sampling is the default.
      relative_to_sensitivity: its noise multiplier is already relative to the L2
        sensitivity its algorithm derives, not to a clip norm (sensitivity 1).
      strict_only: why it has no paper convention, refused with the spec; None: it has one.
      paper_figure: why the accountant refuses its paper convention (the paper states a
        figure of another kind, `registry.Algorithm.paper_theorem`); None: accounted.
      single_users: why users per virtual client must be 1; None: any.
      analysis_note: appended to the analysis line of a report.
      sensitivity_note: the strict convention's sensitivity on that line, for a
        multiplier relative to the sensitivity; None: `sensitivity_in_clips` x clip.
      label: how a report names its noise; stage: a private run of it in a model's
        composition; step: what one of its rounds is called.
    """

    noise: Noise
    analyses: Mapping[tuple[Sampling, NeighboringRelation], tuple[Accountant, ...]]
    label: str
    stage: str
    relative_to_sensitivity: bool = False
    strict_only: str | None = None
    paper_figure: str | None = None
    single_users: str | None = None
    analysis_note: str = ""
    sensitivity_note: str | None = None
    step: str = "rounds"

    @property
    def default_sampling(self) -> Sampling:
        return next(iter(self.analyses))[0]


_UNIFORM_SUBSTITUTE_ONE = {(Sampling.UNIFORM, NeighboringRelation.REPLACE_ONE): _BOTH}
RELEASES: Mapping[Mechanism, Release] = {
    Mechanism.DPSGD: Release(
        Noise.GAUSSIAN,
        {
            (Sampling.UNIFORM, NeighboringRelation.REPLACE_ONE): _BOTH,
            (Sampling.POISSON, NeighboringRelation.ADD_OR_REMOVE_ONE): _BOTH,
            (Sampling.FULL, NeighboringRelation.REPLACE_ONE): _BOTH,
        },
        label="Gaussian noise added independently every round",
        stage="private training",
    ),
    Mechanism.DPFTRL: Release(
        Noise.TREE,
        {(Sampling.EPOCH, NeighboringRelation.REPLACE_SPECIAL): _BOTH},
        label="tree-aggregated Gaussian noise (DP-FTRL)",
        stage="private training (DP-FTRL)",
    ),
    Mechanism.LOGIT_DP: Release(
        Noise.GAUSSIAN,
        _UNIFORM_SUBSTITUTE_ONE,
        label="Logit-DP: per-pair clipped contrastive gradient, Gaussian noise every step",
        stage="Logit-DP contrastive pretraining",
        relative_to_sensitivity=True,
        strict_only=(
            "the logit_dp mechanism has no paper convention: its noise is calibrated "
            "to the derived sensitivity C(n, s, B) (the paper's Eq. 6 is below the "
            "true worst case); use the strict convention"
        ),
        single_users=(
            "the logit_dp mechanism samples single users (one positive pair each): "
            "users per virtual client must be 1"
        ),
        analysis_note=", Logit-DP per-pair clipping",
        sensitivity_note="noise relative to the sensitivity C(n, s, B)",
        step="steps",
    ),
    Mechanism.FDML: Release(
        Noise.GAUSSIAN,
        _UNIFORM_SUBSTITUTE_ONE,
        label=(
            "FDML: Gaussian noise on the triplet derivatives and on the gradient sum every round"
        ),
        stage="private training (FDML)",
        relative_to_sensitivity=True,
        paper_figure=(
            "the fdml paper convention is Theorem V.1, per sample and per round, not "
            "user-level (fdml_privacy.paper_theorem_v1_epsilon); use the strict convention"
        ),
        single_users=(
            "the fdml mechanism's noise multiplier already counts the triplet group "
            "(sensitivity 2 C_r sqrt(g s)): users per virtual client must be 1"
        ),
        analysis_note=", FDML derivatives and gradient sum composed per round",
        sensitivity_note="noise relative to 2 C_r sqrt(g s) and 2 C_g",
    ),
}


def release_of(mechanism: Any) -> Release | None:
    """The `Release` of a mechanism (a member or its value), or None for an unknown one."""
    try:
        return RELEASES[Mechanism(mechanism)]
    except ValueError:
        return None


_DEFAULT_RELATION = {
    Sampling.UNIFORM: NeighboringRelation.REPLACE_ONE,
    Sampling.POISSON: NeighboringRelation.ADD_OR_REMOVE_ONE,
    Sampling.EPOCH: NeighboringRelation.REPLACE_SPECIAL,
    Sampling.FULL: NeighboringRelation.REPLACE_ONE,
}


# Documented input ranges (module docstring, "Bounds").
MAX_POPULATION = 10**10
MAX_ROUNDS = 10**9
MAX_NOISE_MULTIPLIER = 1e6
MIN_DELTA = 1e-100
MAX_TARGET_EPSILON = 100.0


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
            RELEASES[mechanism].default_sampling
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

    @property
    def release(self) -> Release:
        """What is known of its mechanism's release (`RELEASES`)."""
        return RELEASES[self.mechanism]

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
            if self.release.noise is not Noise.TREE:
                raise ValueError("min separation applies only to the dpftrl mechanism")
            _check_int("min separation", self.min_separation, 0)
            if self.min_separation > self.population // self.users_per_round:
                raise ValueError(
                    f"min separation ({self.min_separation}) cannot exceed the rounds per "
                    f"epoch ({self.population // self.users_per_round}): a user returns "
                    "every epoch"
                )
        if self.restart_every_epoch and self.release.noise is not Noise.TREE:
            raise ValueError("tree restart applies only to the dpftrl mechanism")
        release = self.release
        if release.strict_only is not None and self.convention is not Convention.STRICT:
            raise ValueError(release.strict_only)
        if release.single_users is not None and self.users_per_virtual_client != 1:
            raise ValueError(release.single_users)
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
        accountants = release.analyses.get((self.sampling, self.neighboring_relation))
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

        1 for a release whose noise multiplier is already relative to the sensitivity
        (`Release.relative_to_sensitivity`: logit_dp, fdml).
        """
        if self.release.relative_to_sensitivity:
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
        RELEASES[mechanism].noise is Noise.GAUSSIAN
        and sampling is Sampling.UNIFORM
        and relation is NeighboringRelation.REPLACE_ONE
        and convention is Convention.STRICT
    ):
        return Accountant.PLD
    return Accountant.RDP


def _supported_summary() -> str:
    return "; ".join(
        f"{m.value}+{s.value}+{r.value} ({'/'.join(a.value for a in accountants)})"
        for m, release in RELEASES.items()
        for (s, r), accountants in release.analyses.items()
    )
