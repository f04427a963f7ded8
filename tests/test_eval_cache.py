"""The eval cache: what makes it miss (weights, data bytes, numerics, task helpers, model and
scoring code), what it refuses to serve (unreadable or edited entries), and the work it saves."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from eval_runs import cached, write_suite
from filelock import FileLock

from ladder.errors import UsageError
from ladder.eval import cli
from ladder.eval.cache import (
    FILE_HASHES,
    SCORING_PACKAGES,
    FileHashes,
    cache_key,
    code_digest,
    fingerprint,
    model_class,
    scoring_digest,
    task_identity,
)
from ladder.eval.lm_tasks import TASKS_DIR, task_configs
from ladder.eval.models import resolve_models
from ladder.eval.runtime import Runtime
from ladder.eval.suite import Suite, SuiteTask, load_suite
from ladder.io.files import ladder_data_dir

pytest_plugins = ("eval_runs",)  # its ladder_checkpoints fixture


def test_model_names_and_fingerprints(tiny_checkpoint, ladder_checkpoints, tmp_path):
    from ladder.io.loading import embedded_model_path

    refs = resolve_models(["embedded", str(tiny_checkpoint), str(tiny_checkpoint)])
    assert refs[0].path == embedded_model_path().resolve() and refs[0].label == "SmolLM2-135M-Instruct.Q4_1"
    assert [r.label for r in refs[1:]] == [f"{tiny_checkpoint.name} #2", f"{tiny_checkpoint.name} #3"]
    named = resolve_models(["original=embedded", f"ladder={tiny_checkpoint}"])
    assert [(r.label, r.spec) for r in named] == [("original", "embedded"), ("ladder", str(tiny_checkpoint))]
    with pytest.raises(UsageError, match="label"):
        resolve_models([f"={tiny_checkpoint}"])
    # Same weights, other wiring: the config is part of the key, so the cache cannot mix them up.
    upper2, _ = ladder_checkpoints
    hashes = FileHashes(None)
    assert fingerprint(tiny_checkpoint, hashes) != fingerprint(upper2, hashes)
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in upper2.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    (copy / "README.md").write_text("notes do not change the model")
    (copy / "conversion.json").write_text('{"seconds": 1.5}')  # nor does a record of how it was made
    assert fingerprint(copy, hashes) == fingerprint(upper2, hashes)


def test_cache_keys_are_the_same_in_every_process():
    """Task configs hold functions (each offline task's loader, WikiText's detokenizer): the key must
    not depend on where they sit in memory, or the cache would never hit in a new process."""
    script = (
        "from ladder.eval.cache import FileHashes, cache_key, task_identity\n"
        "from ladder.eval.lm_tasks import task_configs, task_manager\n"
        "from ladder.eval.runtime import Runtime\n"
        "from ladder.eval.suite import load_suite\n"
        "suite = load_suite('offline')\n"
        "prepared = task_configs(suite, task_manager(suite))\n"
        "hashes, runtime = FileHashes(None), Runtime('cpu', 'float32')\n"
        "identities = [task_identity(task, prepared[task.task], hashes) for task in suite.tasks]\n"
        "print(*[cache_key({'weights': 'w'}, identity, runtime, 8) for identity in identities])\n"
    )
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    with contextlib.redirect_stdout(io.StringIO()) as here:  # and in this process, where much else has run
        exec(script, {})
    assert len(fresh) == len(load_suite("offline").tasks) and here.getvalue().split() == fresh


# --- the cache cannot go stale ----------------------------------------------------------------


def test_cache_misses_on_a_data_byte_and_the_dtype_and_hits_unchanged(tiny_checkpoint, tmp_path):
    data = tmp_path / "data"
    for name in ("valid.jsonl", "valid-labels.lst"):
        (data / "eval" / "piqa").mkdir(parents=True, exist_ok=True)
        shutil.copy(ladder_data_dir() / "eval" / "piqa" / name, data / "eval" / "piqa" / name)
    suite = write_suite(tmp_path / "s.yaml", [{"task": "ladder_piqa", "limit": 4}])
    cache = tmp_path / "cache"
    runs = iter(range(100))

    def run(*extra: str) -> list[str]:
        out = tmp_path / f"run{next(runs)}"
        assert (
            cli.main(
                [
                    str(tiny_checkpoint),
                    "--suite",
                    str(suite),
                    "--data",
                    str(data),
                    "--cache",
                    str(cache),
                    "--out",
                    str(out),
                    "--device",
                    "cpu",
                    *extra,
                ]
            )
            == 0
        )
        return cached(out)

    assert run() == []
    assert run() == ["ladder_piqa"]  # unchanged: a hit
    items = data / "eval" / "piqa" / "valid.jsonl"
    index = json.loads((cache / FILE_HASHES).read_text())
    assert index[str(items.resolve())][:2] == [items.stat().st_size, items.stat().st_mtime_ns]
    # One byte of an item the run does not even score (the last one) changes the data: a miss.
    content = bytearray(items.read_bytes())
    position = content.rindex(b"a")
    content[position : position + 1] = b"b"
    items.write_bytes(bytes(content))
    assert run() == []
    assert run() == ["ladder_piqa"]
    assert run("--dtype", "bfloat16") == []
    assert run("--batch-size", "auto") == ["ladder_piqa"]  # on the CPU, auto is the default batch size
    assert run("--dtype", "bfloat16") == ["ladder_piqa"]
    # A file is hashed once and then known by its status: an edit that restores its size and
    # mtime (os.utime) still changes its ctime, so it is hashed again and rescored, not served stale.
    status = items.stat()
    content[position : position + 1] = b"c"
    items.write_bytes(bytes(content))
    os.utime(items, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert (items.stat().st_size, items.stat().st_mtime_ns) == (status.st_size, status.st_mtime_ns)
    assert run() == []
    assert run() == ["ladder_piqa"]


def test_corrupt_cache_entries_are_rescored_and_killed_writes_cleaned(tiny_checkpoint, tmp_path, capsys):
    """A cache entry that does not read back (flipped gzip bytes, bad UTF-8, a JSON list) or does
    not match the digest it carries (an edited score, an emptied record) is one warning line and a miss, and the rescored entry replaces it; a killed write's temporary (no lock
    held) is removed when its entry is written again, a live write's (locked) is kept."""
    suite = write_suite(tmp_path / "s.yaml", [{"task": "ladder_piqa", "limit": 2}])
    cache = tmp_path / "cache"
    runs = iter(range(100))

    def run() -> tuple[list[str], list[str]]:
        out = tmp_path / f"run{next(runs)}"
        common = ["--suite", str(suite), "--cache", str(cache), "--device", "cpu"]
        assert cli.main([str(tiny_checkpoint), *common, "--out", str(out)]) == 0
        warnings = [line for line in capsys.readouterr().err.splitlines() if "cache entry" in line]
        return cached(out), warnings

    assert run() == ([], [])
    (record,) = [path for path in cache.glob("*.json") if path.name != FILE_HASHES]
    samples = record.with_suffix(".samples.json.gz")
    flipped = bytearray(samples.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    corruptions = [
        (samples, bytes(flipped), "unreadable cache entry"),
        (record, b'{"results": "\xff\xfe"}', "unreadable cache entry"),
        (record, b"[1, 2]", "does not match its digest"),
        # An edited score (one digit) or a record emptied of its scores: a miss, never a score or a traceback.
        (record, re.sub(rb'("acc,none": )0\.(\d)', rb"\g<1>0.9", record.read_bytes()), "does not match its digest"),
        (record, b'{"results": {}}', "does not match its digest"),
    ]
    assert corruptions[3][1] != record.read_bytes()
    for path, content, message in corruptions:
        path.write_bytes(content)
        hits, warnings = run()
        assert hits == [] and len(warnings) == 1 and message in warnings[0], (content, warnings)
        assert path.read_bytes() != content  # rescored and written back: the next run hits
        assert run() == (["ladder_piqa"], [])

    killed, live = cache / f".{record.name}.tmp-4242", cache / f".{samples.name}.tmp-4243"
    for leftover in (killed, live):
        leftover.write_bytes(b"half a write")
    record.write_bytes(b"[1, 2]")  # a miss: the entry is written again
    with FileLock(live, timeout=0, fallback_to_soft=False):  # as atomic_write holds its temporary
        hits, warnings = run()
    assert hits == [] and len(warnings) == 1
    assert not killed.exists() and live.exists()
    assert run() == (["ladder_piqa"], [])


def test_cache_key_covers_task_helpers_and_model_code(tmp_path, monkeypatch):
    """An edit to a helper of eval/tasks/utils.py (a function the task config does not name) or to
    the source of the model class changes the key."""
    from lm_eval.tasks import TaskManager

    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS_DIR, tasks, ignore=shutil.ignore_patterns("__pycache__"))
    suite = Suite("s", "", True, (SuiteTask(task="ladder_piqa", limit=4),))
    runtime, hashes = Runtime("cpu", "float32"), FileHashes(None)

    def key(model: dict) -> str:
        manager = TaskManager(include_path=str(tasks), include_defaults=False)
        identity = task_identity(suite.tasks[0], task_configs(suite, manager)["ladder_piqa"], hashes)
        return cache_key(model, identity, runtime, 8)

    model = {"weights": "w", "code": "c"}
    before = key(model)
    assert key(model) == before
    utils = tasks / "utils.py"
    source = utils.read_text()
    assert "def _read_jsonl" in source
    utils.write_text(
        source.replace(
            "def _read_jsonl(path: Path) -> list[dict]:\n",
            "def _read_jsonl(path: Path) -> list[dict]:\n    path = Path(path)\n",
        )
    )
    assert key(model) != before
    assert key({**model, "code": "d"}) != key(model)

    # The model code: the installed class that runs the weights, and every base class's module.
    from transformers import LlamaForCausalLM

    from ladder.model.modeling_ladder import LadderLlamaForCausalLM

    module_file = tmp_path / "my_modeling.py"

    def load_class(text: str) -> type:
        module_file.write_text(text)
        spec = importlib.util.spec_from_file_location("my_modeling", module_file)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "my_modeling", module)  # where inspect finds a class's file
        spec.loader.exec_module(module)
        return module.MyLlama

    first = code_digest(
        [load_class("from transformers import LlamaForCausalLM\nclass MyLlama(LlamaForCausalLM):\n    pass\n")]
    )
    edited = code_digest(
        [load_class("from transformers import LlamaForCausalLM\nclass MyLlama(LlamaForCausalLM):\n    x = 1\n")]
    )
    assert first != edited
    assert code_digest([LadderLlamaForCausalLM]) != code_digest([LlamaForCausalLM])


