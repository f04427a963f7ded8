"""The ladder model: wiring against a naive reference, transformers behaviour, save/load formats."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import ladder
from ladder import LadderLlamaConfig, LadderLlamaForCausalLM, to_ladder
from ladder.errors import UsageError
from ladder.layers import format_layers, parse_ladder_layers
from tiny import NUM_LAYERS, random_ids, tiny_llama

# --- A deliberately naive reference, written from the formula in ../shared/docs/ladder.md ------
# Number the modules 1, 2, ... (attention of layer l is module 2l+1, its MLP 2l+2); r_0 is the
# embedding and r_{-1} = r_0. Module m computes r_m = r_{m-1} + h_m(r_{m-2}) if its layer is a
# ladder layer, else r_m = r_{m-1} + h_m(r_{m-1}).


def naive_rms_norm(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def naive_rope(x, positions, inv_freq, scaling):
    angles = positions[:, None].float() * inv_freq[None, :]  # (T, head_dim/2)
    cos = torch.cat([angles.cos(), angles.cos()], -1) * scaling
    sin = torch.cat([angles.sin(), angles.sin()], -1) * scaling
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def naive_attention(layer, x, config, inv_freq, scaling):
    batch, length, _ = x.shape
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = (x @ layer.self_attn.q_proj.weight.T).view(batch, length, heads, head_dim).transpose(1, 2)
    k = (x @ layer.self_attn.k_proj.weight.T).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = (x @ layer.self_attn.v_proj.weight.T).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(length)
    q, k = naive_rope(q, positions, inv_freq, scaling), naive_rope(k, positions, inv_freq, scaling)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    out = (weights @ v).transpose(1, 2).reshape(batch, length, heads * head_dim)
    return out @ layer.self_attn.o_proj.weight.T


def naive_mlp(layer, x):
    gate = torch.nn.functional.silu(x @ layer.mlp.gate_proj.weight.T)
    return (gate * (x @ layer.mlp.up_proj.weight.T)) @ layer.mlp.down_proj.weight.T


def naive_ladder_forward(model, input_ids, ladder_layers):
    """Returns (logits, [r_0, r_2, r_4, ...]): the stream after each whole layer."""
    config, backbone = model.config, model.model
    inv_freq = backbone.rotary_emb.inv_freq
    scaling = backbone.rotary_emb.attention_scaling
    embedding = backbone.embed_tokens.weight[input_ids]
    streams = [embedding, embedding]  # r_{-1}, r_0
    for layer_index, layer in enumerate(backbone.layers):
        for is_mlp in (False, True):
            source = streams[-2] if layer_index in ladder_layers else streams[-1]
            if is_mlp:
                update = naive_mlp(
                    layer, naive_rms_norm(source, layer.post_attention_layernorm.weight, config.rms_norm_eps)
                )
            else:
                normed = naive_rms_norm(source, layer.input_layernorm.weight, config.rms_norm_eps)
                update = naive_attention(layer, normed, config, inv_freq, scaling)
            streams.append(streams[-1] + update)
    final = naive_rms_norm(streams[-1], backbone.norm.weight, config.rms_norm_eps)
    return final @ model.lm_head.weight.T, streams[1::2]


# --- Config ----------------------------------------------------------------------------------


def test_config_int_means_upper_layers():
    assert LadderLlamaConfig(num_hidden_layers=32, ladder_layers=16).ladder_layers == list(range(16, 32))
    assert LadderLlamaConfig(num_hidden_layers=4, ladder_layers=[3, 1]).ladder_layers == [1, 3]
    assert LadderLlamaConfig(num_hidden_layers=4).ladder_layers == []


@pytest.mark.parametrize(
    "layers, message",
    [
        ([4], "out of range"),
        ([-1], "out of range"),
        ([1, 1], "duplicate"),
        ([1.5], "integer"),
        (["2"], "integer"),
        ([True], "integer"),
        (5, "0 <= N <= 4"),
        (-1, "0 <= N <= 4"),
    ],
)
def test_config_rejects_bad_ladder_layers(layers, message):
    with pytest.raises(ValueError, match=message):
        LadderLlamaConfig(num_hidden_layers=4, ladder_layers=layers)


def test_parse_ladder_layers_forms():
    assert parse_ladder_layers("16", 32) == list(range(16, 32))
    assert parse_ladder_layers("16-31", 32) == list(range(16, 32))
    assert parse_ladder_layers("3,5,7", 32) == [3, 5, 7]
    assert parse_ladder_layers("3-5,9", 32) == [3, 4, 5, 9]
    for bad in ("x", "3-", "5-2", "1,,x", "40", "2,2"):
        with pytest.raises(UsageError, match="^--layers: "):
            parse_ladder_layers(bad, 32, "--layers")


def test_layer_sets_format_as_they_parse():
    for layers in ([], [3, 4, 5, 9], list(range(16, 32)), [0, 2, 4]):
        text = format_layers(layers)
        assert text == "none" or parse_ladder_layers(text, 32) == layers
    assert format_layers([3, 4, 5, 9]) == "3-5,9"


def test_ladder_config_refuses_other_architectures():
    with pytest.raises(UsageError, match="'gemma'; supported families: llama, mistral, qwen2, qwen3"):
        ladder.ladder_config(AutoConfig.for_model("gemma"), 1)


# --- Wiring ----------------------------------------------------------------------------------


def test_no_ladder_layers_is_bit_identical_to_llama():
    base = tiny_llama()
    model = to_ladder(base, [])
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base(ids).logits)


@pytest.mark.parametrize(
    "ladder_layers",
    [[0, 1], [2, 3], [4, 5], [1, 3, 4], list(range(NUM_LAYERS))],
    ids=["first", "middle", "last", "non-contiguous", "all"],
)
def test_ladder_layers_match_naive_formula(ladder_layers):
    model = to_ladder(tiny_llama(), ladder_layers)
    ids = random_ids()
    with torch.no_grad():
        expected_logits, expected_streams = naive_ladder_forward(model, ids, ladder_layers)
        output = model(ids, output_hidden_states=True)
    torch.testing.assert_close(output.logits, expected_logits, rtol=1e-5, atol=1e-5)
    # One state per layer plus the embeddings; the last is replaced by the final-normed output.
    assert len(output.hidden_states) == NUM_LAYERS + 1
    for reported, expected in zip(output.hidden_states[:-1], expected_streams[:-1]):
        torch.testing.assert_close(reported, expected, rtol=1e-5, atol=1e-5)
    # Ladder wiring really changes the function (guards against a reference that matches anything).
    assert not torch.allclose(output.logits, tiny_llama()(ids).logits, atol=1e-3)


def test_llama3_rope_scaling_and_tied_embeddings():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    base = tiny_llama(rope_parameters=rope, tie_word_embeddings=True)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    ids = random_ids(length=48)  # longer than the original context, so scaling matters
    with torch.no_grad():
        assert torch.equal(to_ladder(base, []).eval()(ids).logits, base(ids).logits)
        model = to_ladder(base, [3, 4, 5])
        assert model.lm_head.weight is model.model.embed_tokens.weight
        expected, _ = naive_ladder_forward(model, ids, [3, 4, 5])
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_sdpa_and_eager_agree():
    base = tiny_llama()
    ids = random_ids()
    logits = {}
    for implementation in ("sdpa", "eager"):
        model = to_ladder(base, [2, 3, 4])
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            logits[implementation] = model(ids).logits
    torch.testing.assert_close(logits["sdpa"], logits["eager"], rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_gives_same_gradients():
    ids = random_ids()
    gradients = []
    for checkpointing in (False, True):
        model = to_ladder(tiny_llama(), [1, 3, 4]).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert gradients[0].keys() == gradients[1].keys()
    for name in gradients[0]:
        torch.testing.assert_close(gradients[0][name], gradients[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_bfloat16_runs_close_to_float32():
    model = to_ladder(tiny_llama(), 3)
    ids = random_ids()
    with torch.no_grad():
        reference = model(ids).logits
        low = model.to(torch.bfloat16)(ids).logits
    assert low.dtype == torch.bfloat16
    assert (low.float() - reference).abs().max() < 0.1 * reference.abs().max()


# --- Generation ------------------------------------------------------------------------------


def test_kv_cache_decoding_matches_full_forward():
    model = to_ladder(tiny_llama(), [2, 3, 4, 5])
    prompt = random_ids(batch=2, length=5)
    with torch.no_grad():
        cached = model.generate(
            prompt, max_new_tokens=8, do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True
        )
        uncached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False)
        full = model(cached.sequences).logits
    assert torch.equal(cached.sequences, uncached)
    for step, step_logits in enumerate(cached.logits):
        torch.testing.assert_close(step_logits, full[:, prompt.shape[1] - 1 + step], rtol=1e-5, atol=1e-5)


def test_left_padded_batch_matches_each_sequence_alone():
    model = to_ladder(tiny_llama(), [1, 2, 5])
    short, long = random_ids(1, 6, seed=2)[0], random_ids(1, 10, seed=3)[0]
    pad = 0
    ids = torch.stack([torch.cat([torch.full((4,), pad), short]), long])
    mask = torch.stack(
        [
            torch.cat([torch.zeros(4, dtype=torch.long), torch.ones(6, dtype=torch.long)]),
            torch.ones(10, dtype=torch.long),
        ]
    )
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        alone_short = model(short[None]).logits[0]
        alone_long = model(long[None]).logits[0]
        torch.testing.assert_close(batched[0, 4:], alone_short, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched[1], alone_long, rtol=1e-5, atol=1e-5)
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        alone = model.generate(short[None], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated[0, 10:], alone[0, 6:])


# --- Save, load, formats ---------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    model = to_ladder(tiny_llama(tie_word_embeddings=True), [0, 4, 5])
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llamaLadder" and saved["ladder_layers"] == [0, 4, 5]
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, LadderLlamaForCausalLM) and loaded.config.ladder_layers == [0, 4, 5]
    for (name, expected), (_, actual) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(expected, actual), name
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_peft_lora_adapters_save_and_load_on_a_ladder_model(tmp_path):
    """The peft recipe of docs/checkpoints.md: LoRA on a ladder checkpoint, adapter saved, reloaded on a fresh copy."""
    from peft import LoraConfig, PeftModel, get_peft_model

    to_ladder(tiny_llama(), 3).save_pretrained(tmp_path / "ladder")
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tmp_path / "ladder"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():  # LoRA's B starts at zero: give the adapter something to carry
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "ladder"), tmp_path / "adapter"
    )
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "ladder")
    ids = random_ids()
    with torch.no_grad():
        adapted = reloaded.eval()(ids).logits
        assert torch.allclose(adapted, peft_model.eval()(ids).logits, atol=1e-6)
        assert not torch.allclose(adapted, base(ids).logits, atol=1e-3)
    assert isinstance(reloaded.get_base_model(), LadderLlamaForCausalLM)


def test_llama_checkpoint_loads_into_ladder_class_without_key_mapping(tmp_path):
    base = tiny_llama()
    base.save_pretrained(tmp_path)
    config = ladder.ladder_config(base.config, 2)
    model = LadderLlamaForCausalLM.from_pretrained(tmp_path, config=config).eval()
    ids = random_ids()
    with torch.no_grad():
        expected, _ = naive_ladder_forward(model, ids, [4, 5])
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_published_config_format_loads(tmp_path):
    """A config.json as the paper's checkpoints have it: model_type llamaLadder, ladder_layers an int."""
    base = tiny_llama()
    base.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="llamaLadder", architectures=["LadderLlamaForCausalLM"], ladder_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.ladder_layers == [3, 4, 5]
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, to_ladder(base, 3)(ids).logits, rtol=0, atol=0)


def test_remote_code_loads_without_importing_ladder(tmp_path):
    model = to_ladder(tiny_llama(), [2, 5])
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    ids = random_ids()
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        torch.save(model(ids).logits, tmp_path / "expected.pt")
    script = f"""
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
assert "ladder" not in sys.modules, "the ladder package was imported"
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    logits = model(torch.load({str(tmp_path / "ids.pt")!r})).logits
assert torch.equal(logits, torch.load({str(tmp_path / "expected.pt")!r}))
print("ok", model.config.ladder_layers)
"""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    # Run from tmp_path so the repository's `ladder` folder is not importable by accident.
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ok [2, 5]" in result.stdout


def test_llama31_8b_shape_on_meta_device():
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    with torch.device("meta"):
        model = LadderLlamaForCausalLM(ladder.ladder_config(config, 16))
    assert model.config.ladder_layers == list(range(16, 32))
    assert [layer.is_ladder for layer in model.model.layers] == [False] * 16 + [True] * 16
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_cli_unknown_command_is_one_line(capsys):
    from ladder.cli import main

    assert main(["frobnicate"]) == 2
    error = capsys.readouterr().err
    assert error.strip().count("\n") == 0 and "unknown command 'frobnicate'" in error
