"""Tensor-parallel decode speed of the same weights wired four ways, measured in one run:

    standard            every all-reduce blocking (what a plain Llama does under TP)
    ladder (all)        every layer ladder: each all-reduce overlaps the next branch's compute
    ladder (upper half) the published conversion (e.g. Llama-3.1-8B, upper 16 of 32 layers)
    no-comm bound       all-reduces skipped: WRONG OUTPUTS, the speed of a free interconnect

It prints per-token decode latency, tokens/s, ladder's speed-up over standard, the share of the
bound's gain that ladder captures, and the communication share of standard decode time (1 -
bound/standard); the results, with every sample, also go to a JSON file.

    make bench                                          # CPU: TP=2 gloo, plain loopback
    make bench ARGS="--link loopback,35mbit"           # plus an emulated 35 Mbit/s link (root)
    .venv/bin/python -m benchmarks.tp_speed --model runs/convert/SmolLM2-135M-Instruct-ladder15
    python -m benchmarks.tp_speed --tp 8 --model synthetic:llama-3.1-70b --compile --cuda-graphs  # 8 GPUs

It launches the ranks itself (torchrun, one process per rank; under `--link RATE` inside a network
namespace whose loopback is shaped to RATE, see emulated_link.py).
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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from benchmarks import common
from benchmarks.common import PUBLISHED_SHAPES, STANDARD
from ladder.cli_types import non_negative_int, positive_int
from ladder.errors import ArgumentParser, UsageError
from ladder.io.loading import DTYPES
from ladder.launch import rank_environment, torchrun
from ladder.layers import parse_layer_choice
from ladder.plan.emulated_link import LOOPBACK, check_rate, emulated_link
from ladder.tp import runtime
from ladder.tp.shard import ModelShard, ShardShape

# Synthetic shapes (random weights). "cpu", the default, is a ~1B-parameter Llama-2-style model
# (multi-head attention) cut to 8 layers, so a 2-core run takes a few minutes. Its width matters:
# with one core per rank every all-reduce costs about 0.5-1 ms of CPU here, so a branch must compute
# for several ms before hiding one pays. Ladder hides the MLP's all-reduce behind the next attention
# branch, which grouped-query attention makes 3x cheaper: "cpu-gqa" (Llama-3 style) shows the
# difference. The others are the published shapes, for GPU machines.
CPU_SHAPE = common.llama_shape(hidden=3072, intermediate=8192, heads=24, kv_heads=24, layers=8, vocab=8192)
# benchmarks.plan_check's: wide enough that a branch computes for milliseconds on one core (an
# all-reduce costs ~0.2 ms of CPU here), small enough that 3 links x 2 batches x 4 wirings run in a
# few minutes.
PLAN_CHECK_SHAPE = common.llama_shape(hidden=2048, intermediate=5632, heads=16, kv_heads=16, layers=4, vocab=4096)
SHAPES = {
    "cpu": CPU_SHAPE,
    "cpu-gqa": {**CPU_SHAPE, "num_key_value_heads": 8},
    "plan-check": PLAN_CHECK_SHAPE,
    **PUBLISHED_SHAPES,
}
SYNTHETIC = "synthetic:"
BOUND = "no-comm bound"  # with STANDARD, the variants every other is compared with


def add_ratios(rows: list[dict]) -> list[dict]:
    """Per (link, batch): speed-up over standard, share of the bound's gain, and the communication share."""
    summaries = []
    for key in dict.fromkeys((row["link"], row["batch"]) for row in rows):
        group = [row for row in rows if (row["link"], row["batch"]) == key]
        standard = next(row for row in group if row["variant"] == STANDARD)["decode_ms_per_token"]
        bound = next((row["decode_ms_per_token"] for row in group if row["variant"] == BOUND), None)
        # A bound within 2% of standard leaves no gain to share out: the ratio would be noise.
        bound_gain = standard - bound if bound is not None and standard - bound > 0.02 * standard else None
        for row in group:
            row["speedup_vs_standard"] = standard / row["decode_ms_per_token"]
            row["share_of_bound_gain"] = (standard - row["decode_ms_per_token"]) / bound_gain if bound_gain else None
        summaries.append(
            dict(
                link=key[0],
                batch=key[1],
                communication_share_of_standard=None if bound is None else 1 - bound / standard,
            )
        )
    return summaries