def test_cache_key_covers_the_scoring_code(tmp_path):
    """Every module of the scoring packages is in the key, computed from its source: the digest
    over a copy of eval/ equals the installed one's, and an edit to the copy's shared-prefix scorer
    (log-likelihoods negated) changes it. Paths do not: an unchanged copy of the project hits."""
    import ladder.eval

    installed = {name: Path(importlib.import_module(name).__file__).parent for name in SCORING_PACKAGES}
    assert "ladder.eval" in installed and scoring_digest() == scoring_digest(installed)
    copy = tmp_path / "eval"
    shutil.copytree(Path(ladder.eval.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert scoring_digest({**installed, "ladder.eval": copy}) == scoring_digest()
    scorer = copy / "backends" / "shared_prefix.py"
    source = scorer.read_text()
    assert "return float(logprobs.gather(1, tokens[:, None]).sum())" in source
    scorer.write_text(source.replace("return float(logprobs.gather(", "return -float(logprobs.gather("))
    assert scoring_digest({**installed, "ladder.eval": copy}) != scoring_digest()


def test_model_class_is_the_installed_one(tiny_checkpoint, ladder_checkpoints):
    from transformers import LlamaForCausalLM

    from ladder.io.loading import embedded_model_path
    from ladder.model.modeling_ladder import LadderLlamaForCausalLM

    assert model_class(tiny_checkpoint) is LlamaForCausalLM
    assert model_class(embedded_model_path()) is LlamaForCausalLM
    assert model_class(ladder_checkpoints[0]) is LadderLlamaForCausalLM


def test_two_evals_of_one_model_hash_its_weights_once(tiny_checkpoint, tmp_path, monkeypatch):
    """The weights' hashes are remembered by path and file status, in the process and in the cache's
    index: a second eval in this process (even with --no-cache), or one in a new process that shares
    the cache, reads no weight byte to hash it (a changed file would be hashed again)."""
    from ladder.eval import cache as eval_cache

    hashed = []
    real = eval_cache.sha256_file
    monkeypatch.setattr(eval_cache, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    monkeypatch.setattr(FileHashes, "process", {}, raising=False)
    common = [str(tiny_checkpoint), "--tasks", "ladder_piqa", "--limit", "1", "--device", "cpu"]
    cache = ["--cache", str(tmp_path / "cache")]
    assert cli.main([*common, *cache, "--out", str(tmp_path / "one")]) == 0
    monkeypatch.setattr(FileHashes, "process", {}, raising=False)  # a new process: only the cache's index remembers
    assert cli.main([*common, *cache, "--out", str(tmp_path / "two")]) == 0
    assert cli.main([*common, "--no-cache", "--out", str(tmp_path / "three")]) == 0
    assert hashed.count("model.safetensors") == 1
