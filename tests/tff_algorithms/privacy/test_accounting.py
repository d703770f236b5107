"""Tests of tff_algorithms.privacy.accounting and tff_algorithms.privacy.calibration.

Paper values reproduced to two decimals, under ``convention="paper"`` for the
substitute-one schedules (test_paper_dpsgd_epsilon) and under either convention for
DP-FTRL (test_paper_dpftrl_table1):
Table 1 DP-FedAvg 5.62, DP-FedEmb 3.90, DP-FTRL-FedEmb 9.67 with zCDP 1.28; section 3.4
DigiFace 24.86 (rounds not stated there: 800) and iNat 16.06 (delta not stated there:
1e-4). Not reproduced, and why: see test_paper_emnist_value_not_reproduced and
test_paper_figure_2_single_digit_claims (the accounting module docstring has the details).
"""

import dataclasses
import math
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tff_algorithms.privacy import accounting, accounting_spec, calibration, tree_sensitivity
from tff_algorithms.privacy.accounting_spec import AccountingSpec

# Sampled-Gaussian RDP costs ~0.3 s per new (population, users, noise); keep examples few.
FEW = settings(max_examples=5, deadline=None)


def epsilon(**kwargs) -> float:
    return accounting.compute_privacy(AccountingSpec(**kwargs)).epsilon


@pytest.mark.parametrize(
    "population, users_per_round, rounds, noise, delta, expected",
    [
        # Table 1: 10M users, 64 virtual clients x 2048 ... extrapolated to 131K per round.
        pytest.param(10_000_000, 131_072, 800, 0.015 * 64, 1e-7, 5.62, id="table1-dp-fedavg"),
        pytest.param(10_000_000, 131_072, 800, 0.02 * 64, 1e-7, 3.90, id="table1-dp-fedemb"),
        # Section 3.4: DigiFace 98.96K users, 128 virtual clients x 64 users, 800 rounds.
        pytest.param(98_960, 128 * 64, 800, 1.39, 1e-5, 24.86, id="digiface-full"),
        # Section 3.4: iNat 9275 users, 32 virtual clients x 4 users, 400 rounds.
        pytest.param(9275, 32 * 4, 400, 0.5, 1e-4, 16.06, id="inat"),
    ],
)
def test_paper_dpsgd_epsilon(population, users_per_round, rounds, noise, delta, expected):
    paper = AccountingSpec(population, users_per_round, rounds, noise, delta, convention="paper")
    result = accounting.compute_privacy(paper)
    assert round(result.epsilon, 2) == expected
    assert result.zcdp_rho is None
    assert result.rdp_order is not None
    assert result.convention is accounting_spec.Convention.PAPER
    assert "PAPER CONVENTION" in result.analysis
    # The strict default takes z relative to the 2 x clip substitute-one sensitivity: the
    # same schedule costs what the paper's arithmetic gives at z / 2, which is more.
    strict = accounting.compute_privacy(dataclasses.replace(paper, convention="strict"))
    halved = dataclasses.replace(paper, noise_multiplier=noise / 2)
    assert strict.epsilon == accounting.compute_privacy(halved).epsilon > result.epsilon
    assert strict.sensitivity_in_clips == 2.0 and strict.effective_noise_multiplier == noise / 2


def test_strict_is_the_default_convention():
    spec = AccountingSpec(1000, 100, 10, 1.0, 1e-5)
    assert spec.convention is accounting_spec.Convention.STRICT
    result = accounting.compute_privacy(spec).to_dict()
    assert result["convention"] == "strict"
    assert result["neighboring_relation"] == "replace_one"
    assert result["sensitivity_in_clips"] == 2.0
    assert "strict convention (sensitivity 2 x clip)" in result["analysis"]


