"""Scoring speed of `ladder eval` against lm-eval's, in one run; the sides alternate round by round so
that a change in the machine's load hits both. The model: the embedded SmolLM2-135M-Instruct, float32,
on the CPU, the same batch size on both sides.

- requests (default): for each task of a suite lm-eval builds the requests once, and its `HFLM` and
  `ladder eval`'s shared-context scoring (eval/backends/shared_prefix.py) score them. Per task: the
  median seconds of each, the speed-up, the largest log-likelihood difference and whether every greedy
  flag agrees; exits 1 when they disagree beyond MAX_DIFFERENCE. Rolling log-likelihoods (WikiText)
  take lm-eval's path on both sides and are not timed.
- `--whole-command`: `ladder eval --no-cache` against the stock `lm_eval` command line on one task's
  first `--limit` items of the same saved checkpoint, each its own process: wall time, items/s, the
  ratio (goal >= 0.95); exits 1 when the accuracies differ.

    .venv/bin/python -m benchmarks.scoring_speed [--suite demo] [--batch-size 8] [--rounds 2]
    .venv/bin/python -m benchmarks.scoring_speed --whole-command [--task ladder_piqa] [--limit 100]
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

import torch

from benchmarks.common import REPOSITORY, run_benchmark
from ladder.errors import ArgumentParser
from ladder.io.loading import load_model

MAX_DIFFERENCE = 1e-3  # nats; float32 rounding between the two paths measured 1.1e-4 at most


def requests_of(suite_name: str) -> dict[str, list]:
    """{leaf task: its log-likelihood requests (lm-eval Instances)} for the suite's items."""
    from ladder.eval.lm_tasks import task_manager
    from ladder.eval.suite import load_suite

    suite = load_suite(suite_name)
    requests = {}
    for suite_task in suite.tasks:
        for name, task in task_manager(suite).load([suite_task.task])["tasks"].items():
            task.build_all_requests(samples=list(range(0, len(task.eval_docs), suite_task.every))[: suite_task.limit])
            if chosen := [instance for instance in task.instances if instance.request_type == "loglikelihood"]:
                requests[name] = chosen
    return requests


def score_requests(args: argparse.Namespace) -> int:
    from lm_eval.models.huggingface import HFLM

    from ladder.eval.backends.hf import LoadedHFLM
    from ladder.eval.lm_tasks import hub_offline
    from ladder.eval.runtime import Runtime

    with tempfile.TemporaryDirectory(prefix="scoring-speed-") as scratch, hub_offline(Path(scratch)):
        tasks = requests_of(args.suite)
    model, tokenizer = load_model("embedded", dtype=torch.float32)
    sides = {
        "lm-eval HFLM": HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size),
        "ladder eval": LoadedHFLM(model, tokenizer, Runtime("cpu", "float32", args.batch_size)),
    }
    print(f"suite {args.suite}, {torch.get_num_threads()} threads, batch {args.batch_size}, {args.rounds} rounds\n")
    print(f"{'task':<22} {'requests':>8} {'HFLM s':>8} {'ours s':>8} {'speed-up':>8} {'max |dlogp|':>11}  greedy")
    for lm in sides.values():  # first calls pay one-time costs (thread pools, allocations): untimed
        lm.loglikelihood(next(iter(tasks.values()))[:16], disable_tqdm=True)
    medians, differing = [], []  # per task: (HFLM, ours)
    for name, instances in tasks.items():
        times, answers = {side: [] for side in sides}, {}
        for _ in range(args.rounds):
            for side, lm in sides.items():
                started = time.perf_counter()
                answers[side] = lm.loglikelihood(instances, disable_tqdm=True)
                times[side].append(time.perf_counter() - started)
        medians.append([statistics.median(seconds) for seconds in times.values()])
        stock, ours = medians[-1]
        reference, shared = answers.values()
        difference = max(abs(a[0] - b[0]) for a, b in zip(reference, shared))
        greedy = "same" if all(a[1] == b[1] for a, b in zip(reference, shared)) else "DIFFERENT"
        if greedy != "same" or difference > MAX_DIFFERENCE:
            differing.append(name)
        row = f"{stock:>8.1f} {ours:>8.1f} {stock / ours:>7.2f}x {difference:>11.2e}  {greedy}"
        print(f"{name:<22} {len(instances):>8} {row}")
    stock, ours = map(sum, zip(*medians))
    print(f"{'all':<22} {'':>8} {stock:>8.1f} {ours:>8.1f} {stock / ours:>7.2f}x")
    if differing:
        print(f"scoring_speed: ladder eval's scores differ from HFLM's on {', '.join(differing)}", file=sys.stderr)
    return 1 if differing else 0


