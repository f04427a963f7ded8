"""Configuration of a Llama whose chosen layers use Ladder Residual wiring (arXiv 2501.06589).

Depends only on transformers (and `config_rules.py`, which travels with it), so it can travel
inside a checkpoint (see `auto_map`).
"""

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from .config_rules import resolve_ladder_layers, with_legacy_rope


@strict
class LadderLlamaConfig(LlamaConfig):
    """A `LlamaConfig` plus `ladder_layers`, the layers whose modules read the residual stream
    from before the previous module's output was added. With no ladder layers it is Llama."""

    # The model_type of the published ladder checkpoints, so their config.json loads as is.
    model_type = "llamaLadder"

    # Typed `Any` so that our own check below raises ValueError with a clear message.
    ladder_layers: Any = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.ladder_layers = resolve_ladder_layers(self.ladder_layers, self.num_hidden_layers)

    def to_dict(self) -> dict[str, Any]:
        """Differs from Llama: RoPE is also written the transformers 4.x way (`with_legacy_rope`)."""
        return with_legacy_rope(super().to_dict())


__all__ = ["LadderLlamaConfig", "resolve_ladder_layers"]
