"""The shared value checks: one (name, value, ...) order, one-line messages naming the field."""

import math

import numpy as np
import pytest

from tff_algorithms.base import validation


@pytest.mark.parametrize(
    "check, args, message",
    [
        (validation.check_int, ("rounds", 2.5, 1), "rounds must be an integer, got 2.5"),
        (validation.check_int, ("rounds", True, 1), "rounds must be an integer, got True"),
        (validation.check_int, ("rounds", 0, 1), "rounds must be >= 1, got 0"),
        (validation.check_real, ("delta", "0.1"), "delta must be a number, got '0.1'"),
        (validation.check_real, ("delta", False), "delta must be a number, got False"),
        (validation.check_fraction, ("share", 1.5), "share must be a fraction in [0, 1], got 1.5"),
        (validation.check_fraction, ("share", -0.1), "share must be finite and in [0, inf)"),
        (validation.check_bool, ("flag", 1), "flag must be a boolean, got 1"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_field(check, args, message):
    with pytest.raises(ValueError) as raised:
        check(*args)
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "value, low, high, low_open, ok",
    [
        (0.0, 0, math.inf, False, True),
        (0.0, 0, math.inf, True, False),
        (1.0, 0, 1, False, False),
        (math.nan, 0, math.inf, False, False),
        (math.inf, 0, math.inf, False, False),
        (np.float32(0.5), 0, 1, True, True),
    ],
)
def test_check_number_bounds(value, low, high, low_open, ok):
    if ok:
        validation.check_number("x", value, low, high, low_open=low_open)
    else:
        with pytest.raises(ValueError, match=r"x must be finite and in [\[(]"):
            validation.check_number("x", value, low, high, low_open=low_open)


def test_numpy_integers_and_booleans_are_accepted():
    validation.check_int("seed", np.int64(3), 0)
    validation.check_bool("flag", False)
