"""Rewiring in memory: a ladder config from a family's config, and a ladder model that shares a loaded
model's tensors, for resolved layers (an int N = the upper N, or a list of indices)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ladder.layers import CONFIG_BOOKKEEPING, check_model_type
from ladder.model.auto import LADDER_CLASSES, ladder_causal_lm


def ladder_config(config: PretrainedConfig, ladder_layers: int | list[int]) -> PretrainedConfig:
    """The family's ladder config (`LadderQwen3Config`, ...) with the architecture of a supported
    config (plain or ladder) and new ladder layers."""
    config_class = LADDER_CLASSES[check_model_type(config.model_type, "the config")][0]
    values = {k: v for k, v in config.to_dict().items() if k not in CONFIG_BOOKKEEPING}
    return config_class(**values, ladder_layers=ladder_layers)


def to_ladder(model: PreTrainedModel, ladder_layers: int | list[int]) -> PreTrainedModel:
    """Rewire a loaded causal LM of a supported family (or a ladder model) in memory; the new model
    (`LadderQwen3ForCausalLM`, ...) shares its tensors."""
    config = ladder_config(model.config, ladder_layers)
    config._attn_implementation = model.config._attn_implementation
    with torch.device("meta"):
        ladder_model = ladder_causal_lm(config)(config)
    ladder_model.load_state_dict(model.state_dict(), strict=True, assign=True)
    # Non-persistent buffers (the rotary inv_freq) are not in the state dict: share them too.
    source_buffers = dict(model.named_buffers())
    for name, _ in list(ladder_model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        ladder_model.get_submodule(owner).register_buffer(leaf, source_buffers[name], persistent=False)
    ladder_model.tie_weights()
    ladder_model.generation_config = model.generation_config
    return ladder_model.train(model.training)
