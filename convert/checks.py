"""The checks of a source checkpoint that need no tensor: the shape of every tensor a Llama of a
config holds, from the config's numbers alone, and the match of a checkpoint's tensors with them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ladder.errors import UsageError

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


def config_size(config: dict, key: str) -> int:
    """A positive integer of a Llama config (LlamaConfig's default when absent), or a UsageError."""
    value = config.get(key, LLAMA_SHAPE_DEFAULTS.get(key))
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UsageError(f"config.json: {key} must be a positive integer, not {value!r}")
    return value


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Llama with this config holds (lm_head included even when
    tied), from the config's numbers alone: what `LlamaForCausalLM(config).state_dict()` lists,
    without building a model (a test checks that they agree)."""
    hidden, intermediate, vocab = (
        config_size(config, key) for key in ("hidden_size", "intermediate_size", "vocab_size")
    )
    heads = config_size(config, "num_attention_heads")
    kv_heads = config_size(config, "num_key_value_heads") if config.get("num_key_value_heads") is not None else heads
    head_dim = config_size(config, "head_dim") if config.get("head_dim") is not None else hidden // heads
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
