"""eval/: `ladder eval` end to end on tiny checkpoints (cache included), two processes against one,
chat templates on the embedded SmolLM2-Instruct, what makes the cache miss, bad input, and the stock
`lm_eval` command line giving the same numbers. Suites, tasks and the report's statistics are
tested in test_eval_tasks.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import ladder
from ladder.errors import UsageError
from ladder.eval import cli
from ladder.eval.backends.hf import LoadedHFLM
from ladder.eval.cache import (
    FILE_HASHES,
    SCORING_PACKAGES,
    STALE_TEMPORARY_SECONDS,
    FileHashes,
    cache_key,
    code_digest,
    fingerprint,
    model_class,
    scoring_digest,
    task_identity,
)
from ladder.eval.lm_tasks import TASKS_DIR, hub_offline, task_configs
from ladder.eval.models import resolve_models
from ladder.eval.runtime import Runtime, resolve_runtime
from ladder.eval.suite import Suite, SuiteTask, load_suite
from ladder.io.files import ladder_data_dir
from ladder.io.loading import DTYPES, load_model


def _ladder_copy(source: Path, destination: Path, layers) -> Path:
    model = AutoModelForCausalLM.from_pretrained(source)
    ladder.to_ladder(model, layers).save_pretrained(destination)
    AutoTokenizer.from_pretrained(source).save_pretrained(destination)
    return destination


@pytest.fixture(scope="module")
def ladder_checkpoints(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """Two ladder variants of the tiny checkpoint (upper 2 and upper 3 of 4 layers)."""
    root = tmp_path_factory.mktemp("ladder")
    return _ladder_copy(tiny_checkpoint, root / "upper2", 2), _ladder_copy(tiny_checkpoint, root / "upper3", 3)


def _write_suite(path: Path, tasks: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"description": "test", "offline": True, "tasks": tasks}))
    return path


# --- ladder eval end to end -----------------------------------------------------------------


def _suite_file(tmp_path: Path) -> Path:
    return _write_suite(
        tmp_path / "tiny.yaml",
        [
            {"task": "ladder_wikitext", "limit": 2},
            {"task": "ladder_lambada_openai", "limit": 6},
            {"task": "ladder_piqa", "limit": 6},
            {"task": "ladder_hellaswag", "every": 1000, "limit": 6},
        ],
    )


def test_ladder_eval_writes_the_report_and_caches_the_baseline(tiny_checkpoint, ladder_checkpoints, tmp_path, capsys):
    upper2, upper3 = ladder_checkpoints
    suite, cache = _suite_file(tmp_path), tmp_path / "cache"
    common = ["--suite", str(suite), "--cache", str(cache), "--baseline", str(tiny_checkpoint)]
    assert cli.main([str(upper2), *common, "--out", str(tmp_path / "first")]) == 0
    table = capsys.readouterr().out
    assert re.search(r"\| ladder_piqa +\| acc ↑ +\| +6 \|", table) and "Δ upper2" in table

    first = tmp_path / "first"
    assert {p.name for p in first.iterdir()} == {
        ".ladder-output",
        "report.md",
        "report.json",
        "report.png",
        f"{tiny_checkpoint.name}.json",
        "upper2.json",
    }
    results = json.loads((first / "upper2.json").read_text())
    assert {"results", "configs", "versions", "n-shot", "config", "lm_eval_version"} <= set(results)
    assert results["configs"]["ladder_piqa"]["doc_to_text"] == "Question: {{goal}}\nAnswer:"
    summary = json.loads((first / "report.json").read_text())
    assert [m["cached_tasks"] for m in summary["models"]] == [[], []]
    rows = {(r["task"], r["metric"]): r for r in summary["rows"]}
    assert len(rows) == 3 + 2 + 2 + 2
    piqa = rows[("ladder_piqa", "acc")]
    assert piqa["differences"]["upper2"]["method"] == "paired" and piqa["n"] == 6
    # `every` spreads HellaSwag's items over the file (ActivityNet first, WikiHow from item 3243).
    records = [json.loads(f.read_text()) for f in cache.glob("*.json") if f.name != FILE_HASHES]
    hellaswag = [record["per_item"].get("ladder_hellaswag") for record in records]
    assert [c["acc,none"]["doc_id"] for c in hellaswag if c] == [[0, 1000, 2000, 3000, 4000, 5000]] * 2
    wikitext = rows[("ladder_wikitext", "word_perplexity")]
    assert wikitext["scores"][tiny_checkpoint.name]["stderr"] > 0  # bootstrapped: lm-eval gives N/A
    assert "| ladder_piqa " in (first / "report.md").read_text()

    # Another ladder variant against the same baseline: the baseline comes from the cache.
    assert cli.main([str(upper3), *common, "--out", str(tmp_path / "second")]) == 0
    second = json.loads((tmp_path / "second" / "report.json").read_text())
    assert second["models"][0]["cached_tasks"] == [t["task"] for t in yaml.safe_load(suite.read_text())["tasks"]]
    assert second["models"][1]["cached_tasks"] == []
    again = {(r["task"], r["metric"]): r for r in second["rows"]}
    for key, row in rows.items():
        assert again[key]["scores"][tiny_checkpoint.name] == row["scores"][tiny_checkpoint.name]
    # The ladder variants differ from the baseline somewhere (they are not the same model).
    assert any(r["differences"]["upper3"]["value"] for r in second["rows"])

    # An existing results folder is kept unless --force.
    with pytest.raises(UsageError, match="already exists"):
        cli.main([str(upper3), *common, "--out", str(tmp_path / "second")])


def test_stock_lm_eval_command_line_gives_the_same_numbers(ladder_checkpoints, tmp_path):
    """`lm_eval --model hf --model_args pretrained=<ladder dir>,trust_remote_code=True --include_path
    eval/tasks` on a converted checkpoint scores what `ladder eval` scores."""
    upper2, _ = ladder_checkpoints
    suite = _write_suite(
        tmp_path / "two.yaml", [{"task": "ladder_piqa", "limit": 4}, {"task": "ladder_wikitext", "limit": 4}]
    )
    assert cli.main([str(upper2), "--suite", str(suite), "--no-cache", "--out", str(tmp_path / "ours")]) == 0
    ours = json.loads((tmp_path / "ours" / "upper2.json").read_text())["results"]

    command = [
        str(Path(sys.executable).with_name("lm_eval")),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={upper2},trust_remote_code=True",
        "--tasks",
        "ladder_piqa,ladder_wikitext",
        "--include_path",
        str(TASKS_DIR),
        "--limit",
        "4",
        "--device",
        "cpu",
        "--batch_size",
        "8",
        "--output_path",
        str(tmp_path / "stock"),
    ]
    environment = {**os.environ, "LADDER_DATA": str(ladder_data_dir()), "HF_DATASETS_OFFLINE": "1"}
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    stock = json.loads(next((tmp_path / "stock").rglob("results_*.json")).read_text())["results"]
    for key in ("acc,none", "acc_norm,none"):
        assert stock["ladder_piqa"][key] == pytest.approx(ours["ladder_piqa"][key], abs=1e-12)
    # ladder eval scores rolling windows one at a time, lm_eval in batches of 8: float noise only.
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert stock["ladder_wikitext"][key] == pytest.approx(ours["ladder_wikitext"][key], rel=1e-5)


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
    assert fingerprint(tiny_checkpoint) != fingerprint(upper2)
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in upper2.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    (copy / "README.md").write_text("notes do not change the model")
    (copy / "conversion.json").write_text('{"seconds": 1.5}')  # nor does a record of how it was made
    assert fingerprint(copy) == fingerprint(upper2)


def test_cache_keys_are_the_same_in_every_process():
    """Task configs hold functions (HellaSwag's process_docs, WikiText's detokenizer): the key must
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
    keys = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
        for _ in range(2)
    ]
    assert len(keys[0]) == len(load_suite("offline").tasks) and keys[0] == keys[1]


