"""Squared L2 sensitivity of a binary-tree (DP-FTRL) release, per unit clip: the worst
case over one user's participations of the sum, over tree nodes, of (times the user is
counted in the node)^2. `accounting` turns it into zCDP and (epsilon, delta)."""

from __future__ import annotations

import functools


def tree_depth(leaves: int) -> int:
    """Nodes on a leaf-to-root path of a binary tree over `leaves` leaves."""
    return leaves.bit_length()


@functools.lru_cache(maxsize=256)
def single_tree_squared_sensitivity(
    total_steps: int, max_participation: int, min_separation: int
) -> float:
    """Worst-case sum over tree nodes of (times one user is counted)^2, from TF Privacy.

    Imported here because importing tensorflow_privacy imports TensorFlow (seconds);
    only DP-FTRL without restart needs it. TF Privacy's search is slow when the epoch is
    long (minutes for hundreds of rounds per epoch with two participations); results
    are cached per process, so calibration pays it once.
    """
    from tensorflow_privacy.privacy.analysis import tree_aggregation_accountant

    # zCDP of the tree at noise multiplier 1 is S / 2.
    return 2.0 * float(
        tree_aggregation_accountant.compute_zcdp_single_tree(
            noise_multiplier=1.0,
            total_steps=total_steps,
            max_participation=max_participation,
            min_separation=min_separation,
        )
    )


def tree_sensitivity_bound(total_steps: int, max_participation: int, min_separation: int) -> float:
    """A closed-form upper bound on `single_tree_squared_sensitivity`, O(log total_steps).

    Each level of the tree partitions the rounds into nodes of 2^l consecutive leaves, so a
    user's p participations put counts c_n on a level's nodes with sum p, and, with at
    least `min_separation` rounds strictly between two participations, each c_n <=
    m = min(p, ceil(2^l / (min_separation + 1))). A sum of squares with a fixed sum and
    each term at most m is largest with as many terms at m as fit: floor(p/m)·m² +
    (p mod m)². Summing over the levels bounds S.
    """
    total = 0
    p = max_participation
    for level in range(tree_depth(total_steps)):
        most = min(p, -(-(2**level) // (min_separation + 1)))
        full, rest = divmod(p, most)
        total += full * most**2 + rest**2
    return float(total)
