"""Atomic outputs: a directory or file appears whole or not at all; existing outputs are kept."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ladder.errors import UsageError
from ladder.io.files import atomic_directory, atomic_write


def test_directory_appears_only_when_complete(tmp_path):
    final = tmp_path / "out"
    with atomic_directory(final) as temporary:
        (temporary / "weights").write_text("w")
        assert not final.exists()
    assert (final / "weights").read_text() == "w"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_existing_output_is_refused_then_replaced_with_force(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old").write_text("old")
    with pytest.raises(UsageError, match="--force"):
        with atomic_directory(final):
            pass
    assert (final / "old").exists()
    with atomic_directory(final, force=True) as temporary:
        (temporary / "new").write_text("new")
    assert sorted(p.name for p in final.iterdir()) == [".ladder-output", "new"]


def test_failure_keeps_the_old_output_and_leaves_no_temporary(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(final, force=True) as temporary:
            (temporary / "half").write_text("x")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (final / "old").read_text() == "old"


def test_sigkill_leaves_no_output_and_the_next_run_clears_the_leftover(tmp_path):
    final = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal
        from ladder.io.files import atomic_directory
        with atomic_directory({str(final)!r}) as temporary:
            (temporary / "half").write_text("x")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    result = subprocess.run([sys.executable, "-c", script])
    assert result.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert not final.exists() and len(leftovers) == 1 and leftovers[0].startswith(".out.tmp-")
    with atomic_directory(final) as temporary:
        (temporary / "whole").write_text("y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_sigkill_between_the_two_renames_of_a_replacement_loses_neither(tmp_path):
    # The forced replace renames the old output aside, then the new one into place. The script
    # kills itself right after the first rename: the old output is then only under its retired
    # name, and the next run must put it back rather than clear it as a stale temporary.
    final = tmp_path / "out"
    final.mkdir()
    (final / "old").write_text("old")
    script = textwrap.dedent(f"""
        import os, signal
        from ladder.io.files import atomic_directory
        real_rename = os.rename
        def rename_then_die(source, target):
            real_rename(source, target)
            if str(source) == {str(final)!r}:
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename_then_die
        with atomic_directory({str(final)!r}, force=True) as temporary:
            (temporary / "new").write_text("new")
    """)
    result = subprocess.run([sys.executable, "-c", script])
    assert result.returncode == -signal.SIGKILL
    assert not final.exists()
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert len(leftovers) == 2 and any(name.endswith("-old") for name in leftovers), leftovers

    # The next run that writes `out` recovers the old output first; a failure keeps it.
    with pytest.raises(RuntimeError):
        with atomic_directory(final, force=True):
            assert (final / "old").read_text() == "old"
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (final / "old").read_text() == "old"


def test_atomic_write_replaces_whole_file(tmp_path):
    path = tmp_path / "report.json"
    atomic_write(path, "first")
    atomic_write(path, b"second")
    assert path.read_text() == "second"
    assert os.listdir(tmp_path) == ["report.json"]
