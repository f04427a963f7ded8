"""eval/: suites, offline tasks against the stock lm-eval formats, the report's standard errors,
`ladder eval` end to end on tiny checkpoints (cache included), bad input, and the stock `lm_eval`
command line giving the same numbers."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import ladder
from ladder.errors import UsageError
from ladder.eval import cli, harness, report
from ladder.eval.suite import Suite, SuiteTask, load_suite, parse_suite, suite_names
from ladder.files import ladder_data_dir

LM_EVAL_TASKS = Path(inspect.getfile(harness.lm_eval)).parent / "tasks"
OFFLINE_TASKS = {  # our task: (stock task yaml, items in the scored split)
    "ladder_wikitext": ("wikitext/wikitext.yaml", 62),
    "ladder_lambada_openai": ("lambada/lambada_openai.yaml", 5153),
    "ladder_piqa": ("piqa/piqa.yaml", 1838),
    "ladder_arc_easy": ("arc/arc_easy.yaml", 2376),
    "ladder_arc_challenge": ("arc/arc_challenge.yaml", 1172),
    "ladder_hellaswag": ("hellaswag/hellaswag.yaml", 10042),
}


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


@pytest.fixture(scope="module")
def our_tasks():
    return harness.task_manager(Suite("ours", "", True, tuple(SuiteTask(t) for t in OFFLINE_TASKS)))


def _write_suite(path: Path, tasks: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"description": "test", "offline": True, "tasks": tasks}))
    return path


# --- suites ---------------------------------------------------------------------------------


def test_shipped_suites_load_and_name_known_tasks(our_tasks):
    assert {"smoke", "offline", "offline-cpu", "demo", "paper"} <= set(suite_names())
    for name in ("smoke", "offline", "offline-cpu", "demo"):
        suite = load_suite(name)
        assert suite.offline and {t.task for t in suite.tasks} == set(OFFLINE_TASKS)
        assert all(t.task in our_tasks.all_tasks for t in suite.tasks)
    assert all(t.limit for t in load_suite("smoke").tasks)
    paper = load_suite("paper")
    assert not paper.offline and {t.task: t.num_fewshot for t in paper.tasks}["mmlu"] == 5


def test_paper_suite_names_resolve_in_lm_eval():
    """The stock names resolve in lm-eval's task index (no dataset is downloaded to check this)."""
    suite = load_suite("paper")
    manager = harness.task_manager(suite)
    assert [t.task for t in suite.tasks if t.task not in manager.all_tasks] == []


@pytest.mark.parametrize(
    "data, message",
    [
        (["ladder_piqa"], "expected a mapping"),
        ({"tasks": []}, "non-empty list"),
        ({"tasks": ["ladder_piqa"], "shots": 5}, "unknown key"),
        ({"tasks": [{"task": "ladder_piqa", "fewshot": 5}]}, r"task 1 \(ladder_piqa\): unknown key"),
        ({"tasks": [{"task": "ladder_piqa", "limit": 0}]}, "limit must be a positive integer"),
        ({"tasks": [{"task": "ladder_piqa", "num_fewshot": -1}]}, "num_fewshot must be a non-negative"),
        ({"tasks": [{"limit": 3}]}, "task 1: expected a task name"),
        ({"tasks": ["ladder_piqa", "ladder_piqa"]}, "listed twice"),
        ({"tasks": ["ladder_piqa"], "offline": "yes"}, "offline must be true or false"),
    ],
)
def test_bad_suites_name_the_fault(data, message):
    with pytest.raises(UsageError, match=message):
        parse_suite(data, "mine")


def test_limit_caps_every_task():
    suite = parse_suite({"tasks": [{"task": "a", "limit": 3}, "b"]}, "s").with_limit(5)
    assert [t.limit for t in suite.tasks] == [3, 5]


# --- offline tasks --------------------------------------------------------------------------


