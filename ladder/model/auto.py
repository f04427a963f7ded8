"""Registers the ladder model with transformers' Auto classes: `import ladder.model.auto` once, then
`AutoModelForCausalLM.from_pretrained(dir)` loads a ladder checkpoint without remote code, and
`save_pretrained` writes `auto_map` plus the modeling files, so the checkpoint also loads elsewhere
with `trust_remote_code=True`.

Its own module so that `import ladder` (and `ladder --help`) stays free of torch and transformers;
touching a model class through `ladder` (`ladder.LadderLlamaForCausalLM`) imports this first."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_ladder_llama import LadderLlamaConfig
from .modeling_ladder_llama import LadderLlamaForCausalLM, LadderLlamaModel

AutoConfig.register(LadderLlamaConfig.model_type, LadderLlamaConfig, exist_ok=True)
AutoModel.register(LadderLlamaConfig, LadderLlamaModel, exist_ok=True)
AutoModelForCausalLM.register(LadderLlamaConfig, LadderLlamaForCausalLM, exist_ok=True)
LadderLlamaConfig.register_for_auto_class()
LadderLlamaModel.register_for_auto_class("AutoModel")
LadderLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["LadderLlamaConfig", "LadderLlamaForCausalLM", "LadderLlamaModel"]
