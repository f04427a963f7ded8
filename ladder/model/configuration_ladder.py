"""Configurations of the supported families (Llama, Mistral, Qwen2, Qwen3) whose chosen layers use
Ladder Residual wiring (arXiv 2501.06589): each is the family's own transformers config plus
`ladder_layers`.

Depends only on transformers (and `config_rules.py`, which travels with it), so it can travel
inside a checkpoint (see `auto_map`).
"""

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from .config_rules import LADDER_MODEL_TYPES, resolve_ladder_layers, with_legacy_rope


class LadderConfigMixin:
    """Differs from the family's config: `ladder_layers`, the layers whose modules read the residual
    stream from before the previous module's output was added (none: the family's model), resolved
    to a sorted list; RoPE is also written the transformers 4.x way (`with_legacy_rope`)."""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.ladder_layers = resolve_ladder_layers(self.ladder_layers, self.num_hidden_layers)

    def to_dict(self) -> dict[str, Any]:
        return with_legacy_rope(super().to_dict())


# `ladder_layers` is typed `Any` so that resolve_ladder_layers raises ValueError with a clear message.
@strict
class LadderLlamaConfig(LadderConfigMixin, LlamaConfig):
    model_type = LADDER_MODEL_TYPES["llama"]  # the published ladder checkpoints' name
    ladder_layers: Any = None


@strict
class LadderMistralConfig(LadderConfigMixin, MistralConfig):
    model_type = LADDER_MODEL_TYPES["mistral"]
    ladder_layers: Any = None


@strict
class LadderQwen2Config(LadderConfigMixin, Qwen2Config):
    model_type = LADDER_MODEL_TYPES["qwen2"]
    ladder_layers: Any = None


@strict
class LadderQwen3Config(LadderConfigMixin, Qwen3Config):
    model_type = LADDER_MODEL_TYPES["qwen3"]
    ladder_layers: Any = None


__all__ = ["LadderLlamaConfig", "LadderMistralConfig", "LadderQwen2Config", "LadderQwen3Config"]
