"""docs/commands.md names every flag of every `ladder` command, in that command's section, and
the flags every command shares in its conventions section: a flag added without its line fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ladder.cli import STAGES
from ladder.cli import main as ladder_main
from ladder.errors import ArgumentParser

COMMANDS_MD = Path(__file__).resolve().parents[1] / "docs" / "commands.md"
SHARED_FLAGS = {"--help", "--quiet", "--verbose"}  # every command's: the conventions section says them


def section(text: str, heading: str) -> str:
    """The text under the first heading that starts with `heading`, up to the next heading."""
    start = text.index(heading)
    following = re.search(r"^#{2,3} ", text[start + len(heading) :], flags=re.MULTILINE)
    return text[start : start + len(heading) + following.start()] if following else text[start:]


def flags(command: str, monkeypatch) -> set[str]:
    """The long flags of the parser that `ladder COMMAND` parses its arguments with."""
    parsers = []

    def capture(parser, args=None, namespace=None):
        parsers.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(ArgumentParser, "parse_known_args", capture)
    with pytest.raises(SystemExit):
        ladder_main([command, "--help"])  # parsed as any arguments are (adapt refuses none at all)
    return {flag for action in parsers[0]._actions for flag in action.option_strings if flag.startswith("--")}


def documented(flag: str, text: str) -> bool:
    # `--[no-]name` documents both spellings of a BooleanOptionalAction
    name = flag.removeprefix("--no-").removeprefix("--")
    return re.search(rf"`[^`]*{re.escape(flag)}(?![\w-])", text) is not None or f"--[no-]{name}" in text


@pytest.mark.parametrize("command", list(STAGES))
def test_every_flag_is_in_its_commands_section(command, monkeypatch):
    own = section(COMMANDS_MD.read_text(), f"### `ladder {command}")
    missing = sorted(flag for flag in flags(command, monkeypatch) - SHARED_FLAGS if not documented(flag, own))
    assert not missing, f"docs/commands.md, `ladder {command}`: {missing}"


def test_the_shared_flags_are_in_the_conventions():
    conventions = section(COMMANDS_MD.read_text(), "## Conventions")
    assert all(documented(flag, conventions) for flag in SHARED_FLAGS)
