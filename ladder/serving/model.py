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
TP > 1, a start and a wait on vLLM's auxiliary CUDA stream where there is one: around the MLP for
each attention output, and around the next ladder layer's attention for an MLP output where vLLM
runs the step as one full CUDA graph. `ladder/tp/runtime.py` is this package's own runtime, which
overlaps both reductions (gloo or NCCL, asynchronously).

Imported only inside the serving environment (vLLM installed); `ladder.serving.plugin` registers it.
"""

from itertools import islice
from typing import NamedTuple

import torch
from torch.library import Library
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed import get_pp_group, get_tp_group
from vllm.forward_context import get_forward_context, is_forward_context_available
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
# Overlap (tensor parallelism on CUDA): `all_reduce_start` runs vLLM's all-reduce on vLLM's
# auxiliary stream after an event from the compute stream, and `all_reduce_wait` joins it to the
# compute stream after the module it overlaps. Stream fork and join happen inside the ops, unseen
# by torch.compile and recorded by CUDA-graph capture. What keeps that right under inductor is data
# flow, the only thing its scheduler and buffer reuse respect:
# - the wait takes the start's input and output, so neither buffer is freed or reused while the
#   auxiliary stream may still read or write it (inductor reused the input at once otherwise);
# - the wait takes the overlapped module's output, so no pass moves the join before that module;
# - every reduction op takes the result of the reduction before it (`after`), so they run one at
#   a time in program order: vLLM's custom all-reduce has one staging buffer and assumes one call
#   at a time, and a single pair of events serves the one reduction in flight.
# An attention output's reduction always overlaps the MLP. An MLP output's reduction overlaps the
# next (ladder) layer's attention only where vLLM runs the step as one full CUDA graph: piecewise
# graphs are split at attention, and a fork in one piece cannot be joined in the next. The start
# asks vLLM's forward context at run time (`_may_span_attention`) and is synchronous otherwise.
# On CPU there is no stream: start is the synchronous all-reduce of vLLM's communicator (shared
# memory, spinning until every rank has arrived) and wait a copy.
_LIBRARY = Library("ladder", "FRAGMENT")


# The one ladder reduction that may be in flight on the auxiliary stream (each reduction op waits for
# the previous one's result): whether there is one, and its CUDA events (input ready, reduction
# done), made on first use.
_AUX_REDUCTION: dict = {"in_flight": False, "events": None}


def _start_on_aux_stream(tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    assert not _AUX_REDUCTION["in_flight"], "a ladder all-reduce started before the previous one was joined"
    if _AUX_REDUCTION["events"] is None:
        _AUX_REDUCTION["events"] = (torch.cuda.Event(), torch.cuda.Event())
    ready, done = _AUX_REDUCTION["events"]
    main = current_stream()
    ready.record(main)
    with torch.cuda.stream(stream):
        ready.wait(stream)
        reduced = get_tp_group()._all_reduce_out_place(tensor)
        done.record(stream)
    # The caching allocator must not hand either buffer to the other stream while it is in use.
    tensor.record_stream(stream)
    reduced.record_stream(main)
    _AUX_REDUCTION["in_flight"] = True
    return reduced


def _join_aux_stream() -> None:
    if _AUX_REDUCTION["in_flight"]:
        _AUX_REDUCTION["events"][1].wait(current_stream())
        _AUX_REDUCTION["in_flight"] = False


def _may_span_attention() -> bool:
    """Whether vLLM runs this step as one full CUDA graph (`FULL`, or a uniform decode batch under
    `FULL_AND_PIECEWISE`), so a reduction forked before an attention can be joined after it."""
    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL


def _all_reduce(tensor: torch.Tensor, after: torch.Tensor | None) -> torch.Tensor:
    # A custom op may neither change an input it does not declare nor return it (inductor reuses
    # the input's buffer once the op has read it): at TP=1 the fence costs one copy of the output,
    # and vLLM's CPU communicator, which reduces in place and returns its input, gets a copy.
    group = get_tp_group()
    if group.world_size == 1:
        return tensor.clone()
    return group._all_reduce_out_place(tensor.clone() if tensor.is_cpu else tensor)


def _all_reduce_start(tensor: torch.Tensor, after: torch.Tensor | None, spans_attention: bool) -> torch.Tensor:
    stream = aux_stream()
    if stream is None or (spans_attention and not _may_span_attention()):
        return _all_reduce(tensor, after)
    return _start_on_aux_stream(tensor, stream)


def _all_reduce_wait(reduced: torch.Tensor, tensor: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    _join_aux_stream()
    return reduced.clone()  # its own buffer (see _all_reduce)


def _fence(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


def _like(tensor: torch.Tensor, *dependencies: object, **named: object) -> torch.Tensor:
    return torch.empty_like(tensor)


for _name, _op in [
    ("all_reduce", _all_reduce),
    ("all_reduce_start", _all_reduce_start),
    ("all_reduce_wait", _all_reduce_wait),
    # For a standard layer's MLP output that the next (ladder) layer reads after its attention.
    ("fence", _fence),
]:
    direct_register_custom_op(_name, _op, fake_impl=_like, target_lib=_LIBRARY)


class InFlight(NamedTuple):
    """A ladder module's output whose all-reduce was started and not yet joined."""

    reduced: torch.Tensor  # all_reduce_start's output: the sum, once joined
    partial: torch.Tensor  # its input: it must outlive the reduction, so the wait takes it too

    @classmethod
    def start(cls, partial: torch.Tensor, after: torch.Tensor | None, spans_attention: bool = False) -> "InFlight":
        return cls(torch.ops.ladder.all_reduce_start(partial, after, spans_attention), partial)

    def wait(self, after: torch.Tensor) -> torch.Tensor:
        """The sum, joined after `after` (the output of the module the reduction overlaps)."""
        return torch.ops.ladder.all_reduce_wait(self.reduced, self.partial, after)


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
        index = extract_layer_index(prefix)
        self.is_ladder = index in ladder_layers
        # Overlap only where there is something to reduce. The MLP output's reduction overlaps the next
        # layer's attention, so only when that layer is a ladder one: a standard layer reads the whole
        # stream at once.
        self.overlap_attention = self.is_ladder and get_tp_group().world_size > 1
        self.overlap_mlp = self.overlap_attention and index + 1 in ladder_layers
        if self.is_ladder:
            # The sum is added later than Llama adds it, so the layer loop owns the all-reduce.
            self.self_attn.o_proj.reduce_results = False
            self.mlp.down_proj.reduce_results = False

    def ladder_forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | InFlight,
        residual: torch.Tensor | None,
        pending_attention: torch.Tensor | None,
    ) -> tuple[torch.Tensor | InFlight, torch.Tensor, torch.Tensor]:
        """(hidden_states, residual, pending_attention) in, the same out (see the module doc).
        hidden_states, the previous MLP's output, is `InFlight` where its reduction overlaps this
        layer's attention; this layer's is where the next layer is a ladder one too."""
        if residual is None:  # first layer: both streams are the embeddings
            residual, hidden_states = hidden_states, None
        # Attention reads attn_stream = residual + pending_attention (the previous MLP output is not in it).
        if pending_attention is None:
            attention_input = self.input_layernorm(residual)
        else:
            attention_input, residual = self.input_layernorm(pending_attention, residual)
        attention_partial = self.self_attn(positions=positions, hidden_states=attention_input)
        if isinstance(hidden_states, InFlight):
            hidden_states = hidden_states.wait(after=attention_partial)
        # This layer's reductions follow the last one (`after`; see the ops): the previous MLP's,
        # or at the first layer the embeddings' (vLLM's vocabulary-parallel embedding reduces them).
        previous_sum = residual if hidden_states is None else hidden_states
        if self.overlap_attention:  # reduced while the MLP computes
            attention = InFlight.start(attention_partial, after=previous_sum)
        else:
            attention_output = torch.ops.ladder.all_reduce(attention_partial, previous_sum)
        # The MLP reads mlp_stream = attn_stream + previous MLP output (this attention output is not in it).
        if hidden_states is None:
            mlp_input = self.post_attention_layernorm(residual)
        else:
            mlp_input, residual = self.post_attention_layernorm(hidden_states, residual)
        mlp_partial = self.mlp(mlp_input)
        if self.overlap_attention:
            attention_output = attention.wait(after=mlp_partial)
        if self.overlap_mlp:  # reduced while the next layer's attention computes, in a full CUDA graph
            return InFlight.start(mlp_partial, after=attention_output, spans_attention=True), residual, attention_output
        return torch.ops.ladder.all_reduce(mlp_partial, attention_output), residual, attention_output


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
            # overlap (seen in the code it built; tests/test_serving_compiled.py).
            vllm_config.compilation_config.inductor_compile_config["reorder_for_locality"] = False
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type=LadderLlamaDecoderLayer):
        return LadderLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


__all__ = ["LadderLlamaDecoderLayer", "LadderLlamaForCausalLM", "LadderLlamaModel"]
