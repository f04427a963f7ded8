"""convert/'s cheap checks come before any expensive work (issue 28): absurd sizes, integer weights,
attention heads that do not divide and a ladder checkpoint as the source are refused in one line
from config.json and the weight headers, even with --no-verify; verification refuses NaN or
infinite damage. Each source is a copy of the `tiny_checkpoint` fixture, edited."""

from pathlib import Path

import gguf
import pytest
import torch

from checkpoints import copy_of, edit_config, edit_tensors, run_convert, snapshot, write_gguf
from ladder.convert.convert import convert_checkpoint

HIDDEN, LAYERS = 64, 4  # the tiny checkpoint's


def _attention_of(source: Path, heads: int, kv_heads: int, head_dim: int | None) -> Path:
    """`source` with attention projections of these sizes (random weights) and a config that says
    so; `head_dim` None: the config leaves it to be derived, as hidden_size // num_attention_heads."""
    size = head_dim or HIDDEN // heads

    def resize(tensors: dict[str, torch.Tensor]) -> None:
        for layer in range(LAYERS):
            prefix = f"model.layers.{layer}.self_attn."
            tensors[prefix + "q_proj.weight"] = torch.randn(heads * size, HIDDEN)
            tensors[prefix + "k_proj.weight"] = torch.randn(kv_heads * size, HIDDEN)
            tensors[prefix + "v_proj.weight"] = torch.randn(kv_heads * size, HIDDEN)
            tensors[prefix + "o_proj.weight"] = torch.randn(HIDDEN, heads * size)

    edit_tensors(source, resize)
    edit_config(source, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    return source


def _ladder_of(source: Path, work: Path) -> Path:
    convert_checkpoint(source, work / "ladder", ladder_layers="2-3", verify=False)
    return work / "ladder"


def _integer_norm(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int64)


REFUSED = {
    # name: (make the source in `work` from a copy of the tiny checkpoint `src`, extra args, message)
    "a-billion-layers": (
        lambda src, work: edit_config(src, num_hidden_layers=10**9) or src,
        [],
        "config.json: num_hidden_layers is 1000000000, but the weights hold layers 0-3",
    ),
    "a-billion-layers-two-named": (
        lambda src, work: edit_config(src, num_hidden_layers=10**9) or src,
        ["--layers", "2"],
        "config.json: num_hidden_layers is 1000000000, but the weights hold layers 0-3",
    ),
    "gguf-a-billion-blocks": (
        lambda src, work: write_gguf(work / "m.gguf", "llama", gguf.GGMLQuantizationType.F32, block_count=10**9),
        [],
        "has llama.block_count 1000000000, but its tensors hold 0 blocks",
    ),
    "integer-weights": (
        lambda src, work: edit_tensors(src, _integer_norm) or src,
        [],
        "tensor model.norm.weight holds int64; every weight of the model is floating point (1 such tensor)",
    ),
    "kv-heads-do-not-divide-heads": (
        lambda src, work: _attention_of(src, heads=4, kv_heads=3, head_dim=16),
        [],
        "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    "heads-do-not-divide-hidden": (
        lambda src, work: _attention_of(src, heads=5, kv_heads=5, head_dim=None),
        [],
        "config.json: hidden_size 64 is not a multiple of num_attention_heads 5",
    ),
    "odd-head-dim": (
        lambda src, work: _attention_of(src, heads=4, kv_heads=2, head_dim=15),
        [],
        "config.json: head_dim 15 is odd",
    ),
    "ladder-source-other-layers": (
        _ladder_of,
        ["--layers", "1"],
        "config.json has model_type 'llamaLadder' (ladder layers 2-3): it is converted already; "
        "convert the original checkpoint",
    ),
    "ladder-source-same-layers": (
        _ladder_of,
        ["--layers", "2-3"],
        "config.json has model_type 'llamaLadder' (ladder layers 2-3): it is converted already; "
        "convert the original checkpoint",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_cheap_checks_refuse_before_any_work(case, tiny_checkpoint, tmp_path, capsys):
    """One line, exit 2, nothing written, even with --no-verify (no verification to crash in); a
    billion layers refused in the time it takes to read config.json and the headers."""
    make, extra, message = REFUSED[case]
    work = tmp_path / "work"
    source = make(copy_of(tiny_checkpoint, work / "src"), work)
    before = snapshot(work)
    code, stdout, stderr = run_convert(capsys, source, "--out", tmp_path / "out", "--no-verify", *extra)
    assert code == 2, stdout + stderr
    assert stderr.startswith("ladder convert: error: ") and message in stderr and stderr.count("\n") == 1, stderr
    assert snapshot(work) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def _nan_norm(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.norm.weight"][3] = float("nan")


def _infinite_head(tensors: dict[str, torch.Tensor]) -> None:
    tensors["lm_head.weight"][3, 3] = float("inf")


@pytest.mark.parametrize("edit", [_nan_norm, _infinite_head], ids=["nan", "inf"])
def test_verification_refuses_damage_that_is_not_finite(edit, tiny_checkpoint, tmp_path, capsys):
    work = tmp_path / "work"
    source = copy_of(tiny_checkpoint, work / "src")
    edit_tensors(source, edit)
    before = snapshot(work)
    code, stdout, stderr = run_convert(capsys, source, "--out", tmp_path / "out")
    assert code == 2, stdout + stderr
    errors = [line for line in stderr.splitlines() if line.startswith("ladder convert:")]
    assert errors == [stderr.splitlines()[-1]] and "Traceback" not in stderr, stderr
    assert errors[0].startswith(
        "ladder convert: error: verification failed, nothing written: the damage measured is not finite ("
    )
    assert "mean KL nan" in errors[0]
    assert snapshot(work) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
