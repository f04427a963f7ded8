"""Ladder Residual Llama, Mistral, Qwen2 and Qwen3 (Zhang et al., "Ladder-residual: parallelism-aware
architecture for accelerating large model inference with communication overlapping", arXiv 2501.06589).

A small diff over each family's transformers model: the attention (with Qwen3's q/k norms, Qwen2's
biases, the sliding windows), MLP, norms and rotary embedding are the family's own modules, and
parameter names are the family's, so its state dict loads as is. Only the residual wiring changes,
written once (`LadderDecoderLayer`, `LadderModel`); each family's classes only name its modules.
Number the modules (attention, MLP, attention, ...) and let r_i be the residual stream after
module i:

    standard:  r_i = r_{i-1} + h_i(r_{i-1})
    ladder:    r_i = r_{i-1} + h_i(r_{i-2})

so under tensor parallelism the all-reduce of h_{i-1} can run while h_i computes. Every layer
carries two streams, the stream after its attention and the stream after its MLP:

    attn_stream_i = mlp_stream_{i-1} + Attn_i(norm1(ladder ? attn_stream_{i-1} : mlp_stream_{i-1}))
    mlp_stream_i  = attn_stream_i    + MLP_i (norm2(ladder ? mlp_stream_{i-1}  : attn_stream_i))

Both streams start as the token embeddings; the model's output is the last mlp_stream.
This file depends only on torch and transformers so that it can travel inside a checkpoint, where
it runs on whatever transformers the reader has: it works on 5.16.1 to 5.25 (tests/test_portability.py
loads a Llama checkpoint with each end, tests/test_families.py every family; docs/families.md).
"""

import functools
import inspect

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .config_rules import attention_type
from .configuration_ladder import LadderLlamaConfig, LadderMistralConfig, LadderQwen2Config, LadderQwen3Config

# transformers 5.24 renamed Llama's cache argument and output field from `past_key_values` to
# `cache`. This file speaks whichever name the installed Llama uses.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(llama.LlamaAttention.forward).parameters else "past_key_values"


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


class LadderDecoderLayer:
    """Put before a family's decoder layer. Differs from it: takes and returns (attn_stream,
    mlp_stream). A ladder layer's attention reads the previous attn_stream and its MLP the previous
    mlp_stream; a standard layer computes exactly the family's layer on mlp_stream and ignores
    attn_stream. `attention_mask` may be the model's masks by attention type: the layer takes its own."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_ladder = layer_idx in config.ladder_layers
        self.attention_type = attention_type(config, layer_idx)

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
        if isinstance(attention_mask, dict):
            attention_mask = attention_mask[self.attention_type]
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


class LadderModel:
    """Put before a family's ladder pre-trained model, with the family's modules named below.
    Differs from the family's model (`LlamaModel`, ...): the layer loop carries two residual streams.

    `output_hidden_states=True` returns the embeddings and then, per layer, its mlp_stream: the
    full residual stream after that layer, holding every module's update so far (for a ladder
    layer the attn_stream lags one MLP update behind, so it is not reported). As in the family's
    model, the last entry is replaced by the final-normed output.
    """

    layer_class: type[LadderDecoderLayer]
    norm_class: type[nn.Module]
    rotary_class: type[nn.Module]

    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([self.layer_class(config, index) for index in range(config.num_hidden_layers)])
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_class(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @_takes_cache_argument
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
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

        masks = self.attention_masks(inputs_embeds, attention_mask, position_ids, cache)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)

        attn_stream = mlp_stream = inputs_embeds
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            attn_stream, mlp_stream = decoder_layer(
                attn_stream,
                mlp_stream,
                attention_mask=masks,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )

        return BaseModelOutputWithPast(last_hidden_state=self.norm(mlp_stream), **{CACHE_ARGUMENT: cache})

    def attention_masks(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | dict | None,
        position_ids: torch.LongTensor,
        cache: Cache | None,
    ) -> dict:
        """The masks the layers read, by attention type: causal, and sliding where a layer slides (as
        the family's own model builds them). Masks that `generate` prepared come as such a dict already."""
        if isinstance(attention_mask, dict):
            return attention_mask
        arguments = dict(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_ARGUMENT: cache},
        )
        masks = {"full_attention": create_causal_mask(**arguments)}
        if any(layer.attention_type == "sliding_attention" for layer in self.layers):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**arguments)
        return masks


