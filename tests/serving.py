"""vLLM's environment (.venv-serve, another transformers version than the tests' own) as the tests
reach it: its python, the session's offline environment for it, and `ladder` run from it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

SERVE_ENV = Path(__file__).resolve().parents[1] / ".venv-serve"
SERVE_PYTHON = SERVE_ENV / "bin" / "python"

# The session's greedy job (conftest's vllm_greedy): its prompts, the tokens each engine generates,
# and the ladder layers of its tiny model (of 4: ladder first, ladder -> standard, standard ->
# ladder, ladder -> ladder, ladder last).
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: What is 12 times 7?\nAnswer:",
]
NEW_TOKENS = 32
TINY_LAYERS = 4
TINY_LADDER_LAYERS = [0, 2, 3]


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


class ServeJob:
    """A command of .venv-serve started at once, with the session's environment; its output goes to
    work/output.log. `wait()` gives its exit status and output."""

    def __init__(self, command: list[object], work: Path, timeout: int = 1200):
        self.work, self.deadline = work, time.monotonic() + timeout
        with open(work / "output.log", "w") as log:
            self.process = subprocess.Popen(
                list(map(str, command)),
                env=serve_env_vars(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self) -> tuple[int, str]:
        try:
            returncode = self.process.wait(timeout=max(self.deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return returncode, (self.work / "output.log").read_text()

    def stop(self) -> None:
        if self.process.poll() is None:  # the session ended first: the command and its engines' processes
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class VLLMJob(ServeJob):
    """tests/vllm_runner.py on `runs` (one engine each, one after another in one subprocess of
    .venv-serve), with the job's other keys (`in_process`); its files go in `work`. `result()` waits
    for it."""

    def __init__(self, runs: list[dict], work: Path, **job: object):
        (work / "job.json").write_text(json.dumps({"runs": runs, **job}))
        runner = Path(__file__).with_name("vllm_runner.py")
        super().__init__([serve_python(), runner, work / "job.json", work / "result.json"], work)

    def result(self) -> dict:
        returncode, output = self.wait()
        assert returncode == 0, output[-8000:]
        return json.loads((self.work / "result.json").read_text())
