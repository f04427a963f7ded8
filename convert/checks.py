"""The checks of a source checkpoint that need no tensor's values, cheapest first: config.json
alone (`check_config`: a Llama, not a ladder checkpoint already, values transformers can build,
attention heads that divide), then
the weight headers against it (`check_weights`: the layer count before anything proportional to
it is built, floating-point dtypes, then the shape of every tensor a Llama of the config holds,
computed from the config's numbers alone). Conversion runs them before any expensive work."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ladder.errors import UsageError
from ladder.io.loading import check_config_values
from ladder.layers import LADDER_MODEL_TYPE, check_llama_model_type, format_layers

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
    """A positive integer of a Llama config (LlamaConfig's default when absent), or a UsageError."""
    value = config.get(key, LLAMA_SHAPE_DEFAULTS.get(key))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def attention_sizes(config: dict) -> tuple[int, int, int]:
    """The numbers of query and key/value heads and the head size, as LlamaConfig defaults them."""
    heads = config_size(config, "num_attention_heads")
    kv_heads = config_size(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    head_dim = (
        config_size(config, "head_dim")
        if config.get("head_dim") is not None
        else config_size(config, "hidden_size") // heads
    )
    return heads, kv_heads, head_dim


def check_config(config: dict, where: str) -> None:
    """The checks that need only the config (`where` names it), cheapest first."""
    check_llama_model_type(config.get("model_type"), where)
    check_not_ladder(config, where)
    check_config_values(config, where)
    check_attention_heads(config)


def check_weights(tensors: dict[str, TensorSpec], config: dict) -> dict[str, str]:
    """The checks of the weight headers against the config, cheapest first; returns the tensors
    dropped, each with its reason (`check_tensors`)."""
    check_layer_count(tensors, config)
    check_dtypes(tensors)
    return check_tensors(tensors, config)


def check_not_ladder(config: dict, where: str) -> None:
    """Refuse a ladder checkpoint as a source, whatever layers are asked: its weights may have been
    retrained for its wiring, verification compares with a plain Llama it is not, and asking its
    own layers again would change nothing. The original Llama converts to any wiring."""
    if config.get("model_type") != LADDER_MODEL_TYPE:
        return
    layers = config.get("ladder_layers")
    named = (
        format_layers(sorted(layers))
        if isinstance(layers, list) and all(isinstance(layer, int) for layer in layers)
        else repr(layers)
    )
    raise UsageError(
        f"{where} has model_type {LADDER_MODEL_TYPE!r} (ladder layers {named}): it is converted already; "
        "convert the original Llama checkpoint"
    )


def check_attention_heads(config: dict) -> None:
    """Head counts that a Llama can run: LlamaConfig refuses a hidden size that the heads do not
    divide, grouped-query attention gives each key/value head a whole group of query heads, and
    rotary embeddings turn pairs of dimensions."""
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


def check_layer_count(names: Iterable[str], config: dict) -> None:
    """The config's layer count against the layers the weights hold, from their names: before
    anything proportional to the count is built (a table of expected tensors, the upper half of
    the layers), so that a config asking 10^9 layers of a small checkpoint is refused at once."""
    count = config_size(config, "num_hidden_layers")
    present = {int(match.group(1)) for name in names if (match := LAYER_TENSOR.match(name))}
    if not is_every_layer(present, count):
        held = f"layers {format_layers(sorted(present))}" if present else "no model.layers.N tensor"
        raise UsageError(f"config.json: num_hidden_layers is {count}, but the weights hold {held}")


def is_every_layer(indices: set[int], count: int) -> bool:
    """Whether `indices` are 0 .. count - 1, without building that range (`count` may be absurd)."""
    return len(indices) == count and max(indices, default=-1) == count - 1


def check_dtypes(tensors: dict[str, TensorSpec]) -> None:
    """Every weight of a Llama is floating point: integers would be cast to float as they are,
    not dequantized."""
    if others := [spec for spec in tensors.values() if not spec.is_floating_point]:
        raise UsageError(
            f"tensor {others[0].name} holds {others[0].dtype}; every weight of a Llama is floating point "
            f"({len(others)} such tensor{'s' if len(others) > 1 else ''})"
        )


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Llama with this config holds (lm_head included even when
    tied), from the config's numbers alone: what `LlamaForCausalLM(config).state_dict()` lists,
    without building a model (a test checks that they agree)."""
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
            if config.get("attention_bias" if name.startswith("self_attn") else "mlp_bias"):
                shapes[f"{prefix}{name}.bias"] = shape[:1]
        shapes[f"{prefix}input_layernorm.weight"] = shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def check_tensors(source: dict[str, TensorSpec], config: dict) -> dict[str, str]:
    """Match the source's tensors with what a Llama of `config` holds (`expected_shapes`): every
    shape must agree, and a tensor it does not hold is dropped only for a known reason. Returns
    the dropped tensors, each with its reason."""
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
            f"tensor {', '.join(unknown[:3])} is not part of a Llama with this config "
            f"({len(unknown)} such tensor{'s' if len(unknown) > 1 else ''})"
        )
    if missing := [name for name in expected if name not in source]:
        raise UsageError(f"the checkpoint lacks {len(missing)} tensor(s) its config needs: {', '.join(missing[:3])}")
    for name, shape in expected.items():
        if source[name].shape != shape:
            raise UsageError(f"tensor {name} has shape {list(source[name].shape)}; the config needs {list(shape)}")
    return dropped
