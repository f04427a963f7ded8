"""The ladder layer loop of the vLLM model (ladder/serving/model.py) and its all-reduce ops, with torch
alone: vLLM's tensor-parallel group, auxiliary stream and forward context come in through `Engine`,
which the model sets, so tests run the code vLLM runs without vLLM (docs/serving.md, The model).

The residual stream is carried as vLLM carries it (hidden_states + residual, added in the next fused
add-RMSNorm) plus the attention output of the last ladder layer, not in the stream yet:
attn_stream = residual + pending_attention, mlp_stream = attn_stream + hidden_states. A ladder
layer's o_proj and down_proj do not reduce; the layer reduces each output right after its module and
adds the sum where the wiring needs it (Algorithm 1 of arXiv 2501.06589).

The reductions are opaque custom ops, which also fence torch.compile: torch 2.13's inductor fused a
pointwise read of a buffer that a mutating op fills (vLLM's CPU linears write through
`_C.onednn_mm(out, ...)`) into a kernel before the write. vLLM's own models read each output at once; the
ladder reads one a module later and served garbage at TP=1, where vLLM's all-reduce is a no-op. An
extern op is neither fused nor moved, and its output is a buffer of its own.

At TP > 1 on CUDA, `all_reduce_start` runs the reduction on the auxiliary stream and `all_reduce_wait`
joins it after the module it overlaps, unseen by torch.compile. Only data flow orders them under
inductor, so the wait takes the start's input and output and the overlapped module's output, and each
reduction takes the previous one's result (`after`); docs/serving.md (The model) says why each. On
CPU start is the group's synchronous all-reduce and wait a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.library import Library


class SingleRank:
    """The tensor-parallel group of one rank, as vLLM's GroupCoordinator answers the ops."""

    world_size = 1

    def _all_reduce_out_place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@dataclass
class Engine:
    """What the ops ask of the serving engine: its tensor-parallel group (`world_size` and
    `_all_reduce_out_place`, as vLLM's GroupCoordinator), its auxiliary CUDA stream (None: no
    overlap), whether this step runs as one full CUDA graph, and the compute stream."""

    group: Callable[[], Any] = SingleRank
    aux_stream: Callable[[], torch.cuda.Stream | None] = lambda: None
    may_span_attention: Callable[[], bool] = lambda: False
    current_stream: Callable[[], torch.cuda.Stream] = torch.cuda.current_stream


ENGINE = Engine()  # read at run time: ladder.serving.model sets vLLM's, tests their own


# The one ladder reduction that may be in flight on the auxiliary stream (each reduction op waits for
# the previous one's result): whether there is one, and its CUDA events (input ready, reduction
# done), made on first use.
_AUX_REDUCTION: dict = {"in_flight": False, "events": None}


