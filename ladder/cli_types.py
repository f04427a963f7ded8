"""argparse number types, the one home for them, each a one-line ArgumentTypeError on bad input.
Floats are finite and, like counts that feed arithmetic, within a stated range.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable

from .errors import excerpt


def _number(text: str, kind: type, what: str, low: float, high: float | None = None) -> int | float:
    """`text` as a `kind` of at least `low` (else it is not `what`), or within low..high."""
    try:
        value = kind(text)
    except (TypeError, ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not {what} (it must be finite)")
    if high is None and value < low:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not {what}")
    if high is not None and not low <= value <= high:
        bounds = f"{low:g}..{high:g}" if kind is float else f"{low}..{high}"
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is outside {bounds}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", 1)


def non_negative_int(text: str) -> int:
    return _number(text, int, "a non-negative integer", 0)


def float_in(low: float, high: float) -> Callable[[str], float]:
    return functools.partial(_number, kind=float, what="a finite number", low=low, high=high)


def int_in(low: int, high: int) -> Callable[[str], int]:
    return functools.partial(_number, kind=int, what="an integer", low=low, high=high)


def comma_list(item: Callable[[str], int | float]) -> Callable[[str], list]:

    def parse(text: str) -> list:
        parts = [part.strip() for part in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"{excerpt(text)}: expected a comma-separated list, no empty items")
        return [item(part) for part in parts]

    return parse
