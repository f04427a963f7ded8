"""Untrusted inputs and concurrent runs (issue 28): paths that leave their folder, code shipped in
a checkpoint, outputs that two runs share, symlinks out of an input, malformed headers. Each test
is a trial an attacker or a careless user would run; each failed on the code before the fix."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from adapt_runs import REPO, chat_corpus, write_recipe
from file_server import Server, write_manifest
from ladder.cli import main as ladder_main
from ladder.errors import UsageError
from ladder.io.data_fetch import DataFile
from ladder.io.files import atomic_directory


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


@pytest.mark.parametrize("command", ["sample", "eval", "convert", "serve"])
def test_no_code_shipped_in_a_checkpoint_runs_even_when_the_user_says_yes(tmp_path, monkeypatch, capsys, command):
    """`ladder sample` and `ladder eval` used to load without trust_remote_code=False: transformers
    asked "run the custom code? [y/N]", and the answer y ran it (eval: then a traceback)."""
    marker = tmp_path / "ran"
    model = remote_code_checkpoint(tmp_path / "model", marker)
    extra = {
        "sample": ["--out", str(tmp_path / "s.jsonl"), "--tokens", "8"],
        "eval": ["--out", str(tmp_path / "report"), "--limit", "2", "--device", "cpu"],
        "convert": ["--out", str(tmp_path / "ladder")],
        "serve": ["--check-only"],
    }[command]
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\ny\n"))
    status = ladder_main([command, str(model), *extra])
    error = capsys.readouterr().err
    assert not marker.exists()
    assert status == 2, error
    assert error.strip().splitlines() == [
        f"ladder {command}: error: {model / 'config.json'} has model_type 'evil'; "
        "supported families: llama, mistral, qwen2, qwen3 (and their ladder forms llamaLadder, mistralLadder, "
        "qwen2Ladder, qwen3Ladder)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_every_reader_of_an_input_refuses_a_non_llama_model_type(tmp_path):
    """adapt's model check accepted any model_type; the TP reader asked transformers first."""
    from ladder.adapt.preflight import check_model
    from ladder.adapt.recipe import load_recipe
    from ladder.tp.runtime import read_config

    model = remote_code_checkpoint(tmp_path / "model", tmp_path / "ran")
    recipe = load_recipe(REPO / "recipes" / "smollm2-135m-ladder-cpu.yaml", [f"model.path={model}"])
    for check in (lambda: check_model(recipe), lambda: read_config(model)):
        with pytest.raises(UsageError, match="model_type 'evil'"):
            check()
    assert not (tmp_path / "ran").exists()


# --- Two runs, one output (items 3, 4, 5) ----------------------------------------------------------

HOLDER = """
import fcntl, os, sys
from ladder.errors import UsageError
from ladder.io.files import atomic_directory
out = sys.argv[1]
try:
    if sys.argv[2] == "lock":  # what a live `ladder adapt` holds on its output_dir
        os.makedirs(out)
        fcntl.flock(os.open(os.path.join(out, ".ladder-output"), os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX)
        print("ready", flush=True)
        sys.stdin.readline()
    else:
        with atomic_directory(out) as staging:
            (staging / "weights").write_text("this run's")
            print("ready", flush=True)
            sys.stdin.readline()
except UsageError as error:
    print(error, file=sys.stderr)
    sys.exit(2)
"""