class LadderForCausalLM:
    """Put before a family's ladder pre-trained model and its causal LM. Differs from the family's
    causal LM (`LlamaForCausalLM`, ...) only in its backbone, the family's `LadderModel`."""

    model_class: type[LadderModel]

    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


def _can_record_outputs(decoder_layer: type, attention: type) -> dict:
    """Hidden states are recorded from the mlp_stream (index 1) of each layer."""
    return {"hidden_states": OutputRecorder(decoder_layer, index=1), "attentions": OutputRecorder(attention, index=1)}


# Each family: its own modules, named.
class LadderLlamaDecoderLayer(LadderDecoderLayer, llama.LlamaDecoderLayer):
    pass


class LadderLlamaPreTrainedModel(llama.LlamaPreTrainedModel):
    config: LadderLlamaConfig
    _no_split_modules = ["LadderLlamaDecoderLayer"]
    _can_record_outputs = _can_record_outputs(LadderLlamaDecoderLayer, llama.LlamaAttention)


class LadderLlamaModel(LadderModel, LadderLlamaPreTrainedModel):
    layer_class, norm_class, rotary_class = LadderLlamaDecoderLayer, llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding


class LadderLlamaForCausalLM(LadderForCausalLM, LadderLlamaPreTrainedModel, llama.LlamaForCausalLM):
    model_class = LadderLlamaModel


class LadderMistralDecoderLayer(LadderDecoderLayer, mistral.MistralDecoderLayer):
    pass


class LadderMistralPreTrainedModel(mistral.MistralPreTrainedModel):
    config: LadderMistralConfig
    _no_split_modules = ["LadderMistralDecoderLayer"]
    _can_record_outputs = _can_record_outputs(LadderMistralDecoderLayer, mistral.MistralAttention)


class LadderMistralModel(LadderModel, LadderMistralPreTrainedModel):
    layer_class, norm_class = LadderMistralDecoderLayer, mistral.MistralRMSNorm
    rotary_class = mistral.MistralRotaryEmbedding


class LadderMistralForCausalLM(LadderForCausalLM, LadderMistralPreTrainedModel, mistral.MistralForCausalLM):
    model_class = LadderMistralModel


class LadderQwen2DecoderLayer(LadderDecoderLayer, qwen2.Qwen2DecoderLayer):
    pass


class LadderQwen2PreTrainedModel(qwen2.Qwen2PreTrainedModel):
    config: LadderQwen2Config
    _no_split_modules = ["LadderQwen2DecoderLayer"]
    _can_record_outputs = _can_record_outputs(LadderQwen2DecoderLayer, qwen2.Qwen2Attention)


class LadderQwen2Model(LadderModel, LadderQwen2PreTrainedModel):
    layer_class, norm_class, rotary_class = LadderQwen2DecoderLayer, qwen2.Qwen2RMSNorm, qwen2.Qwen2RotaryEmbedding


class LadderQwen2ForCausalLM(LadderForCausalLM, LadderQwen2PreTrainedModel, qwen2.Qwen2ForCausalLM):
    model_class = LadderQwen2Model


class LadderQwen3DecoderLayer(LadderDecoderLayer, qwen3.Qwen3DecoderLayer):
    pass


class LadderQwen3PreTrainedModel(qwen3.Qwen3PreTrainedModel):
    config: LadderQwen3Config
    _no_split_modules = ["LadderQwen3DecoderLayer"]
    _can_record_outputs = _can_record_outputs(LadderQwen3DecoderLayer, qwen3.Qwen3Attention)


class LadderQwen3Model(LadderModel, LadderQwen3PreTrainedModel):
    layer_class, norm_class, rotary_class = LadderQwen3DecoderLayer, qwen3.Qwen3RMSNorm, qwen3.Qwen3RotaryEmbedding


class LadderQwen3ForCausalLM(LadderForCausalLM, LadderQwen3PreTrainedModel, qwen3.Qwen3ForCausalLM):
    model_class = LadderQwen3Model
