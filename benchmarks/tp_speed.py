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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig

from benchmarks.common import PUBLISHED_SHAPES, machine, run_benchmark
from ladder.cli_types import non_negative_int, positive_int, positive_ints
from ladder.errors import ArgumentParser, UsageError
from ladder.io.files import atomic_write
from ladder.io.loading import DTYPES
from ladder.launch import rank_environment, torchrun
from ladder.plan.emulated_link import LOOPBACK, check_rate, emulated_link
from ladder.tp.runtime import GLOO_THREADS, prioritize_gloo_threads
from ladder.tp.shard import ModelShard, ShardShape

# The ranks run `python -m benchmarks.tp_speed`: from the repository root, whatever the caller's folder.
REPOSITORY = Path(__file__).resolve().parents[1]

# Synthetic shapes (random weights). "cpu", the default, is a ~1B-parameter Llama-2-style model
# (multi-head attention) cut to 8 layers, so a 2-core run takes a few minutes. Its width matters:
# with one core per rank every all-reduce costs about 0.5-1 ms of CPU here, so a branch must compute
# for several ms before hiding one pays. Ladder hides the MLP's all-reduce behind the next attention
# branch, which grouped-query attention makes 3x cheaper: "cpu-gqa" (Llama-3 style) shows the
# difference. The others are the published shapes, for GPU machines.
CPU_SHAPE = dict(
    hidden_size=3072,
    intermediate_size=8192,
    num_attention_heads=24,
    num_key_value_heads=24,
    num_hidden_layers=8,
    vocab_size=8192,
)
SHAPES = {"cpu": CPU_SHAPE, "cpu-gqa": {**CPU_SHAPE, "num_key_value_heads": 8}, **PUBLISHED_SHAPES}
SYNTHETIC = "synthetic:"
STANDARD, BOUND = "standard", "no-comm bound"  # the variants every other is compared with


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


def table(rows: list[dict], summaries: list[dict]) -> str:
    header = f"{'link':<10} {'batch':>5}  {'variant':<18} {'decode ms/tok':>13} {'spread':>6} {'tok/s':>8} {'vs standard':>11} {'bound gain':>10} {'prefill ms':>10}"
    lines = [header, "-" * len(header)]
    for summary in summaries:
        for row in rows:
            if (row["link"], row["batch"]) != (summary["link"], summary["batch"]):
                continue
            share = row["share_of_bound_gain"]
            lines.append(
                f"{row['link']:<10} {row['batch']:>5}  {row['variant'] + (' *' if row['variant'] == BOUND else ''):<18} "
                f"{row['decode_ms_per_token']:>13.2f} {row['decode_spread']:>6.0%} {row['tokens_per_s']:>8.1f} "
                f"{row['speedup_vs_standard']:>10.2f}x {'n/a' if share is None else f'{share:.0%}':>10} {row['prefill_ms']:>10.1f}"
            )
        if summary["communication_share_of_standard"] is not None:
            lines.append(
                f"{summary['link']:<10} {summary['batch']:>5}  communication share of standard decode (1 - bound/standard): {summary['communication_share_of_standard']:.0%}"
            )
        lines.append("")
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


@dataclass
class Workload:
    """Everything a rank runs, written to JSON by the launcher and read by each rank."""

    model: str
    config: dict
    tp: int
    batches: list[int]
    prompt_length: int
    new_tokens: int
    repeats: int
    warmup: int
    dtype: str
    device: str
    threads: int
    compile: bool
    cuda_graphs: bool
    comm_priority: str
    link: str = LOOPBACK
    variants: list[Variant] = field(default_factory=list)

    @classmethod
    def from_json(cls, text: str) -> Workload:
        values = json.loads(text)
        values["variants"] = [Variant(**variant) for variant in values["variants"]]
        return cls(**values)


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
            return ModelShard(config, ShardShape.of(config, rank, tp_size)).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def timed(function, device: torch.device) -> tuple[float, object]:
    """Seconds from a common start (barrier) until the slowest rank is done, and the result."""
    import torch.distributed as dist

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