# --- device, processes, samples ----------------------------------------------------------------


def _samples(folder: Path, label: str, task: str) -> list[dict]:
    lines = (folder / "samples" / label / f"{task}.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda sample: sample["doc_id"])


@pytest.mark.parametrize("which", ["llama", "ladder"])
def test_shared_context_scoring_equals_lm_evals_per_request(tiny_checkpoint, ladder_checkpoints, which):
    """`LoadedHFLM` runs each shared context once and the head only on continuation positions; per
    request it gives lm-eval's own HFLM numbers: 4 choices of different lengths on one context,
    one-token continuations, a context of one token, contexts longer than max_length (left
    truncation, so that two different contexts share their truncated tail), batches that split a
    group's requests from the next group's."""
    from lm_eval.models.huggingface import HFLM

    path = tiny_checkpoint if which == "llama" else ladder_checkpoints[0]
    model, tokenizer = load_model(path, dtype=DTYPES["float32"])
    lm = LoadedHFLM(model, tokenizer, Runtime("cpu", "float32", batch_size=3))
    lm._max_length = 24
    rng = np.random.default_rng(0)

    def tokens(count: int) -> list[int]:
        return rng.integers(1, len(tokenizer), count).tolist()

    shared, long_tail = tokens(9), tokens(21)
    requests = [
        *[(shared, tokens(count)) for count in (1, 3, 5, 2)],
        (tokens(14), tokens(1)),
        (tokens(14), tokens(1)),
        (tokens(7) + long_tail, tokens(4)),  # both truncate to long_tail + the continuation
        (tokens(3) + long_tail, tokens(4)),
        (tokens(8), tokens(3)),  # one batch of three contexts of different lengths
        (tokens(5), tokens(2)),
        (tokens(1), tokens(6)),
        (tokens(2), tokens(24)),  # the continuation alone fills max_length
    ]
    requests = [((f"c{index}", "x"), context, continuation) for index, (context, continuation) in enumerate(requests)]
    ours = lm._loglikelihood_tokens(requests)
    stock = HFLM._loglikelihood_tokens(lm, requests)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in stock]
    np.testing.assert_allclose([value for value, _ in ours], [value for value, _ in stock], rtol=1e-5)


