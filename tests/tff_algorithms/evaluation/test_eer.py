"""The FDML paper's EER authentication accuracy (Alg. 4, section VII-C)."""

import numpy as np
import pytest

from tff_algorithms.evaluation import eer


def test_threshold_balances_false_accepts_and_false_rejects():
    genuine = np.array([0.1, 0.2, 0.3, 0.9])
    impostor = np.array([0.25, 0.8, 1.0, 1.2])
    # From 0.3 up to 0.8: FNR 1/4 (0.9 rejected), FPR 1/4 (0.25 accepted); the middle.
    assert eer.eer_threshold(genuine, impostor) == pytest.approx(0.55)
    # Separable: every threshold between the groups has FPR = FNR = 0.
    assert eer.eer_threshold([0.1, 0.2], [0.5, 0.6]) == pytest.approx(0.35)
    with pytest.raises(ValueError, match="genuine and impostor"):
        eer.eer_threshold([], [0.5])


def _clusters(users, per_user, spread, seed=0, dim=8):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(users, dim)) * 3
    embeddings = np.concatenate([c + spread * rng.normal(size=(per_user, dim)) for c in centers])
    return embeddings, np.repeat(np.arange(users), per_user)


def test_separated_users_authenticate_perfectly_and_noise_is_chance():
    embeddings, labels = _clusters(25, 40, 0.01)
    result = eer.eer_accuracy(embeddings, labels)
    assert result.accuracy == 1.0 and result.balanced_accuracy == 1.0
    assert result.evaluated_users == 25 and result.skipped_users == 0

    rng = np.random.default_rng(1)
    noise = eer.eer_accuracy(rng.normal(size=embeddings.shape), labels, seed=3)
    assert 0.35 < noise.balanced_accuracy < 0.65


def test_short_users_are_skipped_and_too_few_users_refused():
    embeddings, labels = _clusters(23, 40, 0.5)
    short = np.concatenate([embeddings, embeddings[:5]])
    result = eer.eer_accuracy(short, np.concatenate([labels, np.full(5, 99)]))
    assert result.skipped_users == 1 and result.evaluated_users == 23
    same = eer.eer_accuracy(embeddings, labels)  # same seed, same draws
    assert result.per_user_accuracy == same.per_user_accuracy
    with pytest.raises(ValueError, match="needs 21"):
        eer.eer_accuracy(embeddings[: 20 * 40], labels[: 20 * 40])
