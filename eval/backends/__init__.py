"""Backends: how a model becomes an lm-eval LM, found by name (`ladder eval --backend NAME`).

Each backend is a module with three functions:
- `check(runtime, models)`: refuse, before anything loads, what it cannot run or score;
- `load_lm(ref, runtime)`: the model as an lm-eval LM;
- `code_classes()`: the classes that run the weights besides the installed transformers class
  (`cache.model_class`), whose source is in the cache key.
A backend module is imported only when chosen: vLLM exists only in the serving environment, and
lm-eval and torch are slow to import (`ladder eval --help` stays fast).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ladder.errors import UsageError

# Name -> module: the one table of backends.
BACKENDS = {
    "hf": "ladder.eval.backends.hf",  # transformers in this process, with the shared-prefix scorer
    "vllm": "ladder.eval.backends.vllm",  # one vLLM engine per model (in .venv-serve)
}


def get_backend(name: str) -> ModuleType:
    """The backend module registered as `name`."""
    if name not in BACKENDS:
        raise UsageError(f"--backend {name!r}: choose {' or '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
