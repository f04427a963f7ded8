"""Scoring speed of `ladder eval` against the stock `lm_eval` command line, in one run.

Both score the same task (default: the first 100 PIQA items, our offline copy of the stock task)
on the same model (the embedded SmolLM2-135M-Instruct, saved once as a plain transformers
checkpoint so that both load the same files the same way), on the CPU in float32 with the same
batch size, each as its own command as a user would type it, `ladder eval` without its cache.
The sides alternate (ladder, lm_eval, ladder, ...) so that a change in the machine's load hits
both. Prints each side's median wall time and items/s, and the ratio ladder / lm_eval (goal: at
least 0.95), and checks that both gave the same accuracy.

    .venv/bin/python -m benchmarks.eval_speed [--task ladder_piqa] [--limit 100] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def save_checkpoint(directory: Path) -> None:
    from ladder.io.loading import load_model

    model, tokenizer = load_model("embedded")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def ladder_command(model: Path, task: str, limit: int, batch: int, out: Path) -> list[str]:
    suite = out.parent / f"{out.name}.yaml"
    suite.write_text(json.dumps({"offline": True, "tasks": [{"task": task, "limit": limit}]}))
    return [
        str(BIN / "ladder"),
        "eval",
        str(model),
        "--suite",
        str(suite),
        "--no-cache",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--batch-size",
        str(batch),
        "--out",
        str(out),
    ]


def stock_command(model: Path, task: str, limit: int, batch: int, out: Path) -> list[str]:
    return [
        str(BIN / "lm_eval"),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model},dtype=float32",
        "--tasks",
        task,
        "--include_path",
        str(REPO / "eval" / "tasks"),
        "--limit",
        str(limit),
        "--device",
        "cpu",
        "--batch_size",
        str(batch),
        "--output_path",
        str(out),
    ]


def accuracy(out: Path, task: str) -> float:
    result = next(out.rglob("results_*.json"), None) or next(p for p in out.glob("*.json") if p.name != "report.json")
    return json.loads(result.read_text())["results"][task]["acc,none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="ladder_piqa", help="an offline task of eval/tasks (default ladder_piqa)")
    parser.add_argument("--limit", type=int, default=100, help="items scored (default 100)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating (default 2)")
    args = parser.parse_args()

    from ladder.io.files import ladder_data_dir

    environment = {
        **os.environ,
        "LADDER_DATA": str(ladder_data_dir()),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    times: dict[str, list[float]] = {"ladder eval": [], "lm_eval": []}
    accuracies: dict[str, set[float]] = {"ladder eval": set(), "lm_eval": set()}
    with tempfile.TemporaryDirectory(prefix="eval-speed-") as scratch:
        root = Path(scratch)
        save_checkpoint(root / "model")
        for round_ in range(args.rounds):
            for side, build in (("ladder eval", ladder_command), ("lm_eval", stock_command)):
                out = root / f"{side.replace(' ', '_')}-{round_}"
                command = build(root / "model", args.task, args.limit, args.batch_size, out)
                started = time.monotonic()
                completed = subprocess.run(command, env=environment, capture_output=True, text=True)
                seconds = time.monotonic() - started
                if completed.returncode != 0:
                    sys.exit(f"{side} failed:\n{completed.stderr[-3000:]}")
                times[side].append(seconds)
                accuracies[side].add(accuracy(out, args.task))
                print(f"round {round_ + 1}: {side:<11} {seconds:6.1f} s", flush=True)

    print(
        f"\n{args.task}, {args.limit} items, SmolLM2-135M-Instruct fp32 on CPU, batch {args.batch_size}, "
        f"median of {args.rounds} (wall time of the whole command: start-up, loading, scoring)"
    )
    rates = {}
    for side, seconds in times.items():
        rates[side] = args.limit / statistics.median(seconds)
        print(
            f"{side:<11} {statistics.median(seconds):6.1f} s  {rates[side]:6.2f} items/s  acc {sorted(accuracies[side])}"
        )
    print(f"ratio ladder eval / lm_eval: {rates['ladder eval'] / rates['lm_eval']:.2f}x (goal >= 0.95)")
    if accuracies["ladder eval"] != accuracies["lm_eval"]:
        sys.exit("the two sides disagree on the accuracy")


if __name__ == "__main__":
    main()