def run_rank(workload: Workload, result_path: Path) -> None:
    import torch.distributed as dist

    from ladder.tp.runtime import (
        CUDAGraphStep,
        compile_branches,
        decode,
        init_distributed,
        install_communication,
        load_shard,
        prefill,
    )

    rank, tp_size, device = init_distributed(cuda=workload.device == "cuda")
    if workload.comm_priority == "realtime" and tp_size > 1 and prioritize_gloo_threads() == 0 and rank == 0:
        print(f"warning: no threads named {GLOO_THREADS}: gloo runs at normal priority", file=sys.stderr)
    torch.set_num_threads(workload.threads)
    torch.set_flush_denormal(True)  # random weights must not wander into slow denormal arithmetic
    dtype = DTYPES[workload.dtype]
    if workload.model.startswith(SYNTHETIC):
        shard = synthetic_shard(LlamaConfig(**workload.config), rank, tp_size, dtype, device)
    else:
        shard = load_shard(workload.model, rank, tp_size, dtype, device)
    if workload.compile:
        compile_branches(shard)

    def configure(variant: Variant) -> None:
        shard.set_ladder_layers(variant.ladder_layers)
        install_communication(shard, variant.communication)

    rows, begun = [], time.time()
    for batch in workload.batches:
        shard.setup_cache(batch, workload.prompt_length + workload.new_tokens)
        generator = torch.Generator().manual_seed(batch)  # the same prompts on every rank
        prompt = torch.randint(0, shard.shape.vocab_size, (batch, workload.prompt_length), generator=generator).to(
            device
        )
        steps = {}
        if workload.cuda_graphs:  # one graph per variant (the wiring is baked in), captured before any prefill
            for variant in workload.variants:
                configure(variant)
                steps[variant.name] = CUDAGraphStep(shard, batch)
        samples = {variant.name: ([], []) for variant in workload.variants}
        rounds = workload.warmup + workload.repeats
        for round_index in range(rounds):
            # Variants interleaved within each round, so slow drifts in machine load hit them all alike.
            for variant in workload.variants:
                configure(variant)
                prefill_s, first = timed(lambda: prefill(shard, prompt), device)
                step = steps.get(variant.name)
                decode_s, _ = timed(
                    lambda: decode(shard, first, workload.prompt_length, workload.new_tokens - 1, step), device
                )
                if round_index >= workload.warmup:
                    samples[variant.name][0].append(1e3 * decode_s / (workload.new_tokens - 1))
                    samples[variant.name][1].append(1e3 * prefill_s)
            if rank == 0:
                print(
                    f"  [{workload.link}] batch {batch}: round {round_index + 1}/{rounds} ({time.time() - begun:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        for variant in workload.variants:
            decode_ms, prefill_ms = samples[variant.name]
            median = statistics.median(decode_ms)
            rows.append(
                dict(
                    link=workload.link,
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
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default=SYNTHETIC + "cpu",
        help=f"a checkpoint directory (safetensors) or {SYNTHETIC}NAME, NAME in {', '.join(SHAPES)} (default {SYNTHETIC}cpu)",
    )
    parser.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel degree: ranks launched (default 2)")
    parser.add_argument("--batch", type=positive_ints, default="1,4", help="batch sizes, comma-separated (default 1,4)")
    parser.add_argument(
        "--prompt-length", type=positive_int, default=32, help="prompt tokens per sequence (default 32)"
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=16,
        help="tokens generated per run; decode is timed over all but the first (default 16)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="timed rounds; medians are reported (default 5)"
    )
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument(
        "--link",
        default=LOOPBACK,
        help=f"'{LOOPBACK}' and/or tbf-shaped rates, comma-separated, e.g. {LOOPBACK},100mbit (default {LOOPBACK})",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads per rank (default 1)")
    parser.add_argument(
        "--comm-priority", choices=("realtime", "normal"),
        help="CPU: scheduling of gloo's communication threads (default realtime as root, else normal; see prioritize_gloo_threads)",
    )  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="torch.compile the attention and MLP branches")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="replay each decode step as one CUDA graph (CUDA only)"
    )
    parser.add_argument(
        "--out", default="runs/bench/tp_speed.json", help="JSON results (default runs/bench/tp_speed.json)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "RESULT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_workload(args: argparse.Namespace) -> tuple[Workload, str]:
    """Validate every option and the model's shape for every rank before anything is launched."""
    from ladder.tp.runtime import read_config

    if args.new_tokens < 2:
        raise UsageError("--new-tokens must be at least 2 (the first comes from the prefill)")
    if args.device == "cuda":
        if torch.cuda.device_count() < args.tp:
            raise UsageError(f"--tp {args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
    elif args.cuda_graphs:
        raise UsageError("--cuda-graphs needs --device cuda")
    root = os.geteuid() == 0
    if args.comm_priority == "realtime" and not root:
        raise UsageError("--comm-priority realtime needs root (SCHED_FIFO); use --comm-priority normal")
    comm_priority = "n/a" if args.device == "cuda" else args.comm_priority or ("realtime" if root else "normal")
    if args.model.startswith(SYNTHETIC):
        name = args.model[len(SYNTHETIC) :]
        if name not in SHAPES:
            raise UsageError(f"unknown synthetic shape {name!r}; choose from {', '.join(SHAPES)}")
        config = LlamaConfig(
            **SHAPES[name], max_position_embeddings=args.prompt_length + args.new_tokens, tie_word_embeddings=False
        )
        described = f"synthetic {name} (random weights)"
    else:
        config = read_config(args.model)
        ladder_layers = getattr(config, "ladder_layers", None) or "none"
        described = f"checkpoint {args.model} ({config.model_type}, its own ladder layers: {ladder_layers})"
    try:
        for rank in range(args.tp):
            ShardShape.of(config, rank, args.tp)
    except ValueError as error:
        raise UsageError(f"{args.model}: {error}") from None
    layers = config.num_hidden_layers
    described += (
        f": {layers} layers, hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV, vocab {config.vocab_size}"
    )
    upper_half = list(range(layers - layers // 2, layers))
    variants = [
        Variant(STANDARD, [], "all-reduce"),
        Variant(f"ladder (all {layers})", list(range(layers)), "all-reduce"),
    ]
    if args.tp > 1:  # at TP=1 there is nothing to overlap and the bound equals standard
        variants += [Variant(f"ladder (upper {len(upper_half)})", upper_half, "all-reduce"), Variant(BOUND, [], "none")]
    workload = Workload(
        model=args.model,
        config=config.to_dict() if args.model.startswith(SYNTHETIC) else {},
        tp=args.tp,
        batches=args.batch,
        prompt_length=args.prompt_length,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        dtype=args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
        device=args.device,
        threads=args.threads,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
        comm_priority=comm_priority,
        variants=variants,
    )
    return workload, described


def launch(workload: Workload, prefix: list[str]) -> list[dict]:
    """Run the ranks under torchrun (behind `prefix`, e.g. `ip netns exec NAME`) and collect rank 0's rows."""
    with tempfile.TemporaryDirectory(prefix="tp-speed-") as scratch:
        workload_path, result_path = Path(scratch, "workload.json"), Path(scratch, "result.json")
        workload_path.write_text(json.dumps(asdict(workload)))
        command = [*torchrun(workload.tp, prefix), "-m", "benchmarks.tp_speed", "--worker", str(workload_path)]
        command.append(str(result_path))
        process = subprocess.Popen(command, env=rank_environment(workload.threads), cwd=REPOSITORY)
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
    if args.worker:
        run_rank(Workload.from_json(Path(args.worker[0]).read_text()), Path(args.worker[1]))
        return 0
    workload, described = make_workload(args)
    links = [check_rate(link.strip()) for link in args.link.split(",") if link.strip()] or [LOOPBACK]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"TP={workload.tp} on {workload.device} ({'NCCL' if workload.device == 'cuda' else f'gloo, {workload.threads} thread(s) per rank, {workload.comm_priority} priority for gloo threads'}), "
        f"{workload.dtype}, {described}\nbatch {','.join(map(str, workload.batches))}, prompt {workload.prompt_length}, "
        f"{workload.new_tokens} new tokens, {workload.warmup} warm-up + {workload.repeats} timed rounds; links: {', '.join(links)}"
        + (f"{' compile' if workload.compile else ''}{' cuda-graphs' if workload.cuda_graphs else ''}"),
        flush=True,
    )
    if workload.tp == 1:
        print(
            "TP=1: no communication, so nothing for ladder to hide: a sanity run and kernel timings, not a TP figure."
        )
    if workload.device == "cpu" and workload.tp * workload.threads > (os.cpu_count() or 1):
        print(
            f"warning: {workload.tp} ranks x {workload.threads} threads exceed the {os.cpu_count()} CPUs: ranks will steal each other's time",
            file=sys.stderr,
        )
    rows, runs = [], []
    for link in links:
        workload.link = link
        load_before, started = os.getloadavg()[0], time.time()
        with emulated_link(link) as prefix:
            rows += launch(workload, prefix)
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
            table([row for row in rows if row["link"] == link], [s for s in summaries if s["link"] == link]), flush=True
        )
        report = dict(
            command=["python", "-m", "benchmarks.tp_speed", *argv],
            model=described,
            workload={key: value for key, value in asdict(workload).items() if key not in ("config", "link")},
            machine=machine(),
            runs=runs,
            summaries=summaries,
            rows=rows,
        )
        atomic_write(out, json.dumps(report, indent=2) + "\n")
    print(f"results: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_benchmark("tp_speed", measure, argv)


if __name__ == "__main__":
    sys.exit(main())
