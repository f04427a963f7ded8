"""`ladder eval` end to end on tiny checkpoints: the report and the cached baseline, the stock
`lm_eval` command line giving the same numbers, two processes against one, chat templates on the
embedded SmolLM2-Instruct, and what a new user meets on the command line."""

from __future__ import annotations

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
from eval_runs import ladder_eval, samples, write_suite

from ladder.errors import UsageError
from ladder.eval import cli
from ladder.eval.cache import (
    FILE_HASHES,
)
from ladder.eval.lm_tasks import TASKS_DIR
from ladder.io.files import ladder_data_dir

pytest_plugins = ("eval_runs",)  # its ladder_checkpoints fixture


# --- ladder eval end to end -----------------------------------------------------------------


def _suite_file(tmp_path: Path) -> Path:
    return write_suite(
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
    assert "1,000 bootstrap draws: lm_eval's default is 100,000" in (first / "report.md").read_text()

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
    suite = write_suite(
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


def test_two_processes_score_the_items_of_one(tiny_checkpoint, tmp_path, capfd):
    """`--processes 2` (accelerate launch, gloo on the CPU) splits the items and gives the same
    per-item results and scores as one process."""
    suite = write_suite(
        tmp_path / "s.yaml", [{"task": "ladder_piqa", "limit": 10}, {"task": "ladder_wikitext", "limit": 2}]
    )
    common = [str(tiny_checkpoint), "--suite", str(suite), "--no-cache", "--log-samples", "--device", "cpu"]
    assert cli.main([*common, "--out", str(tmp_path / "one")]) == 0
    assert cli.main([*common, "--out", str(tmp_path / "two"), "--processes", "2"]) == 0
    output = capfd.readouterr()
    assert "float32 on cpu, 2 process(es)" in output.out and re.search(r"\| ladder_piqa +\| acc", output.out)

    label = tiny_checkpoint.name
    one, two = (json.loads((tmp_path / run / f"{label}.json").read_text()) for run in ("one", "two"))
    assert (one["config"]["processes"], two["config"]["processes"]) == (1, 2)
    assert two["config"]["device"] == "cpu" and two["config"]["dtype"] == "float32"
    for task, size in (("ladder_piqa", 10), ("ladder_wikitext", 2)):
        single, double = samples(tmp_path / "one", label, task), samples(tmp_path / "two", label, task)
        # Each item once: the processes split the items instead of each scoring all of them.
        assert [s["doc_id"] for s in double] == [s["doc_id"] for s in single] == list(range(size))
        for a, b in zip(single, double):
            assert a["filter"] == b["filter"] and a["target"] == b["target"] and a["arguments"] == b["arguments"]
            assert np.allclose(np.array(a["resps"], dtype=float), np.array(b["resps"], dtype=float), rtol=1e-5)
    for task, metrics in one["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float):
                assert two["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)


def test_chat_template_renders_role_markers_on_the_embedded_instruct_model(tmp_path, gguf_parses):
    """SmolLM2-Instruct's template (ChatML) marks each turn with <|im_start|>ROLE; a plain task has
    none. One run, one model load: the chat options are per suite task. The GGUF file is parsed
    once, for the template check, the cache key (its class) and the load."""
    chat = {"apply_chat_template": True, "fewshot_as_multiturn": True, "system_instruction": "Answer the question."}
    suite = write_suite(
        tmp_path / "s.yaml",
        [
            {"task": "ladder_arc_easy", "limit": 2, "num_fewshot": 1, **chat},
            {"task": "ladder_arc_challenge", "limit": 2, "num_fewshot": 1},
        ],
    )
    cache, out = str(tmp_path / "c"), str(tmp_path / "o")
    assert cli.main(["embedded", "--suite", str(suite), "--cache", cache, "--log-samples", "--out", out]) == 0
    assert len(gguf_parses) == 1
    label = "SmolLM2-135M-Instruct.Q4_1"
    for sample in samples(tmp_path / "o", label, "ladder_arc_challenge"):
        context = sample["arguments"][0][0]  # (context, continuation) of the first answer choice
        assert "<|im_start|>" not in context and context.startswith("Question: ")
    for sample in samples(tmp_path / "o", label, "ladder_arc_easy"):
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


# --- the command line a new user meets (issue 38) ---------------------------------------------


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
    assert ladder_eval(str(tiny_checkpoint), *tasks, "--out", str(tmp_path / "out")) == 0
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
    assert ladder_eval(str(tiny_checkpoint), *tasks, "--out", str(tmp_path / "again")) == 0
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert again["models"][0]["cached_tasks"] == ["ladder_lambada_openai", "ladder_piqa"]


def test_more_processes_than_items_is_one_line_before_any_process_starts(tiny_checkpoint, tmp_path, capfd):
    suite = write_suite(
        tmp_path / "few.yaml", [{"task": "ladder_piqa", "limit": 4}, {"task": "ladder_wikitext", "limit": 1}]
    )
    out = tmp_path / "out"
    assert ladder_eval(str(tiny_checkpoint), "--suite", str(suite), "--processes", "2", "--out", str(out)) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert error == [
        "ladder eval: error: --processes 2: ladder_wikitext scores 1 item(s), fewer than one per process; "
        "use at most 1 process(es) or more items (--limit, the suite's limit)"
    ]
    assert not out.exists()


def test_a_hub_task_that_is_not_cached_offline_is_one_line_before_any_model_loads(tiny_checkpoint, tmp_path, capfd):
    # The session is offline with an empty HF cache: piqa's dataset cannot be read.
    assert ladder_eval(str(tiny_checkpoint), "--tasks", "piqa", "--out", str(tmp_path / "out")) == 2
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
    assert ladder_eval(str(tiny_checkpoint), "--suite", "paper", "--out", str(tmp_path / "out")) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(
        "ladder eval: error: the Hugging Face Hub (http://127.0.0.1:9) is not reachable ("
    )


def test_lm_eval_spellings_and_few_shot_from_a_folder_outside_git(tiny_checkpoint, tmp_path, monkeypatch, capfd):
    """lm_eval's --output_path, --batch_size and --num_fewshot work as there; information lines go
    to stdout; lm-eval asks git for a commit, and git's `fatal: not a git repository` stays off
    the terminal (run from a folder outside any repository)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    common = ["--tasks", "ladder_arc_easy", "--limit", "2", "--no-cache", "--device", "cpu"]
    habits = ["--num_fewshot", "1", "--batch_size", "2", "--output_path", str(out)]
    assert ladder_eval(str(tiny_checkpoint), *common, *habits) == 0
    output = capfd.readouterr()
    assert "fatal" not in output.err and "git" not in output.err
    assert f"loading {tiny_checkpoint.name} (float32 on cpu, 1 process(es))" in output.out
    report = json.loads((out / "report.json").read_text())
    assert report["tasks"] == "ladder_arc_easy (1-shot, at most 2)" and report["batch_size"] == 2
