"""Ladder Residual for vLLM (arXiv 2501.06589): each family's ladder model is a small diff over vLLM's
own model of that family (vllm/model_executor/models/{llama,mistral,qwen2,qwen3}.py). The family's
model builds its decoder layers as they are (attention with its q/k norms, biases or sliding window,
MLP, fused add-RMSNorms, rotary embedding, paged attention), its embedding, final norm and weight
loader; the LM head and logits are vLLM's LlamaForCausalLM's, which every family computes alike.
Only the layer loop and the ladder layers differ, written once (`LadderModel`, `LadderForCausalLM`).
Standard layers are the family's, called unchanged: without ladder layers it is vLLM's model.

The layer loop, the ladder layer and its all-reduce ops live in `ladder.serving.ops` (torch alone, so
tests run them without vLLM); this module sets vLLM's tensor-parallel group, auxiliary stream and
forward context there (`ops.ENGINE`). Imported only where vLLM is installed; the plugin registers it.
"""

from itertools import islice

import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed import get_pp_group, get_tp_group
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel
from vllm.model_executor.models.mistral import MistralForCausalLM, MistralModel
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.sequence import IntermediateTensors
from vllm.utils.torch_utils import aux_stream, current_stream

from ladder.model.config_rules import resolve_ladder_layers
from ladder.serving import ops


def _may_span_attention() -> bool:
    """Whether vLLM runs this step as one full CUDA graph (`FULL`, or a uniform decode batch under
    `FULL_AND_PIECEWISE`), so a reduction forked before an attention can be joined after it."""
    return is_forward_context_available() and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL


ops.ENGINE = ops.Engine(get_tp_group, aux_stream, _may_span_attention, current_stream)


class LadderModel:
    """Goes before a family's vLLM model class: its layers, built as the family builds them, are
    marked, and the layer loop is `ops.layer_loop`. A ladder layer reads the stream from before the
    previous module's output was added, and reduces its row-parallel outputs itself. Pipeline
    parallelism is not supported (its hand-over carries two tensors)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **family_arguments) -> None:
        if get_pp_group().world_size > 1:
            raise ValueError(f"{type(self).__name__} does not support pipeline parallelism; use tensor parallelism")
        super().__init__(vllm_config=vllm_config, prefix=prefix, **family_arguments)
        config = vllm_config.model_config.hf_config
        ladder_layers = resolve_ladder_layers(config.ladder_layers, config.num_hidden_layers)
        tensor_parallel = get_tp_group().world_size > 1
        for index, layer in enumerate(self.layers):
            layer.is_ladder = index in ladder_layers
            # Overlap only where there is something to reduce. The MLP output's reduction overlaps the
            # next layer's attention, so only when that layer is a ladder one: a standard layer reads
            # the whole stream at once.
            layer.overlap_attention = layer.is_ladder and tensor_parallel
            layer.overlap_mlp = layer.overlap_attention and index + 1 in ladder_layers
            if layer.is_ladder:
                # The sum is added later than the family adds it, so the layer loop owns the all-reduce.
                layer.self_attn.o_proj.reduce_results = False
                layer.mlp.down_proj.reduce_results = False

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


class LadderForCausalLM(LlamaForCausalLM):
    """vLLM's `LlamaForCausalLM` around a family's model with the ladder layer loop (`family_model`,
    named where a family subclasses it: `LadderModel` goes first), with two compile settings."""

    backbone: type[torch.nn.Module]

    def __init_subclass__(cls, family_model: type[torch.nn.Module] | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if family_model is not None:  # (vLLM's adapters subclass a model class without it)
            cls.backbone = type(f"Ladder{family_model.__name__}", (LadderModel, family_model), {})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **family_arguments) -> None:
        # vLLM's all-reduce + RMSNorm fusion (GPU) matches the families' pattern, vLLM's all_reduce
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
        super().__init__(vllm_config=vllm_config, prefix=prefix, **family_arguments)

    def _init_model(self, vllm_config: VllmConfig, prefix: str = "", layer_type: object = None) -> torch.nn.Module:
        return self.backbone(vllm_config=vllm_config, prefix=prefix)  # with the family's own decoder layer


class LadderLlamaForCausalLM(LadderForCausalLM, family_model=LlamaModel): ...


class LadderMistralForCausalLM(LadderForCausalLM, MistralForCausalLM, family_model=MistralModel): ...  # its loader


class LadderQwen2ForCausalLM(LadderForCausalLM, family_model=Qwen2Model): ...


class LadderQwen3ForCausalLM(LadderForCausalLM, family_model=Qwen3Model): ...


__all__ = ["LadderLlamaForCausalLM", "LadderMistralForCausalLM", "LadderQwen2ForCausalLM", "LadderQwen3ForCausalLM"]
