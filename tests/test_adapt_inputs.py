"""adapt's hostile and unlucky inputs (issue 43): training-data folders are inputs as a whole, a
truncated data cache, numbers out of range, a crafted random-state pickle on resume, a device that
is not there. Each refusal is one line on stderr and a non-zero exit before the model loads."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from adapt_runs import write_recipe
from ladder.adapt.data import load_blocks
from ladder.adapt.recipe import SourceSpec, load_recipe
from ladder.adapt.train import train
from ladder.cli import main as ladder_main
from ladder.errors import UsageError


def refused(capsys, argv: list[str]) -> str:
    """The one stderr line of a command refused in-process (exit 2, no traceback, nothing after)."""
    assert ladder_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ladder {argv[0]}: error: "), lines
    return lines[0]


@pytest.fixture
def data_copy(tmp_path, corpus) -> Path:
    """A copy of the corpus that a test may watch for writes."""
    shutil.copytree(corpus, tmp_path / "corpus")
    return tmp_path / "corpus"


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*"))


def test_a_cache_inside_a_training_data_folder_is_refused(tmp_path, tiny_checkpoint, data_copy, capsys, monkeypatch):
    before = files_under(data_copy)
    recipe = write_recipe(
        tmp_path, tiny_checkpoint, data_copy, **{"data.cache_dir": str(data_copy / "train" / ".cache")}
    )
    assert "overlaps the input" in refused(capsys, ["adapt", str(recipe), "--prepare-data"])
    monkeypatch.setenv("LADDER_CACHE", str(data_copy / "train" / "cache"))  # the shared cache root inside the data
    assert "overlaps the input" in refused(capsys, ["adapt", str(recipe), "data.cache_dir=null", "--prepare-data"])
    assert "overlaps the input" in refused(capsys, ["adapt", str(recipe), "data.cache_dir=null"])
    assert files_under(data_copy) == before


def test_data_reading_refuses_what_the_tool_wrote_and_names_what_it_skips(
    tmp_path, smollm2_tokenizer_dir, data_copy, capsys
):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    train = [SourceSpec(path=str(data_copy / "train"))]
    blocks = len(load_blocks(train, tokenizer, 64, tmp_path / "cache", "train"))
    # A cache an earlier version wrote inside the data folder: its entries carry the tool's marker.
    shutil.copytree(tmp_path / "cache", data_copy / "train" / "old-cache")
    with pytest.raises(UsageError, match=r"old-cache/train-\w+ .*written by ladder .*\.ladder-output"):
        load_blocks(train, tokenizer, 64, tmp_path / "other", "train")
    shutil.rmtree(data_copy / "train" / "old-cache")
    # From the other side: a data folder inside a folder the tool wrote.
    with pytest.raises(UsageError, match=r"written by ladder"):
        load_blocks(
            [SourceSpec(path=str(next((tmp_path / "cache").glob("train-*"))))], tokenizer, 64, tmp_path / "x", "train"
        )
    # Hidden files are not read, and a line says so.
    (data_copy / "train" / ".notes.txt").write_text("not training data " * 100)
    assert len(load_blocks(train, tokenizer, 64, tmp_path / "cache2", "train")) == blocks
    assert ".notes.txt" in capsys.readouterr().err


def test_a_truncated_data_cache_is_rebuilt(tmp_path, smollm2_tokenizer_dir, corpus):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    sources = [SourceSpec(path=str(corpus / "train"))]
    first = np.array(load_blocks(sources, tokenizer, 64, tmp_path, "train").ids)
    entry = next(tmp_path.glob("train-*"))
    for name in ("blocks.bin", "targets.bits"):
        with open(entry / name, "r+b") as handle:
            handle.truncate(100)
        assert np.array_equal(load_blocks(sources, tokenizer, 64, tmp_path, "train").ids, first)


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=1e30", "seed"),
        ("optimizer.lr=.inf", "optimizer.lr"),
        ("optimizer.lr=.nan", "optimizer.lr"),
        ("schedule.warmup_steps=1e30", "schedule.warmup_steps"),
        ("budget=1e30", "budget"),
        ("timeout.setup=.inf", "timeout.setup"),
        ("data.seq_len=1024", "data.seq_len 1024 is longer than the model's context (max_position_embeddings 512"),
    ],
)
def test_numbers_out_of_range_are_refused_before_the_model_loads(
    tmp_path, tiny_checkpoint, corpus, capsys, override, message
):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    assert message in refused(capsys, ["adapt", str(recipe), override])
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


class RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_random_state_pickle_runs_no_code_and_is_refused(tmp_path, tiny_checkpoint, corpus, capsys):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus, budget=4 * 256, checkpoint_every=2)
    train(load_recipe(recipe))
    (tmp_path / "run" / "model").rename(tmp_path / "done")  # as if killed after the checkpoint at step 2
    capsys.readouterr()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    marker = tmp_path / "code-ran"
    (checkpoint / "random_states_0.pkl").write_bytes(pickle.dumps({"random_state": RunsCode(marker)}))
    assert "random_states_0.pkl" in refused(capsys, ["adapt", str(recipe), "resume=true"])
    assert not marker.exists() and not (tmp_path / "run" / "model").exists()


def test_sample_on_a_device_that_is_not_there_is_refused_before_loading(tmp_path, tiny_checkpoint, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = ["sample", str(tiny_checkpoint), "--tokens", "8", "--out", str(tmp_path / "s.jsonl"), "--device", "cuda"]
    assert "cuda" in refused(capsys, argv)
    assert "--device" in refused(capsys, [*argv[:-1], "tpu"])


def test_adapt_plan_counts_training_devices_with_train_devices(tmp_path, tiny_checkpoint, corpus, capsys):
    recipe = write_recipe(tmp_path, tiny_checkpoint, corpus)
    assert ladder_main(["adapt", str(recipe), "--plan", "--hardware", "h100", "--train-devices", "2", "--json"]) == 0
    capsys.readouterr()
    assert "--devices" in refused(capsys, ["adapt", str(recipe), "--plan", "--hardware", "h100", "--devices", "2"])
    assert "--train-devices" in refused(capsys, ["adapt", str(recipe), "--plan", "--train-devices", "0"])
