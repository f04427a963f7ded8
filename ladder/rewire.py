"""Rewiring in memory: a ladder config from a Llama config, and a ladder model that shares a loaded
Llama's tensors. Both take resolved layers (an int N = the upper N, or a list of indices); text
such as "16-31" is parsed once, at the edge, by `ladder.layers.parse_ladder_layers`."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, PreTrainedModel

from ladder.layers import CONFIG_BOOKKEEPING, check_llama_model_type
from ladder.model.auto import LadderLlamaConfig, LadderLlamaForCausalLM


def ladder_config(config: LlamaConfig, ladder_layers: int | list[int]) -> LadderLlamaConfig:
    """A `LadderLlamaConfig` with the architecture of a Llama (or ladder) config and new ladder layers."""
    check_llama_model_type(config.model_type, "the config")
    values = {k: v for k, v in config.to_dict().items() if k not in CONFIG_BOOKKEEPING}
    return LadderLlamaConfig(**values, ladder_layers=ladder_layers)


def to_ladder(model: PreTrainedModel, ladder_layers: int | list[int]) -> LadderLlamaForCausalLM:
    """Rewire a loaded `LlamaForCausalLM` (or ladder model) in memory; the new model shares its tensors."""
    config = ladder_config(model.config, ladder_layers)
    config._attn_implementation = model.config._attn_implementation
    with torch.device("meta"):
        ladder_model = LadderLlamaForCausalLM(config)
    ladder_model.load_state_dict(model.state_dict(), strict=True, assign=True)
    # Non-persistent buffers (the rotary inv_freq) are not in the state dict: share them too.
    source_buffers = dict(model.named_buffers())
    for name, _ in list(ladder_model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        ladder_model.get_submodule(owner).register_buffer(leaf, source_buffers[name], persistent=False)
    ladder_model.tie_weights()
    ladder_model.generation_config = model.generation_config
    return ladder_model.train(model.training)


__all__ = ["ladder_config", "to_ladder"]
