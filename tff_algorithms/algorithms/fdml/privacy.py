"""FDML's threat model, the sensitivities of its two releases, and its user-level accounting.

No TensorFlow at import; dp_accounting is imported where something is computed.

Threat model
------------
Parties and what each sees (`fdml.FdmlProcess` implements the round):

- The server is trusted: it stands for the paper's SGX enclave (section V-A). It sees the
  uploaded embeddings and identity keys, the raw derivatives, each participant's clipped
  gradient, the noise, and all measurements. Nothing it holds is released except what is
  listed below. Its per-round loss and triplet counts are computed on training users
  without privacy: monitoring only, never to be released.
- A participant (possibly malicious, possibly colluding with other participants) sees
  (a) the model broadcast each round, and (b) its own rows of the noised derivatives.
  A coalition sees its members' rows; the analysis treats the whole noised derivative
  buffer of a round as released, which covers any coalition.
- Anyone sees the released model (the final weights, and every broadcast model).
- Nobody outside the server learns who else was selected in a round, which users fill
  the buffer or which fail (as for DP-FedEmb, the sampling amplification below needs it);
  a participant learns only that it was selected itself.

Releases per round, and why the aggregate is a post-processing:

- R1, derivatives: D~ = clip_rows(D, C_r) + N(0, (z_d C_r)^2 I) over every row of the
  buffer (`fdml.privatize_derivatives`): each derivative row is clipped to L2 norm C_r.
- R2, aggregate: S~ = sum_v clip(g_v, C_g) + N(0, (z_g C_g)^2 I), then divided by the
  planned number of participants (Eq. 2 with equal |d_i| = s) and applied by Adam.
  g_v = J_v(theta, x_v)^T D~_v is participant v's backpropagation of its own noised rows
  through its own forward pass. Given R1's output and the (public) broadcast theta, g_v is
  a function of v's data alone. Every broadcast model is a post-processing of earlier
  R2 outputs.

So a round is the adaptive composition of two Gaussian mechanisms, R1 then R2 given R1.

Neighbouring relation and sensitivities (user level, substitute-one)
--------------------------------------------------------------------
Datasets D, D' differ in one user u, replaced by u' (docs/design.md section 5, strict). The
schedule (who is selected, in which slot, who fails) is independent of the data, so in a
round where u is selected u' takes u's slot, with the same s sample positions; every other
slot holds the same rows.

R1. `triplet` mines triplets only inside a group of `users_per_group` = g consecutive
slots, and normalises by a count inside the group. Row j's derivative is a function of
the rows of j's group only. So replacing u changes at most the rows of u's group: g*s
rows (u's own s rows included; padded rows are zero on both sides). Each changed row is
clipped to norm <= C_r in D and in D', so it moves by at most 2 C_r, and

    Delta_1 = sqrt(g s (2 C_r)^2) = 2 C_r sqrt(g s).

Every row of the group can really move: replacing u changes the group's active-triplet
count, which scales every row of the group, and u's rows can be positives, negatives or
(semi-hard) the chosen negative of any anchor of the group; tests/tff_algorithms/algorithms/fdml/test_fdml_privacy.py's
neighbour search (an independent numpy FDML) reaches 0.997 of Delta_1 (batch-all, g = 2,
s = 2), so the bound is tight. With g equal to all
participants (the paper's single buffer) Delta_1 grows as sqrt(participants * s): this
is the price of cross-user triplets, and why g is a parameter. The noise std z_d C_r
gives dp_accounting's Gaussian (which is relative to the L2 sensitivity) the noise
multiplier z_d / (2 sqrt(g s)).

R2. Given R1's output y, every g_v with v != u is the same function of (theta, y, x_v) in
D and D'; only u's term changes, and both clip(g_u) and clip(g_u') have norm <= C_g:

    Delta_2 = 2 C_g,  noise multiplier for dp_accounting z_g / 2.

(Without R1's noise this fails: g_v depends on u's embeddings through D_v, so one
replacement could move every participant's clipped gradient, up to 2 C_g per participant;
tests/tff_algorithms/algorithms/fdml/test_fdml_privacy.py shows it.) A participant that does not deliver its gradient
(Case B) or is not among the first rate_p * n arrivals contributes zero; which ones do is
data-independent, so the bound holds.

Per round: the composition of Gaussians with multipliers z1 = z_d / (2 sqrt(g s)) and
z2 = z_g / 2 has the RDP curve of one Gaussian with 1/z^2 = 1/z1^2 + 1/z2^2, and is
what the accountant composes. A round abandoned after the derivatives were sent (Case B
under strategy AS) released R1 only, and is charged R1. A round restarted before
derivatives are sent (Case A: too few embeddings) released nothing and is not charged.

Sampling. `Sampling.UNIFORM`: the round's participants are a uniform sample without
replacement of `users_per_round` of `population` users (count every SELECTED user when
over-selecting: any of them may end up in the buffer), as elsewhere in the product;
dp_accounting's `SampledWithoutReplacementDpEvent` (RDP, replace-one). `Sampling.NONE`:
no amplification, valid for any selection. The embedding drop of Alg. 2 (rate r) is
applied but given no amplification credit here: it drops rows, not users.

Theorem V.1 of the paper, eps = ln[(1 - r) e^{2T/b} + r], is per sample and per round,
not user-level, without composition, and ignores that one sample moves many derivative
rows and that the aggregate depends on other users through the derivatives.
`paper_theorem_v1_epsilon` computes it as a labelled comparison only; nothing here uses it
for a guarantee.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING

from tff_algorithms.base import validation
from tff_algorithms.privacy import accounting, calibration

if TYPE_CHECKING:
    import dp_accounting

PAPER_THEOREM_V1_LABEL = "FDML Theorem V.1: per sample and per round, not user-level"


class Sampling(str, enum.Enum):
    UNIFORM = "uniform"  # users_per_round of population, without replacement, each round
    NONE = "none"  # no amplification: any selection


def derivative_sensitivity(row_clip: float, users_per_group: int, samples_per_user: int) -> float:
    """Delta_1 = 2 C_r sqrt(g s): L2 sensitivity of the clipped derivative buffer."""
    validation.check_int("users_per_group", users_per_group, 1)
    validation.check_int("samples_per_user", samples_per_user, 1)
    return 2.0 * float(row_clip) * math.sqrt(users_per_group * samples_per_user)


def gradient_sensitivity(gradient_clip: float) -> float:
    """Delta_2 = 2 C_g: L2 sensitivity of the clipped gradient sum given R1's output."""
    return 2.0 * float(gradient_clip)


