"""`ladder demo` end to end on the tiny checkpoint: convert, tokenize, retrain, score three models, and
on a second run reuse every finished stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ladder.cli import demo
from ladder.errors import UsageError
from ladder.io.files import ladder_data_dir


def _recipe(directory: Path, checkpoint: Path, **model) -> Path:
    books = ladder_data_dir() / "train" / "gutenberg"
    recipe = {
        "name": "tiny-demo",
        "model": {"path": str(checkpoint), "ladder_layers": 2, **model},
        "data": {
            "train": [{"path": str(books / "120_treasure_island" / "pg120.txt"), "max_tokens": 4096}],
            "eval": [{"path": str(books / "84_frankenstein" / "84-0.txt"), "max_tokens": 1024}],
            "seq_len": 64,
            "eval_blocks": 4,
        },
        "budget": 6 * 2 * 64,
        "batch": {"micro_batch": 2},
        "optimizer": {"lr": 1e-3},
        "schedule": {"warmup_steps": 1},
        "checkpoint_every": 3,
        "eval_every": 3,
        "logging": {"progress": False},
    }
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _suite(directory: Path) -> Path:
    """Two tasks of the smoke suite, a few items each: the demo scores three models, twice over."""
    tasks = [{"task": "ladder_wikitext", "limit": 1}, {"task": "ladder_piqa", "limit": 4}]
    path = directory / "suite.yaml"
    path.write_text(yaml.safe_dump({"description": "the demo test's", "offline": True, "tasks": tasks}))
    return path


@pytest.mark.slow  # three demo runs: convert, retrain, score three models
def test_demo_runs_the_pipeline_then_reuses_it(tmp_path, tiny_checkpoint, capsys):
    out, suite = tmp_path / "demo", str(_suite(tmp_path))
    arguments = ["--recipe", str(_recipe(tmp_path, tiny_checkpoint)), "--suite", suite, "--out", str(out)]
    assert demo.main(arguments) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report" / "report.json").read_text())
    assert [m["label"] for m in report["models"]] == list(demo.LABELS)
    assert json.loads((out / "ladder" / "config.json").read_text())["ladder_layers"] == [2, 3]
    assert (out / "adapt" / "model" / "model.safetensors").is_file()
    assert set(report["pipeline"]["seconds"]) == {*demo.STAGES, "total"} and report["pipeline"]["reused"] == []
    assert (
        "Held-out WikiText-2 word perplexity" in printed and "## Pipeline" in (out / "report" / "report.md").read_text()
    )

    # Again: the conversion and the retrained model are reused and every score comes from the cache.
    adapted = (out / "adapt" / "model" / "model.safetensors").stat().st_mtime_ns
    assert demo.main(arguments) == 0
    again = json.loads((out / "report" / "report.json").read_text())
    assert again["pipeline"]["reused"] == ["convert", "adapt"]
    assert all(len(m["cached_tasks"]) == 2 for m in again["models"]), [m["cached_tasks"] for m in again["models"]]
    assert (out / "adapt" / "model" / "model.safetensors").stat().st_mtime_ns == adapted
    assert [r["scores"] for r in again["rows"]] == [r["scores"] for r in report["rows"]]

    # Other settings are never served from the old results: refused before any stage, naming
    # what differs, and redone on --redo.
    other_layers = [
        "--recipe",
        str(_recipe(tmp_path, tiny_checkpoint, ladder_layers=1)),
        "--suite",
        suite,
        "--out",
        str(out),
    ]
    with pytest.raises(UsageError, match=r"converted with other settings \(ladder_layers differ.*--redo convert"):
        demo.main(other_layers)
    (tmp_path / "lr").mkdir()
    other_lr = _recipe(tmp_path / "lr", tiny_checkpoint)
    other_lr.write_text(other_lr.read_text().replace("lr: 0.001", "lr: 0.002"))
    with pytest.raises(UsageError, match=r"at optimizer.lr;.*--redo adapt retrains"):
        demo.main(["--recipe", str(other_lr), "--suite", suite, "--out", str(out)])
    assert (out / "adapt" / "model" / "model.safetensors").stat().st_mtime_ns == adapted
    assert demo.main(other_layers + ["--redo", "convert"]) == 0  # a new conversion retrains too
    assert json.loads((out / "ladder" / "config.json").read_text())["ladder_layers"] == [3]
    assert (out / "adapt" / "model" / "model.safetensors").stat().st_mtime_ns != adapted
    assert json.loads((out / "report" / "report.json").read_text())["pipeline"]["reused"] == []


def test_demo_needs_a_recipe_that_names_the_layers(tmp_path, tiny_checkpoint):
    with pytest.raises(UsageError, match="ladder_layers"):
        demo.main(["--recipe", str(_recipe(tmp_path, tiny_checkpoint, ladder_layers=None)), "--out", str(tmp_path)])
    with pytest.raises(UsageError, match="invalid choice"):
        demo.main(["--redo", "everything"])