@pytest.mark.slow
def test_paper_dpftrl_table1():
    """Table 1 DP-FTRL-FedEmb: z = 0.26 x 64, 32 users per virtual client, no restart.

    The paper takes the min separation to be the 76 rounds per epoch; our epoch schedule
    repeats a fixed order, so a user's participations are 76 rounds apart with 75 rounds
    strictly between (TF Privacy's definition), which is the default and costs more."""
    table1 = dict(mechanism="dpftrl", users_per_virtual_client=32)
    paper = AccountingSpec(10_000_000, 131_072, 800, 0.26 * 64, 1e-7, **table1, min_separation=76)
    assert paper.rounds_per_epoch == 76 and paper.max_participations == 11
    result = accounting.compute_privacy(paper)
    assert result.effective_noise_multiplier == pytest.approx(0.26 * 64 / 2)
    assert round(result.epsilon, 2) == 9.67
    assert round(result.zcdp_rho, 2) == 1.28
    # The paper already doubles the virtual client's sensitivity under add/remove: the
    # paper convention gives the same numbers for trees.
    same = accounting.compute_privacy(dataclasses.replace(paper, convention="paper"))
    assert (same.epsilon, same.zcdp_rho) == (result.epsilon, result.zcdp_rho)
    ours = AccountingSpec(10_000_000, 131_072, 800, 0.26 * 64, 1e-7, **table1)
    assert ours.tree_min_separation == 75
    assert round(accounting.compute_privacy(ours).zcdp_rho, 2) == 1.36


def test_paper_emnist_value_not_reproduced():
    """Appendix D.6 EMNIST: 6800 users, 32 x 8 per round, 200 rounds, z 0.62, delta 1e-4,
    reported epsilon 9.28. The paper's substitute-one convention gives 15.33 (strict: 69.9);
    add-or-remove with Poisson sampling gives 9.27 (PLD) and 10.89 (RDP): the reported
    value matches the earlier draft's add-or-remove accounting (footnote 1), not to the
    second decimal."""
    schedule = dict(population=6800, users_per_round=256, rounds=200, noise_multiplier=0.62)
    assert round(epsilon(**schedule, delta=1e-4, convention="paper"), 2) == 15.33
    assert epsilon(**schedule, delta=1e-4) > 60
    poisson = dict(**schedule, delta=1e-4, sampling="poisson")
    assert round(epsilon(**poisson, accountant="pld"), 2) == 9.27
    assert round(epsilon(**poisson), 2) == 10.89


def test_paper_figure_2_single_digit_claims():
    """Section 3.1 reads Fig. 2c/2d as: DP-FedEmb (z 0.02 per 2048 users, 800 rounds,
    delta 1e-7) is single-digit at ~98K users per round for 3M users and ~57K for 10M.
    That holds under Poisson add-or-remove accounting (the earlier draft's), not under the
    substitute-one accounting the final paper states, which gives 15.4 and 11.2 with the
    paper's arithmetic (and more under the strict convention)."""
    base = AccountingSpec(3_000_000, 2048, 800, 0.02, 1e-7, convention="paper")
    for population, multiple in ((3_000_000, 48), (10_000_000, 28)):
        spec = dataclasses.replace(
            base,
            population=population,
            users_per_round=2048 * multiple,
            noise_multiplier=0.02 * multiple,
        )
        poisson = dataclasses.replace(
            spec, sampling="poisson", neighboring_relation="add_or_remove_one"
        )
        assert accounting.compute_privacy(poisson).epsilon < 10
        assert accounting.compute_privacy(spec).epsilon > 10


def test_extrapolation_reproduces_table1_from_the_simulated_schedule():
    simulated = AccountingSpec(9047, 2048, 800, 0.02, 1e-7, convention="paper")
    (point,) = calibration.extrapolate_privacy(simulated, 10_000_000, [64 * 2048])
    assert point.noise_multiplier == pytest.approx(1.28)
    assert round(point.epsilon, 2) == 3.90


# Cross-checks between independent code paths.