def whole_commands(args: argparse.Namespace) -> int:
    from ladder.io.files import ladder_data_dir

    offline = dict.fromkeys(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"), "1")
    environment = {**os.environ, **offline, "LADDER_DATA": str(ladder_data_dir())}
    times: dict[str, list[float]] = {"ladder eval": [], "lm_eval": []}
    accuracies: dict[str, set[float]] = {side: set() for side in times}
    with tempfile.TemporaryDirectory(prefix="scoring-speed-") as scratch:
        root, bin_, batch = Path(scratch), Path(sys.executable).parent, str(args.batch_size)
        model_dir = root / "model"
        for part in load_model("embedded"):
            part.save_pretrained(model_dir)
        suite = root / "suite.yaml"
        suite.write_text(json.dumps({"offline": True, "tasks": [{"task": args.task, "limit": args.limit}]}))
        for round_ in range(args.rounds):
            out = {side: root / f"{side.replace(' ', '_')}-{round_}" for side in times}
            commands = {
                "ladder eval": [bin_ / "ladder", "eval", model_dir, "--suite", suite, "--no-cache", "--device", "cpu"]
                + ["--dtype", "float32", "--batch-size", batch, "--out", out["ladder eval"]],
                "lm_eval": [bin_ / "lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32"]
                + ["--tasks", args.task, "--include_path", REPOSITORY / "eval" / "tasks", "--limit", str(args.limit)]
                + ["--device", "cpu", "--batch_size", batch, "--output_path", out["lm_eval"]],
            }
            for side, command in commands.items():
                started = time.monotonic()
                completed = subprocess.run(list(map(str, command)), env=environment, capture_output=True, text=True)
                times[side].append(time.monotonic() - started)
                if completed.returncode != 0:
                    sys.exit(f"{side} failed:\n{completed.stderr[-3000:]}")
                result = next(out[side].rglob("results_*.json"), None) or next(
                    p for p in out[side].glob("*.json") if p.name != "report.json"
                )
                accuracies[side].add(json.loads(result.read_text())["results"][args.task]["acc,none"])
                print(f"round {round_ + 1}: {side:<11} {times[side][-1]:6.1f} s", flush=True)
    print(
        f"\n{args.task}, {args.limit} items, batch {args.batch_size}, median of {args.rounds} (wall time of the command)"
    )
    rates = {side: args.limit / statistics.median(seconds) for side, seconds in times.items()}
    for side, seconds in times.items():
        print(
            f"{side:<11} {statistics.median(seconds):6.1f} s  {rates[side]:6.2f} items/s  acc {sorted(accuracies[side])}"
        )
    print(f"ratio ladder eval / lm_eval: {rates['ladder eval'] / rates['lm_eval']:.2f}x (goal >= 0.95)")
    if accuracies["ladder eval"] != accuracies["lm_eval"]:
        print("scoring_speed: the two sides disagree on the accuracy", file=sys.stderr)
        return 1
    return 0


def measure(argv: list[str]) -> int:
    parser = ArgumentParser(prog="benchmarks.scoring_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="demo", help="a shipped suite or a suite YAML (default demo)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating (default 2)")
    parser.add_argument("--whole-command", action="store_true", help="time `ladder eval` against `lm_eval`")
    parser.add_argument("--task", default="ladder_piqa", help="--whole-command's offline task of eval/tasks")
    parser.add_argument("--limit", type=int, default=100, help="--whole-command's items (default 100)")
    args = parser.parse_args(argv)
    return whole_commands(args) if args.whole_command else score_requests(args)


if __name__ == "__main__":
    sys.exit(run_benchmark("scoring_speed", measure))
