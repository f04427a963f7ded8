"""Hostile inputs, second round (issue 37): inputs built to exhaust memory (YAML alias bombs, chat
templates that loop or repeat without end) and malformed files that used to end in a traceback.
Each trial runs the real command in a subprocess whose address space is capped
(`resource.RLIMIT_AS`), so that the code before the fix fails in a bounded way (a MemoryError
traceback, or the timeout) instead of filling the machine; after it, each is one line and status 2,
with nothing written."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from adapt_runs import REPO, write_recipe
from file_server import write_manifest
from ladder.io.data_fetch import DataFile
from ladder.io.files import sha256_file

# Far more than any of these commands needs to refuse its input, far less than the machine has.
MEMORY_CAP = 3 << 30


def ladder_capped(*args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """`ladder ARGS` in a subprocess whose address space is capped at MEMORY_CAP."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    return subprocess.run(
        [sys.executable, "-m", "ladder.cli", *map(str, args)],
        cwd=REPO,
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_refusal(result: subprocess.CompletedProcess, *words: str) -> str:
    error = result.stderr.strip()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(error.splitlines()) == 1 and len(error) < 600, error[:2000]
    for word in words:
        assert word in error, error
    return error


def alias_bomb(levels: int = 12, width: int = 9) -> list[str]:
    """YAML lines anchoring `a{levels}`: a list that aliases expand to width**levels leaves."""
    lines = ["a0: &a0 [lol]"]
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]")
    return lines


def flow_alias_bomb(levels: int = 12, width: int = 9) -> str:
    """The same bomb on one line, as a `key=value` override's value."""
    parts = ["a0: &a0 [lol]"]
    for level in range(1, levels + 1):
        parts.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]")
    return "{" + ", ".join(parts) + "}"


def test_a_recipe_alias_bomb_is_refused_in_one_line(tmp_path, tiny_checkpoint, corpus):
    """The recipe's error message used to expand the bomb with repr (past 3 GB)."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    text = "\n".join(line for line in recipe.read_text().splitlines() if not line.startswith("budget:"))
    recipe.write_text(text + "\nbudget:\n" + "".join(f"  {line}\n" for line in alias_bomb()))
    result = ladder_capped("adapt", recipe)
    assert_one_line_refusal(result, str(recipe), "alias")
    assert not (tmp_path / "run").exists()


def test_an_override_alias_bomb_is_refused_in_one_line(tmp_path, tiny_checkpoint, corpus):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    result = ladder_capped("adapt", recipe, f"budget={flow_alias_bomb()}")
    assert_one_line_refusal(result, "budget", "alias")
    assert not (tmp_path / "run").exists()


def test_a_suite_alias_bomb_is_refused_in_one_line(tmp_path, tiny_checkpoint):
    """The suite's error message used to expand the bomb with repr."""
    suite = tmp_path / "bomb.yaml"
    suite.write_text("\n".join([*alias_bomb(), "offline: *a12", "tasks: [ladder_piqa]"]) + "\n")
    result = ladder_capped("eval", tiny_checkpoint, "--suite", suite, "--out", tmp_path / "report", "--device", "cpu")
    assert_one_line_refusal(result, str(suite), "alias")
    assert not (tmp_path / "report").exists()


def test_adam_eps_below_zero_is_refused_with_the_recipe(tmp_path, tiny_checkpoint, corpus):
    """optimizer.eps=-1 used to pass the recipe and fail in torch's Adam, a traceback after the model loaded."""
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    result = ladder_capped("adapt", recipe, "optimizer.eps=-1")
    assert_one_line_refusal(result, "optimizer.eps")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("scheme", ["file", "ftp"])
def test_a_data_manifest_url_that_is_not_http_is_refused(tmp_path, scheme):
    """pooch took `file://` (a traceback: 'Unrecognized URL protocol') and `ftp://` as they came."""
    source = tmp_path / "secret.txt"
    source.write_text("a file of this machine")
    url = source.as_uri() if scheme == "file" else "ftp://127.0.0.1:9/secret.txt"
    entry = DataFile("books/secret.txt", source.stat().st_size, sha256_file(source), url)
    manifest = write_manifest(tmp_path / "manifest.tsv", [entry])
    result = ladder_capped("data", "--dest", tmp_path / "data", "--manifest", manifest, timeout=120)
    assert_one_line_refusal(result, f"{scheme}://", "books/secret.txt")
    assert not (tmp_path / "data" / "books").exists()
