"""Opening model paths: checkpoint directories, GGUF files, the embedded default, Hub IDs, bad paths."""

import json
import shutil
import sys
from pathlib import Path

import gguf
import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub import ModelCard

from checkpoints import COMMIT, cache_hub_model
from ladder.cli import main as ladder_main
from ladder.errors import UsageError
from ladder.eval.models import resolve_models
from ladder.io import loading, tensors
from ladder.io.loading import embedded_model_path, hub_model_id, load_model, model_name, resolve_model_path


def test_empty_path_means_the_embedded_model():
    path = resolve_model_path(None)
    assert path == embedded_model_path() == resolve_model_path("")
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_a_checkpoint_is_checked_and_its_tokenizer_read_once_per_process(tiny_checkpoint, tmp_path, monkeypatch):
    """load_tokenizer re-parsed tokenizer.json and every safetensors header on each call (issue 41);
    an edited checkpoint is checked and read again."""
    from transformers import AutoTokenizer

    model = Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))
    calls = {"headers": 0, "tokenizer files": 0, "tokenizer": 0}

    def counting(key, function):
        return lambda *args, **kwargs: calls.__setitem__(key, calls[key] + 1) or function(*args, **kwargs)

    monkeypatch.setattr(tensors, "read_shard", counting("headers", tensors.read_shard))
    monkeypatch.setattr(loading, "check_tokenizer_files", counting("tokenizer files", loading.check_tokenizer_files))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counting("tokenizer", AutoTokenizer.from_pretrained))
    first, second = loading.load_tokenizer(model), loading.load_tokenizer(model)
    loading.check_checkpoint(model)
    assert first is not second and first("Hello")["input_ids"] == second("Hello")["input_ids"]
    assert calls == {"headers": 1, "tokenizer files": 1, "tokenizer": 1}
    (model / "tokenizer_config.json").write_text((model / "tokenizer_config.json").read_text() + "\n")
    loading.load_tokenizer(model)
    assert calls == {"headers": 2, "tokenizer files": 2, "tokenizer": 2}


