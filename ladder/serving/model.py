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

The ladder all-reduces are custom ops (below): fences for torch.compile at every TP size and, at
TP > 1, a start and a wait around the MLP for each attention output, on vLLM's auxiliary CUDA stream
where there is one. `ladder/tp/runtime.py` is this package's own runtime, which overlaps both
reductions (gloo or NCCL, asynchronously).

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
from vllm.utils.torch_utils import aux_stream, current_stream, direct_register_custom_op

from ladder.model.configuration_ladder_llama import resolve_ladder_layers

# The ladder layers' all-reduces are opaque custom ops, registered as vLLM registers its own (fake
# implementations for tracing). Besides reducing they fence torch.compile: torch 2.13's inductor
# fuses a pointwise read of a buffer that a mutating custom op fills (vLLM's CPU linears write
# through `_C.onednn_mm(out, ...)` into an empty buffer) into an earlier kernel, before the write.
# vLLM's Llama reads each output at once and never meets it; the ladder reads an output one module
# later, after independent work that inductor fused with the read, and served garbage: tokens that
# changed from run to run at TP=1, where vLLM's all-reduce is a Python no-op and no opaque op stood
# between the linear and the late read. An extern op is neither fused nor moved, and its output is
# a buffer of its own, so every reader follows the write.
#
# Overlap (tensor parallelism on CUDA): the attention output's all-reduce starts on vLLM's
# auxiliary stream (`all_reduce_start`) and joins the compute stream after the MLP
# (`all_reduce_wait`, which takes the MLP output as an argument: a data dependency, so no compiler
# pass can move the join before the MLP). Stream fork and join happen inside the ops, unseen by
# torch.compile and recorded by CUDA-graph capture. The MLP output's all-reduce stays synchronous:
# the module it would overlap is the next attention, and vLLM's piecewise CUDA graphs are split at
# attention, so a fork there could not be joined inside one graph. On CPU there is no stream:
# start is the synchronous all-reduce of vLLM's communicator (shared memory, spinning until every
# rank has arrived) and wait a copy.
_LIBRARY = Library("ladder", "FRAGMENT")
_EVENTS: list = []  # [input ready, reduction done], CUDA events made on first use


def _all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    # A custom op may neither change an input it does not declare nor return it (inductor reuses
    # the input's buffer once the op has read it): at TP=1 the fence costs one copy of the output,
    # and vLLM's CPU communicator, which reduces in place and returns its input, gets a copy.
    group = get_tp_group()
    if group.world_size == 1:
        return tensor.clone()
    return group._all_reduce_out_place(tensor.clone() if tensor.is_cpu else tensor)


def _all_reduce_start(tensor: torch.Tensor) -> torch.Tensor:
    group, stream = get_tp_group(), aux_stream()
    if stream is None:
        return _all_reduce(tensor)
    if not _EVENTS:
        _EVENTS.extend([torch.cuda.Event(), torch.cuda.Event()])
    ready, done = _EVENTS
    main = current_stream()
    ready.record(main)
    with torch.cuda.stream(stream):
        ready.wait(stream)
        reduced = group._all_reduce_out_place(tensor)
        done.record(stream)
    # The caching allocator must not hand either buffer to the other stream while it is in use.
    tensor.record_stream(stream)
    reduced.record_stream(main)
    return reduced


def _all_reduce_wait(reduced: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    if aux_stream() is not None:
        _EVENTS[1].wait(current_stream())
    return reduced.clone()  # its own buffer (see _all_reduce)


def _fence(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


def _like(tensor: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(tensor)


for _name, _op in [
    ("all_reduce", _all_reduce),
    ("all_reduce_start", _all_reduce_start),
    ("all_reduce_wait", _all_reduce_wait),
    # For a standard layer's MLP output that the next (ladder) layer reads after its attention.
    ("fence", _fence),
]:
    direct_register_custom_op(_name, _op, fake_impl=_like, target_lib=_LIBRARY)


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
        # Overlap only where there is something to reduce.
        self.overlap = get_tp_group().world_size > 1
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
        attention_partial = self.self_attn(positions=positions, hidden_states=attention_input)
        if self.overlap:  # reduced while the MLP computes
            attention_sum = torch.ops.ladder.all_reduce_start(attention_partial)
        else:
            attention_output = torch.ops.ladder.all_reduce(attention_partial)
        # The MLP reads mlp_stream = attn_stream + previous MLP output (this attention output is not in it).
        if hidden_states is None:
            mlp_input = self.post_attention_layernorm(residual)
        else:
            mlp_input, residual = self.post_attention_layernorm(hidden_states, residual)
        mlp_partial = self.mlp(mlp_input)
        if self.overlap:
            attention_output = torch.ops.ladder.all_reduce_wait(attention_sum, mlp_partial)
        return torch.ops.ladder.all_reduce(mlp_partial), residual, attention_output


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
    """Differs from vLLM's `LlamaForCausalLM` in its backbone, a `LadderLlamaModel`, and in two
    compile settings."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", layer_type=LadderLlamaDecoderLayer):
        # vLLM's all-reduce + RMSNorm fusion (GPU) matches Llama's pattern, vLLM's all_reduce
        # followed by the fused add-RMSNorm that consumes it, and moves the reduction into that
        # norm. A ladder layer's sum is consumed a module later, by design, so its reductions are
        # ladder ops the pass does not match; off, so that nothing at the ladder/standard boundaries
        # is rewired by a pass the tests cannot run (no GPU here). Set before the backbone is built:
        # vLLM configures its passes from this config when it compiles the model.
        vllm_config.compilation_config.pass_config.fuse_allreduce_rms = False
        if get_tp_group().world_size > 1:
            # Inductor's locality reordering sinks a node towards its first consumer: it moved each
            # o_proj and its all_reduce_start after the MLP, next to the wait, and nothing could
            # overlap (seen in the code it built; test_compiled_ladder_overlap_order).
            vllm_config.compilation_config.inductor_compile_config["reorder_for_locality"] = False
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type=LadderLlamaDecoderLayer):
        return LadderLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


__all__ = ["LadderLlamaDecoderLayer", "LadderLlamaForCausalLM", "LadderLlamaModel"]
