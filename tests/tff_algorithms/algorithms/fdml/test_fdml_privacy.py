"""FDML's user-level privacy (issue 27, item 2).

The neighbour search re-implements the mechanism in numpy (a linear embedding model, the
grouped triplet mining, Alg. 1, row clipping, per-participant backpropagation) and uses
neither `fdml` nor `triplet`, nor `fdml_privacy`'s sensitivity functions: the sensitivity
it checks is read off the dp_accounting event the accountant composes, divided into the
noise std the mechanism adds (z * clip; tests/tff_algorithms/algorithms/fdml/test_fdml.py measures that std on the real
server step). `test_the_numpy_mechanism_is_the_modules` ties the copy to the product: the
real `fdml.FdmlProcess`, given the same linear model and data without noise, releases the
same clipped rows and the same clipped gradient sum, so a clip the module loses is a
failure here too.
"""

import collections
import itertools
import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_algorithms.algorithms.fdml import privacy as fdml_privacy
from tff_algorithms.algorithms.fdml import protocol as fdml
from tff_algorithms.algorithms.fdml import round_config
from tff_algorithms.privacy import accounting, accounting_spec

PIXELS, DIM, USERS, SAMPLES = 4, 2, 4, 2
MARGIN = 0.5


# --- numpy FDML ------------------------------------------------------------------------


def _triplets(e, keys, valid, strategy):
    rows = range(len(keys))
    dist = np.linalg.norm(e[:, None] - e[None], axis=-1)
    out = []
    for a, p in itertools.product(rows, rows):
        if a == p or not (valid[a] and valid[p]) or keys[a] != keys[p]:
            continue
        negatives = [n for n in rows if valid[n] and keys[n] != keys[a]]
        if negatives and strategy == "semi_hard":
            farther = [n for n in negatives if dist[a, n] > dist[a, p]]
            pick = (
                min(farther, key=lambda n: (dist[a, n], n))
                if farther
                else max(negatives, key=lambda n: (dist[a, n], -n))
            )
            negatives = [pick]
        out += [(a, p, n) for n in negatives if dist[a, p] - dist[a, n] + MARGIN > 0]
    return out, dist


def _derivatives(e, keys, valid, strategy):
    found, dist = _triplets(e, keys, valid, strategy)
    out = np.zeros_like(e)
    for a, p, n in found:
        u_ap = (e[a] - e[p]) / dist[a, p]
        u_an = (e[a] - e[n]) / dist[a, n]
        out[a] += u_ap - u_an
        out[p] -= u_ap
        out[n] += u_an
    return out / max(len(found), 1)


def _clip(v, bound):
    norm = np.linalg.norm(v)
    return v if norm <= bound else v * (bound / norm)


def _released_derivatives(weights, data, group, strategy, row_clip):
    """R1 before noise: the [users, s, d] buffer of row-clipped derivatives."""
    x, keys, valid = data
    out = np.zeros((USERS, SAMPLES, DIM))
    for start in range(0, USERS, group):
        part = slice(start, start + group)
        e = (x[part] @ weights.T).reshape(-1, DIM)
        rows = _derivatives(e, keys[part].reshape(-1), valid[part].reshape(-1), strategy)
        out[part] = rows.reshape(-1, SAMPLES, DIM)
    return np.apply_along_axis(_clip, -1, out, row_clip)


def _clipped_gradient_sum(derivatives, data, gradient_clip):
    """R2 before noise: sum over participants of clip(J_v^T D_v) (linear model: D^T x)."""
    x, _, valid = data
    total = 0.0
    for v in range(USERS):
        rows = derivatives[v] * valid[v][:, None]
        total = total + _clip(rows.T @ x[v], gradient_clip)
    return total


def _dataset(rng, identities=(0, 0, 1, 1)):
    x = rng.normal(size=(USERS, SAMPLES, PIXELS))
    keys = np.repeat(np.array(identities)[:, None], SAMPLES, axis=1)
    return x, keys, np.ones((USERS, SAMPLES), bool)


