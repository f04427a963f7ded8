"""Scoring speed of `ladder eval`'s shared-context log-likelihoods against lm-eval's HFLM, in one run.

For each task of a suite (default: `demo`, the items `make demo` scores), lm-eval builds the
task's requests once; lm-eval's own `HFLM` and `ladder eval`'s (eval/backends/shared_prefix.py) then
score the same requests on the same loaded model (the embedded SmolLM2-135M-Instruct, float32,
CPU, the same batch size), alternating for `--rounds` rounds so that a change in the machine's
load hits both. Prints per task the median seconds of each, the ratio, the largest difference in
any request's log-likelihood and whether every greedy flag agrees; exits 1 when a task's flags
differ or a log-likelihood differs by more than MAX_DIFFERENCE. Rolling log-likelihoods
(WikiText) take lm-eval's path on both sides and are not timed.

    .venv/bin/python -m benchmarks.scoring_speed [--suite demo] [--batch-size 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from lm_eval.models.huggingface import HFLM

from ladder.eval.backends.hf import LoadedHFLM
from ladder.eval.lm_tasks import hub_offline, task_manager
from ladder.eval.runtime import Runtime
from ladder.eval.suite import load_suite
from ladder.io.loading import load_model

MAX_DIFFERENCE = 1e-3  # nats; float32 rounding between the two paths measured 1.1e-4 at most


def requests_of(suite_name: str) -> dict[str, list]:
    """{leaf task: its log-likelihood requests (lm-eval Instances)} for the suite's items."""
    suite = load_suite(suite_name)
    manager = task_manager(suite)
    requests = {}
    for suite_task in suite.tasks:
        for name, task in manager.load([suite_task.task])["tasks"].items():
            items = list(range(0, len(task.eval_docs), suite_task.every))[: suite_task.limit]
            task.build_all_requests(samples=items)
            chosen = [instance for instance in task.instances if instance.request_type == "loglikelihood"]
            if chosen:
                requests[name] = chosen
    return requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="demo", help="a shipped suite or a suite YAML (default demo)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating (default 2)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="scoring-speed-") as scratch, hub_offline(Path(scratch)):
        tasks = requests_of(args.suite)
    model, tokenizer = load_model("embedded", dtype=torch.float32)
    sides = {
        "lm-eval HFLM": HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size),
        "ladder eval": LoadedHFLM(model, tokenizer, Runtime("cpu", "float32", args.batch_size)),
    }
    print(
        f"suite {args.suite}, SmolLM2-135M-Instruct fp32 on CPU ({torch.get_num_threads()} threads), "
        f"batch {args.batch_size}, median of {args.rounds} rounds\n"
    )
    print(f"{'task':<22} {'requests':>8} {'HFLM s':>8} {'ours s':>8} {'speed-up':>8} {'max |dlogp|':>11}  greedy")
    for lm in sides.values():  # first calls pay one-time costs (thread pools, allocations): untimed
        lm.loglikelihood(next(iter(tasks.values()))[:16], disable_tqdm=True)
    totals = {side: 0.0 for side in sides}
    differing = []
    for name, instances in tasks.items():
        times: dict[str, list[float]] = {side: [] for side in sides}
        answers = {}
        for _ in range(args.rounds):
            for side, lm in sides.items():
                started = time.perf_counter()
                answers[side] = lm.loglikelihood(instances, disable_tqdm=True)
                times[side].append(time.perf_counter() - started)
        medians = {side: statistics.median(seconds) for side, seconds in times.items()}
        for side, seconds in medians.items():
            totals[side] += seconds
        stock, ours = medians.values()
        reference, shared = answers.values()
        difference = max(abs(a[0] - b[0]) for a, b in zip(reference, shared))
        greedy = "same" if all(a[1] == b[1] for a, b in zip(reference, shared)) else "DIFFERENT"
        if greedy != "same" or difference > MAX_DIFFERENCE:
            differing.append(name)
        row = f"{stock:>8.1f} {ours:>8.1f} {stock / ours:>7.2f}x {difference:>11.2e}  {greedy}"
        print(f"{name:<22} {len(instances):>8} {row}")
    stock, ours = totals.values()
    print(f"{'all':<22} {'':>8} {stock:>8.1f} {ours:>8.1f} {stock / ours:>7.2f}x")
    if differing:
        print(f"ladder eval's scores differ from HFLM's on {', '.join(differing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
