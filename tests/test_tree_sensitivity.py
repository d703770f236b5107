"""Tree sensitivity: the closed-form bound against TF Privacy's exact search."""

import pytest

from tff_algorithms import tree_sensitivity


@pytest.mark.parametrize(
    "total_steps, participations, separation",
    [(35, 4, 9), (64, 2, 31), (100, 10, 9), (200, 3, 66), (300, 30, 9), (77, 1, 76), (500, 7, 75)],
)
def test_tree_sensitivity_bound_is_above_the_exact_search(total_steps, participations, separation):
    """The closed-form bound used beyond accounting.EXACT_TREE_MAX_ROUNDS never undercuts TF
    Privacy's exact worst case, and stays within half again of it."""
    exact = tree_sensitivity.single_tree_squared_sensitivity(
        total_steps, participations, separation
    )
    bound = tree_sensitivity.tree_sensitivity_bound(total_steps, participations, separation)
    assert exact <= bound <= 1.5 * exact