def report_table(rows: list[dict], summaries: list[dict]) -> str:
    """One link's rows, then its communication shares."""
    columns = [
        ("link", "<10", lambda row: row["link"]),
        ("batch", ">5", lambda row: str(row["batch"])),
        ("variant", "<18", lambda row: row["variant"] + (" *" if row["variant"] == BOUND else "")),
        *common.DECODE_COLUMNS,
        (
            "bound gain",
            ">10",
            lambda row: "n/a" if row["share_of_bound_gain"] is None else f"{row['share_of_bound_gain']:.0%}",
        ),
        ("prefill ms", ">10", lambda row: f"{row['prefill_ms']:.1f}"),
    ]
    lines = common.table(rows, columns) + [""]
    for summary in summaries:
        if summary["communication_share_of_standard"] is not None:
            lines.append(
                f"batch {summary['batch']}: communication share of standard decode (1 - bound/standard): {summary['communication_share_of_standard']:.0%}"
            )
    lines.append(
        f"* {BOUND}: all-reduces skipped, so its OUTPUTS ARE WRONG; it only times a free interconnect.\n"
        "spread: (max - min) / median over the repeats; bound gain: (standard - variant) / (standard - bound), "
        "n/a when the bound is within 2% of standard."
    )
    return "\n".join(lines)


@dataclass
class Variant:
    name: str
    ladder_layers: list[int]
    communication: str  # "all-reduce" or "none" (see ladder.tp.runtime.install_communication)


# --- One rank (runs under torchrun) --------------------------------------------------------------


