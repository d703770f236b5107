"""The step loops' Adam and LAMB (issue 42) against their published update rules,
computed here in numpy, and the seed paper's remark that DP-Adam and DP-LAMB take the
same first step from zero weights."""

import numpy as np
import pytest
import tensorflow as tf

from tff_algorithms.modeling import optimizers


def _numpy_lamb(weights, gradients, lr, beta1, beta2, eps, decay, layerwise):
    """You et al. 2019, Algorithm 2 (LAMB) with φ(z) = z, per variable; without the
    trust ratio it is Adam (Kingma and Ba 2014) with decay λ in the update."""
    w = [np.array(x, np.float64) for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    for t, step in enumerate(gradients, start=1):
        for i, g in enumerate(step):
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            r = (m[i] / (1 - beta1**t)) / (np.sqrt(v[i] / (1 - beta2**t)) + eps) + decay * w[i]
            ratio = 1.0
            if layerwise and np.linalg.norm(w[i]) > 0 and np.linalg.norm(r) > 0:
                ratio = np.linalg.norm(w[i]) / np.linalg.norm(r)
            w[i] = w[i] - lr * ratio * r
    return w


@pytest.mark.parametrize("name", [optimizers.ADAM, optimizers.LAMB])
def test_three_steps_follow_the_published_rule(name):
    rng = np.random.default_rng(0)
    start = [rng.normal(size=(4, 3)), np.zeros(3), np.full(2, -10.0)]
    gradients = [[rng.normal(size=x.shape) for x in start] for _ in range(3)]
    lr, beta1, beta2, eps, decay = 0.01, 0.8, 0.99, 1e-6, 0.05
    want = _numpy_lamb(start, gradients, lr, beta1, beta2, eps, decay, name == optimizers.LAMB)
    variables = [tf.Variable(x.astype(np.float32)) for x in start]
    optimizer = optimizers.build_optimizer(
        name, lr, beta1=beta1, beta2=beta2, epsilon=eps, weight_decay=decay
    )
    for step in gradients:
        optimizer.apply_gradients(
            zip([tf.constant(g, tf.float32) for g in step], variables, strict=True)
        )
    for got, expected in zip(variables, want, strict=True):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_adam_and_lamb_take_the_same_sign_like_first_step_from_zero():
    """Appendix D.3: from zero weights one step of DP-LAMB is DP-Adam's, lr·m̂/(√v̂+ε)
    = lr·g/(|g|+ε), within ε of lr·sign(g) per coordinate."""
    rng = np.random.default_rng(1)
    noised = rng.normal(scale=1e-3, size=(50, 8)).astype(np.float32)  # a noised mean gradient
    lr, eps = 1e-3, 1e-8
    steps = {}
    for name in (optimizers.ADAM, optimizers.LAMB):
        w = tf.Variable(tf.zeros([50, 8]))
        optimizers.build_optimizer(name, lr, epsilon=eps, weight_decay=0.1).apply_gradients(
            [(tf.constant(noised), w)]
        )
        steps[name] = -w.numpy()
    np.testing.assert_array_equal(steps[optimizers.ADAM], steps[optimizers.LAMB])
    np.testing.assert_allclose(
        steps[optimizers.ADAM], lr * noised / (np.abs(noised) + eps), rtol=1e-5
    )
    # lr·sign(g) wherever |g| >> ε (off by lr·ε/(|g|+ε)).
    large = np.abs(noised) > 1e3 * eps
    assert large.mean() > 0.9
    np.testing.assert_allclose(
        steps[optimizers.ADAM][large], lr * np.sign(noised[large]), rtol=1e-3
    )
    # Not so for a variable that starts away from zero (the paper's bias at -10).
    for name in (optimizers.ADAM, optimizers.LAMB):
        b = tf.Variable(tf.fill([8], -10.0))
        optimizers.build_optimizer(name, lr, epsilon=eps).apply_gradients(
            [(tf.constant(noised[0]), b)]
        )
        steps[name] = b.numpy() + 10.0
    assert not np.allclose(steps[optimizers.ADAM], steps[optimizers.LAMB])


def test_sgd_keeps_keras_momentum_sgd_and_an_unknown_name_is_one_line():
    assert isinstance(optimizers.build_optimizer("sgd", 0.1, momentum=0.9), tf.keras.optimizers.SGD)
    with pytest.raises(
        ValueError, match="unknown optimizer 'adagrad': choose one of sgd, adam, lamb"
    ):
        optimizers.build_optimizer("adagrad", 0.1)
