"""Ladder Residual for pretrained Llama, Mistral, Qwen2 and Qwen3 checkpoints: the model (`ladder/`),
shared by the stages installed beside it as `ladder.convert`, `ladder.adapt` and `ladder.eval`.

`import ladder` is light (no torch): the model classes and the rewiring functions load on first
use, and with them the registration with transformers' Auto classes (`ladder.model.auto`).
"""

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it; loaded on first access (PEP 562).
_LAZY = {
    "LadderLlamaConfig": "ladder.model.auto",
    "LadderLlamaForCausalLM": "ladder.model.auto",
    "LadderLlamaModel": "ladder.model.auto",
    "ladder_config": "ladder.rewire",
    "to_ladder": "ladder.rewire",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ladder' has no attribute {name!r}")


__all__ = [*_LAZY, "__version__"]
