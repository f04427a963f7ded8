"""What a Llama-family model (Llama, Mistral, Qwen2, Qwen3) costs to run, from its config alone:
parameter counts, and FLOPs and bytes per module and tensor-parallel rank (pure arithmetic, no torch).

A multiply-add is 2 FLOPs; attention scores and values cost 2 * 2 * t * heads * head_dim * context.
Each rank holds its share of q/k/v/o and gate/up/down (Megatron, as ladder/tp/shard.py shards them);
the embedding, the final norm and the LM head are replicated. Biases count like weights (2 FLOPs
each, sharded with their heads); Qwen3's q/k norms are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError
from ..model.config_rules import biased_projections, family_of


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False  # Qwen2's q, k and v projections
    o_bias: bool = False  # a Llama with attention_bias: o_proj's too
    qk_norm: bool = False  # Qwen3's per-head q and k RMSNorms
    sliding_window: int | None = None  # Mistral v0.1's: positions each token attends, at most

    def layer_weights(self, heads: int, kv_heads: int, intermediate: int) -> tuple[int, int]:
        """One layer's attention and MLP weights (each with its norm) holding these heads and rows."""
        h, d = self.hidden_size, self.head_dim
        biases = (heads + 2 * kv_heads) * d * (self.qkv_bias or self.o_bias) + h * self.o_bias
        return 2 * h * (heads + kv_heads) * d + h + biases + 2 * d * self.qk_norm, 3 * h * intermediate + h

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:

        def size(key: str, default: int | None = None) -> int:
            value = default if config.get(key) is None else config[key]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"config.json: {key} must be a positive integer, not {value!r}")
            return value

        hidden, heads, family = size("hidden_size"), size("num_attention_heads"), family_of(config.get("model_type"))
        biased = biased_projections(family, config.get("attention_bias"))
        window = config.get("sliding_window") if family == "mistral" or config.get("use_sliding_window") else None
        return cls(
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=size("num_key_value_heads", heads),
            head_dim=size("head_dim", hidden // heads),
            vocab_size=size("vocab_size"),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias="q_proj" in biased,
            o_bias="o_proj" in biased,
            qk_norm=family == "qwen3",
            sliding_window=size("sliding_window") if window is not None else None,
        )


@dataclass(frozen=True)
class ParameterCounts:
    """Weights of the whole model (not per rank), by where they sit."""

    attention: int  # per layer: q, k, v, o and the input norm
    mlp: int  # per layer: gate, up, down and the post-attention norm
    embedding: int
    lm_head: int  # 0 when tied to the embedding
    final_norm: int

    @property
    def per_layer(self) -> int:
        return self.attention + self.mlp

    def total(self, num_layers: int) -> int:
        return num_layers * self.per_layer + self.embedding + self.lm_head + self.final_norm


def parameter_counts(shape: ModelShape) -> ParameterCounts:
    """As `sum(p.numel() for p in model.parameters())` counts them (tied embeddings once)."""
    h = shape.hidden_size
    attention, mlp = shape.layer_weights(shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
    return ParameterCounts(
        attention=attention,
        mlp=mlp,
        embedding=shape.vocab_size * h,
        lm_head=0 if shape.tied_embeddings else shape.vocab_size * h,
        final_norm=h,
    )


def rank_share(shape: ModelShape, tp: int) -> tuple[int, int, int]:
    """The largest share (heads, KV heads, MLP rows) any one rank holds at tensor-parallel degree `tp`
    (the slowest rank sets the pace). KV heads are split when there are at least `tp` of them, else
    replicated (gpt-fast's choice for 405B's 8 KV heads at TP=16); query heads follow their KV heads."""
    if shape.num_kv_heads >= tp:
        kv_heads = math.ceil(shape.num_kv_heads / tp)
        heads = kv_heads * (shape.num_heads // shape.num_kv_heads)
    else:
        kv_heads, heads = 1, math.ceil(shape.num_heads / tp)
    return heads, kv_heads, math.ceil(shape.intermediate_size / tp)


@dataclass(frozen=True)
class ModuleCost:
    flops: float
    weight_bytes: float
    kv_bytes: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class ForwardCost:
    attention: ModuleCost
    mlp: ModuleCost
    head: ModuleCost
    all_reduce_bytes: float
    num_layers: int

    @property
    def bytes(self) -> float:
        return self.num_layers * (self.attention.bytes + self.mlp.bytes) + self.head.bytes


def forward_cost(
    shape: ModelShape, batch: int, query_tokens: int, context: int, tp: int = 1, dtype_bytes: int = 2
) -> ForwardCost:
    """One forward of `batch` sequences of `query_tokens` new tokens each over `context` cached
    positions; the LM head runs on every query position (as gpt-fast and ladder/tp/runtime.py do)."""
    heads, kv_heads, intermediate = rank_share(shape, tp)
    h, d, tokens = shape.hidden_size, shape.head_dim, batch * query_tokens
    attention_weights, mlp_weights = shape.layer_weights(heads, kv_heads, intermediate)
    attended = min(context, shape.sliding_window or context)
    head_weights = shape.vocab_size * h + h
    return ForwardCost(
        attention=ModuleCost(
            flops=2 * tokens * attention_weights + 4 * tokens * heads * d * attended,
            weight_bytes=dtype_bytes * attention_weights,
            kv_bytes=dtype_bytes * 2 * batch * kv_heads * d * attended,
        ),
        mlp=ModuleCost(flops=2 * tokens * mlp_weights, weight_bytes=dtype_bytes * mlp_weights),
        head=ModuleCost(flops=2 * tokens * head_weights, weight_bytes=dtype_bytes * head_weights),
        all_reduce_bytes=dtype_bytes * tokens * h,
        num_layers=shape.num_layers,
    )