@dataclasses.dataclass(frozen=True)
class FdmlPrivacySpec:
    """What the accountant charges for an FDML run.

    Attributes:
      population: users that can be selected.
      users_per_round: users selected per round (with over-selection, all selected).
      users_per_group: g, participants per triplet group.
      samples_per_user: s, rows per participant.
      derivative_noise_multiplier: z_d; the derivative noise std is z_d * row clip.
      gradient_noise_multiplier: z_g; the aggregate's noise std is z_g * gradient clip.
      rounds: rounds whose gradients were applied (R1 and R2 released).
      abandoned_rounds: rounds abandoned after the derivatives were sent (R1 only).
      sampling: `Sampling`.
    """

    population: int
    users_per_round: int
    users_per_group: int
    samples_per_user: int
    derivative_noise_multiplier: float
    gradient_noise_multiplier: float
    rounds: int
    abandoned_rounds: int = 0
    sampling: Sampling = Sampling.UNIFORM

    def __post_init__(self) -> None:
        validation.check_int("population", self.population, 1)
        validation.check_int("users_per_round", self.users_per_round, 1)
        if self.users_per_round > self.population:
            raise ValueError(
                f"users_per_round ({self.users_per_round}) exceeds population ({self.population})"
            )
        validation.check_int("users_per_group", self.users_per_group, 1)
        validation.check_int("samples_per_user", self.samples_per_user, 1)
        validation.check_int("rounds", self.rounds, 0)
        validation.check_int("abandoned_rounds", self.abandoned_rounds, 0)
        for name in ("derivative_noise_multiplier", "gradient_noise_multiplier"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        object.__setattr__(self, "sampling", Sampling(self.sampling))

    @property
    def derivative_event_noise_multiplier(self) -> float:
        """R1's noise std over its L2 sensitivity: z_d / (2 sqrt(g s))."""
        return self.derivative_noise_multiplier / derivative_sensitivity(
            1.0, self.users_per_group, self.samples_per_user
        )

    @property
    def gradient_event_noise_multiplier(self) -> float:
        """R2's noise std over its L2 sensitivity: z_g / 2."""
        return self.gradient_noise_multiplier / gradient_sensitivity(1.0)


def _sampled(spec: FdmlPrivacySpec, event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    import dp_accounting

    if spec.sampling is Sampling.NONE:
        return event
    return dp_accounting.SampledWithoutReplacementDpEvent(
        spec.population, spec.users_per_round, event
    )


def round_event(spec: FdmlPrivacySpec) -> dp_accounting.DpEvent:
    """One applied round: R1 then R2 on the same sampled participants."""
    import dp_accounting

    return _sampled(
        spec,
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(spec.derivative_event_noise_multiplier),
                dp_accounting.GaussianDpEvent(spec.gradient_event_noise_multiplier),
            ]
        ),
    )