def start_holder(out: Path, mode: str = "stage", prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """A run in another process that has started writing `out` (or locked it) and waits for a line on stdin."""
    holder = subprocess.Popen(
        [*prefix, sys.executable, "-c", HOLDER, str(out), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "ready\n", holder.stderr.read()
    return holder


def finish(holder: subprocess.Popen) -> tuple[int, str]:
    _, error = holder.communicate("go\n", timeout=60)
    return holder.returncode, error


def test_an_output_that_appears_while_a_run_works_is_not_replaced(tmp_path):
    """The "already exists" check ran only at the start: the final rename replaced what appeared."""
    out = tmp_path / "out"
    holder = start_holder(out)
    out.mkdir()
    (out / "theirs").write_text("another run's output")
    code, error = finish(holder)
    assert code == 2 and "appeared while this run worked" in error and len(error.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["theirs"]
    (kept,) = tmp_path.glob("out.conflict-*")  # this run's work is not lost either
    assert (kept / "weights").read_text() == "this run's"


def test_atomic_write_without_replace_refuses_a_file_that_appeared_meanwhile(tmp_path, monkeypatch):
    """`ladder sample --out F` without --force: a file written at F by another run during the
    write (here: at the moment the data is flushed) is kept, not replaced."""
    from ladder.io.files import atomic_write

    target, real_fsync = tmp_path / "samples.jsonl", os.fsync

    def another_run_writes_the_target(descriptor):
        real_fsync(descriptor)
        if not target.exists():
            target.write_text("theirs")

    monkeypatch.setattr(os, "fsync", another_run_writes_the_target)
    with pytest.raises(UsageError, match="appeared while this run wrote it"):
        atomic_write(target, "ours", replace=False)
    assert target.read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["samples.jsonl"]


def dead_pid() -> int:
    """A PID no process has in this namespace (the PID a run in another namespace may well have)."""
    for pid in range(30000, 300, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    pytest.skip("no free PID found")


def test_a_live_run_in_another_pid_namespace_keeps_its_temporaries(tmp_path):
    """Temporaries were judged stale by PID: a second run saw the PID of a run in another PID
    namespace (container, node) as dead, deleted its staging folder, and the live run crashed.
    Now the live run holds a lock, and the second run is refused instead."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-pfr", "true"]).returncode != 0:
        pytest.skip("no unprivileged PID namespaces here")
    pid = dead_pid()
    # In a new PID namespace the live run gets PID `pid`, which is free (dead) in this one.
    prefix = (
        "unshare",
        "-pfr",
        "--mount-proc",
        "sh",
        "-c",
        f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid; "$@"',
        "-",
    )
    out = tmp_path / "out"
    holder = start_holder(out, prefix=prefix)
    with pytest.raises(UsageError, match="another run is writing"):
        with atomic_directory(out) as staging:
            (staging / "weights").write_text("second run's")
    code, error = finish(holder)
    assert code == 0, error
    assert (out / "weights").read_text() == "this run's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_killed_writes_leave_no_temporaries_behind(tmp_path):
    """atomic_write's `.tmp` files of killed writes stayed forever; a live write's is kept."""
    from ladder.io.files import atomic_write

    target = tmp_path / "scores.json"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WRITE, str(target)], capture_output=True, text=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL
    assert len(list(tmp_path.glob(".scores.json.tmp-*"))) == 1
    atomic_write(target, "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["scores.json"]


KILLED_WRITE = """
import os, signal, sys
import ladder.io.files as files
def die(descriptor):
    os.kill(os.getpid(), signal.SIGKILL)
os.fsync = die
files.atomic_write(sys.argv[1], "half")
"""


def test_force_replaces_only_an_earlier_output_of_the_same_command(tmp_path):
    """--force deleted any folder, also one holding other models, without checking it was an
    earlier output."""
    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    (models / "llama" / "model.safetensors").write_text("weights")
    with pytest.raises(UsageError, match="replaces only an earlier output of `ladder convert`"):
        with atomic_directory(models, force=True, command="convert"):
            pass
    assert (models / "llama" / "model.safetensors").read_text() == "weights"
    with atomic_directory(tmp_path / "out", command="convert") as staging:
        (staging / "a").write_text("first")
    with pytest.raises(UsageError, match="`ladder eval`"):
        with atomic_directory(tmp_path / "out", force=True, command="eval"):
            pass
    with atomic_directory(tmp_path / "out", force=True, command="convert") as staging:
        (staging / "a").write_text("second")
    assert (tmp_path / "out" / "a").read_text() == "second"


@pytest.mark.parametrize("where", ["the model", "inside the model", "its parent"])
def test_eval_out_may_not_be_a_model_it_scores(tmp_path, tiny_checkpoint, capsys, where):
    """`ladder eval MODEL --out MODEL --force` deleted the model and left a report in its place."""
    model = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_checkpoint, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    out = {"the model": model, "inside the model": model / "results", "its parent": model.parent}[where]
    argv = ["eval", str(model), "--out", str(out), "--force", "--limit", "2", "--no-cache", "--device", "cpu"]
    assert ladder_main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and ("overlaps the input" in error or "earlier output" in error), error
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


@pytest.mark.slow  # two conversion processes, each verifying
def test_two_conversions_into_one_folder_never_both_succeed(tmp_path, tiny_checkpoint):
    """Two `ladder convert` runs into one --out, started together, both exited 0 and the second
    silently replaced the first. Verification (seconds) keeps both inside their staging at once."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "ladder.cli", "convert", str(tiny_checkpoint), "--out", str(out), "--layers"]
    runs = {
        layers: subprocess.Popen(
            [*command, layers],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for layers in ("1", "2")
    }
    ended = {layers: (run.communicate(timeout=300)[1], run.returncode) for layers, run in runs.items()}
    assert sorted(code for _, code in ended.values()) == [0, 2], ended
    (winner,) = (layers for layers, (_, code) in ended.items() if code == 0)
    (lines,) = (stderr.strip().splitlines() for stderr, code in ended.values() if code == 2)
    progress = [line for line in lines if line.startswith("verifying")]  # refused after its verification
    assert lines == [*progress, lines[-1]] and lines[-1].startswith("ladder convert: error: "), lines
    manifest = json.loads((out / "conversion.json").read_text())
    assert manifest["ladder_layers"] == list(range(4 - int(winner), 4))  # the survivor is one run's, whole
    written = {p.name: p.read_bytes() for p in out.iterdir() if p.name in ("model.safetensors", "tokenizer.json")}
    assert written == {name: (tiny_checkpoint / name).read_bytes() for name in written} and len(written) == 2


def small_recipe(tmp_path: Path, checkpoint: Path) -> Path:
    """A recipe of a few steps on a small corpus, its output_dir tmp_path / "run"."""
    corpus = tmp_path / "corpus"
    (corpus / "train").mkdir(parents=True)
    (corpus / "train" / "book.txt").write_text("The sea was calm and the ship sailed on. " * 400)
    (corpus / "heldout.txt").write_text("The wind rose over the hills at dawn. " * 300)
    return write_recipe(tmp_path, checkpoint, corpus, budget=256)


def test_adapt_output_dir_is_locked_for_the_run_s_life(tmp_path, tiny_checkpoint, capsys):
    """Two `ladder adapt` runs into one output_dir both ran (metrics.jsonl held 99 records for 50 steps)."""
    recipe = small_recipe(tmp_path, tiny_checkpoint)
    holder = start_holder(tmp_path / "run", mode="lock")  # a run of this recipe, alive
    try:
        assert ladder_main(["adapt", str(recipe)]) == 2
    finally:
        finish(holder)
    assert "another run is writing" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_adapt_refuses_a_run_that_finished_while_it_loaded_its_model(tmp_path, tiny_checkpoint, capsys, monkeypatch):
    """A second run that passed the "earlier run" check before the first wrote metrics.jsonl, and
    took the lock after the first finished, emptied that run's metrics and trained over it."""
    import ladder.adapt.train as adapt_train

    recipe, theirs = small_recipe(tmp_path, tiny_checkpoint), '{"step": 1, "loss": 2.5}\n'
    lock_output = adapt_train.lock_output

    def another_run_finishes_first(directory: Path, command: str):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "metrics.jsonl").write_text(theirs)
        return lock_output(directory, command)

    monkeypatch.setattr(adapt_train, "lock_output", another_run_finishes_first)
    assert ladder_main(["adapt", str(recipe)]) == 2
    error = capsys.readouterr().err  # after transformers' weight-loading bar
    assert error.strip().splitlines()[-1].startswith("ladder adapt: error: ") and "holds an earlier run" in error
    assert "Traceback" not in error
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == theirs


def test_an_input_s_symlinks_are_not_followed_out_of_its_folder(tmp_path, capsys):
    """A source whose LICENSE was a symlink to a system file had that file's contents copied into
    the output. Links inside the folder, and a Hub snapshot's links into its blobs/, still count."""
    from ladder.io.model_card import copy_licence_files

    secret = tmp_path / "secret"
    secret.write_text("a file the user never meant to publish")
    source = tmp_path / "models--org--name" / "snapshots" / "0123abc"
    (source.parents[1] / "blobs").mkdir(parents=True)
    source.mkdir(parents=True)
    (source.parents[1] / "blobs" / "f00d").write_text("Llama licence")
    (source / "LICENSE").symlink_to(secret)
    (source / "USE_POLICY.md").symlink_to("../../blobs/f00d")
    (source / "NOTICE.txt").write_text("notice")
    (source / "LICENCE.md").symlink_to("NOTICE.txt")
    destination = tmp_path / "out"
    destination.mkdir()
    assert copy_licence_files(source, destination) == ["LICENCE.md", "NOTICE.txt", "USE_POLICY.md"]
    assert not (destination / "LICENSE").exists() and (destination / "USE_POLICY.md").read_text() == "Llama licence"
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith("warning: skipping") and str(secret) in warning


def test_convert_copies_no_file_a_symlink_leads_out_of_the_source(tmp_path, tiny_checkpoint, capsys):
    """`ladder convert` copied a source's LICENSE and README.md symlinked to a system file into the
    output (README.md as README.source.md). Links inside the source still count."""
    secret = tmp_path / "secret"
    secret.write_text("a file the user never meant to publish")
    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoint, source)
    (source / "LICENSE").symlink_to(secret)
    (source / "README.md").symlink_to(secret)
    (source / "NOTICE.txt").write_text("notice")
    (source / "USE_POLICY.md").symlink_to("NOTICE.txt")
    out = tmp_path / "out"
    assert ladder_main(["convert", str(source), "--out", str(out), "--layers", "2", "--no-verify"]) == 0
    warnings = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":")[0:2] for line in warnings] == [
        ["warning", " skipping " + str(source / name)] for name in ("LICENSE", "README.md")
    ]
    assert all(str(secret) in line for line in warnings)
    assert (out / "USE_POLICY.md").read_text() == "notice" and (out / "tokenizer.json").is_file()
    assert not any("never meant" in p.read_text(errors="replace") for p in out.iterdir() if p.is_file())


@pytest.mark.parametrize(
    "header, message",
    [
        (b'{"w":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}}', "number out of range"),
        (b"[" * 200_000 + b"]" * 200_000, "invalid type: sequence"),
    ],
)
def test_a_hostile_safetensors_header_is_one_line(tmp_path, tiny_checkpoint, capsys, header, message):
    """A shape of 1e999 raised OverflowError, 200k nested brackets RecursionError, out of `ladder convert`."""
    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoint, source)
    (source / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    assert ladder_main(["convert", str(source), "--out", str(tmp_path / "out"), "--layers", "2"]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert "is not a valid safetensors file" in error and message in error
    assert not (tmp_path / "out").exists()


FULL_DISK_SAVE = """
import sys, torch
from safetensors.torch import save_file
from ladder.errors import run_command
from ladder.io.files import atomic_directory
def save(argv):
    with atomic_directory(argv[0]) as staging:  # as adapt's checkpoints and convert's outputs are written
        save_file({"w": torch.zeros(1 << 20)}, staging / "model.safetensors")
sys.exit(run_command("save", save, sys.argv[1:]))
"""


def test_a_full_disk_during_a_safetensors_save_is_one_line(tmp_path):
    """safetensors reports ENOSPC as its own SafetensorError, which the atomic writer let through as
    a traceback. The output is on a 256 KiB tmpfs (a private mount namespace)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-mr", "true"]).returncode != 0:
        pytest.skip("no unprivileged mount namespaces here")
    full = tmp_path / "full"
    full.mkdir()
    script = f'mount -t tmpfs -o size=256k none {full} && exec "$@"'
    command = ["unshare", "-mr", "sh", "-c", script, "-", sys.executable, "-c", FULL_DISK_SAVE, str(full / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"ladder save: error: no space left on the device while writing {full / 'out'}"
    ]


def test_a_chat_template_that_raises_is_one_line(tmp_path, tiny_checkpoint, capsys):
    """A model whose chat template raises (here through its own `raise_exception`) ended
    `ladder adapt --prepare-data` on chat records in a jinja2 traceback."""
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = "{{ raise_exception('this template takes no system message') }}"
    tokenizer.save_pretrained(model)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    recipe = write_recipe(tmp_path, model, chat_corpus(tmp_path / "corpus", chat))
    assert ladder_main(["adapt", str(recipe), "--prepare-data"]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert f"the chat template of {model} failed on this chat: this template takes no system message" in error


# --- ladder serve (item 12) -------------------------------------------------------------------------
# Its checks run in .venv-serve (vLLM's parser reads the host and key), in one process:
# tests/test_serve_access.py, the head size vLLM's CPU attention cannot run among them.
