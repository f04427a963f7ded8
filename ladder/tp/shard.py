"""One rank's shard of a Llama, Mistral, Qwen2 or Qwen3 (dense) for tensor-parallel inference, gpt-fast
style (pytorch-labs/gpt-fast model.py): a lean forward with a static KV cache, fused projections and
local shapes only.

References: the Ladder Residual paper (arXiv 2501.06589), Algorithm 1, and its official gpt-fast
code (github.com/mayank31398/ladder-residual-inference, gpt_fast/gpt_ladder_TP.py), whose layer
loop this follows; Megatron-LM for the sharding.

Megatron sharding: q/k/v and gate/up are column-parallel (this rank holds some heads and some
intermediate channels), o/down are row-parallel, so each branch (attention, MLP) returns this
rank's *partial* output, one term of a sum over ranks. The layer loop hands every partial to
`self.reduce`, which sums it over the ranks and returns a pending result; the loop calls `.wait()`
where the wiring needs the sum. This file imports nothing distributed: the default `reduce` is the
identity, exact at TP=1, and `ladder.tp.runtime` installs the collective (an all-reduce over the group).

The attention and MLP maths follow transformers' Llama (RMSNorm, RoPE from LlamaRotaryEmbedding so
llama3/linear/... scaling comes for free, GQA, tied embeddings); the families differ only in small
optional pieces chosen from the config: biases (Qwen2's on q/k/v, `attention_bias`, `mlp_bias`),
Qwen3's per-head q/k RMSNorm, and a sliding window in the mask (Mistral's on every layer, Qwen's on
the layers `layer_types` marks). Logits match each family's transformers model and its ladder form to
float tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from ..model.config_rules import (
    LADDER_MODEL_TYPES,
    attention_type,
    biased_projections,
    family_of,
    resolve_ladder_layers,
)
from .degrees import tp_runtime_refusal


def shard_range(total: int, parts: int, index: int) -> range:
    """Part `index` of `range(total)` cut into `parts` contiguous pieces whose sizes differ by at most one."""
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


@dataclass(frozen=True)
class ShardShape:
    """What one rank holds, derived once from the config, the rank and the TP degree.

    KV heads are split across ranks and each KV head keeps its whole group of query heads, so
    attention needs no communication. When the KV heads do not divide evenly (SmolLM2: 3 KV heads
    at TP=2) the ranks get unequal groups: it runs, with some load imbalance.
    """

    hidden_size: int
    head_dim: int
    rms_norm_eps: float
    heads: range  # this rank's query heads
    kv_heads: range
    intermediate: range  # this rank's MLP channels
    biased: frozenset[str]  # the projections with a bias, by their transformers names (q_proj, ...)
    qk_norm: bool  # Qwen3: RMSNorm over each query and key head (head_dim wide) before RoPE
    sliding_window: int | None  # how many positions a sliding layer sees, itself included
    sliding_layers: frozenset[int]

    @classmethod
    def of(cls, config: PretrainedConfig, rank: int = 0, tp_size: int = 1) -> ShardShape:
        family = family_of(config.model_type)
        if family is None or config.hidden_act != "silu":
            raise ValueError(
                f"the TP runtime runs {', '.join(LADDER_MODEL_TYPES)} models with hidden_act silu, "
                f"not {config.model_type} with {config.hidden_act}"
            )
        window = getattr(config, "sliding_window", None)
        kv_heads, heads = config.num_key_value_heads, config.num_attention_heads
        if problem := tp_runtime_refusal(heads, kv_heads, tp_size):
            raise ValueError(problem)
        group = heads // kv_heads
        kv_range = shard_range(kv_heads, tp_size, rank)
        return cls(
            hidden_size=config.hidden_size,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            heads=range(kv_range.start * group, kv_range.stop * group),
            kv_heads=kv_range,
            intermediate=shard_range(config.intermediate_size, tp_size, rank),
            biased=biased_projections(
                family, getattr(config, "attention_bias", False), getattr(config, "mlp_bias", False)
            ),
            qk_norm=family == "qwen3",
            sliding_window=window,
            sliding_layers=frozenset(
                i
                for i in range(config.num_hidden_layers)
                if window and attention_type(config, i) == "sliding_attention"
            ),
        )


class Pending(Protocol):
    """A branch output being summed over the ranks; `wait()` returns the sum once it is complete."""

    def wait(self) -> torch.Tensor: ...


class Ready(NamedTuple):
    """A sum that is already complete (TP=1, a blocking all-reduce, or no communication at all)."""

    value: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.value


# reduce(partial, async_op) sums a branch's partial output over the ranks. With async_op=False it
# returns once the sum is done; with async_op=True it may return while the sum is in flight.
Reduce = Callable[[torch.Tensor, bool], Pending]


def local_sum(partial: torch.Tensor, async_op: bool) -> Ready:
    """The partial output is the whole sum: exact at TP=1, the no-communication bound above it."""
    return Ready(partial)


def settle(x: torch.Tensor, pending: Pending | None) -> torch.Tensor:
    """Add a pending branch output to the residual, waiting for its sum if it is still in flight."""
    return x if pending is None else x + pending.wait()


class AttentionBranch(nn.Module):
    """norm -> this rank's q/k/v heads (one fused matmul) -> per-head q/k norms (Qwen3) -> RoPE ->
    static KV cache -> SDPA -> its columns of o_proj. Returns the partial sum; it does not touch the
    residual."""

    def __init__(self, shape: ShardShape):
        super().__init__()
        self.shape = shape
        q_width = len(shape.heads) * shape.head_dim
        kv_width = len(shape.kv_heads) * shape.head_dim
        self.split = (q_width, kv_width, kv_width)
        self.norm = LlamaRMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.wqkv = nn.Linear(shape.hidden_size, sum(self.split), bias="q_proj" in shape.biased)
        self.wo = nn.Linear(q_width, shape.hidden_size, bias="o_proj" in shape.biased)
        head_norm = (lambda: LlamaRMSNorm(shape.head_dim, eps=shape.rms_norm_eps)) if shape.qk_norm else nn.Identity
        self.q_norm, self.k_norm = head_norm(), head_norm()  # whole on every rank: they act within a head

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.wqkv(self.norm(x)).split(self.split, dim=-1)
        q = self.q_norm(q.view(batch, length, -1, self.shape.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(batch, length, -1, self.shape.head_dim)).transpose(1, 2)
        v = v.view(batch, length, -1, self.shape.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        # Attend over the whole cache with a mask (gpt-fast): shapes stay static for compile/graphs.
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class MLPBranch(nn.Module):
    """norm -> this rank's gate/up channels (one fused matmul) -> SiLU gate -> its rows of down_proj.
    Returns the partial sum."""

    def __init__(self, shape: ShardShape):
        super().__init__()
        self.norm = LlamaRMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.w13 = nn.Linear(shape.hidden_size, 2 * len(shape.intermediate), bias="gate_proj" in shape.biased)
        self.w2 = nn.Linear(len(shape.intermediate), shape.hidden_size, bias="down_proj" in shape.biased)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(self.norm(x)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    """A decoder layer as two branches; `is_ladder` says how their outputs join the residual,
    `sliding` whether its attention sees only the last `sliding_window` positions."""

    def __init__(self, shape: ShardShape, sliding: bool):
        super().__init__()
        self.attention = AttentionBranch(shape)
        self.mlp = MLPBranch(shape)
        self.is_ladder, self.sliding = False, sliding


class ModelShard(nn.Module):
    """Rank `rank`'s shard at TP=`tp_size` (its ShardShape): embedding and LM head (replicated on every
    rank), the sharded blocks, the final norm and the RoPE tables. `setup_cache` must run before the
    first forward."""

    def __init__(self, config: PretrainedConfig, rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = config
        self.shape = shape = ShardShape.of(config, rank, tp_size)
        self.embed = nn.Embedding(config.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(Block(shape, i in shape.sliding_layers) for i in range(config.num_hidden_layers))
        self.set_ladder_layers(resolve_ladder_layers(getattr(config, "ladder_layers", None), config.num_hidden_layers))
        self.norm = LlamaRMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, config.vocab_size, bias=False)
        self.reduce: Reduce = local_sum
        self.max_length = 0

    @property
    def ladder_layers(self) -> list[int]:
        return [index for index, block in enumerate(self.layers) if block.is_ladder]

    def set_ladder_layers(self, ladder_layers: list[int]) -> None:
        """Rewire in place: the weights stay, only which layers use ladder wiring changes."""
        chosen = set(ladder_layers)
        for index, block in enumerate(self.layers):
            block.is_ladder = index in chosen

    def setup_cache(self, batch: int, max_length: int) -> None:
        """Allocate the KV caches, the causal and sliding-window masks and the cos/sin tables for
        `max_length` positions."""
        weight = self.lm_head.weight
        size = (batch, len(self.shape.kv_heads), max_length, self.shape.head_dim)
        for block in self.layers:  # buffers, so that torch.compile / CUDA graphs see fixed addresses
            block.attention.register_buffer("k_cache", weight.new_zeros(size), persistent=False)
            block.attention.register_buffer("v_cache", weight.new_zeros(size), persistent=False)
        positions = torch.arange(max_length, device=weight.device)
        rope = LlamaRotaryEmbedding(self.config).to(weight.device)
        cos, sin = rope(weight, positions[None])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        behind = positions[:, None] - positions[None, :]  # query position - key position
        window = self.shape.sliding_window or max_length
        self.register_buffer("causal_mask", behind >= 0, persistent=False)
        self.register_buffer("sliding_mask", (behind >= 0) & (behind < window), persistent=False)
        self.max_length = max_length

    def forward(self, input_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Logits for `input_ids` (batch, length) at cache positions `input_pos` (length,).

        The two streams of ladder/model/modeling_ladder.py are `x` plus what is pending: `x` with
        the pending attention sum settled is its attn_stream, with the pending MLP sum settled too
        its mlp_stream. The residual `x` takes each branch's summed output one step late (Algorithm 1): a ladder
        layer adds the previous attention output, launches its own attention, adds the previous
        MLP output, launches its MLP, and the sums travel while the next branch computes. A
        standard layer adds whatever is pending and sums its attention at once; its MLP output is
        also left pending, because a ladder layer right after it reads the stream from before that
        MLP (see ladder/model/modeling_ladder.py). The caller keeps positions inside the cache.
        """
        cos, sin = self.cos[:, input_pos], self.sin[:, input_pos]
        causal, sliding = self.causal_mask[input_pos], self.sliding_mask[input_pos]
        x = self.embed(input_ids)
        pending_attention = pending_mlp = None
        for block in self.layers:
            mask = sliding if block.sliding else causal
            if block.is_ladder:
                x = settle(x, pending_attention)
                pending_attention = self.reduce(block.attention(x, cos, sin, mask, input_pos), True)
                x = settle(x, pending_mlp)
                pending_mlp = self.reduce(block.mlp(x), True)
            else:
                x = settle(settle(x, pending_attention), pending_mlp)
                x = x + self.reduce(block.attention(x, cos, sin, mask, input_pos), False).wait()
                pending_attention = None
                pending_mlp = self.reduce(block.mlp(x), False)
        x = settle(settle(x, pending_attention), pending_mlp)
        return self.lm_head(self.norm(x))
