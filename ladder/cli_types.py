"""argparse number types, the one home for them, each a one-line ArgumentTypeError on bad input.
Floats are finite and, like counts that feed arithmetic, within a stated range.
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
    value = _number(text, int, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int, "a non-negative integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a non-negative integer")
    return value


def float_in(low: float, high: float) -> Callable[[str], float]:

    def parse(text: str) -> float:
        value = _number(text, float, "a finite number")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{excerpt(text)} is outside {low:g}..{high:g}")
        return value

    return parse


def int_in(low: int, high: int) -> Callable[[str], int]:

    def parse(text: str) -> int:
        value = _number(text, int, "an integer")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{excerpt(text)} is outside {low}..{high}")
        return value

    return parse


def comma_list(item: Callable[[str], int | float]) -> Callable[[str], list]:

    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"{excerpt(text)}: expected a comma-separated list, no empty items")
        return [item(part) for part in parts]

    return parse


positive_ints = comma_list(positive_int)
