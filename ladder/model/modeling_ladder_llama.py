"""Ladder Residual Llama (Zhang et al., "Ladder-residual: parallelism-aware architecture for
accelerating large model inference with communication overlapping", arXiv 2501.06589).

A small diff over transformers' Llama: the attention, MLP, norms and rotary embedding are
Llama's own modules, and parameter names are Llama's, so any Llama state dict loads as is.
Only the residual wiring changes. Number the modules (attention, MLP, attention, ...) and let
r_i be the residual stream after module i:

    standard:  r_i = r_{i-1} + h_i(r_{i-1})
    ladder:    r_i = r_{i-1} + h_i(r_{i-2})

so under tensor parallelism the all-reduce of h_{i-1} can run while h_i computes. Every layer
carries two streams, the stream after its attention and the stream after its MLP:

    attn_stream_i = mlp_stream_{i-1} + Attn_i(norm1(ladder ? attn_stream_{i-1} : mlp_stream_{i-1}))
    mlp_stream_i  = attn_stream_i    + MLP_i (norm2(ladder ? mlp_stream_{i-1}  : attn_stream_i))

Both streams start as the token embeddings; the model's output is the last mlp_stream.
This file depends only on torch and transformers so that it can travel inside a checkpoint, where
it runs on whatever transformers the reader has: it works on 5.16.1 to 5.25 (tests/test_portability.py
loads a checkpoint with each end).
"""

import functools
import inspect

import torch
from torch import nn
from transformers import LlamaForCausalLM
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_ladder_llama import LadderLlamaConfig

# transformers 5.24 renamed Llama's cache argument and output field from `past_key_values` to
# `cache`. This file speaks whichever name the installed Llama uses.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"


def _takes_cache_argument(forward):
    """Let `forward(cache=...)` also be called the installed transformers' way: from 5.24 on, a
    `past_key_values=` is renamed with transformers' own deprecation warning, as Llama does; before
    5.24 it is the name Llama's own callers (generate, the causal-LM head) use, renamed silently."""
    if CACHE_ARGUMENT == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def renamed(self, *args, past_key_values: Cache | None = None, **kwargs):
        if past_key_values is not None:
            kwargs["cache"] = past_key_values
        return forward(self, *args, **kwargs)

    return renamed


class LadderLlamaDecoderLayer(LlamaDecoderLayer):
    """Differs from Llama: takes and returns (attn_stream, mlp_stream). A ladder layer's attention
    reads the previous attn_stream and its MLP the previous mlp_stream; a standard layer computes
    exactly Llama's layer on mlp_stream and ignores attn_stream."""

    def __init__(self, config: LadderLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_ladder = layer_idx in config.ladder_layers

    def forward(
        self,
        attn_stream: torch.Tensor,
        mlp_stream: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_input = attn_stream if self.is_ladder else mlp_stream
        attn_output, _ = self.self_attn(
            hidden_states=self.input_layernorm(attn_input),
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **{CACHE_ARGUMENT: cache},
            **kwargs,
        )
        new_attn_stream = mlp_stream + attn_output
        mlp_input = mlp_stream if self.is_ladder else new_attn_stream
        new_mlp_stream = new_attn_stream + self.mlp(self.post_attention_layernorm(mlp_input))
        return new_attn_stream, new_mlp_stream


class LadderLlamaPreTrainedModel(LlamaPreTrainedModel):
    """Differs from Llama: hidden states are recorded from the mlp_stream (index 1) of each layer."""

    config: LadderLlamaConfig
    _no_split_modules = ["LadderLlamaDecoderLayer"]
    _can_record_outputs = {
        "hidden_states": OutputRecorder(LadderLlamaDecoderLayer, index=1),
        "attentions": OutputRecorder(LlamaAttention, index=1),
    }


class LadderLlamaModel(LadderLlamaPreTrainedModel):
    """Differs from `LlamaModel`: the layer loop carries two residual streams.

    `output_hidden_states=True` returns the embeddings and then, per layer, its mlp_stream: the
    full residual stream after that layer, holding every module's update so far (for a ladder
    layer the attn_stream lags one MLP update behind, so it is not reported). As in Llama, the
    last entry is replaced by the final-normed output.
    """

    def __init__(self, config: LadderLlamaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [LadderLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @_takes_cache_argument
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_ARGUMENT: cache},
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)

        attn_stream = mlp_stream = inputs_embeds
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            attn_stream, mlp_stream = decoder_layer(
                attn_stream,
                mlp_stream,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )

        return BaseModelOutputWithPast(last_hidden_state=self.norm(mlp_stream), **{CACHE_ARGUMENT: cache})


class LadderLlamaForCausalLM(LadderLlamaPreTrainedModel, LlamaForCausalLM):
    """Differs from `LlamaForCausalLM` only in its backbone, a `LadderLlamaModel`."""

    def __init__(self, config: LadderLlamaConfig):
        LadderLlamaPreTrainedModel.__init__(self, config)
        self.model = LadderLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


__all__ = ["LadderLlamaDecoderLayer", "LadderLlamaForCausalLM", "LadderLlamaModel", "LadderLlamaPreTrainedModel"]