def _random_requests(tokenizer, count: int, seed: int = 0) -> list:
    """lm-eval's (request, context tokens, continuation tokens): pairs of choices after one context."""
    rng = np.random.default_rng(seed)
    requests = []
    for index in range(count):
        context = rng.integers(1, len(tokenizer), 6 + index % 5).tolist()
        for choice in range(2):
            requests.append(
                ((f"c{index}", f"x{choice}"), context, rng.integers(1, len(tokenizer), 2 + choice).tolist())
            )
    return requests


def test_batch_size_auto_keeps_the_shared_context_scorer(tiny_checkpoint):
    """Under `--batch-size auto` lm-eval's detection picks the batch size and the shared-context
    scorer still scores (the head sees only continuation rows, [rows, hidden]; lm-eval's own path
    and its detection run it on [batch, positions, hidden]), with lm-eval's numbers."""
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = load_model(tiny_checkpoint, dtype=DTYPES["float32"])
    lm = LoadedHFLM(model, tokenizer, Runtime("cpu", "float32", batch_size="auto"))
    lm.max_batch_size = 4  # the detection's first try (64 full-length rows) is slow on a CPU
    head_inputs = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: head_inputs.append(inputs[0].dim()))
    requests = _random_requests(tokenizer, 6)
    ours = lm._loglikelihood_tokens(requests)
    assert 2 in head_inputs  # (besides the detection's full-length batches)
    head_inputs.clear()
    stock = HFLM._loglikelihood_tokens(lm, requests)
    hook.remove()
    assert set(head_inputs) == {3}
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in stock]
    np.testing.assert_allclose([value for value, _ in ours], [value for value, _ in stock], rtol=1e-5)


def test_bfloat16_head_log_softmax_runs_in_float32(tiny_checkpoint):
    """A bf16 model's continuation log-likelihoods equal the head and log-softmax taken in float64
    over the same bf16 hidden states; bf16 logits (what the head gives in the model's dtype) are
    off by far more."""
    import torch

    model, tokenizer = load_model(tiny_checkpoint, dtype=DTYPES["bfloat16"])
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits of a trained model's size (random ones are near 0)
    lm = LoadedHFLM(model, tokenizer, Runtime("cpu", "bfloat16", batch_size=4))
    requests = _random_requests(tokenizer, 4, seed=1)
    ours = [value for value, _ in lm._loglikelihood_tokens(requests)]
    exact, rounded = [], []
    for _, context, continuation in requests:
        ids = torch.tensor([context + continuation[:-1]])
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state[0, len(context) - 1 :]
        targets = torch.tensor(continuation)[:, None]
        logits = hidden.double() @ model.lm_head.weight.double().T
        exact.append(float(torch.log_softmax(logits, dim=-1).gather(1, targets).sum()))
        rounded.append(float(torch.log_softmax(model.lm_head(hidden).double(), dim=-1).gather(1, targets).sum()))
    np.testing.assert_allclose(ours, exact, atol=2e-4)
    assert max(abs(a - b) for a, b in zip(rounded, exact)) > 1e-2  # the check can tell them apart


