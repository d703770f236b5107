"""Checks of one configuration value, shared by the config dataclasses.

Each takes (name, value, ...) and raises a one-line ValueError that names the field and
what it must be. No TensorFlow at import: configs are read by the CLI's checks, the
pipeline and the benchmarks before any heavy import.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def check_int(name: str, value: Any, minimum: int) -> None:
    """An integer (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_real(name: str, value: Any) -> None:
    """An int or float (not a bool); finiteness and range are the caller's rule."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")


def check_number(
    name: str, value: Any, low: float, high: float = math.inf, *, low_open: bool
) -> None:
    """A finite number in [low, high), or (low, high) when `low_open`."""
    check_real(name, value)
    above_low = value > low if low_open else value >= low
    if not (math.isfinite(value) and above_low and value < high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g})"
        raise ValueError(f"{name} must be finite and in {interval}, got {value}")


def check_fraction(name: str, value: Any) -> None:
    """A number in [0, 1]."""
    check_number(name, value, 0, low_open=False)
    if value > 1:
        raise ValueError(f"{name} must be a fraction in [0, 1], got {value}")


def check_bool(name: str, value: Any) -> None:
    """True or False (not 0 or 1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")
