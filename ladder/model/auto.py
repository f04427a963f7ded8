"""Registers the ladder models of every family with transformers' Auto classes: `import ladder.model.auto`
once, then `AutoModelForCausalLM.from_pretrained(dir)` loads a ladder checkpoint without remote code,
and `save_pretrained` writes `auto_map` plus the modeling files, so the checkpoint also loads
elsewhere with `trust_remote_code=True`.

Its own module so that `import ladder` (and `ladder --help`) stays free of torch and transformers;
touching a model class through `ladder` (`ladder.LadderLlamaForCausalLM`) imports this first."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import configuration_ladder, modeling_ladder
from .config_rules import CLASS_NAMES, family_of, ladder_architecture
from .configuration_ladder import LadderLlamaConfig  # noqa: F401  (ladder.LadderLlamaConfig, ladder/__init__.py)
from .modeling_ladder import LadderLlamaForCausalLM, LadderLlamaModel  # noqa: F401  (likewise)

# Family -> its ladder config, backbone and causal LM, by the family's class-name stem
# (ladder.model.config_rules: LADDER_MODEL_TYPES names the families, CLASS_NAMES their stems).
LADDER_CLASSES = {
    family: (
        getattr(configuration_ladder, f"Ladder{stem}Config"),
        getattr(modeling_ladder, f"Ladder{stem}Model"),
        getattr(modeling_ladder, ladder_architecture(family)),
    )
    for family, stem in CLASS_NAMES.items()
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