def test_runtime_defaults_to_cpu_float32_without_a_gpu():
    import torch

    runtime = resolve_runtime()
    if torch.cuda.is_available():
        assert runtime.device == "cuda:0" and runtime.dtype in ("bfloat16", "float16")
    else:
        assert (runtime.device, runtime.dtype, runtime.processes) == ("cpu", "float32", 1)
        with pytest.raises(UsageError, match="no CUDA GPU is visible"):
            resolve_runtime("cuda:0")
    assert resolve_runtime("cpu", "bfloat16").dtype == "bfloat16"
    with pytest.raises(UsageError, match="--device 'gpu'"):
        resolve_runtime("gpu")


def test_vllm_backend_spawns_its_engines_where_cuda_may_be(monkeypatch):
    """Where torch has CUDA, vLLM's start method is spawn before vLLM is first imported, and this
    process never initialises the CUDA driver: torch.cuda.is_available() does, without setting the
    flag vLLM reads to choose spawn, and vLLM's forked engine then failed. A CUDA build with one GPU
    (counted through NVML) is patched in: there is no GPU here."""
    import importlib.abc

    import torch

    from ladder.eval.backends import get_backend

    def initialises_the_driver(*args, **kwargs):
        raise AssertionError("the CUDA driver was initialised in the process that starts vLLM")

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # restored after the test
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", initialises_the_driver)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", initialises_the_driver)
    start_methods = []  # VLLM_WORKER_MULTIPROC_METHOD at each import of vllm

    class ImportWatch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "vllm":
                start_methods.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
            return None

    monkeypatch.setattr(sys, "meta_path", [ImportWatch(), *sys.meta_path])
    runtime = resolve_runtime(backend="vllm")
    with pytest.raises(UsageError, match="vLLM is not installed"):  # in this environment
        get_backend("vllm").check(runtime, [])
    assert runtime.device == "cuda:0"
    assert start_methods and set(start_methods) == {"spawn"}


