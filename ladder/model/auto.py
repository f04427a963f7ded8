"""Registers the ladder models of every family with transformers' Auto classes: `import ladder.model.auto`
once, then `AutoModelForCausalLM.from_pretrained(dir)` loads a ladder checkpoint without remote code,
and `save_pretrained` writes `auto_map` plus the modeling files, so the checkpoint also loads
elsewhere with `trust_remote_code=True`.

Its own module so that `import ladder` (and `ladder --help`) stays free of torch and transformers;
touching a model class through `ladder` (`ladder.LadderLlamaForCausalLM`) imports this first."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config_rules import family_of
from .configuration_ladder import LadderLlamaConfig, LadderMistralConfig, LadderQwen2Config, LadderQwen3Config
from .modeling_ladder import (
    LadderLlamaForCausalLM,
    LadderLlamaModel,
    LadderMistralForCausalLM,
    LadderMistralModel,
    LadderQwen2ForCausalLM,
    LadderQwen2Model,
    LadderQwen3ForCausalLM,
    LadderQwen3Model,
)

# Family -> its ladder config, backbone and causal LM (ladder.model.config_rules.LADDER_MODEL_TYPES names the families).
LADDER_CLASSES = {
    "llama": (LadderLlamaConfig, LadderLlamaModel, LadderLlamaForCausalLM),
    "mistral": (LadderMistralConfig, LadderMistralModel, LadderMistralForCausalLM),
    "qwen2": (LadderQwen2Config, LadderQwen2Model, LadderQwen2ForCausalLM),
    "qwen3": (LadderQwen3Config, LadderQwen3Model, LadderQwen3ForCausalLM),
}

for config_class, model_class, causal_lm_class in LADDER_CLASSES.values():
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)
    config_class.register_for_auto_class()
    model_class.register_for_auto_class("AutoModel")
    causal_lm_class.register_for_auto_class("AutoModelForCausalLM")


def ladder_causal_lm(config) -> type:
    """The ladder causal LM class (`LadderQwen3ForCausalLM`, ...) of a config's family, plain or ladder."""
    return LADDER_CLASSES[family_of(config.model_type)][2]
