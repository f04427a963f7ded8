"""Bad user input: the one exception type for it, the argparse parser every command uses, which
raises it, and `run_command`, which turns it into one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import reprlib
import sys
from collections.abc import Callable

from ladder import log


class UsageError(Exception):
    """Bad input (a path, a flag, a recipe key): the message says what is wrong and how to fix it."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type name when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def excerpt(value: object, limit: int = 80) -> str:
    """`repr(value)` in at most about `limit` characters, never expanded whole however large."""
    shown = _EXCERPT.repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


_EXCERPT = reprlib.Repr()  # keyword arguments need Python 3.12
_EXCERPT.maxlevel, _EXCERPT.maxstring, _EXCERPT.maxother, _EXCERPT.maxlong = 3, 60, 60, 40
_EXCERPT.maxlist = _EXCERPT.maxtuple = _EXCERPT.maxdict = _EXCERPT.maxset = 4


class ArgumentParser(argparse.ArgumentParser):
    """Every command's parser: bad arguments are a UsageError (one line, exit 2); `-q` and `-v` set
    `ladder.log` as soon as the arguments are parsed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        volume = self.add_mutually_exclusive_group()
        volume.add_argument("-q", "--quiet", action="store_true", help="say only warnings and errors")
        volume.add_argument(
            "-v", "--verbose", action="count", default=0, help="say more: debug detail and the libraries' messages"
        )

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        log.configure(-1 if parsed.quiet else parsed.verbose)
        return parsed, rest

    def error(self, message: str):
        raise UsageError(message)


def run_command(name: str, main: Callable[[list[str]], int | None], argv: list[str], label: str = "") -> int:
    """How every command ends: a `UsageError` is one line on stderr and status 2, Ctrl-C 130. The
    lines start with `label` (default `ladder NAME`)."""
    label = label or f"ladder {name}"
    try:
        return main(argv) or 0
    except UsageError as error:
        print(f"{label}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{label}: interrupted", file=sys.stderr)
        return 130
