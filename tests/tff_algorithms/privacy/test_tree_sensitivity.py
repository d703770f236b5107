"""Tree sensitivity: the closed-form bound against TF Privacy's exact search, and the
sensitivity the accountant uses against a brute-force count of the tree nodes one user
touches on small trees.

The brute force shares nothing with `tree_sensitivity`: it lists the nodes a tree over T
rounds releases (the complete dyadic blocks [k 2^l, (k+1) 2^l) within [0, T): a prefix
sum up to round t only ever adds complete blocks, so an incomplete one is never noised or
released), enumerates every set of rounds one user may take part in, and sums, over the
nodes, the square of how many of its rounds each node holds (the squared L2 sensitivity
of the whole tree release per unit clip, `tree_sensitivity`'s docstring).
"""

import itertools
import math

import pytest

from tff_algorithms.privacy import accounting, accounting_spec, tree_sensitivity


@pytest.mark.parametrize(
    "total_steps, participations, separation",
    [(35, 4, 9), (64, 2, 31), (100, 10, 9), (200, 3, 66), (300, 30, 9), (77, 1, 76), (500, 7, 75)],
)
@pytest.mark.slow
def test_tree_sensitivity_bound_is_above_the_exact_search(total_steps, participations, separation):
    """The closed-form bound used beyond accounting.EXACT_TREE_MAX_ROUNDS never undercuts TF
    Privacy's exact worst case, and stays within half again of it."""
    exact = tree_sensitivity.single_tree_squared_sensitivity(
        total_steps, participations, separation
    )
    bound = tree_sensitivity.tree_sensitivity_bound(total_steps, participations, separation)
    assert exact <= bound <= 1.5 * exact


def _released_nodes(rounds: int) -> list[range]:
    """The rounds each released node of a tree over `rounds` leaves sums."""
    nodes, width = [], 1
    while width <= rounds:
        nodes += [range(start, start + width) for start in range(0, rounds - width + 1, width)]
        width *= 2
    return nodes


def _node_count_square_sum(rounds: int, participated: tuple[int, ...]) -> int:
    return sum(sum(r in node for r in participated) ** 2 for node in _released_nodes(rounds))


def _allowed_participations(rounds: int, most: int, separation: int):
    """Every set of at most `most` rounds with at least `separation` rounds strictly
    between two of them."""
    for count in range(1, most + 1):
        for chosen in itertools.combinations(range(rounds), count):
            if all(b - a > separation for a, b in zip(chosen, chosen[1:])):
                yield chosen


def _brute_force(rounds: int, most: int, separation: int) -> int:
    return max(
        _node_count_square_sum(rounds, chosen)
        for chosen in _allowed_participations(rounds, most, separation)
    )


def _tree_spec(population: int, rounds: int, restart: bool) -> accounting_spec.AccountingSpec:
    # One user per round: rounds_per_epoch = population, a user returns once an epoch.
    return accounting_spec.AccountingSpec(
        population=population,
        users_per_round=1,
        rounds=rounds,
        noise_multiplier=1.0,
        delta=1e-5,
        mechanism=accounting_spec.Mechanism.DPFTRL,
        restart_every_epoch=restart,
    )


def test_released_nodes_of_a_small_tree():
    # 5 rounds: 5 leaves, [0,2) and [2,4), and [0,4); [4,6) and [0,8) never complete.
    assert sorted((n.start, n.stop) for n in _released_nodes(5)) == [
        (0, 1), (0, 2), (0, 4), (1, 2), (2, 3), (2, 4), (3, 4), (4, 5)
    ]  # fmt: skip


@pytest.mark.parametrize("population", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("rounds", [1, 2, 3, 5, 6, 8, 11, 13])
def test_single_tree_sensitivity_is_the_brute_force_worst_case(population, rounds):
    """Without restart, the accountant's S (TF Privacy's search at these sizes) is the
    largest node-count square sum over every participation pattern its max participations
    and min separation allow, and the schedule's own patterns (one fixed user order each
    epoch: every `population` rounds from any first round) stay within it."""
    spec = _tree_spec(population, rounds, restart=False)
    most, separation = spec.max_participations, spec.tree_min_separation
    assert (most, separation) == (math.ceil(rounds / population), population - 1)
    used = accounting.tree_squared_sensitivity(spec)
    assert used == pytest.approx(_brute_force(rounds, most, separation))
    for first in range(min(population, rounds)):
        schedule = tuple(range(first, rounds, population))
        assert _node_count_square_sum(rounds, schedule) <= used + 1e-9
    assert tree_sensitivity.tree_sensitivity_bound(rounds, most, separation) >= used - 1e-9


@pytest.mark.parametrize(
    "population, rounds", [(1, 4), (2, 5), (3, 7), (4, 12), (5, 13), (6, 6), (7, 20)]
)
def test_restarted_tree_sensitivity_is_the_brute_force_worst_case(population, rounds):
    """With a restart every epoch, each epoch is its own tree in which a user takes part
    at most once: S is the sum over the trees of the most nodes one round belongs to."""
    spec = _tree_spec(population, rounds, restart=True)
    epochs = [population] * (rounds // population) + [rounds % population] * bool(
        rounds % population
    )
    expected = sum(_brute_force(epoch, 1, 0) for epoch in epochs)
    assert accounting.tree_squared_sensitivity(spec) == pytest.approx(expected)