def _start_on_aux_stream(tensor: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    assert not _AUX_REDUCTION["in_flight"], "a ladder all-reduce started before the previous one was joined"
    if _AUX_REDUCTION["events"] is None:
        _AUX_REDUCTION["events"] = (torch.cuda.Event(), torch.cuda.Event())
    ready, done = _AUX_REDUCTION["events"]
    ready.record(ENGINE.current_stream())
    with torch.cuda.stream(stream):
        ready.wait(stream)
        reduced = ENGINE.group()._all_reduce_out_place(tensor)
        done.record(stream)
    # No record_stream (issue 42 item 4): the wait takes both buffers, so neither is freed before the
    # join, and after it the compute stream follows the reduction; the auxiliary stream allocates
    # (`reduced`) only after it waited for the compute stream. During CUDA-graph capture the caching
    # allocator defers the frees of blocks marked by record_stream to the capture's end, which kept
    # every layer's reduction buffers in the graph's pool.
    _AUX_REDUCTION["in_flight"] = True
    return reduced


def _join_aux_stream() -> None:
    if _AUX_REDUCTION["in_flight"]:
        _AUX_REDUCTION["events"][1].wait(ENGINE.current_stream())
        _AUX_REDUCTION["in_flight"] = False


def _all_reduce(tensor: torch.Tensor, after: torch.Tensor | None) -> torch.Tensor:
    # A custom op may neither change an input it does not declare nor return it (inductor reuses
    # the input's buffer once the op has read it): at TP=1 the fence costs one copy of the output,
    # and vLLM's CPU communicator, which reduces in place and returns its input, gets a copy.
    group = ENGINE.group()
    if group.world_size == 1:
        return tensor.clone()
    return group._all_reduce_out_place(tensor.clone() if tensor.is_cpu else tensor)


def _all_reduce_start(tensor: torch.Tensor, after: torch.Tensor | None, spans_attention: bool) -> torch.Tensor:
    stream = ENGINE.aux_stream()
    # A reduction spans an attention only within one full CUDA graph: piecewise graphs split at attention.
    if stream is None or (spans_attention and not ENGINE.may_span_attention()):
        return _all_reduce(tensor, after)
    return _start_on_aux_stream(tensor, stream)


def _all_reduce_wait(reduced: torch.Tensor, tensor: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    _join_aux_stream()
    return reduced.clone()  # its own buffer (see _all_reduce)


def _fence(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone()


def _like(tensor: torch.Tensor, *dependencies: object, **named: object) -> torch.Tensor:
    return torch.empty_like(tensor)


# Registered as vLLM's direct_register_custom_op registers its own: a schema from the signature, the
# body, a fake implementation for tracing.
_LIBRARY = Library("ladder", "FRAGMENT")
for _name, _op in [
    ("all_reduce", _all_reduce),
    ("all_reduce_start", _all_reduce_start),
    ("all_reduce_wait", _all_reduce_wait),
    # For a standard layer's MLP output that the next (ladder) layer reads after its attention.
    ("fence", _fence),
]:
    _LIBRARY.define(_name + torch.library.infer_schema(_op, mutates_args=()))
    _LIBRARY.impl(_name, _op, "CompositeExplicitAutograd")
    torch.library.register_fake(f"ladder::{_name}", _like, lib=_LIBRARY)


class InFlight(NamedTuple):
    """A reduction started and not yet joined, the one handle of both tensor-parallel runtimes:
    `wait()` returns the sum. Here `work` is torch.distributed's handle (ladder.tp.runtime); without
    one it is a ladder op's start, joined by `all_reduce_wait` after `after`, the output of the
    module the reduction overlaps (the vLLM model)."""

    reduced: torch.Tensor  # the sum, once joined
    partial: torch.Tensor  # the reduction's input: it must outlive the reduction, so the wait takes it too
    work: Any = None  # torch.distributed.Work

    @classmethod
    def start(cls, partial: torch.Tensor, after: torch.Tensor | None, spans_attention: bool = False) -> InFlight:
        return cls(torch.ops.ladder.all_reduce_start(partial, after, spans_attention), partial)

    def wait(self, after: torch.Tensor | None = None) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            return self.reduced
        return torch.ops.ladder.all_reduce_wait(self.reduced, self.partial, after)


def ladder_forward(
    layer: torch.nn.Module,
    positions: torch.Tensor,
    hidden_states: torch.Tensor | InFlight,
    residual: torch.Tensor | None,
    pending_attention: torch.Tensor | None,
) -> tuple[torch.Tensor | InFlight, torch.Tensor, torch.Tensor]:
    """A ladder layer (a family's vLLM decoder layer: fused add-RMSNorms, `self_attn`, `mlp`, whose
    outputs are unreduced): (hidden_states, residual, pending_attention) in, the same out (see the
    module doc).
    hidden_states, the previous MLP's output, is `InFlight` where its reduction overlaps this
    layer's attention; this layer's is where the next layer is a ladder one too (`overlap_mlp`)."""
    if residual is None:  # first layer: both streams are the embeddings
        residual, hidden_states = hidden_states, None
    # Attention reads attn_stream = residual + pending_attention (the previous MLP output is not in it).
    if pending_attention is None:
        attention_input = layer.input_layernorm(residual)
    else:
        attention_input, residual = layer.input_layernorm(pending_attention, residual)
    attention_partial = layer.self_attn(positions=positions, hidden_states=attention_input)
    if isinstance(hidden_states, InFlight):
        hidden_states = hidden_states.wait(after=attention_partial)
    # This layer's reductions follow the last one (`after`; see the ops): the previous MLP's,
    # or at the first layer the embeddings' (vLLM's vocabulary-parallel embedding reduces them).
    previous_sum = residual if hidden_states is None else hidden_states
    if layer.overlap_attention:  # reduced while the MLP computes
        attention = InFlight.start(attention_partial, after=previous_sum)
    else:
        attention_output = torch.ops.ladder.all_reduce(attention_partial, previous_sum)
    # The MLP reads mlp_stream = attn_stream + previous MLP output (this attention output is not in it).
    if hidden_states is None:
        mlp_input = layer.post_attention_layernorm(residual)
    else:
        mlp_input, residual = layer.post_attention_layernorm(hidden_states, residual)
    mlp_partial = layer.mlp(mlp_input)
    if layer.overlap_attention:
        attention_output = attention.wait(after=mlp_partial)
    if layer.overlap_mlp:  # reduced while the next layer's attention computes, in a full CUDA graph
        return InFlight.start(mlp_partial, after=attention_output, spans_attention=True), residual, attention_output
    return torch.ops.ladder.all_reduce(mlp_partial, attention_output), residual, attention_output


def layer_loop(
    layers: Iterable[torch.nn.Module], positions: torch.Tensor, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers of a family's vLLM model forward with ladder layers among them (`is_ladder`:
    `ladder_forward`; else the family's layer as is): the embeddings in, (hidden_states, residual) out,
    for the final fused add-RMSNorm."""
    residual = pending_attention = None
    fenced = True  # hidden_states came through a ladder op, or from no linear (the embeddings)
    for layer in layers:
        if layer.is_ladder:
            if not fenced:  # a standard layer's MLP output, read after this layer's attention
                hidden_states = torch.ops.ladder.fence(hidden_states)
            hidden_states, residual, pending_attention = ladder_forward(
                layer, positions, hidden_states, residual, pending_attention
            )
        else:
            if pending_attention is not None:  # a standard layer reads the whole stream
                residual, pending_attention = residual + pending_attention, None
            hidden_states, residual = layer(positions, hidden_states, residual)
        fenced = layer.is_ladder
    if pending_attention is not None:
        residual = residual + pending_attention
    return hidden_states, residual


__all__ = ["ENGINE", "Engine", "InFlight", "SingleRank", "ladder_forward", "layer_loop"]
