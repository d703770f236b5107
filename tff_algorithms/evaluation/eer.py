"""The FDML paper's authentication accuracy at the equal-error-rate threshold (its Alg. 4 and
section VII-C), on held-out users' embeddings. numpy only.

For each evaluated identity ("user"), its first `template + threshold + test` embeddings
(in the order given) are split into three parts: A (the template, their mean), B
(threshold selection) and C (accuracy). Other users are drawn from (seed, user) alone:
`reference_users` whose B parts serve as impostors for the threshold, and
`reference_users` more, none of them the first ones, whose C parts serve as impostors for
the accuracy (the paper: ten and ten).

Threshold (Alg. 4): the distances from the template to the user's own B (genuine) and to
the reference users' B (impostor). An embedding is ACCEPTED when its Euclidean distance to
the template is at most the threshold. Candidates are the observed distances; the
smallest one that minimises |FPR - FNR| (FPR: impostors accepted, FNR: genuine rejected)
is found, and the threshold is the middle between it and the next observed distance
(every threshold in between has the same error rates).

Accuracy: with that threshold, the user's own C should be accepted and the other
reference users' C rejected. The paper does not say whether its accuracy weights the two
sides equally; both are returned: `accuracy` over all those embeddings (test + test x
reference_users of them) and `balanced_accuracy` = (TPR + TNR) / 2. Each is averaged over
the evaluated users. Users with fewer embeddings than the three parts need are skipped
and counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tff_algorithms.base import validation


@dataclasses.dataclass(frozen=True)
class EerAccuracy:
    accuracy: float
    balanced_accuracy: float
    evaluated_users: int
    skipped_users: int
    # Per evaluated user, in the order of their labels' first appearance.
    per_user_accuracy: tuple[float, ...]
    per_user_threshold: tuple[float, ...]


def eer_threshold(genuine: np.ndarray, impostor: np.ndarray) -> float:
    """Alg. 4: the distance threshold where FPR is closest to FNR (accept: distance <= t)."""
    genuine = np.sort(np.asarray(genuine, np.float64))
    impostor = np.sort(np.asarray(impostor, np.float64))
    if not (len(genuine) and len(impostor)):
        raise ValueError("the threshold needs genuine and impostor distances")
    candidates = np.unique(np.concatenate([genuine, impostor]))
    false_reject = 1 - np.searchsorted(genuine, candidates, side="right") / len(genuine)
    false_accept = np.searchsorted(impostor, candidates, side="right") / len(impostor)
    best = int(np.argmin(np.abs(false_accept - false_reject)))  # the first minimum
    if best + 1 == len(candidates):
        return float(candidates[best])
    # Every threshold up to the next observed distance has the same error rates: take
    # the middle, so that unseen embeddings near either side are not decided by the edge.
    return float((candidates[best] + candidates[best + 1]) / 2)


def eer_accuracy(
    embeddings: np.ndarray,
    labels: Sequence | np.ndarray,
    *,
    template: int = 20,
    threshold: int = 10,
    test: int = 10,
    reference_users: int = 10,
    seed: int = 0,
) -> EerAccuracy:
    """The paper's authentication accuracy (module docstring) of [N, d] `embeddings`."""
    for name, value in (
        ("template", template),
        ("threshold", threshold),
        ("test", test),
        ("reference_users", reference_users),
    ):
        validation.check_int(name, value, 1)
    embeddings = np.asarray(embeddings, np.float64)
    labels = np.asarray(labels)
    if embeddings.ndim != 2 or len(embeddings) != len(labels):
        raise ValueError("embeddings must be [N, d] with one label per row")
    needed = template + threshold + test
    users, first = np.unique(labels, return_index=True)
    users = users[np.argsort(first)]
    parts = {}
    skipped = 0
    for user in users:
        rows = embeddings[labels == user]
        if len(rows) < needed:
            skipped += 1
            continue
        parts[user] = (
            rows[:template].mean(axis=0),
            rows[template : template + threshold],
            rows[template + threshold : needed],
        )
    evaluated = list(parts)
    if len(evaluated) < 2 * reference_users + 1:
        raise ValueError(
            f"{len(evaluated)} users have {needed} embeddings; the protocol needs "
            f"{2 * reference_users + 1} ({reference_users} reference users twice, plus one)"
        )
    accuracies, balanced, thresholds = [], [], []
    for index, user in enumerate(evaluated):
        center, own_b, own_c = parts[user]
        others = [u for u in evaluated if u != user]
        rng = np.random.default_rng([seed, index])
        chosen = rng.choice(len(others), size=2 * reference_users, replace=False)
        for_threshold = [others[i] for i in chosen[:reference_users]]
        for_test = [others[i] for i in chosen[reference_users:]]

        def distances(rows: np.ndarray, center: np.ndarray = center) -> np.ndarray:
            return np.linalg.norm(rows - center, axis=1)

        cut = eer_threshold(
            distances(own_b), np.concatenate([distances(parts[u][1]) for u in for_threshold])
        )
        accepted_own = distances(own_c) <= cut
        rejected_other = np.concatenate([distances(parts[u][2]) for u in for_test]) > cut
        correct = int(accepted_own.sum() + rejected_other.sum())
        accuracies.append(correct / (len(accepted_own) + len(rejected_other)))
        balanced.append((accepted_own.mean() + rejected_other.mean()) / 2)
        thresholds.append(cut)
    return EerAccuracy(
        accuracy=float(np.mean(accuracies)),
        balanced_accuracy=float(np.mean(balanced)),
        evaluated_users=len(evaluated),
        skipped_users=skipped,
        per_user_accuracy=tuple(float(a) for a in accuracies),
        per_user_threshold=tuple(thresholds),
    )
