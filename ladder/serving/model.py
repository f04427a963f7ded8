"""Ladder Residual Llama for vLLM (arXiv 2501.06589), on vLLM's own Llama parts.

A small diff over vLLM's `LlamaForCausalLM` (vllm/model_executor/models/llama.py): the same
column/row-parallel linears (stacked q/k/v and gate/up), vocab-parallel embedding and LM head,
paged attention with its KV cache, rotary embedding and weight loader. Only the layer loop and
the ladder layers differ; standard layers are vLLM's `LlamaDecoderLayer`, called unchanged, so a
checkpoint without ladder layers computes exactly vLLM's Llama.

The layer loop, the ladder layer and its all-reduce ops live in `ladder.serving.ops` (torch
alone, so tests run them without vLLM); this module builds vLLM's modules around them and
sets vLLM's tensor-parallel group, auxiliary stream and forward context there (`ops.ENGINE`).
`ladder/tp/runtime.py` is this package's own runtime, which overlaps both reductions (gloo or
NCCL, asynchronously).

Imported only inside the serving environment (vLLM installed); `ladder.serving.plugin` registers it.
"""

from itertools import islice

import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed import get_pp_group, get_tp_group
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.utils import extract_layer_index
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import aux_stream, current_stream

from ladder.model.configuration_ladder_llama import resolve_ladder_layers
from ladder.serving import ops


def _may_span_attention() -> bool:
    """Whether vLLM runs this step as one full CUDA graph (`FULL`, or a uniform decode batch under
    `FULL_AND_PIECEWISE`), so a reduction forked before an attention can be joined after it."""
    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL


ops.ENGINE = ops.Engine(get_tp_group, aux_stream, _may_span_attention, current_stream)


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

    ladder_forward = ops.ladder_forward


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
        layers = islice(self.layers, self.start_layer, self.end_layer)
        hidden_states, residual = ops.layer_loop(layers, positions, hidden_states)
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
