"""Untrusted inputs and concurrent runs (issue 28): paths that leave their folder, code shipped in
a checkpoint, outputs that two runs share, symlinks out of an input, malformed headers. Each test
is a trial an attacker or a careless user would run; each failed on the code before the fix."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_fetch import Server, write_manifest

from ladder.cli import main as ladder_main
from ladder.errors import UsageError
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


def remote_code_checkpoint(folder: Path, marker: Path) -> Path:
    """A checkpoint whose config names its own model_type and ships the code for it (`auto_map`):
    importing that code writes `marker`."""
    folder.mkdir()
    classes = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": classes}))
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    return folder


def test_no_code_shipped_in_a_checkpoint_runs_even_when_the_user_says_yes(tmp_path):
    """`ladder sample` used to load without trust_remote_code=False: transformers asked "run the
    custom code? [y/N]", and the answer y ran it."""
    marker = tmp_path / "ran"
    model = remote_code_checkpoint(tmp_path / "model", marker)
    command = [sys.executable, "-m", "ladder.cli", "sample", str(model), "--out", str(tmp_path / "s.jsonl")]
    done = subprocess.run([*command, "--tokens", "8"], input="y\ny\ny\n", capture_output=True, text=True, timeout=120)
    assert not marker.exists()
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"ladder sample: error: {model / 'config.json'} has model_type 'evil'; "
        "supported: 'llama' or 'llamaLadder' (Llama-architecture checkpoints)"
    ]


def test_every_reader_of_an_input_refuses_a_non_llama_model_type(tmp_path):
    """adapt's model check accepted any model_type; the TP reader asked transformers first."""
    from adapt.recipe import load_recipe
    from adapt.train import check_model
    from ladder.tp.runtime import read_config

    model = remote_code_checkpoint(tmp_path / "model", tmp_path / "ran")
    recipe = load_recipe("recipes/smollm2-135m-ladder-cpu.yaml", [f"model.path={model}"])
    for check in (lambda: check_model(recipe), lambda: read_config(model)):
        with pytest.raises(UsageError, match="model_type 'evil'"):
            check()
    assert not (tmp_path / "ran").exists()