def test_two_processes_score_the_items_of_one(tiny_checkpoint, tmp_path, capfd):
    """`--processes 2` (accelerate launch, gloo on the CPU) splits the items and gives the same
    per-item results and scores as one process."""
    suite = _write_suite(
        tmp_path / "s.yaml", [{"task": "ladder_piqa", "limit": 10}, {"task": "ladder_wikitext", "limit": 2}]
    )
    common = [str(tiny_checkpoint), "--suite", str(suite), "--no-cache", "--log-samples", "--device", "cpu"]
    assert cli.main([*common, "--out", str(tmp_path / "one")]) == 0
    assert cli.main([*common, "--out", str(tmp_path / "two"), "--processes", "2"]) == 0
    output = capfd.readouterr()
    assert "float32 on cpu, 2 process(es)" in output.err and re.search(r"\| ladder_piqa +\| acc", output.out)

    label = tiny_checkpoint.name
    one, two = (json.loads((tmp_path / run / f"{label}.json").read_text()) for run in ("one", "two"))
    assert (one["config"]["processes"], two["config"]["processes"]) == (1, 2)
    assert two["config"]["device"] == "cpu" and two["config"]["dtype"] == "float32"
    for task, size in (("ladder_piqa", 10), ("ladder_wikitext", 2)):
        single, double = _samples(tmp_path / "one", label, task), _samples(tmp_path / "two", label, task)
        # Each item once: the processes split the items instead of each scoring all of them.
        assert [s["doc_id"] for s in double] == [s["doc_id"] for s in single] == list(range(size))
        for a, b in zip(single, double):
            assert a["filter"] == b["filter"] and a["target"] == b["target"] and a["arguments"] == b["arguments"]
            assert np.allclose(np.array(a["resps"], dtype=float), np.array(b["resps"], dtype=float), rtol=1e-5)
    for task, metrics in one["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float):
                assert two["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)


def test_chat_template_renders_role_markers_on_the_embedded_instruct_model(tmp_path):
    """SmolLM2-Instruct's template (ChatML) marks each turn with <|im_start|>ROLE; a plain task has
    none. One run, one model load: the chat options are per suite task."""
    chat = {"apply_chat_template": True, "fewshot_as_multiturn": True, "system_instruction": "Answer the question."}
    suite = _write_suite(
        tmp_path / "s.yaml",
        [
            {"task": "ladder_arc_easy", "limit": 2, "num_fewshot": 1, **chat},
            {"task": "ladder_arc_challenge", "limit": 2, "num_fewshot": 1},
        ],
    )
    assert (
        cli.main(["embedded", "--suite", str(suite), "--no-cache", "--log-samples", "--out", str(tmp_path / "o")]) == 0
    )
    label = "SmolLM2-135M-Instruct.Q4_1"
    for sample in _samples(tmp_path / "o", label, "ladder_arc_challenge"):
        context = sample["arguments"][0][0]  # (context, continuation) of the first answer choice
        assert "<|im_start|>" not in context and context.startswith("Question: ")
    for sample in _samples(tmp_path / "o", label, "ladder_arc_easy"):
        context = sample["arguments"][0][0]
        assert context.startswith("<|im_start|>system\nAnswer the question.<|im_end|>")
        # One-shot as turns: the example's question (user), its answer (assistant), then the item.
        assert context.count("<|im_start|>user\n") == 2 and context.count("<|im_start|>assistant\n") == 2
        assert context.endswith("<|im_start|>assistant\n")
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert (
        "ladder_arc_easy (1-shot, at most 2, chat template, few-shot as turns, system instruction)" in report["tasks"]
    )
    options = json.loads((tmp_path / "o" / f"{label}.json").read_text())["ladder"]["chat_options"]
    assert options["ladder_arc_easy"] == {**chat, "gen_kwargs": None}
    assert options["ladder_arc_challenge"]["apply_chat_template"] is False


def test_chat_template_on_a_model_without_one_is_refused(tiny_checkpoint, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="has no chat template"):
        cli.main([str(base), "--apply-chat-template", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# --- the cache cannot go stale ----------------------------------------------------------------


def _cached(out: Path) -> list[str]:
    return json.loads((out / "report.json").read_text())["models"][0]["cached_tasks"]


def test_cache_misses_on_a_data_byte_and_the_dtype_and_hits_unchanged(tiny_checkpoint, tmp_path):
    data = tmp_path / "data"
    for name in ("valid.jsonl", "valid-labels.lst"):
        (data / "eval" / "piqa").mkdir(parents=True, exist_ok=True)
        shutil.copy(ladder_data_dir() / "eval" / "piqa" / name, data / "eval" / "piqa" / name)
    suite = _write_suite(tmp_path / "s.yaml", [{"task": "ladder_piqa", "limit": 4}])
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
        return _cached(out)

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
    assert run("--batch-size", "auto") == []
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
    """A cache entry that does not read back (flipped gzip bytes, bad UTF-8, a JSON list) is one
    warning line and a miss, and the rescored entry replaces it; a killed write's temporary is
    removed once it is old, a live write's (young) is kept."""
    suite = _write_suite(tmp_path / "s.yaml", [{"task": "ladder_piqa", "limit": 2}])
    cache = tmp_path / "cache"
    runs = iter(range(100))

    def run() -> tuple[list[str], list[str]]:
        out = tmp_path / f"run{next(runs)}"
        common = ["--suite", str(suite), "--cache", str(cache), "--device", "cpu"]
        assert cli.main([str(tiny_checkpoint), *common, "--out", str(out)]) == 0
        warnings = [line for line in capsys.readouterr().err.splitlines() if "cache entry" in line]
        return _cached(out), warnings

    assert run() == ([], [])
    (record,) = [path for path in cache.glob("*.json") if path.name != FILE_HASHES]
    samples = record.with_suffix(".samples.json.gz")
    flipped = bytearray(samples.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    corruptions = [
        (samples, bytes(flipped), "unreadable cache entry"),
        (record, b'{"results": "\xff\xfe"}', "unreadable cache entry"),
        (record, b"[1, 2]", "not a cached record"),
    ]
    for path, content, message in corruptions:
        path.write_bytes(content)
        cached, warnings = run()
        assert cached == [] and len(warnings) == 1 and message in warnings[0], (content, warnings)
        assert path.read_bytes() != content  # rescored and written back: the next run hits
        assert run() == (["ladder_piqa"], [])

    killed, live = cache / f".{record.name}.tmp-4242", cache / f".{samples.name}.tmp-4243"
    for leftover in (killed, live):
        leftover.write_bytes(b"half a write")
    hours_ago = killed.stat().st_mtime - STALE_TEMPORARY_SECONDS - 60
    os.utime(killed, (hours_ago, hours_ago))
    assert run() == (["ladder_piqa"], [])
    assert not killed.exists() and live.exists()


def test_cache_key_covers_task_helpers_and_model_code(tmp_path, monkeypatch):
    """An edit to a helper of eval/tasks/utils.py (a function the task config does not name) or to
    the source of the model class changes the key."""
    from lm_eval.tasks import TaskManager

    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS_DIR, tasks, ignore=shutil.ignore_patterns("__pycache__"))
    suite = Suite("s", "", True, (SuiteTask("ladder_piqa", limit=4),))
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

    from ladder.model.modeling_ladder_llama import LadderLlamaForCausalLM

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
    from ladder.model.modeling_ladder_llama import LadderLlamaForCausalLM

    assert model_class(tiny_checkpoint) is LlamaForCausalLM
    assert model_class(embedded_model_path()) is LlamaForCausalLM
    assert model_class(ladder_checkpoints[0]) is LadderLlamaForCausalLM


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--suite", "nightly"], "unknown suite 'nightly'"),
        (["--limit", "0"], "not a positive integer"),
        (["--limit", "ten"], "not a positive integer"),
        (["--limit", "1.5"], "'1.5' is not a positive integer or a fraction between 0 and 1"),
        (["--suite", "smoke", "--tasks", "ladder_piqa"], "argument --tasks: not allowed with argument --suite"),
        (["--tasks", "ladder_piqa,,piqa"], "expected task names separated by commas"),
        (["--data", "/nonexistent/data"], "data folder /nonexistent/data does not exist"),
        (["--device", "tpu"], "--device 'tpu': choose auto, cpu, cuda or cuda:N"),
        (["--dtype", "int8"], "argument --dtype: invalid choice"),
        (["--batch-size", "big"], "not a positive integer"),
        (["--gen-kwargs", "max_gen_toks"], "expected key=value"),
        (["--gen-kwargs", "until=["], r"'until=\[' does not parse as YAML"),
        (["--gen-kwargs", "until=a: b"], "a value is a number, a string"),
        (["--fewshot-as-multiturn"], "fewshot_as_multiturn needs apply_chat_template"),
        (["--data-parallel", "2"], "--data-parallel is for --backend vllm"),
    ],
)
def test_bad_arguments_are_usage_errors(tiny_checkpoint, arguments, message):
    with pytest.raises(UsageError, match=message):
        cli.main([str(tiny_checkpoint), *arguments])


def test_model_that_is_neither_checkpoint_nor_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UsageError, match="not a .gguf file"):
        cli.main([str(tmp_path / "weights.bin")])
    with pytest.raises(UsageError, match="has no config.json"):
        cli.main([str(tmp_path)])


def test_unknown_task_fails_before_any_model_loads(tiny_checkpoint, tmp_path):
    suite = _write_suite(tmp_path / "typo.yaml", [{"task": "ladder_piqa"}, {"task": "ladder_hellaswg"}])
    with pytest.raises(UsageError, match="unknown task.*ladder_hellaswg"):
        cli.main([str(tiny_checkpoint), "--suite", str(suite), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_missing_data_file_is_one_line_on_the_command_line(tiny_checkpoint, tmp_path, capsys):
    from ladder.cli import main as ladder_main

    empty = tmp_path / "data"
    empty.mkdir()
    status = ladder_main(["eval", str(tiny_checkpoint), "--data", str(empty), "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(error) == 1
    assert error[0].startswith("ladder eval: error: data file ") and "is missing" in error[0]


def test_gen_kwargs_that_do_not_parse_are_one_line(capsys):
    from ladder.cli import main as ladder_main

    assert ladder_main(["eval", "embedded", "--gen-kwargs", "max_gen_toks=5,until=[", "--out", "unused"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "ladder eval: error: argument --gen-kwargs: 'until=[' does not parse as YAML: "
        "expected the node content, but found '<stream end>'"
    ]


def test_hub_switches_are_restored(tmp_path):
    import datasets.config
    import huggingface_hub.constants

    before = (os.environ.get("HF_DATASETS_CACHE"), datasets.config.HF_DATASETS_CACHE)
    with hub_offline(tmp_path):
        assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
        assert datasets.config.HF_DATASETS_CACHE == tmp_path == Path(os.environ["HF_DATASETS_CACHE"])
    assert (os.environ.get("HF_DATASETS_CACHE"), datasets.config.HF_DATASETS_CACHE) == before


# --- the command line a new user meets (issue 38) ---------------------------------------------


def _ladder_eval(*arguments: str) -> int:
    from ladder.cli import main as ladder_main

    return ladder_main(["eval", *arguments])


def test_tasks_and_a_fractional_limit_print_the_table_and_the_report_paths_only(
    tiny_checkpoint, tmp_path, monkeypatch, capfd
):
    """`--tasks` takes lm-eval names, `--limit 0.002` a share of the items (rounded up, as lm_eval
    does), stdout holds the table and the report paths (lm-eval's own prints go to its log), stderr
    an overall progress bar; the scores land in $LADDER_CACHE/eval, which a run from another
    folder reads back."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LADDER_CACHE", str(cache))
    tasks = ["--tasks", "ladder_lambada_openai,ladder_piqa", "--limit", "0.002"]
    first, second = tmp_path / "here", tmp_path / "elsewhere"
    first.mkdir(), second.mkdir()
    monkeypatch.chdir(first)
    assert _ladder_eval(str(tiny_checkpoint), *tasks, "--out", str(tmp_path / "out")) == 0
    output = capfd.readouterr()
    assert "bootstrapping" not in output.out  # lm-eval's print for LAMBADA's perplexity
    lines = output.out.strip().splitlines()
    assert lines[-4] == f"results in {tmp_path / 'out'} " + lines[-4].split(" ", 3)[-1]
    assert lines[-3:] == [f"  {tmp_path / 'out' / name}" for name in ("report.json", "report.md", "report.png")]
    assert "model 1/1 tiny-llama" in output.err and "item" in output.err  # the overall progress bar
    rows = {(r["task"], r["metric"]): r for r in json.loads((tmp_path / "out" / "report.json").read_text())["rows"]}
    assert rows[("ladder_lambada_openai", "acc")]["n"] == 11  # ceil(0.002 x 5153)
    assert rows[("ladder_piqa", "acc")]["n"] == 4  # ceil(0.002 x 1838)
    assert (
        len(list((cache / "eval").glob("*.samples.json.gz"))) == 2 and not (first / "runs" / "eval" / "cache").exists()
    )

    monkeypatch.chdir(second)
    assert _ladder_eval(str(tiny_checkpoint), *tasks, "--out", str(tmp_path / "again")) == 0
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert again["models"][0]["cached_tasks"] == ["ladder_lambada_openai", "ladder_piqa"]


def test_more_processes_than_items_is_one_line_before_any_process_starts(tiny_checkpoint, tmp_path, capfd):
    suite = _write_suite(
        tmp_path / "few.yaml", [{"task": "ladder_piqa", "limit": 4}, {"task": "ladder_wikitext", "limit": 1}]
    )
    out = tmp_path / "out"
    assert _ladder_eval(str(tiny_checkpoint), "--suite", str(suite), "--processes", "2", "--out", str(out)) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert error == [
        "ladder eval: error: --processes 2: ladder_wikitext scores 1 item(s), fewer than one per process; "
        "use at most 1 process(es) or more items (--limit, the suite's limit)"
    ]
    assert not out.exists()


def test_a_hub_task_that_is_not_cached_offline_is_one_line_before_any_model_loads(tiny_checkpoint, tmp_path, capfd):
    # The session is offline with an empty HF cache: piqa's dataset cannot be read.
    assert _ladder_eval(str(tiny_checkpoint), "--tasks", "piqa", "--out", str(tmp_path / "out")) == 2
    output = capfd.readouterr()
    error = output.err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("ladder eval: error: Couldn't reach ") and "piqa" in error[0]
    assert "reads its dataset from the Hub" in error[0] and "loading" not in output.err
    assert not (tmp_path / "out").exists()


def test_an_unreachable_hub_is_one_line_before_any_task_loads(tiny_checkpoint, tmp_path, monkeypatch, capfd):
    import huggingface_hub.constants

    # Hub access switched on, to an address where nothing listens (port 9: refused at once).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    assert _ladder_eval(str(tiny_checkpoint), "--suite", "paper", "--out", str(tmp_path / "out")) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(
        "ladder eval: error: the Hugging Face Hub (http://127.0.0.1:9) is not reachable ("
    )
