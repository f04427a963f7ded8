"""The output rule (ladder/io/outputs.py), over every command that writes: an output that is an input,
inside one or above one, `/`, a home folder, a file where a folder goes (or a folder where a file
goes), a read-only file system, or a folder of the user's that --force would replace, is one line
and exit 2, with nothing written and every input as it was. Then what a command deletes or replaces:
only its own outputs, and a file only once its replacement is whole."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from adapt_runs import REPO, write_recipe
from checkpoints import copy_of, private_mount_namespace, snapshot
from file_server import Server, write_manifest
from ladder.cli import main as ladder_main
from ladder.errors import UsageError
from ladder.io.data_fetch import DataFile
from ladder.io.files import OUTPUT_MARKER
from ladder.io.outputs import make_output_folder, remove_output


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_checkpoint, corpus) -> dict[str, Path]:
    """What the commands read, in a folder of their own: a copy of the tiny checkpoint, a recipe for
    it (adapt's and the demo's), a data manifest whose one URL nothing answers."""
    root = tmp_path_factory.mktemp("inputs")
    model = copy_of(tiny_checkpoint, root / "model")
    recipe = write_recipe(root / "recipe", model, corpus)
    manifest = write_manifest(
        root / "manifest.tsv", [DataFile("a.txt", 1, hashlib.sha256(b"a").hexdigest(), "http://127.0.0.1:9/a.txt")]
    )
    return {"model": model, "recipe": recipe, "manifest": manifest, "corpus": corpus}


# command: (its arguments writing OUT, which input the cases aim at, whether OUT is a file)
COMMANDS = {
    "convert": (lambda i, out: ["convert", i["model"], "--layers", "2", "--out", out, "--force"], "model", False),
    "adapt": (lambda i, out: ["adapt", i["recipe"], f"output_dir={out}"], "model", False),
    "eval": (
        lambda i, out: ["eval", i["model"], "--suite", "smoke", "--limit", "1", "--out", out, "--force"],
        "model",
        False,
    ),
    "sample": (
        lambda i, out: ["sample", i["model"], "--tokens", "2", "--length", "2", "--out", out, "--force"],
        "model",
        True,
    ),
    "demo": (lambda i, out: ["demo", "--recipe", i["recipe"], "--suite", "smoke", "--out", out], "model", False),
    "data": (lambda i, out: ["data", "--dest", out, "--manifest", i["manifest"]], "manifest", False),
}

# case: (OUT given the input aimed at and a scratch folder, the words the one line must hold)
CASES = {
    "is-the-input": (lambda source, scratch: source, "(it is that input)"),
    "inside-the-input": (lambda source, scratch: source / "model.safetensors", "(it lies inside it)"),
    "holds-the-input": (lambda source, scratch: source.parent, "(it holds it)"),
    "root": (lambda source, scratch: Path("/"), "is the root folder"),
    "home": (lambda source, scratch: Path.home(), "the home folder"),
}


def run(capsys, argv: list) -> tuple[int, str]:
    code = ladder_main([str(word) for word in argv])
    return code, capsys.readouterr().err


def state(inputs: dict[str, Path]) -> dict[str, dict[str, str]]:
    return {name: snapshot(path) if path.is_dir() else {path.name: path.read_text()} for name, path in inputs.items()}


def assert_one_line(code: int, err: str, command: str, words: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"ladder {command}: error:"), err
    assert words in err, err


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_that_is_an_input_above_one_root_or_home_is_refused(command, case, inputs, tmp_path, capsys):
    arguments, aimed_at, _ = COMMANDS[command]
    place, words = CASES[case]
    out = place(inputs[aimed_at], tmp_path)
    if case == "inside-the-input" and aimed_at == "manifest":
        out = inputs[aimed_at] / "folder"
    before, existed = state(inputs), out.exists()
    code, err = run(capsys, arguments(inputs, out))
    assert_one_line(code, err, command, words)
    assert state(inputs) == before
    assert out.exists() == existed


@pytest.mark.parametrize("length", ["name", "path"])
@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_too_long_for_the_file_system_is_one_line(command, length, inputs, tmp_path, capsys):
    """An output name past 255 bytes, or a path past 4,096, ended in an ENAMETOOLONG traceback
    (issue 43)."""
    arguments = COMMANDS[command][0]
    out = tmp_path / ("x" * 300) if length == "name" else tmp_path.joinpath(*["y" * 200] * 25)
    before = state(inputs)
    code, err = run(capsys, arguments(inputs, out))
    assert_one_line(code, err, command, "too long for the file system")
    assert state(inputs) == before and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_of_the_wrong_kind_is_refused_before_any_work(command, inputs, tmp_path, capsys):
    """A folder command given a file, and `sample` given a folder (which it found out after sampling)."""
    arguments, _, writes_file = COMMANDS[command]
    out = tmp_path / "taken"
    if writes_file:
        out.mkdir()
        (out / "mine.txt").write_text("the user's")
    else:
        out.write_text("the user's")
    code, err = run(capsys, arguments(inputs, out))
    assert_one_line(code, err, command, "is a folder" if writes_file else "is a file, not a folder")
    assert (out / "mine.txt" if writes_file else out).read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize("command", ["convert", "eval"])
def test_force_replaces_no_folder_of_the_users(command, inputs, tmp_path, capsys):
    arguments, _, _ = COMMANDS[command]
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    code, err = run(capsys, arguments(inputs, out))
    assert_one_line(code, err, command, f"replaces only an earlier output of `ladder {command}`")
    assert snapshot(out) == {"notes.txt": hashlib.sha256(b"the user's").hexdigest()}


@pytest.mark.parametrize("command", ["adapt", "demo", "data"])
def test_a_folder_written_into_is_not_another_commands_output(command, inputs, tmp_path, capsys):
    """adapt, the demo and `ladder data` add files to a folder that may exist: not to another
    command's output (a converted model, whose --force would then delete the run with it)."""
    arguments, _, _ = COMMANDS[command]
    out = tmp_path / "converted"
    out.mkdir()
    (out / OUTPUT_MARKER).write_text(json.dumps({"command": "convert"}))
    code, err = run(capsys, arguments(inputs, out))
    assert_one_line(code, err, command, "is an output of `ladder convert`")
    assert [p.name for p in out.iterdir()] == [OUTPUT_MARKER]


