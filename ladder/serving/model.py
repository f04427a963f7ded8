"""Ladder Residual Llama for vLLM (arXiv 2501.06589), on vLLM's own Llama parts.

A small diff over vLLM's `LlamaForCausalLM` (vllm/model_executor/models/llama.py): the same
column/row-parallel linears (stacked q/k/v and gate/up), vocab-parallel embedding and LM head,
paged attention with its KV cache, rotary embedding and weight loader. Only the layer loop and
the ladder layers differ; standard layers are vLLM's `LlamaDecoderLayer`, called unchanged, so a
checkpoint without ladder layers computes exactly vLLM's Llama.

The residual stream is carried as vLLM carries it (stream = hidden_states + residual, added
inside the next fused add-RMSNorm) plus one more term, the attention output of the last ladder
layer that is not in the stream yet:

    attn_stream = residual + pending_attention
    mlp_stream  = residual + pending_attention + hidden_states

A ladder layer's o_proj and down_proj are built with `reduce_results=False`; the layer issues
the all-reduce of each output itself, right after the module that made it, and the sum is
added only where the wiring needs it: the attention output before the next attention, the MLP
output before the next MLP. This is Algorithm 1 of the paper.

What the all-reduce does while the next module computes depends on vLLM's communicator, which
is synchronous (vLLM 0.32 has no asynchronous all-reduce):
- CPU: `shm_allreduce` copies through shared memory and spins in the calling thread until every
  rank has arrived, so the reduction has finished before the next module starts: nothing
  overlaps. With one core per rank there is no idle core to overlap on anyway.
- GPU: the all-reduce kernel (custom all-reduce or NCCL) is enqueued on the compute stream, so
  stream order puts it before the next module's kernels: nothing overlaps either. Overlap needs
  the reduction on a second CUDA stream with events, inside vLLM's CUDA-graph capture; vLLM's
  communicator offers no such call, and it is not done here.
So on vLLM the ladder wiring is computed correctly under tensor parallelism, with the reductions
placed where an asynchronous communicator would overlap them; `ladder/tp/runtime.py` is the runtime that
does overlap them (gloo or NCCL, asynchronously).

Imported only inside the serving environment (vLLM installed); `ladder.serving.plugin` registers it.
"""

from itertools import islice

import torch
from torch.library import Library
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tp_group
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.utils import extract_layer_index
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import direct_register_custom_op

from ladder.model.configuration_ladder_llama import resolve_ladder_layers

# The ladder layers' all-reduce is an opaque custom op, registered as vLLM registers its own (fake
# implementation for tracing). Besides reducing it is a fence for torch.compile: torch 2.13's
# inductor schedules a pointwise read of a buffer that a mutating custom op fills (vLLM's CPU
# linears write through `_C.onednn_mm(out, ...)` into an empty buffer) into an earlier fused kernel,
# before the write. vLLM's Llama reads each output at once and never meets it; the ladder reads an
# output one module later, after independent work that inductor fuses with the read, and so
# served garbage: run-dependent tokens at TP=1, where vLLM's all-reduce is a Python no-op and no
# opaque op stood between the linear and the late read. An extern op is not fused or moved
# across, and its output is a buffer of its own, so every reader follows the write.
_LIBRARY = Library("ladder", "FRAGMENT")


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    group = get_tp_group()
    # A custom op's output may not alias its input: at TP=1 the fence costs one copy of the output.
    return tensor.clone() if group.world_size == 1 else group._all_reduce_out_place(tensor)


def _fence(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


def _like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor)


direct_register_custom_op("all_reduce", _all_reduce, fake_impl=_like, target_lib=_LIBRARY)
# For a standard layer's MLP output that the next (ladder) layer reads after its attention.
direct_register_custom_op("fence", _fence, fake_impl=_like, target_lib=_LIBRARY)


def ladder_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of a ladder module's row-parallel output over the tensor-parallel group."""
    return torch.ops.ladder.all_reduce(tensor)


class LadderLlamaDecoderLayer(LlamaDecoderLayer):
    """Differs from vLLM's Llama layer: a ladder layer reads the stream from before the previous
    module's output was added, and reduces its row-parallel outputs itself (`ladder_forward`).
    A standard layer is vLLM's layer as is."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        config=None,
        attn_layer_type: type[torch.nn.Module] = LlamaAttention,
    ) -> None:
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=attn_layer_type)
        config = config or vllm_config.model_config.hf_config
        ladder_layers = resolve_ladder_layers(config.ladder_layers, config.num_hidden_layers)
        self.is_ladder = extract_layer_index(prefix) in ladder_layers
        if self.is_ladder:
            # The sum is added later than Llama adds it, so the layer loop owns the all-reduce.
            self.self_attn.o_proj.reduce_results = False
            self.mlp.down_proj.reduce_results = False

    def ladder_forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        pending_attention: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden_states, residual, pending_attention) in, the same out (see the module doc)."""
        if residual is None:  # first layer: both streams are the embeddings
            residual, hidden_states = hidden_states, None
        # Attention reads attn_stream = residual + pending_attention (the previous MLP output is not in it).
        if pending_attention is None:
            attention_input = self.input_layernorm(residual)
        else:
            attention_input, residual = self.input_layernorm(pending_attention, residual)
        attention_output = ladder_all_reduce(self.self_attn(positions=positions, hidden_states=attention_input))
        # The MLP reads mlp_stream = attn_stream + previous MLP output (this attention output is not in it).
        if hidden_states is None:
            mlp_input = self.post_attention_layernorm(residual)
        else:
            mlp_input, residual = self.post_attention_layernorm(hidden_states, residual)
        mlp_output = ladder_all_reduce(self.mlp(mlp_input))
        return mlp_output, residual, attention_output


class LadderLlamaModel(LlamaModel):
    """Differs from vLLM's `LlamaModel`: the layer loop carries the ladder layers' pending attention
    output, and pipeline parallelism is not supported (its hand-over carries two tensors)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", layer_type=LadderLlamaDecoderLayer):
        if get_pp_group().world_size > 1:
            raise ValueError("LadderLlamaForCausalLM does not support pipeline parallelism; use tensor parallelism")
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = pending_attention = None
        fenced = True  # hidden_states came through a ladder op, or from no linear (the embeddings)
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            if layer.is_ladder:
                if not fenced:  # a standard layer's MLP output, read after this layer's attention
                    hidden_states = torch.ops.ladder.fence(hidden_states)
                hidden_states, residual, pending_attention = layer.ladder_forward(
                    positions, hidden_states, residual, pending_attention
                )
            else:
                if pending_attention is not None:  # a standard layer reads the whole stream
                    residual, pending_attention = residual + pending_attention, None
                hidden_states, residual = layer(positions, hidden_states, residual)
            fenced = layer.is_ladder
        if pending_attention is not None:
            residual = residual + pending_attention
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LadderLlamaForCausalLM(LlamaForCausalLM):
    """Differs from vLLM's `LlamaForCausalLM` only in its backbone, a `LadderLlamaModel`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", layer_type=LadderLlamaDecoderLayer):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type=LadderLlamaDecoderLayer):
        return LadderLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


__all__ = ["LadderLlamaDecoderLayer", "LadderLlamaForCausalLM", "LadderLlamaModel"]
