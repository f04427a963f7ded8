"""convert/'s pieces: tensor shapes from the config alone, the config written without transformers,
and the verification (layer by layer, as the whole models measure it)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

import ladder
from checkpoints import run_convert
from ladder import LadderLlamaForCausalLM
from ladder.convert import execute as convert_execute
from ladder.convert.checks import expected_shapes
from ladder.convert.execute import MODELING_FILES
from ladder.convert.layout import ladder_config_dict
from ladder.convert.verify import Damage, damage_problems, largest, prompt_ids


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True, "mlp_bias": True},
        {"head_dim": 32, "num_key_value_heads": 1},
        {"tie_word_embeddings": True, "num_key_value_heads": None},
    ],
)
def test_shapes_from_the_config_match_a_model_built_from_it(overrides):
    config = LlamaConfig(
        **{
            "vocab_size": 300,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            **overrides,
        }
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert expected_shapes(json.loads(config.to_json_string())) == {**expected, "lm_head.weight": (300, 64)}


def test_light_config_loads_as_what_save_pretrained_writes(tmp_path):
    """convert writes config.json and the modeling files without transformers: they must load to
    the config that `ladder_config(...).save_pretrained` (with custom_object_save) would give."""
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import custom_object_save

    source = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    source.save_pretrained(tmp_path / "source")
    heavy = ladder.ladder_config(source, [1, 3])
    heavy.architectures, heavy.dtype = ["LadderLlamaForCausalLM"], "bfloat16"
    with torch.device("meta"):
        skeleton = LadderLlamaForCausalLM(heavy)
    written = (
        custom_object_save(skeleton, tmp_path / "heavy", config=heavy) if (tmp_path / "heavy").mkdir() is None else []
    )
    heavy.save_pretrained(tmp_path / "heavy")
    light = ladder_config_dict(json.loads((tmp_path / "source" / "config.json").read_text()), [1, 3], "bfloat16")
    (tmp_path / "light").mkdir()
    convert_execute._write_config(tmp_path / "light", light)

    assert sorted(Path(p).name for p in written) == sorted(MODELING_FILES)
    for name in MODELING_FILES:
        assert (tmp_path / "light" / name).read_bytes() == (tmp_path / "heavy" / name).read_bytes()
    assert json.loads((tmp_path / "light" / "config.json").read_text())["auto_map"] == heavy.auto_map
    loaded = [
        {k: v for k, v in AutoConfig.from_pretrained(tmp_path / kind).to_dict().items() if k != "_name_or_path"}
        for kind in ("heavy", "light")
    ]
    assert loaded[0] == loaded[1] and loaded[1]["ladder_layers"] == [1, 3]


@torch.no_grad()
def measure_damage(original: PreTrainedModel, ladder_model: PreTrainedModel, prompts: list[torch.Tensor]) -> Damage:
    """The damage measured on the two whole models as transformers runs them: what the layer-by-layer
    verification must reproduce."""
    first = min(ladder_model.config.ladder_layers, default=None)
    hidden_diff = logits_diff = kl_sum = 0.0
    agreements = tokens = 0
    for ids in prompts:
        reference = original(ids[None], output_hidden_states=True)
        converted = ladder_model(ids[None], output_hidden_states=True)
        # hidden_states[i] is the stream entering layer i, so [: first + 1] is everything before it.
        compared = slice(None) if first is None else slice(first + 1)
        for expected, actual in zip(reference.hidden_states[compared], converted.hidden_states[compared], strict=True):
            hidden_diff = largest(hidden_diff, (expected - actual).abs().max().item())
        logits_diff = largest(logits_diff, (reference.logits - converted.logits).abs().max().item())
        log_p = F.log_softmax(reference.logits[0].float(), dim=-1)
        log_q = F.log_softmax(converted.logits[0].float(), dim=-1)
        kl_sum += F.kl_div(log_q, log_p, log_target=True, reduction="sum").item()
        agreements += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
        tokens += ids.numel()
    return Damage(len(prompts), tokens, first, hidden_diff, logits_diff, agreements / tokens, kl_sum / tokens)


@pytest.mark.parametrize("extra", [[], ["--dtype", "bfloat16"]], ids=["as-is", "bf16"])
def test_layerwise_verification_measures_what_the_whole_models_measure(tiny_checkpoint, tmp_path, capsys, extra):
    # convert verifies one module at a time (bounded memory); the figures must be those of the two
    # whole models run through transformers, and a cast output is compared in its own rounding.
    out = tmp_path / "out"
    assert run_convert(capsys, tiny_checkpoint, "--out", out, "--layers", "2", *extra)[0] == 0
    recorded = json.loads((out / "conversion.json").read_text())["damage"]
    dtype = torch.bfloat16 if extra else torch.float32
    original = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=dtype).float().eval()
    ladder_model = AutoModelForCausalLM.from_pretrained(out).float().eval()
    whole = measure_damage(original, ladder_model, prompt_ids(AutoTokenizer.from_pretrained(out), 49152))
    assert whole.hidden_max_abs_diff == 0 and whole.mean_kl > 0 and whole.first_ladder_layer == 2
    for key, value in whole.__dict__.items():
        assert recorded[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_damage_problems_catch_differences_where_the_wiring_is_unchanged():
    clean = Damage(5, 100, 2, 0.0, 0.4, 0.8, 0.1)
    assert damage_problems(clean) == []
    assert "hidden states" in damage_problems(Damage(5, 100, 2, 1e-6, 0.4, 0.8, 0.1))[0]
    assert "logits" in damage_problems(Damage(5, 100, None, 0.0, 1e-7, 1.0, 0.0))[0]