def _neighbours(rng, data, user, count):
    """Datasets with `user` replaced: random and extreme inputs, its own, another or a
    new identity, fewer rows."""
    x, keys, valid = data
    for trial in range(count):
        x2, keys2, valid2 = x.copy(), keys.copy(), valid.copy()
        scale = [0.01, 1.0, 100.0][trial % 3]
        x2[user] = scale * rng.normal(size=(SAMPLES, PIXELS))
        if trial % 4 == 1:  # push it next to another user's rows
            other = (user + 1 + trial % (USERS - 1)) % USERS
            x2[user] = x[other] + 1e-3 * rng.normal(size=(SAMPLES, PIXELS))
        keys2[user] = [keys[user, 0], rng.integers(0, 3), 7][trial % 3]
        if trial % 5 == 2:
            valid2[user] = [True] + [False] * (SAMPLES - 1)
        yield x2, keys2, valid2


def _event_noise_multipliers(event):
    """The Gaussian noise multipliers the accountant composes, in order."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return [event.noise_multiplier]
    if isinstance(event, dp_accounting.SampledWithoutReplacementDpEvent):
        return _event_noise_multipliers(event.event)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return [z for sub in event.events for z in _event_noise_multipliers(sub)]
    raise AssertionError(f"unexpected event {event}")


def _accountant_sensitivities(group, row_clip, gradient_clip, z_d=3.0, z_g=1.5):
    """(Delta_1, Delta_2) the accountant assumes: noise std / the event's multiplier."""
    spec = fdml_privacy.FdmlPrivacySpec(
        population=100,
        users_per_round=USERS,
        users_per_group=group,
        samples_per_user=SAMPLES,
        derivative_noise_multiplier=z_d,
        gradient_noise_multiplier=z_g,
        rounds=1,
    )
    z1, z2 = _event_noise_multipliers(fdml_privacy.round_event(spec))
    return z_d * row_clip / z1, z_g * gradient_clip / z2


def _linear_backbone():
    return tf.keras.Sequential([tf.keras.layers.Dense(DIM, use_bias=False, input_shape=(PIXELS,))])


