"""Ladder Residual for pretrained Llama checkpoints: the model, shared by convert/, adapt/, eval/.

Importing this package registers the ladder model with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(dir)` loads a ladder checkpoint without remote code, and
`save_pretrained` writes `auto_map` plus the modeling files so that it also loads elsewhere with
`trust_remote_code=True`.
"""

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from .configuration_ladder_llama import LadderLlamaConfig, resolve_ladder_layers
from .modeling_ladder_llama import LadderLlamaForCausalLM, LadderLlamaModel

__version__ = "0.1.0"

AutoConfig.register(LadderLlamaConfig.model_type, LadderLlamaConfig, exist_ok=True)
AutoModel.register(LadderLlamaConfig, LadderLlamaModel, exist_ok=True)
AutoModelForCausalLM.register(LadderLlamaConfig, LadderLlamaForCausalLM, exist_ok=True)
LadderLlamaConfig.register_for_auto_class()
LadderLlamaModel.register_for_auto_class("AutoModel")
LadderLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

# Keys of a Llama config.json that describe the file, not the model.
_CONFIG_BOOKKEEPING = ("model_type", "architectures", "auto_map", "transformers_version", "ladder_layers")


def parse_ladder_layers(spec: str | int | list[int], num_hidden_layers: int) -> list[int]:
    """Parse a command-line layer choice: `N` (upper N layers), a range `16-31`, or a list `3,5,7`."""
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "," in text:
                spec = [int(part) for part in text.split(",") if part.strip()]
            elif "-" in text.lstrip("-"):
                first, last = (int(part) for part in text.split("-"))
                if first > last:
                    raise ValueError(f"layer range {text!r} runs backwards")
                spec = list(range(first, last + 1))
            else:
                spec = int(text)
        except ValueError as error:
            if "backwards" in str(error):
                raise
            raise ValueError(
                f"ladder layers {spec!r} is not a number, a range like 16-31 or a list like 3,5,7"
            ) from None
    return resolve_ladder_layers(spec, num_hidden_layers)


def ladder_config(config: LlamaConfig, ladder_layers: str | int | list[int]) -> LadderLlamaConfig:
    """A `LadderLlamaConfig` with the architecture of a Llama (or ladder) config and new ladder layers."""
    if config.model_type not in ("llama", LadderLlamaConfig.model_type):
        raise ValueError(
            f"model_type {config.model_type!r} is not supported: expected 'llama' or '{LadderLlamaConfig.model_type}'"
        )
    values = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_BOOKKEEPING}
    layers = parse_ladder_layers(ladder_layers, config.num_hidden_layers)
    return LadderLlamaConfig(**values, ladder_layers=layers)


def to_ladder(model: PreTrainedModel, ladder_layers: str | int | list[int]) -> LadderLlamaForCausalLM:
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


__all__ = [
    "LadderLlamaConfig",
    "LadderLlamaForCausalLM",
    "LadderLlamaModel",
    "ladder_config",
    "parse_ladder_layers",
    "resolve_ladder_layers",
    "to_ladder",
]
