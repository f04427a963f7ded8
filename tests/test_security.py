"""Untrusted inputs and concurrent runs (issue 28): paths that leave their folder, code shipped in
a checkpoint, outputs that two runs share, symlinks out of an input, malformed headers. Each test
is a trial an attacker or a careless user would run; each failed on the code before the fix."""

from __future__ import annotations

import hashlib

import pytest
from test_data_fetch import Server, write_manifest

from ladder.cli import main as ladder_main
from ladder.io.data_fetch import DataFile


@pytest.mark.parametrize("escape", ["../victim.txt", "ABSOLUTE", "link/victim.txt"])
def test_data_manifest_paths_that_leave_dest_are_refused_before_anything_is_touched(tmp_path, capsys, escape):
    """A manifest path outside --dest (`..`, absolute, through a symlink) used to delete the file
    there (its checksum differs) and download another in its place."""
    www, destination = tmp_path / "www", tmp_path / "data"
    www.mkdir()
    destination.mkdir()
    (www / "payload").write_bytes(b"attacker's bytes")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    (destination / "link").symlink_to(tmp_path)
    path = str(victim) if escape == "ABSOLUTE" else escape
    server = Server(www)
    try:
        payload = DataFile(path, 16, hashlib.sha256(b"attacker's bytes").hexdigest(), f"{server.url}/payload")
        good = DataFile("ok.txt", 16, payload.sha256, f"{server.url}/payload")
        manifest = write_manifest(tmp_path / "manifest.tsv", [good, payload])
        assert ladder_main(["data", "--dest", str(destination), "--manifest", str(manifest)]) == 2
    finally:
        server.close()
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "leave" in error and path in error
    assert victim.read_text() == "the user's file"
    assert server.requests == [] and not (destination / "ok.txt").exists()
