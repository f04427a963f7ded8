"""`ladder data` (ladder/io/data_fetch.py, cli/data.py): fetch-and-verify against a real HTTP server on 127.0.0.1
serving copies of a few files of the data folder, one of them altered; a closed port stands for
no network. And the shipped manifest against the data folder's SHA256SUMS."""

from __future__ import annotations

import hashlib
import re
import socket
from pathlib import Path

import pytest

from file_server import Server, write_manifest
from ladder.cli import main as ladder_main
from ladder.errors import UsageError
from ladder.io.data_fetch import DataFile, fetch_data, read_manifest
from ladder.io.files import ladder_data_dir, sha256_file

# Small files of the manifest: served byte for byte. ALTERED is served with one byte changed.
GOOD = [
    "eval/piqa/valid-labels.lst",
    "eval/hellaswag/LICENSE_rowanz-hellaswag_MIT.txt",
    "train/gutenberg/11_alice_in_wonderland/LICENSE.txt",
]
ALTERED = "eval/piqa/UPSTREAM_README.md"


def data_folder() -> Path:
    folder = ladder_data_dir()
    if not (folder / "SHA256SUMS").is_file():
        pytest.skip(f"no data folder at {folder} (set LADDER_DATA or run `make data`)")
    return folder


@pytest.fixture
def served(tmp_path) -> tuple[Server, list[DataFile]]:
    """The server, and the manifest entries of GOOD + ALTERED with their URLs pointing at it."""
    source = data_folder()
    manifest = {item.path: item for item in read_manifest()}
    root = tmp_path / "www"
    for path in GOOD + [ALTERED]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes((source / path).read_bytes())
    altered = bytearray((root / ALTERED).read_bytes())
    altered[0] ^= 1
    (root / ALTERED).write_bytes(bytes(altered))
    server = Server(root)
    entries = [
        DataFile(path, manifest[path].size, manifest[path].sha256, f"{server.url}/{path}") for path in GOOD + [ALTERED]
    ]
    yield server, entries
    server.close()


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there once the probe is closed


def test_fetch_keeps_verified_files_and_refuses_a_wrong_one(served, tmp_path):
    server, entries = served
    destination = tmp_path / "data"
    report = fetch_data(destination, entries)
    assert report.fetched == GOOD and report.refused == [ALTERED] and report.present == []
    # The refused file is gone and no temporary file is left beside the kept ones.
    assert files_under(destination) == set(GOOD)
    for path in GOOD:
        assert sha256_file(destination / path) == hashlib.sha256((data_folder() / path).read_bytes()).hexdigest()


def test_a_second_run_fetches_only_what_is_missing_or_wrong(served, tmp_path):
    server, entries = served
    good = entries[: len(GOOD)]
    destination = tmp_path / "data"
    fetch_data(destination, good)
    server.requests.clear()
    assert fetch_data(destination, good).present == GOOD
    assert server.requests == []

    damaged = destination / GOOD[0]
    damaged.write_bytes(damaged.read_bytes()[:-1])
    report = fetch_data(destination, good)
    assert report.fetched == [GOOD[0]] and report.present == GOOD[1:]
    assert server.requests == [f"/{GOOD[0]}"]
    assert sha256_file(damaged) == good[0].sha256


def test_a_wrong_local_file_stays_as_it_was_when_the_source_is_wrong_too(served, tmp_path):
    """A file is replaced only by a verified download, never deleted first (issue 37)."""
    server, entries = served
    destination = tmp_path / "data"
    (destination / ALTERED).parent.mkdir(parents=True)
    (destination / ALTERED).write_text("not the file\n")
    assert fetch_data(destination, entries[-1:]).refused == [ALTERED]
    assert files_under(destination) == {ALTERED} and (destination / ALTERED).read_text() == "not the file\n"


def test_the_command_line(served, tmp_path, capsys):
    server, entries = served
    destination = tmp_path / "data"
    good_manifest = write_manifest(tmp_path / "good.tsv", entries[: len(GOOD)])
    assert ladder_main(["data", "--dest", str(destination), "--manifest", str(good_manifest)]) == 0
    assert f"data folder {destination}: 3 fetched, 0 already present" in capsys.readouterr().out

    all_manifest = write_manifest(tmp_path / "all.tsv", entries)
    assert ladder_main(["data", "--dest", str(destination), "--manifest", str(all_manifest)]) == 2
    captured = capsys.readouterr()
    assert "0 fetched, 3 already present, 1 refused (wrong checksum, not kept): " + ALTERED in captured.out
    assert len(captured.err.strip().splitlines()) == 1 and "failed their SHA-256 check" in captured.err
    assert files_under(destination) == set(GOOD)


def test_without_network_one_line_says_what_to_fetch_and_where(tmp_path, capsys):
    unreachable = closed_port_url()
    entries = [DataFile(path, 1, "0" * 64, f"{unreachable}/{path}") for path in GOOD]
    manifest = write_manifest(tmp_path / "offline.tsv", entries)
    destination = tmp_path / "data"
    assert ladder_main(["data", "--dest", str(destination), "--manifest", str(manifest)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert re.search(
        rf"cannot download from 127\.0\.0\.1:\d+ \(ConnectionError\): fetch the 3 files listed in "
        rf"{re.escape(str(manifest))} .* into {re.escape(str(destination))}",
        error,
    ), error
    assert not destination.exists() or files_under(destination) == set()


def test_a_missing_source_file_names_the_file_and_the_answer(served, tmp_path):
    server, entries = served
    missing = DataFile(GOOD[0], entries[0].size, entries[0].sha256, f"{server.url}/no/such/file")
    with pytest.raises(UsageError, match=rf"cannot fetch {GOOD[0]}: .* answered 404"):
        fetch_data(tmp_path / "data", [missing])


def test_the_manifest_lists_the_data_folder():
    """Every file of SHA256SUMS, with its checksum and size, and a URL pinned to a commit."""
    folder = data_folder()
    sums = dict(reversed(line.split("  ", 1)) for line in (folder / "SHA256SUMS").read_text().splitlines())
    manifest = read_manifest()
    assert {item.path: item.sha256 for item in manifest} == sums
    for item in manifest:
        assert (folder / item.path).stat().st_size == item.size, item.path
        assert re.fullmatch(r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/\S+", item.url), item.url


def test_a_bad_manifest_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_text("path\tsha256\neval/x\tabc\n")
    for manifest in (bad, tmp_path / "missing.tsv"):
        assert ladder_main(["data", "--dest", str(tmp_path / "data"), "--manifest", str(manifest)]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and f"cannot read the manifest {manifest}" in error
