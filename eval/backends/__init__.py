"""Backends: how a model becomes an lm-eval LM (`ladder eval --backend NAME`). Each is a module with
`check(runtime, models)` (refuse, before anything loads, what it cannot run), `load_lm(ref, runtime)`
and `code_classes()` (what runs the weights besides the transformers class: in the cache key),
imported only when chosen (vLLM exists only in the serving environment).
"""

from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = {
    "hf": "ladder.eval.backends.hf",  # transformers in this process, with the shared-prefix scorer
    "vllm": "ladder.eval.backends.vllm",  # one vLLM engine per model (in .venv-serve)
}


def get_backend(name: str) -> ModuleType:
    """A name of BACKENDS (`--backend`'s choices)."""
    return importlib.import_module(BACKENDS[name])
