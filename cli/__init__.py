"""`ladder <command> ...`: dispatches to each command, which owns its arguments."""

from __future__ import annotations

import importlib
import sys

from ladder.errors import run_command

STAGES = {
    "convert": ("ladder.convert.cli", "rewire a Llama, Mistral, Qwen2 or Qwen3 checkpoint into ladder form"),
    "adapt": ("ladder.adapt.cli", "retrain a ladder model from a YAML recipe"),
    "sample": ("ladder.adapt.sample", "sample text from a model to retrain on (self-distillation data)"),
    "eval": ("ladder.eval.cli", "score models side by side with lm-evaluation-harness"),
    "demo": ("ladder.cli.demo", "convert, retrain and evaluate the embedded SmolLM2 (make demo)"),
    "data": ("ladder.cli.data", "fetch the data folder from its public sources and verify it (make data)"),
    "serve": ("ladder.serving.server", "serve a checkpoint with vLLM's OpenAI-compatible server (make serve)"),
    "plan": ("ladder.cli.plan", "predict what ladder wiring buys under tensor parallelism, before converting"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        lines = ["usage: ladder <command> [options]", "", "commands:"]
        lines += [f"  {name:<8} {summary}" for name, (_, summary) in STAGES.items()]
        print("\n".join([*lines, "", "`ladder <command> --help` describes each command."]))
        return 0 if argv else 2
    if argv[0] == "--version":
        from ladder import __version__

        print(__version__)
        return 0
    if argv[0] not in STAGES:
        print(f"ladder: error: unknown command {argv[0]!r}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    command = importlib.import_module(STAGES[argv[0]][0])
    return run_command(argv[0], command.main, argv[1:])
