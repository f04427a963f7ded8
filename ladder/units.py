"""Sizes as people write them (`80GB`, `80GiB`, `8e10`), the one parser for them: transformers'
`convert_file_size_to_int` takes neither fractions nor scientific notation, which datasheets use.
"""

from __future__ import annotations

import math
import re

from .errors import UsageError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE = re.compile(r"\s*(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[kmgt]i?b|b)?\s*", re.IGNORECASE)


def parse_size(text: str, flag: str) -> int:
    match = SIZE.fullmatch(text)
    if match is None:
        raise UsageError(f"{flag} {text!r} is not a size like 5GB, 80GiB, 500MB or 8e10 (bytes)")
    size = float(match["number"]) * UNITS[(match["unit"] or "").lower()]
    if not math.isfinite(size):
        raise UsageError(f"{flag} {text!r} is not a finite size")
    if size < 1:
        raise UsageError(f"{flag} {text!r} must be at least one byte")
    return int(size)