@pytest.mark.parametrize("strategy, group", [("batch_all", 2), ("semi_hard", 4)])
def test_the_numpy_mechanism_is_the_modules(tff_runtime, strategy, group):
    """Same weights and data, no noise: the module's released derivatives (R1) and its
    sum of clipped participant gradients (R2, n x the released mean) are the numpy copy's,
    with both clips binding, one participant holding fewer rows than s."""
    row_clip, gradient_clip = 0.05, 0.02
    rng = np.random.default_rng(3)
    weights = rng.normal(size=(DIM, PIXELS))
    x, keys, valid = _dataset(rng, (0, 1, 2, 0))
    valid[2, 1:] = False  # participant 2 uploads one example: a padded row
    config = round_config.FdmlConfig(
        samples_per_user=SAMPLES,
        users_per_round=USERS,
        users_per_group=group,
        strategy=strategy,
        margin=MARGIN,
        row_clip=row_clip,
        gradient_clip=gradient_clip,
    )
    process = fdml.FdmlProcess(
        _linear_backbone,
        (PIXELS,),
        config,
        initial_weights=tff.learning.models.ModelWeights([weights.T], []),
    )
    datasets = [
        tf.data.Dataset.from_tensor_slices(
            collections.OrderedDict(
                identity=keys[v][valid[v]], image=x[v][valid[v]].astype(np.float32)
            )
        )
        for v in range(USERS)
    ]
    state = process.initialize()
    uploads = sorted(
        process.embed(state, datasets, list(range(USERS))), key=lambda u: int(u["position"])
    )
    step = process.server_step(
        np.stack([np.asarray(u["embeddings"]) for u in uploads]),
        np.stack([np.asarray(u["keys"]) for u in uploads]),
        valid,
        np.array([0, 0], np.int64),
        np.int64(0),
    )
    expected = _released_derivatives(weights, (x, keys, valid), group, strategy, row_clip)
    # Both clips bind, so a lost clip cannot agree by chance.
    assert np.max(np.linalg.norm(expected, axis=-1)) == pytest.approx(row_clip)
    np.testing.assert_allclose(step["derivatives"], expected, rtol=1e-4, atol=1e-6)

    output = process.next(state, datasets)
    expected_sum = _clipped_gradient_sum(expected, (x, keys, valid), gradient_clip)
    assert np.linalg.norm(expected_sum) > gradient_clip  # participants' gradients clipped
    # Keras' kernel is [PIXELS, DIM]: the transpose of the numpy weights.
    np.testing.assert_allclose(output.gradient[0] * USERS, expected_sum.T, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("strategy", ["batch_all", "semi_hard"])
@pytest.mark.parametrize("group", [2, 4])
def test_no_neighbour_moves_a_release_more_than_the_accountant_assumes(strategy, group):
    row_clip, gradient_clip = 0.05, 0.02
    delta_1, delta_2 = _accountant_sensitivities(group, row_clip, gradient_clip)
    rng = np.random.default_rng(group)
    worst_1 = worst_2 = 0.0
    for identities in [(0, 1, 0, 1), (0, 0, 1, 1), (0, 1, 2, 0)]:
        weights = rng.normal(size=(DIM, PIXELS))
        data = _dataset(rng, identities)
        released = _released_derivatives(weights, data, group, strategy, row_clip)
        fixed_sum = _clipped_gradient_sum(released, data, gradient_clip)
        for user in range(USERS):
            for other in _neighbours(rng, data, user, 60):
                moved = _released_derivatives(weights, other, group, strategy, row_clip)
                worst_1 = max(worst_1, float(np.linalg.norm(moved - released)))
                # Rows outside the replaced user's group never move.
                start = user // group * group
                outside = np.ones(USERS, bool)
                outside[start : start + group] = False
                assert np.array_equal(moved[outside], released[outside])
                # R2 given R1's output: only the user's own clipped term changes.
                change = _clipped_gradient_sum(released, other, gradient_clip) - fixed_sum
                worst_2 = max(worst_2, float(np.linalg.norm(change)))
    assert worst_1 <= delta_1 + 1e-12, (worst_1, delta_1)
    assert worst_2 <= delta_2 + 1e-12, (worst_2, delta_2)
    # The search reaches a good part of the bound, so it tests something (when written:
    # 0.997 / 0.928 of Delta_1 at g = 2 and 0.772 / 0.949 at g = 4, batch-all / semi-hard;
    # 0.99 of Delta_2).
    assert worst_1 > 0.5 * delta_1 and worst_2 > 0.5 * delta_2, (
        worst_1 / delta_1,
        worst_2 / delta_2,
    )


def test_without_private_derivatives_one_user_moves_every_gradient():
    """Why R1 is noised: recomputing the derivatives from the neighbour (no privatized
    R1 in between) moves the clipped gradient sum beyond 2 C_g (issue 27, third point)."""
    row_clip, gradient_clip = 0.05, 0.02
    rng = np.random.default_rng(11)
    worst = 0.0
    for _ in range(3):
        weights = rng.normal(size=(DIM, PIXELS))
        data = _dataset(rng)
        base = _clipped_gradient_sum(
            _released_derivatives(weights, data, USERS, "batch_all", row_clip), data, gradient_clip
        )
        for other in _neighbours(rng, data, 0, 60):
            moved = _clipped_gradient_sum(
                _released_derivatives(weights, other, USERS, "batch_all", row_clip),
                other,
                gradient_clip,
            )
            worst = max(worst, float(np.linalg.norm(moved - base)))
    # (1.53 x 2 C_g when written.)
    assert worst > 2 * gradient_clip, worst


# --- the accountant --------------------------------------------------------------------


def _spec(**overrides):
    fields = dict(
        population=1000,
        users_per_round=32,
        users_per_group=4,
        samples_per_user=8,
        derivative_noise_multiplier=12.0,
        gradient_noise_multiplier=2.0,
        rounds=200,
    )
    fields.update(overrides)
    return fdml_privacy.FdmlPrivacySpec(**fields)


def test_a_round_is_one_gaussian_of_the_combined_multiplier():
    spec = _spec(sampling=fdml_privacy.Sampling.NONE, rounds=1)
    z1 = spec.derivative_event_noise_multiplier
    z2 = spec.gradient_event_noise_multiplier
    assert z1 == pytest.approx(12.0 / (2 * math.sqrt(4 * 8)))
    assert z2 == pytest.approx(1.0)
    combined = 1 / math.sqrt(1 / z1**2 + 1 / z2**2)
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    accountant.compose(dp_accounting.GaussianDpEvent(combined))
    assert fdml_privacy.compute_epsilon(spec, 1e-5) == pytest.approx(
        accountant.get_epsilon(1e-5), rel=1e-9
    )


def test_the_jobs_spec_charges_what_fdmls_own_event_costs():
    """A job's ledger charges the fdml AccountingSpec: one Gaussian of the combined
    multiplier, already relative to the sensitivities (its `Release`, no clip factor).
    Under RDP, over sampled rounds, that costs what this module's own two-release event
    costs."""
    spec = _spec(rounds=50)
    z1 = spec.derivative_event_noise_multiplier
    z2 = spec.gradient_event_noise_multiplier
    job = accounting_spec.AccountingSpec(
        spec.population,
        spec.users_per_round,
        spec.rounds,
        1 / math.sqrt(1 / z1**2 + 1 / z2**2),
        1e-5,
        mechanism=accounting_spec.Mechanism.FDML,
        accountant=accounting_spec.Accountant.RDP,
    )
    assert accounting.compute_privacy(job).epsilon == pytest.approx(
        fdml_privacy.compute_epsilon(spec, 1e-5), rel=1e-6
    )


def test_epsilon_orders():
    base = fdml_privacy.compute_epsilon(_spec(), 1e-5)
    assert math.isfinite(base) and base > 0
    assert fdml_privacy.compute_epsilon(_spec(abandoned_rounds=20), 1e-5) > base
    assert fdml_privacy.compute_epsilon(_spec(sampling="none"), 1e-5) > base
    assert fdml_privacy.compute_epsilon(_spec(derivative_noise_multiplier=24.0), 1e-5) < base
    # A larger group reaches more rows: the same noise buys less.
    assert fdml_privacy.compute_epsilon(_spec(users_per_group=32), 1e-5) > base
    assert fdml_privacy.compute_epsilon(_spec(gradient_noise_multiplier=0.0), 1e-5) == math.inf
    assert fdml_privacy.compute_epsilon(_spec(rounds=0), 1e-5) == 0.0


def test_sensitivities():
    assert fdml_privacy.derivative_sensitivity(0.1, 4, 8) == pytest.approx(0.2 * math.sqrt(32))
    assert fdml_privacy.gradient_sensitivity(0.3) == pytest.approx(0.6)


def test_paper_theorem_is_a_labelled_comparison_only():
    assert "not user-level" in fdml_privacy.PAPER_THEOREM_V1_LABEL
    assert "per sample and per round" in fdml_privacy.PAPER_THEOREM_V1_LABEL
    assert fdml_privacy.paper_theorem_v1_epsilon(0.0, 1.0, 2.0) == pytest.approx(1.0)
    assert fdml_privacy.paper_theorem_v1_epsilon(0.2, 2e-5, 1e-5) == pytest.approx(
        math.log(0.8 * math.e**4 + 0.2)
    )
    # The arithmetic: a per-round epsilon of 1 over 1,600 rounds is not 1.
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.LaplaceDpEvent(1.0), 1600)
    assert accountant.get_epsilon(1e-5) > 100