def test_tree_restart_matches_tf_privacy():
    from tensorflow_privacy.privacy.analysis import tree_aggregation_accountant

    spec = AccountingSpec(
        1000, 30, 100, 3.0, 1e-6, mechanism="dpftrl", restart_every_epoch=True
    )  # 33 rounds per epoch: 3 full epochs and one of 1 round
    ours = accounting.rdp_curve(spec)
    theirs = tree_aggregation_accountant.compute_rdp_tree_restart(
        3.0, [33, 33, 33, 1], list(accounting.RDP_ORDERS)
    )
    np.testing.assert_allclose(ours, theirs, rtol=1e-12)


def test_single_tree_matches_tf_privacy_rdp_and_zcdp():
    from tensorflow_privacy.privacy.analysis import tree_aggregation_accountant

    spec = AccountingSpec(100, 10, 35, 2.0, 1e-5, mechanism="dpftrl", users_per_virtual_client=2)
    z = 1.0  # virtual clients of two users halve the noise multiplier
    # 10 rounds per epoch, a fixed order: 9 rounds strictly between participations.
    theirs = tree_aggregation_accountant.compute_rdp_single_tree(
        z, 35, 4, 9, list(accounting.RDP_ORDERS)
    )
    np.testing.assert_allclose(accounting.rdp_curve(spec), theirs, rtol=1e-12)
    rho = tree_aggregation_accountant.compute_zcdp_single_tree(z, 35, 4, 9)
    assert accounting.compute_privacy(spec).zcdp_rho == pytest.approx(rho, rel=1e-12)


def test_single_tree_within_one_epoch_equals_restarted_tree():
    """With at most one participation, TF Privacy's single-tree search and dp_accounting's
    single-epoch tree event must agree."""
    one_tree = AccountingSpec(5000, 50, 77, 1.5, 1e-5, mechanism="dpftrl")
    restarted = dataclasses.replace(one_tree, restart_every_epoch=True)
    assert one_tree.max_participations == 1
    a, b = accounting.compute_privacy(one_tree), accounting.compute_privacy(restarted)
    assert a.epsilon == pytest.approx(b.epsilon, rel=1e-12)
    assert a.zcdp_rho == pytest.approx(b.zcdp_rho, rel=1e-12)


@pytest.mark.parametrize("restart", [False, True])
def test_tree_rdp_is_linear_in_order_with_slope_rho(restart):
    spec = AccountingSpec(400, 20, 50, 4.0, 1e-5, mechanism="dpftrl", restart_every_epoch=restart)
    rho = accounting.compute_privacy(spec).zcdp_rho
    np.testing.assert_allclose(
        accounting.rdp_curve(spec), rho * np.asarray(accounting.RDP_ORDERS), rtol=1e-12
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(population=60_000, users_per_round=600, rounds=300, noise_multiplier=1.1),
        dict(population=5000, users_per_round=250, rounds=50, noise_multiplier=2.0),
    ],
)
def test_poisson_rdp_and_pld_roughly_agree(kwargs):
    rdp = epsilon(**kwargs, delta=1e-5, sampling="poisson")
    pld = epsilon(**kwargs, delta=1e-5, sampling="poisson", accountant="pld")
    assert 0.6 * rdp < pld <= rdp


def test_tree_pld_is_tighter_than_rdp():
    kwargs = dict(mechanism="dpftrl", restart_every_epoch=True)
    rdp = epsilon(
        population=1000, users_per_round=10, rounds=300, noise_multiplier=5.0, delta=1e-6, **kwargs
    )
    pld = epsilon(
        population=1000,
        users_per_round=10,
        rounds=300,
        noise_multiplier=5.0,
        delta=1e-6,
        accountant="pld",
        **kwargs,
    )
    assert 0.6 * rdp < pld <= rdp


# The virtual-client sensitivity rule.


