"""Checks `ladder plan`'s speed model (ladder/plan/speed.py) against measurements and published numbers,
in one run, side by side; exits 1 when a row misses its bound.

(a) here: on each link setting this machine is calibrated (`ladder plan --calibrate`'s probe), then
    benchmarks/tp_speed.py measures standard, all-ladder and upper-half-ladder decode (TP=2 over gloo,
    the wirings interleaved in each round); the predicted speed-up must be within 10% of the measured.
(b) published (arXiv 2501.06589, gpt-fast on H100, prompt 1024, 512 new tokens): the paper's 70B and
    405B rows predicted from the device and link profiles, each within 15%; the no-communication bound
    beside the published 1.43x.
(c) published memory: adapt/training_cost.py's peak per GPU for torchtitan's Llama-3.1-8B FSDP runs
    (its program and setting) against their published peak reserve, each within 15%.

    python -m benchmarks.plan_check                        # as root (the links are shaped namespaces)
    python -m benchmarks.plan_check --links loopback,400mbit,100mbit --batch 1,4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from benchmarks import common, tp_speed
from benchmarks.common import PUBLISHED_SHAPES, STANDARD
from benchmarks.tp_speed import BOUND, SYNTHETIC, launch, workload
from ladder.adapt.training_cost import PUBLISHED_MEMORY, torchtitan_reserved_bytes
from ladder.errors import ArgumentParser
from ladder.plan.calibrate import measure_link
from ladder.plan.costs import ModelShape
from ladder.plan.emulated_link import LOOPBACK, check_rate, emulated_link
from ladder.plan.speed import Setting, device_profile, link_profile, predict

HERE_TOLERANCE, PUBLISHED_TOLERANCE = 0.10, 0.15

# Published speed-ups (Zhang et al., arXiv 2501.06589, inference with gpt-fast on H100, prompt 1024,
# 512 new tokens, every layer ladder). ../shared/docs/ladder.md quotes them. The 405B row is a range.
PUBLISHED = [
    ("70B TP=8 NVLink batch 1", "llama-3.1-70b", 8, "nvlink", 1, (1.31, 1.31)),
    ("70B TP=8 NVLink batch 64", "llama-3.1-70b", 8, "nvlink", 64, (1.16, 1.16)),
    ("70B TP=8 no P2P batch 1", "llama-3.1-70b", 8, "pcie", 1, (1.60, 1.60)),
    ("405B TP=16 two nodes batch 1", "llama-3.1-405b", 16, "ib", 1, (1.31, 1.39)),
]
PUBLISHED_BOUND = ("70B TP=8 NVLink batch 1, no-communication bound", 110.6 / 77.4)  # PUBLISHED[0]'s setting


@dataclass
class Row:
    check: str
    setting: str
    predicted: float
    observed: float  # measured here, or published (the range's nearest end)
    tolerance: float | None  # None: shown for reference, not checked
    bound: float | None = None  # predicted no-communication bound, for reference
    spread: float | None = None  # measured: (max - min) / median of the per-round ratios
    unit: str = "x"  # "x": a speed-up; "G": memory in GiB

    @property
    def error(self) -> float:
        return self.predicted / self.observed - 1

    @property
    def passed(self) -> bool:
        return self.tolerance is None or abs(self.error) <= self.tolerance


def check_here(args: argparse.Namespace, report: dict) -> list[Row]:
    """tp_speed's run of its "plan-check" shape (TP=2 over gloo, fp32, one thread per rank) on each link,
    after the link's calibration, against the model's predictions."""
    tp_argv = [f"--model={SYNTHETIC}plan-check", "--tp=2", "--device=cpu", "--dtype=float32", "--threads=1"]
    tp_argv += [f"--batch={','.join(map(str, args.batch))}", f"--prompt-length={args.prompt_length}"]
    tp_argv += [f"--new-tokens={args.new_tokens}", f"--repeats={args.repeats}", "--warmup=1"]
    config, variants, _ = workload(tp_speed.parse_args(tp_argv))
    shape, rows = ModelShape.from_config(config.to_dict()), []
    for link_name in args.links:
        load_before = os.getloadavg()[0]
        with emulated_link(link_name) as prefix:
            device, link = measure_link(link_name, prefix)
            print(
                f"[{link_name}] calibrated: memory {device.bandwidth / 1e9:.1f} GB/s, matmul {device.flops / 1e9:.0f} "
                f"GFLOP/s, {device.eager_kernel_us:.1f} us/operator; all-reduce {link.base_us:.0f} us + bytes / "
                f"{link.bus_bandwidth / 1e6:.2f} MB/s, of which {link.host_us:.0f} us + {link.host_ns_per_byte:.1f} "
                "ns/byte on the CPU",
                flush=True,
            )
            measured = launch(tp_argv, link_name, prefix)
        loads = dict(load_before=load_before, load_after=os.getloadavg()[0])
        report["links"].append(dict(device=asdict(device), link=asdict(link), rows=measured, **loads))
        rows += compare(shape, device, link, args, measured, variants)
    return rows


def compare(shape: ModelShape, device, link, args: argparse.Namespace, measured: list[dict], variants) -> list[Row]:
    """One link's rows: each ladder wiring's predicted and measured speed-up per batch, then the bound's
    (not checked: shown beside, to tell a compute error from a communication one)."""
    rows = []
    for variant in variants[1:]:  # all but standard
        for batch in args.batch:
            # The median over rounds of standard/variant decode time (both timed in the same round), and
            # the spread of those ratios.
            standard, ladder = (
                next(row for row in measured if row["batch"] == batch and row["variant"] == name)["decode_ms_samples"]
                for name in (STANDARD, variant.name)
            )
            ratios = [s / v for s, v in zip(standard, ladder)]
            speedup = statistics.median(ratios)
            spread = (max(ratios) - min(ratios)) / speedup
            setting = Setting(device, link, tp=2, batch=batch, prompt=args.prompt_length,
                              new_tokens=args.new_tokens, dtype_bytes=4, cuda_graphs=False)  # fmt: skip
            prediction = predict(shape, setting, variant.ladder_layers)
            where = f"{link.name}, batch {batch}, " + variant.name.replace("(", "").replace(")", "")
            if variant.name == BOUND:
                rows.append(Row("here", where, prediction.bound_speedup, speedup, None, spread=spread))
            else:
                rows.append(
                    Row("here", where, prediction.speedup, speedup, HERE_TOLERANCE, prediction.bound_speedup, spread)
                )
    return rows


def check_published() -> list[Row]:
    rows = []
    for name, shape_name, tp, link, batch, (low, high) in PUBLISHED:
        shape = ModelShape.from_config(PUBLISHED_SHAPES[shape_name])
        setting = Setting(device_profile("h100"), link_profile(link), tp=tp, batch=batch)
        prediction = predict(shape, setting, list(range(shape.num_layers)))
        nearest = min(max(prediction.speedup, low), high)  # inside a published range counts as exact
        rows.append(Row("paper", name, prediction.speedup, nearest, PUBLISHED_TOLERANCE, prediction.bound_speedup))
    name, published_bound = PUBLISHED_BOUND  # the first row's setting (a bound does not depend on the ladder layers)
    rows.append(Row("paper", name, rows[0].bound, published_bound, PUBLISHED_TOLERANCE))
    return rows


def check_memory_published() -> list[Row]:
    rows = []
    for name, gpus, eager, compiled in PUBLISHED_MEMORY:
        predicted = torchtitan_reserved_bytes(gpus) / 2**30
        for mode, measured in (("eager", eager), ("compiled", compiled)):
            rows.append(Row("tt", f"{name}, {mode}, peak reserve", predicted, measured, PUBLISHED_TOLERANCE, unit="G"))
    return rows


def table(rows: list[Row]) -> str:
    header = (
        f"{'check':<6} {'setting':<50} {'predicted':>9} {'observed':>9} {'error':>7} {'bound':>6} {'spread':>6}  result"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        bound = f"{row.bound:.2f}x" if row.bound is not None else ""
        spread = f"{row.spread:.0%}" if row.spread is not None else ""
        verdict = "ok" if row.passed else f"MISS (by {abs(row.error) - row.tolerance:.0%} beyond ±{row.tolerance:.0%})"
        verdict = "(reference)" if row.tolerance is None else verdict
        lines.append(
            f"{row.check:<6} {row.setting:<50} {row.predicted:>8.2f}{row.unit} {row.observed:>8.2f}{row.unit} {row.error:>+7.1%} "
            f"{bound:>6} {spread:>6}  {verdict}"
        )
    lines.append(
        "predicted/observed: ladder's decode speed-up over standard (the bound row: the no-communication bound's); "
        "observed = measured here (median over rounds of the per-round ratio) or published; bound: the model's "
        "no-communication bound; spread: (max - min) / median of the measured per-round ratios; "
        "tt rows (G): the training cost's peak memory per GPU in GiB against torchtitan's published peak reserve."
    )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="benchmarks.plan_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default=f"{LOOPBACK},400mbit,100mbit", help="link settings (default %(default)s)")
    common.add_decode_options(parser, "plan_check", prompt=4, tokens=8, rounds=10)
    parser.add_argument("--published-only", action="store_true", help="only (b): no measurement")
    args = parser.parse_args(argv)
    args.links = [check_rate(link.strip()) for link in args.links.split(",") if link.strip()]
    return args


def measure(argv: list[str]) -> int:
    args = parse_args(argv)
    started, load = time.time(), os.getloadavg()[0]
    report = dict(machine=common.machine(), links=[])
    print(f"machine: {report['machine']['cpu']}, {os.cpu_count()} CPUs, load average {load:.2f} at start", flush=True)
    rows = [] if args.published_only else check_here(args, report)
    rows += check_published() + check_memory_published()
    print(table(rows))
    print(f"{time.time() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at the end (started at {load:.2f})")
    report["rows"] = [asdict(row) | {"error": row.error, "passed": row.passed} for row in rows]
    common.write_report(args.out, report)
    loads = [load, os.getloadavg()[0]] + [link["load_after"] for link in report["links"]]
    if report["links"] and max(loads) > 1.5 * os.cpu_count():  # the two ranks alone make about one per CPU here
        print(
            f"plan_check: warning: load average up to {max(loads):.1f} on {os.cpu_count()} CPUs: other jobs ran "
            "beside the measurement, so its ratios are noisy; rerun on a quiet machine",
            file=sys.stderr,
        )
    missed = [row for row in rows if not row.passed]
    if missed:
        print(f"plan_check: {len(missed)} of {len(rows)} rows miss their bound", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(common.run_benchmark("plan_check", measure))