@pytest.fixture(scope="module")
def read_only_runs(inputs, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every command writing into a read-only tmpfs (EROFS; root's write permission does not help
    there), in one private mount namespace: {command: (exit status, stderr)}."""
    prefix = private_mount_namespace()
    disk = tmp_path_factory.mktemp("read-only")
    argvs = {
        command: [str(word) for word in arguments(inputs, disk / "out")]
        for command, (arguments, _, _) in COMMANDS.items()
    }
    script = (
        "import contextlib, io, json, sys\n"
        "from ladder.cli import main\n"
        "results = {}\n"
        "for command, argv in json.loads(sys.argv[1]).items():\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except BaseException as error:\n"
        "            code = f'{type(error).__name__}: {error}'\n"
        "    results[command] = (code, err.getvalue())\n"
        "print(json.dumps(results))\n"
    )
    shell = f'mount -t tmpfs -o ro tmpfs {disk} && exec "$0" -c "$1" "$2"'
    result = subprocess.run(
        [*prefix, "sh", "-c", shell, sys.executable, script, json.dumps(argvs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return {command: tuple(outcome) for command, outcome in json.loads(result.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_read_only_file_system_is_refused_in_one_line(command, read_only_runs):
    code, err = read_only_runs[command]
    assert_one_line(code, err, command, "is on a read-only file system")


def test_sample_never_overwrites_the_weights_it_reads(inputs, capsys):
    """Issue 37 item 3: `--out MODEL/model.safetensors --force` replaced the weights with JSON lines."""
    before = state(inputs)
    code, err = run(capsys, COMMANDS["sample"][0](inputs, inputs["model"] / "model.safetensors"))
    assert_one_line(code, err, "sample", "(it lies inside it)")
    assert state(inputs) == before


@pytest.mark.parametrize("name", ["adapt", "data", "eval-cache"])
def test_demo_deletes_no_folder_it_did_not_make(name, inputs, tmp_path, capsys):
    """Issue 37 item 2: a D holding the user's adapt/ lost it, exit 0 (a new --out redoes adapt);
    --redo all removed data/ and eval-cache/ too. Refused before any stage."""
    out = tmp_path / "demo"
    (out / name).mkdir(parents=True)
    (out / name / "notes.txt").write_text("the user's")
    code, err = run(capsys, [*COMMANDS["demo"][0](inputs, out), "--redo", "all"])
    assert_one_line(code, err, "demo", f"{out / name} is not an output of")
    assert snapshot(out) == {f"{name}/notes.txt": hashlib.sha256(b"the user's").hexdigest()}


def test_data_keeps_a_file_until_its_replacement_is_verified(tmp_path, capsys):
    """Issue 37 item 4: a file whose checksum differs was deleted before its download; when the
    download failed, it was gone. It stays until the verified download replaces it."""
    served = tmp_path / "served"
    served.mkdir()
    (served / "a.txt").write_text("new")
    destination = tmp_path / "data"
    destination.mkdir()
    (destination / "a.txt").write_text("old")
    (destination / "b.txt").write_text("old")
    server = Server(served)
    try:
        entries = [
            DataFile("a.txt", 3, hashlib.sha256(b"new").hexdigest(), f"{server.url}/a.txt"),
            DataFile("b.txt", 3, hashlib.sha256(b"new").hexdigest(), f"{server.url}/gone.txt"),
        ]
        manifest = write_manifest(tmp_path / "manifest.tsv", entries)
        code, err = run(capsys, ["data", "--dest", destination, "--manifest", manifest])
    finally:
        server.close()
    assert_one_line(code, err, "data", "cannot fetch b.txt")
    assert (destination / "a.txt").read_text() == "new"
    assert (destination / "b.txt").read_text() == "old"
    assert sorted(p.name for p in destination.iterdir()) == ["a.txt", "b.txt"]


def test_a_folder_is_deleted_only_by_the_command_its_marker_names(tmp_path):
    """What `demo --redo` relies on: its caches, made with their command's marker, go; nothing else does."""
    cache = make_output_folder(tmp_path / "cache", "adapt")
    (cache / "blocks.bin").write_bytes(b"\0")
    with pytest.raises(UsageError, match="is not an output of `ladder eval`"):
        remove_output(cache, "eval")
    remove_output(cache, "adapt")
    assert not cache.exists()
    remove_output(cache, "adapt")  # gone already: nothing to do


@pytest.mark.parametrize("place", ["root", "folder"])
def test_plan_calibration_checks_its_output_before_measuring(place, tmp_path, capsys):
    """`ladder plan --calibrate --out` measured for minutes, then failed on `/` or a folder with a traceback."""
    out = Path("/") if place == "root" else tmp_path
    code, err = run(capsys, ["plan", "--calibrate", "--out", out])
    assert_one_line(code, err, "plan", "is the root folder" if place == "root" else "is a folder")


def test_eval_checks_its_output_before_launching_processes(inputs, capsys):
    """With --processes, every launched process refused the output: one error per process."""
    argv = [
        "eval",
        inputs["model"],
        "--suite",
        "smoke",
        "--limit",
        "1",
        "--processes",
        "2",
        "--out",
        inputs["model"],
        "--force",
    ]
    code, err = run(capsys, argv)
    assert_one_line(code, err, "eval", "(it is that input)")
