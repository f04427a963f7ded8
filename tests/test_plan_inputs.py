"""`ladder plan`'s inputs: numbers finite and in range, malformed GGUF files, a closed pipe, model and
hardware names as users write them, the flags every command shares, whether the model fits, and the
published shapes of the Qwen3, Qwen2.5 and Mistral families (issue 43 item 5, issue 44 items 3, 7, 9,
issue 45)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from ladder.cli import main
from ladder.plan.costs import ModelShape, forward_cost, parameter_counts
from ladder.plan.models import published_config

LLAMA_8B = "meta-llama/Llama-3.1-8B"


def refused(capsys, *arguments: str) -> str:
    """`ladder plan ...` ends with status 2 and one error line, nothing on stdout; the line."""
    assert main(["plan", *arguments]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("ladder plan: error:")]
    assert len(errors) == 1 and "Traceback" not in captured.err and captured.out == "", captured.err
    return errors[0]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--interconnect", "1e12,nan"], "--interconnect '1e12,nan': BANDWIDTH and LATENCY_US: 'nan' is not"),
        (["--interconnect", "1e999,5"], "'1e999' is not a finite number"),
        (["--interconnect", "370e9,1e-300"], "'1e-300' is outside"),
        (["--hardware", "1e999,3.35e12"], "'1e999' is not a finite number"),
        (["--hardware", "1e-300,3.35e12,80GB"], "'1e-300' is outside"),
        (["--hardware", "989e12,inf,80GB"], "'inf' is not a finite number"),
        (["--hardware", "989e12,3.35e12,1e999GB"], "is not a finite size"),
        (["--tp", "0"], "argument --tp: '0' is not a positive integer"),
        (["--prompt", "-1"], "argument --prompt: '-1' is outside 1..16777216"),
        (["--batch-size", "1,0"], "argument --batch-size: '0' is outside 1..1048576"),
        (["--train-devices", "0"], "argument --train-devices: '0' is outside 1..1048576"),
        (["--prompt", "1" + "0" * 300], "argument --prompt: '1000"),  # an OverflowError traceback
        (["--batch-size", "1," + "1" * 200], "is outside 1..1048576"),  # cells of 1e198 ms
    ],
)
def test_plan_refuses_a_figure_that_is_not_finite_or_out_of_range(capsys, arguments, message):
    """Issue 43 item 5: `--interconnect 1e12,nan` printed "0/0 hidden, 1.00x" on every row, exit 0; 1e999 and
    1e-300 printed inf or nan cells."""
    assert message in refused(capsys, LLAMA_8B, *arguments)


def test_plan_refuses_a_calibration_with_a_figure_that_is_not_finite(tmp_path, capsys):
    device = dict(name="cpu (measured)", flops=float("nan"), bandwidth=1e10, efficiency=1.0, kernel_us=1.0,
                  eager_kernel_us=1.0, memory=1e9)  # fmt: skip
    link = dict(name="loopback", base_us=100.0, hop_us=0.0, bus_bandwidth=1e9, host_us=1.0, host_ns_per_byte=1.0)
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(dict(device=device, links=[link])))  # json writes NaN
    assert "is not a calibration" in refused(capsys, LLAMA_8B, "--hardware", str(calibration))


def llama_gguf(path: Path, heads: int = 4) -> Path:
    gguf = pytest.importorskip("gguf")  # optional: only GGUF input needs it
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_bytes(llama_gguf(path).read_bytes()[:40]),  # struct.error in gguf-py
        lambda path: llama_gguf(path, heads=0),  # ZeroDivisionError in transformers' config
        lambda path: path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64),
    ],
)
def test_plan_of_a_malformed_gguf_is_one_line(tmp_path, capsys, damage):
    """Issue 43: three malformed GGUFs that convert refuses in one line gave struct.error and
    ZeroDivisionError tracebacks in plan."""
    damage(tmp_path / "model.gguf")
    assert "cannot read the config" in refused(capsys, str(tmp_path / "model.gguf"), "--tp", "1")


def test_plan_into_a_closed_pipe_ends_quietly(monkeypatch, capsys):
    """Issue 44 item 5: `ladder plan ... | head -1` ended in a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as closed:
        monkeypatch.setattr("sys.stdout", closed)
        assert main(["plan", LLAMA_8B]) == 141  # as `yes | head` ends: 128 + SIGPIPE
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "name", ["Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B", "META-LLAMA/LLAMA-3.1-70B", "llama-3.1-70b"]
)
def test_plan_takes_a_model_name_as_users_write_it(hub_cache, capsys, name):
    """Issue 44 item 9: the name without its organisation and Meta's earlier 3.1 name were refused."""
    assert main(["plan", name, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "meta-llama/Llama-3.1-70B" and result["shape"]["num_layers"] == 80


def test_plan_suggests_a_published_name_and_fetches_no_original_weights(hub_cache, capsys):
    """Issue 44 item 9: no suggestion, and the hint `hf download REPO` also fetched original/ (16 GB)."""
    error = refused(capsys, "meta-llama/Llama3.1-8B")
    assert "did you mean meta-llama/Llama-3.1-8B?" in error
    assert "`hf download meta-llama/Llama3.1-8B config.json --exclude 'original/*'`" in error


def test_hardware_and_link_names_are_case_insensitive(capsys):
    assert main(["plan", LLAMA_8B, "--hardware", "H100", "--interconnect", "NVLink", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["device"]["name"] == "h100" and result["interconnect"]["name"] == "nvlink"


def test_plan_flags_mean_what_they_mean_on_every_command(capsys):
    """Issue 44 item 7: `--layers 3,5,7` is one set of layers as in convert (several choices: the flag
    repeated), `--device` is a torch device elsewhere and no alias here, `--set` gave way to positional
    key=value overrides, `--batch` to `--batch-size`."""
    plan = ["plan", LLAMA_8B, "--batch-size", "1", "--json"]
    assert main([*plan, "--layers", "3,5,7", "--layers", "16", "--layers", "auto:4"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(row["choice"], row["layers"]) for row in rows] == [
        ("3,5,7", "3,5,7"), ("upper 16", "16-31"), ("auto:4", "28-31")
    ]  # fmt: skip
    assert "unrecognized arguments: --device" in refused(capsys, LLAMA_8B, "--device", "h100")
    assert "unrecognized arguments: --set" in refused(capsys, LLAMA_8B, "--set", "trainable.mode=all")
    assert "key=value overrides go with --recipe" in refused(capsys, LLAMA_8B, "trainable.mode=all")


def test_every_plan_says_whether_the_model_fits_and_what_does(capsys):
    """Issue 44 item 3: every plan says whether it fits, and when not, the smallest setting that does."""
    plan = ["plan", "meta-llama/Llama-3.1-405B", "--batch-size", "1,64"]
    assert main([*plan, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] is False and result["memory"]["fits_with"]["tp"] == 16
    assert main(plan) == 0
    assert "does NOT fit at TP=8; the smallest setting that fits: --tp 16" in capsys.readouterr().out
    assert main([*plan, "--tp", "16", "--engine", "vllm", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"] is True


# --- Qwen3, Qwen2.5 and Mistral (issue 45) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "config_class, model_class, extra",
    [
        (Qwen2Config, Qwen2ForCausalLM, {}),
        (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24)),
        (MistralConfig, MistralForCausalLM, dict(sliding_window=16)),
    ],
)
@pytest.mark.parametrize("tied", [False, True])
def test_family_parameter_counts_match_transformers(config_class, model_class, extra, tied):
    """Qwen2's q/k/v biases and Qwen3's q/k norms are counted: the family's own transformers model holds them."""
    config = config_class(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, **extra)  # fmt: skip
    shape = ModelShape.from_config(config.to_dict())
    model = model_class(config)
    assert parameter_counts(shape).total(shape.num_layers) == sum(p.numel() for p in model.parameters())
    cost = forward_cost(shape, batch=1, query_tokens=1, context=1, tp=1, dtype_bytes=4)
    layer_weights = sum(p.numel() for p in model.model.layers.parameters())
    assert cost.num_layers * (cost.attention.weight_bytes + cost.mlp.weight_bytes) == 4 * layer_weights


# Parameter counts as published: the Hub's safetensors metadata of each repository, and keras-hub's
# Qwen3 presets (qwen3_14b_en, qwen3_32b_en).
PUBLISHED_PARAMETERS = {
    "meta-llama/Llama-3.2-1B-Instruct": 1_235_814_400,
    "meta-llama/Llama-3.2-3B-Instruct": 3_212_749_824,
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
    "meta-llama/Llama-3.1-70B-Instruct": 70_553_706_496,
    "meta-llama/Llama-3.3-70B-Instruct": 70_553_706_496,
    "meta-llama/Llama-3.1-405B-Instruct": 405_853_388_800,
    "Qwen/Qwen3-14B": 14_768_307_200,
    "Qwen/Qwen3-32B": 32_762_123_264,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "Qwen/Qwen2.5-0.5B": 494_032_768,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "mistralai/Mistral-Nemo-Instruct-2407": 12_247_782_400,
    "mistralai/Mistral-Small-24B-Instruct-2501": 23_572_403_200,
}


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_PARAMETERS))
def test_plan_knows_the_published_shapes_offline(hub_cache, capsys, model_id):
    """Issue 38 item 3 (Llama 3.x, gated), issue 45 (Qwen3, Qwen2.5, Mistral): the shipped shapes give the
    parameter count published for each repository, with nothing downloaded."""
    assert main(["plan", model_id, "--tp", "2", "--layers", "4", "--json"]) == 0
    shape = ModelShape(**json.loads(capsys.readouterr().out)["shape"])
    assert parameter_counts(shape).total(shape.num_layers) == PUBLISHED_PARAMETERS[model_id]
    assert not any(hub_cache.rglob("*"))  # nothing was downloaded


def test_qwen3_32b_at_tp8_prints_a_prediction_offline(hub_cache, capsys):
    assert main(["plan", "Qwen/Qwen3-32B", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen3-32B: 64 layers, hidden 5120, 64 heads / 8 KV; TP=8" in out and "all 64" in out
    assert not any(hub_cache.rglob("*"))


def test_a_sliding_window_bounds_what_a_token_reads(tmp_path, capsys):
    """Mistral v0.1 attends its last 4,096 positions: past them, its cache reads stop growing."""
    window = ModelShape.from_config(published_config("mistralai/Mistral-7B-v0.1"))
    full = ModelShape.from_config(published_config("mistralai/Mistral-7B-v0.3") | dict(vocab_size=32000))
    assert window.sliding_window == 4096 and full.sliding_window is None
    short = [forward_cost(shape, 1, 1, 4096).attention for shape in (window, full)]
    long = [forward_cost(shape, 1, 1, 16384).attention for shape in (window, full)]
    assert short[0] == short[1] and long[0] == short[0] and long[1].kv_bytes == 4 * short[1].kv_bytes
    # A folder holding a family's config.json plans as a published shape does.
    (tmp_path / "config.json").write_text(json.dumps(published_config("Qwen/Qwen3-0.6B")))
    assert main(["plan", str(tmp_path), "--tp", "2", "--batch-size", "1"]) == 0
    assert "28 layers, hidden 1024, 16 heads / 8 KV" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps(dict(published_config("Qwen/Qwen3-0.6B"), model_type="gpt2")))
    assert "has model_type 'gpt2'; supported families: llama, mistral, qwen2, qwen3" in refused(capsys, str(tmp_path))