def abandoned_round_event(spec: FdmlPrivacySpec) -> dp_accounting.DpEvent:
    """A round abandoned after the derivatives were sent (strategy AS): R1 only."""
    import dp_accounting

    return _sampled(spec, dp_accounting.GaussianDpEvent(spec.derivative_event_noise_multiplier))


def dp_event(spec: FdmlPrivacySpec) -> dp_accounting.DpEvent:
    """Every round of the run, composed."""
    import dp_accounting

    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(round_event(spec), spec.rounds),
            dp_accounting.SelfComposedDpEvent(abandoned_round_event(spec), spec.abandoned_rounds),
        ]
    )


def compute_epsilon(spec: FdmlPrivacySpec, delta: float) -> float:
    """Strict user-level epsilon at `delta` over all rounds: this module's event
    (`dp_event`) under the product's RDP accountant (`accounting.event_rdp_epsilon`,
    substitute-one)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if spec.rounds + spec.abandoned_rounds == 0:
        return 0.0
    if min(spec.derivative_noise_multiplier, spec.gradient_noise_multiplier) == 0:
        return math.inf
    return accounting.event_rdp_epsilon(dp_event(spec), delta)


def paper_theorem_v1_epsilon(drop_rate: float, bound: float, laplace_scale: float) -> float:
    """FDML Theorem V.1, eps = ln[(1 - r) e^{2T/b} + r]: PER SAMPLE AND PER ROUND, NOT
    USER-LEVEL (`PAPER_THEOREM_V1_LABEL`). A comparison with the paper only; never a
    guarantee (module docstring)."""
    if not 0 <= drop_rate < 1:
        raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
    if not (bound > 0 and laplace_scale > 0):
        raise ValueError("bound and laplace_scale must be positive")
    return math.log((1 - drop_rate) * math.exp(2 * bound / laplace_scale) + drop_rate)


def paper_theorem(drop_rate: float, bound: float, laplace_scale: float) -> tuple[float, str]:
    """`paper_theorem_v1_epsilon` and its label (`PAPER_THEOREM_V1_LABEL`): what
    `dp-fedemb privacy --mechanism fdml --convention paper` prints
    (`registry.Algorithm.paper_theorem`)."""
    return paper_theorem_v1_epsilon(drop_rate, bound, laplace_scale), PAPER_THEOREM_V1_LABEL


def calibrate(
    spec: FdmlPrivacySpec,
    target_epsilon: float,
    delta: float,
    *,
    derivative_share: float = 0.5,
    relative_tolerance: float = calibration.CALIBRATION_RELATIVE_TOLERANCE,
) -> FdmlPrivacySpec:
    """`spec` with the smallest noise that keeps its rounds within `target_epsilon`.

    A round costs what one Gaussian of multiplier z costs, 1/z^2 = 1/z1^2 + 1/z2^2 (module
    docstring); `derivative_share` of 1/z^2 goes to the derivatives (R1), the rest to the
    aggregate (R2): z1 = z / sqrt(share), z2 = z / sqrt(1 - share), then z_d = 2 sqrt(g s) z1
    and z_g = 2 z2. z is the product's one calibration (`calibration.calibrate_noise`)
    over this module's event (`dp_event`), to within `relative_tolerance`; the returned
    spec's epsilon is at most the target. With `Sampling.UNIFORM` each accountant call
    takes 1-4 s here (dp_accounting's RDP of sampling without replacement), without
    sampling milliseconds.
    """
    if not 0 < derivative_share < 1:
        raise ValueError(f"derivative_share must be in (0, 1), got {derivative_share}")
    rows = derivative_sensitivity(1.0, spec.users_per_group, spec.samples_per_user)

    def with_noise(z: float) -> FdmlPrivacySpec:
        return dataclasses.replace(
            spec,
            derivative_noise_multiplier=rows * z / math.sqrt(derivative_share),
            gradient_noise_multiplier=2.0 * z / math.sqrt(1 - derivative_share),
        )

    z = calibration.calibrate_noise(
        calibration.event_epsilon(lambda z: dp_event(with_noise(z)), delta),
        target_epsilon,
        relative_tolerance,
    )
    return with_noise(z)
