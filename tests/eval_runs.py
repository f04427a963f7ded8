"""What the eval tests share: a suite file, ladder copies of the tiny checkpoint, a run's samples,
and `ladder eval` as the command line runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

import ladder


def ladder_copy(source: Path, destination: Path, layers) -> Path:
    model = AutoModelForCausalLM.from_pretrained(source)
    ladder.to_ladder(model, layers).save_pretrained(destination)
    AutoTokenizer.from_pretrained(source).save_pretrained(destination)
    return destination


@pytest.fixture(scope="module")
def ladder_checkpoints(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """Two ladder variants of the tiny checkpoint (upper 2 and upper 3 of 4 layers)."""
    root = tmp_path_factory.mktemp("ladder")
    return ladder_copy(tiny_checkpoint, root / "upper2", 2), ladder_copy(tiny_checkpoint, root / "upper3", 3)


def write_suite(path: Path, tasks: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"description": "test", "offline": True, "tasks": tasks}))
    return path


def samples(folder: Path, label: str, task: str) -> list[dict]:
    lines = (folder / "samples" / label / f"{task}.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda sample: sample["doc_id"])


def cached(out: Path) -> list[str]:
    return json.loads((out / "report.json").read_text())["models"][0]["cached_tasks"]


def ladder_eval(*arguments: str) -> int:
    """`ladder eval ARGUMENTS` as the command line runs it (one line and status 2 on bad input)."""
    from ladder.cli import main as ladder_main

    return ladder_main(["eval", *arguments])
