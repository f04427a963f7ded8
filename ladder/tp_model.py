"""One rank's shard of a Llama for tensor-parallel inference, gpt-fast style (pytorch-labs/gpt-fast
model.py): a lean forward with a static KV cache, fused projections and local shapes only.

This file imports nothing distributed. Each branch (attention, MLP) returns its *partial* output:
with Megatron sharding, q/k/v and gate/up are column-parallel (this rank holds some heads and some
intermediate channels) and o/down are row-parallel, so a branch's output is this rank's term of a
sum over ranks. `ladder.tp` owns the layer loop that adds the terms up (all-reduce) and decides
when to wait for them; that is where the standard and ladder wirings differ. At TP=1 the shard is
the whole model and the partial output is the output.

The attention and MLP maths follow transformers' Llama (RMSNorm, RoPE from LlamaRotaryEmbedding
so llama3/linear/... scaling comes for free, GQA, tied embeddings), so logits match
`LlamaForCausalLM` to float tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb


@dataclass(frozen=True)
class ShardShape:
    """The sizes one rank holds; derived once from the config and the TP degree."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    head_dim: int
    local_heads: int
    local_kv_heads: int
    local_intermediate: int
    rms_norm_eps: float

    @classmethod
    def of(cls, config: LlamaConfig, tp_size: int) -> ShardShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            num_layers=config.num_hidden_layers,
            head_dim=head_dim,
            local_heads=config.num_attention_heads // tp_size,
            local_kv_heads=config.num_key_value_heads // tp_size,
            local_intermediate=config.intermediate_size // tp_size,
            rms_norm_eps=config.rms_norm_eps,
        )


class AttentionBranch(nn.Module):
    """norm -> this rank's q/k/v heads (one fused matmul) -> RoPE -> static KV cache -> SDPA -> its
    columns of o_proj. Returns the partial sum; it does not touch the residual."""

    def __init__(self, shape: ShardShape):
        super().__init__()
        self.shape = shape
        q_width = shape.local_heads * shape.head_dim
        kv_width = shape.local_kv_heads * shape.head_dim
        self.split = (q_width, kv_width, kv_width)
        self.norm = LlamaRMSNorm(shape.hidden_size, eps=shape.rms_norm_eps)
        self.wqkv = nn.Linear(shape.hidden_size, sum(self.split), bias=False)
        self.wo = nn.Linear(q_width, shape.hidden_size, bias=False)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def setup_cache(self, batch: int, max_length: int, dtype: torch.dtype, device: torch.device) -> None:
        size = (batch, self.shape.local_kv_heads, max_length, self.shape.head_dim)
        # Buffers, so that torch.compile / CUDA graphs see fixed addresses.
        self.register_buffer("k_cache", torch.zeros(size, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(size, dtype=dtype, device=device), persistent=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.wqkv(self.norm(x)).split(self.split, dim=-1)
        q = q.view(batch, length, self.shape.local_heads, self.shape.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.shape.local_kv_heads, self.shape.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.shape.local_kv_heads, self.shape.head_dim).transpose(1, 2)
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
        self.w13 = nn.Linear(shape.hidden_size, 2 * shape.local_intermediate, bias=False)
        self.w2 = nn.Linear(shape.local_intermediate, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(self.norm(x)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    """A decoder layer as two branches; how their outputs join the residual is the runtime's choice."""

    def __init__(self, shape: ShardShape):
        super().__init__()
        self.attention = AttentionBranch(shape)
        self.mlp = MLPBranch(shape)


class LlamaShard(nn.Module):
    """Embedding and LM head (replicated on every rank), the sharded blocks, the final norm and the
    RoPE tables. `setup_cache` must run before the first forward."""

    def __init__(self, config: LlamaConfig, tp_size: int):
        super().__init__()
        self.config = config
        self.shape = ShardShape.of(config, tp_size)
        self.embed = nn.Embedding(self.shape.vocab_size, self.shape.hidden_size)
        self.layers = nn.ModuleList(Block(self.shape) for _ in range(self.shape.num_layers))
        self.norm = LlamaRMSNorm(self.shape.hidden_size, eps=self.shape.rms_norm_eps)
        self.lm_head = nn.Linear(self.shape.hidden_size, self.shape.vocab_size, bias=False)
        self.max_length = 0

    def setup_cache(self, batch: int, max_length: int) -> None:
        """Allocate the KV caches, the causal mask and the cos/sin tables for `max_length` positions."""
        weight = self.lm_head.weight
        for block in self.layers:
            block.attention.setup_cache(batch, max_length, weight.dtype, weight.device)
        positions = torch.arange(max_length, device=weight.device)
        rope = LlamaRotaryEmbedding(self.config).to(weight.device)
        cos, sin = rope(weight, positions[None])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        causal = torch.ones(max_length, max_length, dtype=torch.bool, device=weight.device).tril()
        self.register_buffer("causal_mask", causal, persistent=False)
        self.max_length = max_length

    def rope_and_mask(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """cos, sin for the given positions and the mask rows that let them see the cache up to themselves."""
        if self.max_length == 0 or int(input_pos[-1]) >= self.max_length:
            raise ValueError(f"position {int(input_pos[-1])} is beyond the cache; call setup_cache with more room")
        return self.cos[:, input_pos], self.sin[:, input_pos], self.causal_mask[input_pos]

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


__all__ = ["AttentionBranch", "Block", "LlamaShard", "MLPBranch", "ShardShape"]