def test_spec_refuses_nonsense():
    with pytest.raises(ValueError, match="exceeds population"):
        _spec(users_per_round=2000)
    with pytest.raises(ValueError, match="derivative_noise_multiplier"):
        _spec(derivative_noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="delta"):
        fdml_privacy.compute_epsilon(_spec(), 0.0)


@pytest.mark.parametrize("share", [0.2, 0.5, 0.8])
def test_calibrate_reaches_the_target_with_the_least_noise(share):
    # Without sampling: the search is the same, and sampled RDP costs ~2 s an evaluation.
    spec = _spec(derivative_noise_multiplier=0.0, gradient_noise_multiplier=0.0, sampling="none")
    calibrated = fdml_privacy.calibrate(spec, 4.0, 1e-5, derivative_share=share)
    epsilon = fdml_privacy.compute_epsilon(calibrated, 1e-5)
    assert 4.0 * 0.99 < epsilon <= 4.0
    z1 = calibrated.derivative_event_noise_multiplier
    z2 = calibrated.gradient_event_noise_multiplier
    z = 1 / math.sqrt(1 / z1**2 + 1 / z2**2)
    assert (z / z1) ** 2 == pytest.approx(share)


def test_calibrate_refuses_an_unreachable_target():
    with pytest.raises(ValueError, match="out of reach"):
        fdml_privacy.calibrate(_spec(sampling="none", rounds=10**6), 1e-6, 1e-10)
