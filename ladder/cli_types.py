"""argparse number types, the one home for them: `type=positive_int` and the like on every command.
Each raises argparse.ArgumentTypeError with a one-line message, which argparse reports as
`argument --tp: ...` (ladder.errors.ArgumentParser: one line, exit 2) before any work. Floats are
finite (no nan, no inf) and, like counts that feed arithmetic, within a stated range (`float_in`, `int_in`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .errors import excerpt


def _number(text: str, kind: type, what: str) -> int | float:
    try:
        value = kind(text)
    except (TypeError, ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not {what} (it must be finite)")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = _number(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    value = _number(text, int, "a non-negative integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a non-negative integer")
    return value


def float_in(low: float, high: float) -> Callable[[str], float]:
    """A finite number from `low` to `high` (both included), e.g. a device's FLOP/s: a figure outside
    the physical range (1e-300, 1e999) is a typo, never a plan."""

    def parse(text: str) -> float:
        value = _number(text, float, "a finite number")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{excerpt(text)} is outside {low:g}..{high:g}")
        return value

    return parse


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An integer from `low` to `high` (both included), e.g. a count of tokens, which beyond any context
    is a typo that would overflow the arithmetic it feeds."""

    def parse(text: str) -> int:
        value = _number(text, int, "an integer")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{excerpt(text)} is outside {low}..{high}")
        return value

    return parse


def comma_list(item: Callable[[str], int | float]) -> Callable[[str], list]:
    """`1,16,64` parsed item by item (`comma_list(positive_int)`); an empty list is refused."""

    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"{excerpt(text)}: expected a comma-separated list, no empty items")
        return [item(part) for part in parts]

    return parse


positive_ints = comma_list(positive_int)