def test_virtual_clients_halve_noise_under_add_or_remove_relations():
    tree = dict(population=640, users_per_round=64, rounds=30, delta=1e-5, mechanism="dpftrl")
    grouped = accounting.compute_privacy(
        AccountingSpec(**tree, noise_multiplier=4.0, users_per_virtual_client=8)
    )
    alone = accounting.compute_privacy(AccountingSpec(**tree, noise_multiplier=2.0))
    assert grouped.effective_noise_multiplier == 2.0
    assert grouped.epsilon == alone.epsilon and grouped.zcdp_rho == alone.zcdp_rho
    poisson = AccountingSpec(640, 64, 30, 4.0, 1e-5, sampling="poisson", users_per_virtual_client=8)
    assert poisson.effective_noise_multiplier == 2.0


@pytest.mark.parametrize("convention, effective", [("strict", 0.5), ("paper", 1.0)])
def test_virtual_clients_do_not_change_substitute_one(convention, effective):
    """Under substitute-one one user moves one virtual client's clipped update whatever
    k is: 2 x clip under the strict convention, clip in the paper's arithmetic."""
    base = AccountingSpec(6400, 64, 30, 1.0, 1e-5, convention=convention)
    grouped = dataclasses.replace(base, users_per_virtual_client=32)
    assert base.effective_noise_multiplier == grouped.effective_noise_multiplier == effective
    assert epsilon(**base.to_dict()) == epsilon(**grouped.to_dict())


# Bounds: documented ranges and costs.