def harness_yaml(path: Path) -> dict:
    """A task YAML as lm-eval reads it: `include:` merged, `!function` resolved."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=True, recursive=True)


def _same(ours, stock) -> bool:
    if callable(ours) and callable(stock):
        return inspect.getsource(ours) == inspect.getsource(stock)
    return ours == stock


@pytest.mark.parametrize("task", sorted(OFFLINE_TASKS))
def test_offline_tasks_copy_the_stock_prompt_and_metrics(task):
    stock_file, _ = OFFLINE_TASKS[task]
    ours = harness_yaml(harness.TASKS_DIR / f"{task}.yaml")
    stock = harness_yaml(LM_EVAL_TASKS / stock_file)
    for key in ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_results", "metric_list"):
        if key == "doc_to_target" and task == "ladder_hellaswag":
            continue  # stock "{{label}}" reads HF's string label; ours is the same template on an int
        assert _same(ours.get(key), stock.get(key)), key
    assert ours["metadata"]["version"] == stock["metadata"]["version"]


def test_offline_tasks_read_the_local_files(our_tasks):
    loaded = our_tasks.load(list(OFFLINE_TASKS))["tasks"]
    for name, (_, size) in OFFLINE_TASKS.items():
        assert len(loaded[name].eval_docs) == size, name
    hellaswag = loaded["ladder_hellaswag"]
    first = hellaswag.eval_docs[0]
    # HellaSwag val item 0 through the stock preprocessing: ctx_b "he" is capitalized.
    assert hellaswag.doc_to_text(first) == "Roof shingle removal: A man is sitting on a roof. He"
    assert hellaswag.doc_to_choice(first)[3] == "starts pulling up roofing on a roof."
    assert hellaswag.doc_to_target(first) == 3
    wikitext = loaded["ladder_wikitext"]
    page = wikitext.eval_docs[0]["page"]
    assert page.startswith(" = Robert Boulter = \n") and "\r" not in page
    assert wikitext.doc_to_target(wikitext.eval_docs[0]).startswith(" = Robert Boulter =\n")
    arc = loaded["ladder_arc_challenge"]
    assert arc.doc_to_text(arc.eval_docs[0]).startswith("Question: ") and arc.eval_docs[0]["answerKey"]


# --- the report's standard errors -----------------------------------------------------------


def _record(task: str, key: str, doc_ids, values, aggregation: str, value=None, stderr=None) -> dict:
    metric = key.split(",")[0]
    return {
        "results": {task: {key: value, f"{metric}_stderr,none": stderr}},
        "per_item": {task: {key: {"doc_id": list(doc_ids), "value": list(values)}}},
        "aggregations": {task: {metric: aggregation}},
    }


def test_difference_of_means_is_paired():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 200).astype(float)
    b = np.where(rng.random(200) < 0.9, a, 1 - a)  # agrees with `a` on ~90% of items
    ref = _record("t", "acc,none", range(200), a, "mean", a.mean(), a.std(ddof=1) / math.sqrt(200))
    other = _record("t", "acc,none", range(200), b, "mean", b.mean(), b.std(ddof=1) / math.sqrt(200))
    score_ref, score = report._score(ref, "t", "acc,none"), report._score(other, "t", "acc,none")
    difference = report._difference(ref, other, "t", "acc,none", score_ref, score)
    assert difference.method == "paired"
    assert difference.value == pytest.approx(b.mean() - a.mean())
    assert difference.stderr == pytest.approx((b - a).std(ddof=1) / math.sqrt(200))
    # Correlated scores: the paired error is well below the independent one.
    assert difference.stderr < 0.6 * math.hypot(score_ref.stderr, score.stderr)
    # Different items: fall back to the independent formula, and say so.
    moved = _record("t", "acc,none", range(1, 201), b, "mean", b.mean(), score.stderr)
    fallback = report._difference(ref, moved, "t", "acc,none", score_ref, score)
    assert fallback.method == "independent"
    assert fallback.stderr == pytest.approx(math.hypot(score_ref.stderr, score.stderr))


def test_perplexity_stderr_is_bootstrapped_when_lm_eval_gives_none():
    rng = np.random.default_rng(1)
    pairs = [[float(-rng.uniform(100, 300)), int(rng.integers(50, 150))] for _ in range(40)]
    ref = _record("w", "word_perplexity,none", range(40), pairs, "weighted_perplexity", 7.0, "N/A")
    same = report._score(ref, "w", "word_perplexity,none")
    assert same.stderr is not None and same.stderr > 0
    identical = report._difference(ref, ref, "w", "word_perplexity,none", same, same)
    assert identical.method == "paired" and identical.stderr == 0.0


def test_paired_bootstrap_of_two_models_matches_the_delta_method():
    # Word perplexity of two different, correlated models on the same 300 documents: the report's
    # paired bootstrap standard error of the difference against the delta method (linearizing
    # exp(-sum(ll) / sum(words)) per document), an independent computation of the same quantity.
    rng = np.random.default_rng(2)
    words = rng.integers(50, 150, 300)
    ll_a = -words * rng.normal(3.0, 0.3, 300)
    ll_b = ll_a - words * rng.normal(0.2, 0.1, 300)  # the second model: worse, and not uniformly
    pairs_a = [[float(ll), int(w)] for ll, w in zip(ll_a, words)]
    pairs_b = [[float(ll), int(w)] for ll, w in zip(ll_b, words)]
    ppl_a, ppl_b = math.exp(-ll_a.sum() / words.sum()), math.exp(-ll_b.sum() / words.sum())
    ref = _record("w", "word_perplexity,none", range(300), pairs_a, "weighted_perplexity", ppl_a, "N/A")
    other = _record("w", "word_perplexity,none", range(300), pairs_b, "weighted_perplexity", ppl_b, "N/A")
    score_ref, score = report._score(ref, "w", "word_perplexity,none"), report._score(other, "w", "word_perplexity,none")
    difference = report._difference(ref, other, "w", "word_perplexity,none", score_ref, score)
    assert difference.method == "paired" and difference.value == pytest.approx(ppl_b - ppl_a)

    total = words.sum()
    influence = (-ppl_b * (ll_b / total + words / total * math.log(ppl_b))
                 + ppl_a * (ll_a / total + words / total * math.log(ppl_a)))
    delta_method = math.sqrt((influence**2).sum())
    assert difference.stderr == pytest.approx(delta_method, rel=0.1)
    assert difference.stderr < 0.5 * math.hypot(score_ref.stderr, score.stderr)  # pairing matters here


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
    assert "| ladder_piqa | acc ↑ | 6 |" in table and "Δ upper2" in table

    first = tmp_path / "first"
    assert {p.name for p in first.iterdir()} == {
        "report.md", "report.json", "report.png", f"{tiny_checkpoint.name}.json", "upper2.json"
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
    hellaswag = [json.loads(f.read_text())["per_item"].get("ladder_hellaswag") for f in cache.glob("*.json")]
    assert [c["acc,none"]["doc_id"] for c in hellaswag if c] == [[0, 1000, 2000, 3000, 4000, 5000]] * 2
    wikitext = rows[("ladder_wikitext", "word_perplexity")]
    assert wikitext["scores"][tiny_checkpoint.name]["stderr"] > 0  # bootstrapped: lm-eval gives N/A
    assert "| ladder_piqa |" in (first / "report.md").read_text()

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
    suite = _write_suite(tmp_path / "two.yaml", [{"task": "ladder_piqa", "limit": 4}, {"task": "ladder_wikitext", "limit": 4}])
    assert cli.main([str(upper2), "--suite", str(suite), "--no-cache", "--out", str(tmp_path / "ours")]) == 0
    ours = json.loads((tmp_path / "ours" / "upper2.json").read_text())["results"]

    command = [
        str(Path(sys.executable).with_name("lm_eval")), "--model", "hf",
        "--model_args", f"pretrained={upper2},trust_remote_code=True",
        "--tasks", "ladder_piqa,ladder_wikitext", "--include_path", str(harness.TASKS_DIR),
        "--limit", "4", "--device", "cpu", "--batch_size", "8", "--output_path", str(tmp_path / "stock"),
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
    from ladder.loading import embedded_model_path

    refs = harness.resolve_models(["embedded", str(tiny_checkpoint), str(tiny_checkpoint)])
    assert refs[0].path == embedded_model_path().resolve() and refs[0].label == "SmolLM2-135M-Instruct.Q4_1"
    assert [r.label for r in refs[1:]] == [f"{tiny_checkpoint.name} #2", f"{tiny_checkpoint.name} #3"]
    named = harness.resolve_models(["original=embedded", f"ladder={tiny_checkpoint}"])
    assert [(r.label, r.spec) for r in named] == [("original", "embedded"), ("ladder", str(tiny_checkpoint))]
    with pytest.raises(UsageError, match="label"):
        harness.resolve_models([f"={tiny_checkpoint}"])
    # Same weights, other wiring: the config is part of the key, so the cache cannot mix them up.
    upper2, _ = ladder_checkpoints
    assert harness.fingerprint(tiny_checkpoint) != harness.fingerprint(upper2)
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in upper2.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    (copy / "README.md").write_text("notes do not change the model")
    (copy / "conversion.json").write_text('{"seconds": 1.5}')  # nor does a record of how it was made
    assert harness.fingerprint(copy) == harness.fingerprint(upper2)



def test_cache_keys_are_the_same_in_every_process():
    """Task configs hold functions (HellaSwag's process_docs, WikiText's detokenizer): the key must
    not depend on where they sit in memory, or the cache would never hit in a new process."""
    script = (
        "from ladder.eval import harness; from ladder.eval.suite import load_suite\n"
        "suite = load_suite('offline')\n"
        "prepared = harness.task_configs(suite, harness.task_manager(suite))\n"
        "print(*[harness.cache_key('model', task, prepared[task.task]) for task in suite.tasks])\n"
    )
    keys = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
        for _ in range(2)
    ]
    assert len(keys[0]) == len(OFFLINE_TASKS) and keys[0] == keys[1]


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--suite", "nightly"], "unknown suite 'nightly'"),
        (["--limit", "0"], "not a positive integer"),
        (["--limit", "ten"], "not a positive integer"),
        (["--data", "/nonexistent/data"], "data folder /nonexistent/data does not exist"),
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


def test_hub_switches_are_restored(tmp_path):
    import datasets.config
    import huggingface_hub.constants

    before = (os.environ.get("HF_DATASETS_CACHE"), datasets.config.HF_DATASETS_CACHE)
    with harness.hub_offline(tmp_path):
        assert huggingface_hub.constants.HF_HUB_OFFLINE and datasets.config.HF_DATASETS_OFFLINE
        assert datasets.config.HF_DATASETS_CACHE == tmp_path == Path(os.environ["HF_DATASETS_CACHE"])
    assert (os.environ.get("HF_DATASETS_CACHE"), datasets.config.HF_DATASETS_CACHE) == before