def synthetic_shard(
    config: LlamaConfig, rank: int, tp_size: int, dtype: torch.dtype, device: torch.device
) -> ModelShard:
    """This rank's shard with random weights (the default nn init): speed runs need no checkpoint."""
    torch.manual_seed(rank)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on its device: a 70B shard never exists in fp32
    try:
        with torch.device(device):
            return ModelShard(config, rank, tp_size).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def timed(function, device: torch.device) -> tuple[float, object]:
    """Seconds from a common start (barrier) until the slowest rank is done, and the result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    result = function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), result


def run_rank(args: argparse.Namespace, config, variants: list[Variant], result_path: Path) -> None:
    rank, tp_size, device = runtime.init_distributed(cuda=args.device == "cuda")
    if args.comm_priority == "realtime" and tp_size > 1 and runtime.prioritize_gloo_threads() == 0 and rank == 0:
        print(f"warning: no threads named {runtime.GLOO_THREADS}: gloo runs at normal priority", file=sys.stderr)
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # random weights must not wander into slow denormal arithmetic
    dtype = DTYPES[args.dtype]
    if args.model.startswith(SYNTHETIC):
        shard = synthetic_shard(config, rank, tp_size, dtype, device)
    else:
        shard = runtime.load_shard(args.model, rank, tp_size, dtype, device)
    if args.compile:
        runtime.compile_branches(shard)

    def configure(variant: Variant) -> None:
        shard.set_ladder_layers(variant.ladder_layers)
        runtime.install_communication(shard, variant.communication)

    rows, begun, decoded = [], time.time(), args.new_tokens - 1  # the first new token comes from the prefill
    for batch in args.batch:
        shard.setup_cache(batch, args.prompt_length + args.new_tokens)
        generator = torch.Generator().manual_seed(batch)  # the same prompts on every rank
        prompt = torch.randint(0, shard.config.vocab_size, (batch, args.prompt_length), generator=generator).to(device)
        steps = {}
        if args.cuda_graphs:  # one graph per variant (the wiring is baked in), captured before any prefill
            for variant in variants:
                configure(variant)
                steps[variant.name] = runtime.CUDAGraphStep(shard, batch)
        samples = {variant.name: ([], []) for variant in variants}
        rounds = args.warmup + args.repeats
        for round_index in range(rounds):
            # Variants interleaved within each round, so slow drifts in machine load hit them all alike.
            for variant in variants:
                configure(variant)
                prefill_s, first = timed(lambda: runtime.prefill(shard, prompt), device)
                step = steps.get(variant.name)
                decode_s, _ = timed(lambda: runtime.decode(shard, first, args.prompt_length, decoded, step), device)
                if round_index >= args.warmup:
                    samples[variant.name][0].append(1e3 * decode_s / decoded)
                    samples[variant.name][1].append(1e3 * prefill_s)
            if rank == 0:
                print(
                    f"  [{args.link}] batch {batch}: round {round_index + 1}/{rounds} ({time.time() - begun:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        for variant in variants:
            decode_ms, prefill_ms = samples[variant.name]
            median = statistics.median(decode_ms)
            rows.append(
                dict(
                    link=args.link,
                    tp=tp_size,
                    batch=batch,
                    variant=variant.name,
                    ladder_layers=len(variant.ladder_layers),
                    decode_ms_per_token=median,
                    decode_spread=(max(decode_ms) - min(decode_ms)) / median,
                    tokens_per_s=1e3 * batch / median,
                    prefill_ms=statistics.median(prefill_ms),
                    decode_ms_samples=decode_ms,
                    prefill_ms_samples=prefill_ms,
                )
            )
    if rank == 0:
        result_path.write_text(json.dumps({"rows": rows}))
    if dist.is_initialized():
        dist.destroy_process_group()


# --- The launcher --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="benchmarks.tp_speed", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add(
        "--model",
        default=SYNTHETIC + "cpu",
        help=f"a checkpoint directory (safetensors) or {SYNTHETIC}NAME, NAME in {', '.join(SHAPES)} (default {SYNTHETIC}cpu)",
    )
    add("--tp", type=positive_int, default=2, help="tensor-parallel degree: ranks launched (default 2)")
    common.add_decode_options(parser, "tp_speed", prompt=32, tokens=16, rounds=5)
    add("--warmup", type=non_negative_int, default=1, help="untimed rounds first (default 1)")
    add(
        "--link",
        default=LOOPBACK,
        help=f"'{LOOPBACK}' and/or tbf-shaped rates, comma-separated, e.g. {LOOPBACK},100mbit (default {LOOPBACK})",
    )
    add("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", choices=tuple(DTYPES), help="default float32 on CPU, bfloat16 on CUDA")
    add("--threads", type=positive_int, default=1, help="CPU threads per rank (default 1)")
    add(
        "--comm-priority",
        choices=("realtime", "normal"),
        help="CPU: scheduling of gloo's communication threads (default realtime as root, else normal; see prioritize_gloo_threads)",
    )
    add("--compile", action="store_true", help="torch.compile the attention and MLP branches")
    add("--cuda-graphs", action="store_true", help="replay each decode step as one CUDA graph (CUDA only)")
    add("--worker", metavar="RESULT", help=argparse.SUPPRESS)  # a rank, under torchrun: rank 0 writes RESULT
    return parser.parse_args(argv)


def workload(args: argparse.Namespace) -> tuple[object, list[Variant], str]:
    """Validate every option and the model's shape for every rank before anything is launched (each
    rank does it again from the same options), fill in the defaults of --dtype and --comm-priority,
    and return the model's config, the variants, and the model in words."""
    if args.device == "cuda":
        if torch.cuda.device_count() < args.tp:
            raise UsageError(f"--tp {args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
    elif args.cuda_graphs:
        raise UsageError("--cuda-graphs needs --device cuda")
    root = os.geteuid() == 0
    if args.comm_priority == "realtime" and not root:
        raise UsageError("--comm-priority realtime needs root (SCHED_FIFO); use --comm-priority normal")
    args.comm_priority = "n/a" if args.device == "cuda" else args.comm_priority or ("realtime" if root else "normal")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.model.startswith(SYNTHETIC):
        name = args.model[len(SYNTHETIC) :]
        if name not in SHAPES:
            raise UsageError(f"unknown synthetic shape {name!r}; choose from {', '.join(SHAPES)}")
        config = LlamaConfig(
            **SHAPES[name], max_position_embeddings=args.prompt_length + args.new_tokens, tie_word_embeddings=False
        )
        described = f"synthetic {name} (random weights)"
    else:
        config = runtime.read_config(args.model)
        ladder_layers = getattr(config, "ladder_layers", None) or "none"
        described = f"checkpoint {args.model} ({config.model_type}, its own ladder layers: {ladder_layers})"
    try:
        ShardShape.of(config, 0, args.tp)  # its checks are the same for every rank
    except ValueError as error:
        raise UsageError(f"{args.model}: {error}") from None
    layers = config.num_hidden_layers
    described += (
        f": {layers} layers, hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV, vocab {config.vocab_size}"
    )
    upper_half = parse_layer_choice(None, layers)
    variants = [
        Variant(STANDARD, [], "all-reduce"),
        Variant(f"ladder (all {layers})", list(range(layers)), "all-reduce"),
    ]
    if args.tp > 1:  # at TP=1 there is nothing to overlap and the bound equals standard
        variants += [Variant(f"ladder (upper {len(upper_half)})", upper_half, "all-reduce"), Variant(BOUND, [], "none")]
    return config, variants, described


def launch(argv: list[str], link: str, prefix: list[str]) -> list[dict]:
    """Run the ranks of `python -m benchmarks.tp_speed ARGV` on `link` under torchrun (behind `prefix`,
    e.g. `ip netns exec NAME`) and collect rank 0's rows."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tp-speed-") as scratch:
        result_path = Path(scratch, "result.json")
        command = [*torchrun(args.tp, prefix), "-m", "benchmarks.tp_speed", *argv, "--link", link]
        command += ["--worker", str(result_path)]
        process = subprocess.Popen(command, env=rank_environment(args.threads), cwd=common.REPOSITORY)
        try:
            status = process.wait()
        except BaseException:  # Ctrl-C: stop the ranks before the namespace goes away
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
            raise
        if status != 0 or not result_path.is_file():
            raise UsageError(f"the ranks failed (exit status {status}); their output is above")
        return json.loads(result_path.read_text())["rows"]


def measure(argv: list[str]) -> int:
    args = parse_args(argv)
    config, variants, described = workload(args)
    if args.worker:
        run_rank(args, config, variants, Path(args.worker))
        return 0
    links = [check_rate(link.strip()) for link in args.link.split(",") if link.strip()] or [LOOPBACK]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    print(
        f"TP={args.tp} on {args.device} ({'NCCL' if args.device == 'cuda' else f'gloo, {args.threads} thread(s) per rank, {args.comm_priority} priority for gloo threads'}), "
        f"{args.dtype}, {described}\nbatch {','.join(map(str, args.batch))}, prompt {args.prompt_length}, "
        f"{args.new_tokens} new tokens, {args.warmup} warm-up + {args.repeats} timed rounds; links: {', '.join(links)}"
        + (f"{' compile' if args.compile else ''}{' cuda-graphs' if args.cuda_graphs else ''}"),
        flush=True,
    )
    if args.tp == 1:
        print(
            "TP=1: no communication, so nothing for ladder to hide: a sanity run and kernel timings, not a TP figure."
        )
    if args.device == "cpu" and args.tp * args.threads > (os.cpu_count() or 1):
        print(
            f"warning: {args.tp} ranks x {args.threads} threads exceed the {os.cpu_count()} CPUs: ranks will steal each other's time",
            file=sys.stderr,
        )
    settings = {
        key: value for key, value in vars(args).items() if key not in ("link", "out", "worker", "quiet", "verbose")
    }
    rows, runs = [], []
    for link in links:
        load_before, started = os.getloadavg()[0], time.time()
        with emulated_link(link) as prefix:
            rows += launch(argv, link, prefix)
        runs.append(
            dict(
                link=link,
                seconds=time.time() - started,
                load_average_before=load_before,
                load_average_after=os.getloadavg()[0],
            )
        )
        summaries = add_ratios(rows)
        print(
            report_table([row for row in rows if row["link"] == link], [s for s in summaries if s["link"] == link]),
            flush=True,
        )
        report = dict(
            command=["python", "-m", "benchmarks.tp_speed", *argv],
            model=described,
            workload=settings | dict(variants=[asdict(variant) for variant in variants]),
            machine=common.machine(),
            runs=runs,
            summaries=summaries,
            rows=rows,
        )
        common.write_report(args.out, report)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_benchmark("tp_speed", measure))