def test_a_gguf_file_is_parsed_once_per_load(gguf_parses):
    # transformers parses the file for the tokenizer, the config and the weights; load_model has
    # them share one parse, and leaves gguf as it found it.
    counting_reader = gguf.GGUFReader
    model, tokenizer = load_model(None)
    assert len(gguf_parses) == 1 and gguf.GGUFReader is counting_reader
    assert (
        model.config.num_hidden_layers == 30
        and tokenizer.decode(tokenizer("Ladder residual").input_ids) == "Ladder residual"
    )
    [down] = [t for t in counting_reader(embedded_model_path()).tensors if t.name == "blk.0.ffn_down.weight"]
    expected = torch.from_numpy(gguf.dequantize(down.data, down.tensor_type))
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, expected)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: (d / "weights.bin").write_bytes(b"x") and d / "weights.bin", "not a .gguf file"),
        (lambda d: d, "has no config.json"),
    ],
    ids=["missing", "not-gguf", "no-config"],
)
def test_bad_model_paths_are_named(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(UsageError, match=message) as error:
        resolve_model_path(path)
    assert str(path) in str(error.value)


# --- Hub model IDs: resolved through huggingface_hub's cache (the tests run with HF_HUB_OFFLINE=1) ---


def test_a_hub_id_resolves_through_the_cache(hub_cache, tiny_checkpoint, tmp_path, monkeypatch):
    snapshot = cache_hub_model(hub_cache, "test-org/tiny-llama", tiny_checkpoint)
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    assert resolve_model_path("test-org/tiny-llama") == snapshot
    assert resolve_model_path(f"test-org/tiny-llama@{COMMIT}") == snapshot
    assert hub_model_id(snapshot) == "test-org/tiny-llama" and model_name(snapshot) == "tiny-llama"
    # A local folder spelled like the ID wins.
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "test-org" / "tiny-llama"
    shutil.copytree(tiny_checkpoint, local)
    assert resolve_model_path("test-org/tiny-llama") == Path("test-org/tiny-llama")


@pytest.mark.parametrize(
    "model_id, message",
    [
        (
            "test-org/not-downloaded",
            "model test-org/not-downloaded is not a local path and not in the Hugging Face "
            "cache ({cache}), and HF_HUB_OFFLINE is set: download it with "
            "`hf download test-org/not-downloaded` where the Hub is reachable",
        ),
        ("test-org/tiny-llama@v2", "`hf download test-org/tiny-llama --revision v2`"),
    ],
)
def test_a_hub_id_that_is_not_cached_says_how_to_download_it(hub_cache, tiny_checkpoint, model_id, message, capsys):
    cache_hub_model(hub_cache, "test-org/tiny-llama", tiny_checkpoint)
    with pytest.raises(UsageError) as error:
        resolve_model_path(model_id)
    assert message.format(cache=hub_cache) in str(error.value) and "\n" not in str(error.value)
    assert ladder_main(["convert", model_id]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_convert_and_eval_take_a_hub_id_and_cards_carry_base_model_and_licence(
    hub_cache, tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoint, source)
    (source / "LICENSE").write_text("LLAMA 3.1 COMMUNITY LICENSE AGREEMENT ...")
    (source / "USE_POLICY.md").write_text("# Llama 3.1 Acceptable Use Policy ...")
    (source / "README.md").write_text("---\nlicense: llama3.1\nbase_model: test-org/tiny-base\n---\n# Tiny\n")
    snapshot = cache_hub_model(hub_cache, "test-org/tiny-llama", source, [p.name for p in source.iterdir()])
    monkeypatch.chdir(tmp_path)
    assert ladder_main(["convert", "test-org/tiny-llama", "--layers", "2"]) == 0
    out = tmp_path / "runs" / "convert" / "tiny-llama-ladder2"  # named after the repository, not the commit
    assert (out / "model.safetensors").read_bytes() == (snapshot / "model.safetensors").read_bytes()
    assert resolve_models(["test-org/tiny-llama"])[0].label == "tiny-llama"

    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "test-org/tiny-llama" and card.data.base_model_relation == "finetune"
    assert card.data.license == "llama3.1" and card.data.library_name == "transformers"
    assert card.data.tags[:2] == ["ladder-residual", "llama"]
    assert "2 of its 4 layers are rewired (2-3)" in card.text and "top-1 agreement" in card.text
    assert (out / "LICENSE").read_text() == (source / "LICENSE").read_text()
    assert (out / "USE_POLICY.md").is_file() and (out / "README.source.md").is_file()

    # Retraining the converted model: its card names the original as base model, with the data and the
    # held-out losses, and the licence files travel on.
    (tmp_path / "text.txt").write_text(" ".join(["the quiet river under the old stone bridge"] * 120))
    recipe = {
        "model": {"path": str(out)},
        "budget": 128,
        "batch": {"micro_batch": 2},
        "data": {"train": [str(tmp_path / "text.txt")], "seq_len": 32, "heldout_fraction": 0.3},
        "output_dir": str(tmp_path / "adapted"),
        "logging": {"progress": False},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert ladder_main(["adapt", str(tmp_path / "recipe.yaml")]) == 0
    final = tmp_path / "adapted" / "model"
    card = ModelCard.load(final / "README.md")
    assert card.data.base_model == "test-org/tiny-llama" and card.data.license == "llama3.1"
    assert "ladder-residual" in card.data.tags and card.data.datasets is None  # local files are not Hub datasets
    assert "Layers 2-3 of 4 are ladder layers" in card.text and "`text.txt`" in card.text
    evals = [
        json.loads(line)
        for line in (tmp_path / "adapted" / "metrics.jsonl").read_text().splitlines()
        if "eval_loss" in line
    ]
    assert f"| {evals[0]['eval_loss']:.4f} |" in card.text and f"| {evals[-1]['eval_loss']:.4f} |" in card.text
    assert sorted(p.name for p in final.glob("[LU]*")) == ["LICENSE", "USE_POLICY.md"]


def test_gguf_parsed_once_runs_without_gguf(monkeypatch):
    """The lent GPU image has no gguf (docs/gpu.md): adapt and eval enter this block on every run."""
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with loading.gguf_parsed_once():
        pass