def test_long_single_trees_use_the_bound_and_stay_cheap():
    """A hundred million rounds of one tree: the closed form, O(log rounds)."""
    spec = AccountingSpec(1000, 100, 10**8, 1.0, 1e-5, mechanism="dpftrl")
    assert spec.rounds > accounting.EXACT_TREE_MAX_ROUNDS
    expected = tree_sensitivity.tree_sensitivity_bound(10**8, 10**7, 9)
    assert accounting.tree_squared_sensitivity(spec) == expected
    assert math.isfinite(accounting.compute_privacy(spec).epsilon)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(noise_multiplier=1e308), "noise multiplier must be at most"),
        (dict(noise_multiplier=1e160), "noise multiplier must be at most"),
        (dict(population=10**11, users_per_round=10), "population .* at most"),
        (dict(rounds=10**10), "rounds must be at most"),
        (dict(delta=1e-200), "delta must be at least"),
    ],
)
def test_numbers_outside_the_documented_ranges_are_one_line_errors(kwargs, message):
    base = dict(population=1000, users_per_round=100, rounds=10, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(ValueError, match=message):
        AccountingSpec(**{**base, **kwargs})


@pytest.mark.parametrize("target", [1e300, 100.5])
def test_calibration_refuses_targets_above_the_range(target):
    with pytest.raises(ValueError, match="target epsilon must be in"):
        calibration.calibrate_noise_multiplier(AccountingSpec(1000, 100, 10, 1.0, 1e-5), target)


def test_calibration_says_when_no_noise_suffices():
    # RDP's conversion leaves a floor at small delta whatever the noise.
    with pytest.raises(calibration.TargetOutOfReach, match="out of reach"):
        calibration.calibrate_noise_multiplier(AccountingSpec(100, 100, 10, 1.0, 1e-90), 1e-3)


# Monotonicity.


@FEW
@given(
    z=st.floats(0.3, 5.0),
    factor=st.floats(1.05, 3.0),
    mechanism=st.sampled_from(["dpsgd", "dpftrl"]),
)
def test_epsilon_decreases_with_noise(z, factor, mechanism):
    spec = AccountingSpec(2000, 40, 60, z, 1e-5, mechanism=mechanism)
    noisier = spec.with_noise_multiplier(z * factor)
    assert accounting.compute_privacy(noisier).epsilon < accounting.compute_privacy(spec).epsilon


@FEW
@given(rounds=st.integers(1, 300), more=st.integers(1, 300))
def test_epsilon_increases_with_rounds(rounds, more):
    sgd = AccountingSpec(5000, 50, rounds, 1.0, 1e-5)
    assert epsilon(**sgd.with_rounds(rounds + more).to_dict()) > epsilon(**sgd.to_dict())
    tree = AccountingSpec(5000, 50, rounds, 2.0, 1e-5, mechanism="dpftrl", restart_every_epoch=True)
    # A restarted tree's cost grows with each new epoch, and within one only with its depth.
    assert epsilon(**tree.with_rounds(rounds + more).to_dict()) >= epsilon(**tree.to_dict())
    next_epoch = tree.with_rounds(rounds + tree.rounds_per_epoch)
    assert epsilon(**next_epoch.to_dict()) > epsilon(**tree.to_dict())


@FEW
@given(
    users=st.integers(10, 400),
    extra=st.integers(1, 400),
    sampling=st.sampled_from(["uniform", "poisson"]),
)
def test_epsilon_increases_with_sampling_rate(users, extra, sampling):
    spec = AccountingSpec(4000, users, 100, 1.0, 1e-6, sampling=sampling)
    denser = dataclasses.replace(spec, users_per_round=users + extra)
    assert accounting.compute_privacy(denser).epsilon > accounting.compute_privacy(spec).epsilon


def test_zero_noise_is_infinite_epsilon():
    assert math.isinf(
        epsilon(population=10, users_per_round=5, rounds=1, noise_multiplier=0.0, delta=1e-5)
    )
    tree = accounting.compute_privacy(AccountingSpec(10, 5, 3, 0.0, 1e-5, mechanism="dpftrl"))
    assert math.isinf(tree.epsilon) and math.isinf(tree.zcdp_rho)
    assert tree.to_dict()["epsilon"] is None


# Calibration.


def assert_calibrated(spec: AccountingSpec, target: float, tolerance: float) -> float:
    z = calibration.calibrate_noise_multiplier(spec, target, tolerance)
    assert accounting.compute_privacy(spec.with_noise_multiplier(z)).epsilon <= target
    below = spec.with_noise_multiplier(z * (1 - tolerance))
    assert accounting.compute_privacy(below).epsilon > target
    return z


@settings(max_examples=8, deadline=None)
@given(
    target=st.floats(0.2, 30.0),
    analysis=st.sampled_from(
        [
            dict(sampling="poisson"),
            dict(mechanism="dpftrl", restart_every_epoch=True),
            dict(mechanism="dpftrl", accountant="pld", users_per_virtual_client=5),
        ]
    ),
)
@pytest.mark.slow
def test_calibration_round_trip(target, analysis):
    assert_calibrated(AccountingSpec(3000, 30, 120, 1.0, 1e-5, **analysis), target, 1e-3)


@pytest.mark.slow
def test_calibration_round_trip_uniform_sampling():
    # The paper's analysis costs ~0.3 s per evaluation: one case, coarse tolerance; the
    # paper's z = 1.39 for epsilon 24.86 must lie within it, and the strict convention
    # needs twice that noise for the same epsilon.
    spec = AccountingSpec(98_960, 8192, 800, 1.0, 1e-5, convention="paper")
    z = assert_calibrated(spec, 24.86, 2e-2)
    assert 1.39 <= z <= 1.39 / (1 - 2e-2)
    strict = calibration.calibrate_noise_multiplier(
        dataclasses.replace(spec, convention="strict"), 24.86, 2e-2
    )
    assert 2 * 1.39 <= strict <= 2 * 1.39 / (1 - 2e-2)


def test_calibration_of_a_tree_matches_the_closed_form():
    # 10 rounds per epoch, 4 epochs: each tree has depth 4, so rho = 16 / (2 z^2).
    spec = AccountingSpec(1000, 100, 40, 1.0, 1e-5, mechanism="dpftrl", restart_every_epoch=True)
    z = calibration.calibrate_noise_multiplier(spec, 3.0, 1e-6)
    result = accounting.compute_privacy(spec.with_noise_multiplier(z))
    assert result.epsilon == pytest.approx(3.0, rel=1e-4)
    assert result.zcdp_rho == pytest.approx(16 / (2 * z**2), rel=1e-12)


@pytest.mark.parametrize("target", [0.0, -1.0, math.inf, math.nan])
def test_calibration_rejects_nonsense_targets(target):
    with pytest.raises(ValueError, match="target epsilon"):
        calibration.calibrate_noise_multiplier(AccountingSpec(100, 10, 10, 1.0, 1e-5), target)


# Input validation.


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(users_per_round=200), "exceeds the population"),
        (dict(noise_multiplier=-0.5), "non-negative"),
        (dict(noise_multiplier=math.inf), "finite"),
        (dict(delta=1.0), r"delta must be in \(0, 1\)"),
        (dict(delta=0.0), r"delta must be in \(0, 1\)"),
        (dict(rounds=0), "rounds must be at least 1"),
        (dict(population=0), "at least 1"),
        (dict(users_per_round=2.5), "must be an integer"),
        (dict(users_per_virtual_client=3), "multiple of users per virtual client"),
        (dict(restart_every_epoch=True), "only to the dpftrl"),
        (dict(mechanism="dpsgd-2"), "unknown mechanism"),
        (dict(sampling="epoch"), "no privacy analysis"),
        (dict(sampling="uniform", neighboring_relation="add_or_remove_one"), "no privacy analysis"),
        (dict(mechanism="dpftrl", sampling="uniform"), "no privacy analysis"),
        (dict(convention="loose"), "unknown accounting convention"),
    ],
)
def test_invalid_specs_are_rejected(kwargs, message):
    base = dict(population=100, users_per_round=10, rounds=10, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(ValueError, match=message):
        AccountingSpec(**{**base, **kwargs})


def test_spec_dict_round_trip_and_defaults():
    spec = AccountingSpec(100, 10, 10, 1.0, 1e-5, mechanism="dpftrl")
    assert spec.sampling is accounting_spec.Sampling.EPOCH
    assert spec.neighboring_relation is accounting_spec.NeighboringRelation.REPLACE_SPECIAL
    assert AccountingSpec.from_dict(spec.to_dict()) == spec
    assert spec.to_dict()["convention"] == "strict"
    # Specs written before the convention existed read as strict (recomputed honestly).
    legacy = {k: v for k, v in spec.to_dict().items() if k != "convention"}
    assert AccountingSpec.from_dict(legacy) == spec
    with pytest.raises(ValueError, match="unknown accounting spec fields"):
        AccountingSpec.from_dict({**spec.to_dict(), "clip": 1.0})


# Extrapolation.


@pytest.mark.slow
def test_extrapolation_table_and_png(tmp_path):
    base = AccountingSpec(9047, 2048, 400, 0.015, 1e-7)
    users = [2048 * m for m in (8, 32, 64)]
    points = calibration.extrapolate_privacy(base, 3_000_000, users)
    assert [p.users_per_round for p in points] == users
    assert [p.noise_multiplier for p in points] == pytest.approx([0.015 * m for m in (8, 32, 64)])
    assert all(p.zcdp_rho is None for p in points)
    epsilons = [p.epsilon for p in points]
    assert epsilons == sorted(epsilons, reverse=True)  # more users, more noise: less epsilon

    path = tmp_path / "extrapolation.png"
    calibration.write_extrapolation_plot({"DP-FedEmb r400": points}, str(path), title="3M users")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR comes first
    assert data[12:16] == b"IHDR" and width > 100 and height > 100
    assert data[-8:-4] == b"IEND"


def test_extrapolation_plot_of_zcdp_needs_trees(tmp_path):
    points = calibration.extrapolate_privacy(AccountingSpec(1000, 10, 10, 0.1, 1e-5), 10_000, [20])
    with pytest.raises(ValueError, match="no zcdp_rho"):
        calibration.write_extrapolation_plot(
            {"sgd": points}, str(tmp_path / "x.png"), quantity="zcdp_rho"
        )


def test_tree_accounting_uses_the_separation_the_schedule_guarantees():
    """One convention: the accountant's default min separation is what the epoch
    schedule of beam_jobs.schedule reports for the same population and round size."""
    from beam_jobs import schedule

    plan = schedule.VirtualClientSchedule(1000, 4, 25, seed=0, mode=schedule.EPOCH)
    stats = plan.participation_stats(rounds=40)
    spec = AccountingSpec(
        stats.users,
        stats.users_per_round,
        stats.rounds,
        2.0,
        1e-5,
        mechanism="dpftrl",
        users_per_virtual_client=stats.users_per_virtual_client,
    )
    assert spec.rounds_per_epoch == stats.rounds_per_epoch
    assert spec.tree_min_separation == stats.min_separation
    assert spec.max_participations == stats.max_participations


def test_pld_refuses_noise_its_grid_cannot_hold():
    spec = AccountingSpec(3000, 30, 120, 0.01, 1e-5, sampling="poisson", accountant="pld")
    with pytest.raises(ValueError, match="use the RDP accountant"):
        accounting.compute_privacy(spec)


def test_rdp_orders_are_dp_accounting_defaults():
    """RDP_ORDERS is spelled out so that the module imports without dp_accounting."""
    from dp_accounting.rdp import rdp_privacy_accountant

    assert accounting.RDP_ORDERS == tuple(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


def test_job_config_imports_neither_dp_accounting_nor_tensorflow():
    """Config and `--help` import the accounting module; the accountant is imported
    only when something is computed (a fresh interpreter: this one has them loaded)."""
    import subprocess
    import sys

    code = (
        "import sys; import tff_algorithms.config.job_config, pipeline.config; "
        "print(sorted(m for m in ('dp_accounting', 'scipy', 'tensorflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _composed_gaussian_epsilon(rounds: int, noise_multiplier: float, delta: float) -> float:
    """Full batch from first principles: each round one user's clipped update can be
    replaced (sum moves by up to 2 clips) under N(0, (z·clip)²), so `rounds` rounds are one
    Gaussian mechanism with μ = sqrt(rounds)·2/z; ε solves the analytic Gaussian's
    δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle and Wang 2018)."""
    from scipy import optimize, stats

    mu = math.sqrt(rounds) * 2 / noise_multiplier

    def excess(eps: float) -> float:
        tail = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )
        return tail - delta

    return optimize.brentq(excess, 0.0, 100.0, xtol=1e-12)


@pytest.mark.parametrize("rounds, noise, delta", [(1, 2.0, 1e-5), (3, 5.0, 1e-6), (10, 8.0, 1e-4)])
def test_full_batch_is_the_composed_gaussian_without_amplification(rounds, noise, delta):
    spec = AccountingSpec(500, 500, rounds, noise, delta, sampling="full")
    assert spec.neighboring_relation is accounting_spec.NeighboringRelation.REPLACE_ONE
    assert spec.accountant is accounting_spec.Accountant.PLD and spec.sensitivity_in_clips == 2
    exact = _composed_gaussian_epsilon(rounds, noise, delta)
    pld = accounting.compute_privacy(spec, rdp_cross_check=True)
    # PLD's pessimistic grid (PLD_DISCRETIZATION) sits just above the exact value; RDP
    # is an upper bound.
    assert exact <= pld.epsilon <= exact + 1e-4
    assert pld.epsilon_rdp > exact
    assert "no amplification" in pld.analysis
    # Sampling a strict subset each round would be cheaper: the amplification full
    # batch does not get.
    sampled = AccountingSpec(500, 250, rounds, noise, delta)
    assert accounting.compute_privacy(sampled).epsilon < exact


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"users_per_round": 499}, "users per round (499) must equal the population (500)"),
        ({"convention": "paper"}, "full sampling has no paper convention"),
        ({"neighboring_relation": "add_or_remove_one"}, "no privacy analysis for mechanism"),
    ],
)
def test_full_batch_refusals_are_one_line(changes, message):
    values = {"population": 500, "users_per_round": 500, "rounds": 1, "noise_multiplier": 2.0}
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        AccountingSpec(**{**values, "delta": 1e-5, "sampling": "full", **changes})
    assert "\n" not in str(e.value)
