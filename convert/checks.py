"""The checks of a source checkpoint that need no tensor's values, cheapest first: config.json alone
(`check_config`), then the weight headers against it (`check_weights`), before any expensive work."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ladder.errors import UsageError
from ladder.io.loading import check_config_values
from ladder.layers import check_model_type, format_layers, is_ladder_model_type
from ladder.model.config_rules import biased_projections, family_of

if TYPE_CHECKING:
    from ladder.io.tensors import TensorSpec

# LlamaConfig's defaults for the numbers the tensor shapes depend on (a config.json may omit them).
LLAMA_SHAPE_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
}
LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def config_size(config: dict, key: str) -> int:
    """A positive integer of a config (LlamaConfig's default when a Llama's omits it; the other
    families' configs name their sizes), or a UsageError."""
    value = config.get(key, LLAMA_SHAPE_DEFAULTS.get(key) if family_of(config.get("model_type")) == "llama" else None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def attention_sizes(config: dict) -> tuple[int, int, int]:
    """The numbers of query and key/value heads and the head size, as the family's config defaults them."""
    heads = config_size(config, "num_attention_heads")
    kv_heads = config_size(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    if config.get("head_dim") is not None:
        head_dim = config_size(config, "head_dim")
    elif family_of(config.get("model_type")) == "qwen3":
        head_dim = 128  # Qwen3Config's default, not hidden_size // heads
    else:
        head_dim = config_size(config, "hidden_size") // heads
    return heads, kv_heads, head_dim


def check_config(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    check_model_type(model_type, where)
    # A ladder checkpoint is no source: its weights may be retrained for its wiring, and verification
    # compares with the family's model it is not.
    if is_ladder_model_type(model_type):
        layers = config.get("ladder_layers")
        named = (
            format_layers(sorted(layers))
            if isinstance(layers, list) and all(isinstance(layer, int) for layer in layers)
            else repr(layers)
        )
        raise UsageError(
            f"{where} has model_type {model_type!r} (ladder layers {named}): it is converted already; "
            "convert the original checkpoint"
        )
    check_config_values(config, where)
    hidden = config_size(config, "hidden_size")
    heads, kv_heads, head_dim = attention_sizes(config)
    if hidden % heads:
        raise UsageError(f"config.json: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if heads % kv_heads:
        raise UsageError(
            f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
            "(each key/value head serves a whole group of query heads)"
        )
    if head_dim % 2:
        raise UsageError(
            f"config.json: head_dim {head_dim} is odd; rotary position embeddings turn pairs of dimensions"
        )


def is_every_layer(indices: set[int], count: int) -> bool:
    """Whether `indices` are 0 .. count - 1, without building that range (`count` may be absurd)."""
    return len(indices) == count and max(indices, default=-1) == count - 1


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the family's model of this config holds (lm_head even when tied),
    as its `state_dict()` lists them, without building a model (a test checks that they agree)."""
    family = check_model_type(config.get("model_type"), "config.json")
    biased = biased_projections(family, config.get("attention_bias"), config.get("mlp_bias"))
    hidden, intermediate, vocab = (
        config_size(config, key) for key in ("hidden_size", "intermediate_size", "vocab_size")
    )
    heads, kv_heads, head_dim = attention_sizes(config)
    projections = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(config_size(config, "num_hidden_layers")):
        prefix = f"model.layers.{layer}."
        for name, shape in projections.items():
            shapes[f"{prefix}{name}.weight"] = shape
            if name.rpartition(".")[2] in biased:
                shapes[f"{prefix}{name}.bias"] = shape[:1]
        if family == "qwen3":
            shapes[f"{prefix}self_attn.q_norm.weight"] = shapes[f"{prefix}self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{prefix}input_layernorm.weight"] = shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def check_weights(source: dict[str, TensorSpec], config: dict) -> dict[str, str]:
    """The weight headers against the config: its layer count against the layers they hold, before
    anything proportional to it is built (a config asking 10^9 layers of a small checkpoint is
    refused at once); then every shape must agree with `expected_shapes`, and a tensor it lacks is
    dropped only for a known reason. Returns the dropped tensors, each with its reason."""
    count = config_size(config, "num_hidden_layers")
    present = {int(match.group(1)) for name in source if (match := LAYER_TENSOR.match(name))}
    if not is_every_layer(present, count):
        held = f"layers {format_layers(sorted(present))}" if present else "no model.layers.N tensor"
        raise UsageError(f"config.json: num_hidden_layers is {count}, but the weights hold {held}")
    # Integer weights would be cast to float as they are, not dequantized.
    if others := [spec for spec in source.values() if not spec.is_floating_point]:
        raise UsageError(
            f"tensor {others[0].name} holds {others[0].dtype}; every weight of the model is floating point "
            f"({len(others)} such tensor{'s' if len(others) > 1 else ''})"
        )
    expected = expected_shapes(config)
    dropped = {}
    if config.get("tie_word_embeddings", False):
        expected.pop("lm_head.weight")
        if "lm_head.weight" in source:
            dropped["lm_head.weight"] = "tied to model.embed_tokens.weight"
    for name in source:
        if name.endswith("rotary_emb.inv_freq"):
            dropped[name] = "recomputed from the config"
    if unknown := [name for name in source if name not in expected and name not in dropped]:
        raise UsageError(
            f"tensor {', '.join(unknown[:3])} is not part of a {config.get('model_type')} model with this config "
            f"({len(unknown)} such tensor{'s' if len(unknown) > 1 else ''})"
        )
    if missing := [name for name in expected if name not in source]:
        raise UsageError(f"the checkpoint lacks {len(missing)} tensor(s) its config needs: {', '.join(missing[:3])}")
    for name, shape in expected.items():
        if source[name].shape != shape:
            raise UsageError(f"tensor {name} has shape {list(source[name].shape)}; the config needs {list(shape)}")
    return dropped
