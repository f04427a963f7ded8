"""vLLM's environment (.venv-serve, another transformers version than the tests' own) as the tests
reach it: its python, the session's offline environment for it, and `ladder` run from it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SERVE_ENV = Path(__file__).resolve().parents[1] / ".venv-serve"
SERVE_PYTHON = SERVE_ENV / "bin" / "python"


def serve_python() -> Path:
    if not SERVE_PYTHON.is_file():
        pytest.fail(f"the serving environment {SERVE_ENV} is missing: run `make serve-env` (make test builds it)")
    return SERVE_PYTHON


def serve_env_vars() -> dict[str, str]:
    """The test session's environment (offline, private HF cache) for a subprocess in .venv-serve,
    with vLLM's compile cache in the session's private cache too: every engine compiles there."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    env["VLLM_CACHE_ROOT"] = str(Path(os.environ["HF_HOME"]) / "vllm")
    env.pop("VIRTUAL_ENV", None)
    return env


def serve_ladder(*arguments: object, timeout: int = 300) -> subprocess.CompletedProcess:
    """`ladder ARGUMENTS` run from .venv-serve, its output captured."""
    command = [str(SERVE_ENV / "bin" / "ladder"), *map(str, arguments)]
    return subprocess.run(command, env=serve_env_vars(), capture_output=True, text=True, timeout=timeout)
