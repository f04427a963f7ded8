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
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig

from benchmarks.common import PUBLISHED_SHAPES
from benchmarks.tp_report import BOUND, STANDARD, add_ratios, table
from ladder.errors import UsageError
from ladder.io.files import atomic_write
from ladder.io.loading import DTYPES
from ladder.plan.emulated_link import LOOPBACK, check_rate, emulated_link
from ladder.tp.runtime import GLOO_THREADS, prioritize_gloo_threads
from ladder.tp.shard import LlamaShard, ShardShape

# The ranks run `python -m benchmarks.tp_speed`: from the repository root, whatever the caller's folder.
REPOSITORY = Path(__file__).resolve().parents[1]

# Synthetic shapes (random weights). "cpu", the default, is a ~1B-parameter Llama-2-style model
# (multi-head attention) cut to 8 layers, so a 2-core run takes a few minutes. Its width matters:
# with one core per rank every all-reduce costs about 0.5-1 ms of CPU here, so a branch must compute
# for several ms before hiding one pays. Ladder hides the MLP's all-reduce behind the next attention
# branch, which grouped-query attention makes 3x cheaper: "cpu-gqa" (Llama-3 style) shows the
# difference. The others are the published shapes, for GPU machines.
SHAPES = {
    "cpu": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_attention_heads=24,
        num_key_value_heads=24,
        num_hidden_layers=8,
        vocab_size=8192,
    ),
    "cpu-gqa": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_attention_heads=24,
        num_key_value_heads=8,
        num_hidden_layers=8,
        vocab_size=8192,
    ),
    **PUBLISHED_SHAPES,
}
SYNTHETIC = "synthetic:"


@dataclass
class Variant:
    name: str
    ladder_layers: list[int]
    communication: str  # "all-reduce" or "none" (see ladder.tp.runtime.install_communication)


@dataclass
class Plan:
    """Everything a rank needs, written to JSON by the launcher and read by each rank."""

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
    def from_json(cls, text: str) -> Plan:
        values = json.loads(text)
        values["variants"] = [Variant(**variant) for variant in values["variants"]]
        return cls(**values)


# --- One rank (runs under torchrun) --------------------------------------------------------------


def synthetic_shard(
    config: LlamaConfig, rank: int, tp_size: int, dtype: torch.dtype, device: torch.device
) -> LlamaShard:
    """This rank's shard with random weights (the default nn init): speed runs need no checkpoint."""
    torch.manual_seed(rank)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on its device: a 70B shard never exists in fp32
    try:
        with torch.device(device):
            return LlamaShard(config, ShardShape.of(config, rank, tp_size)).eval()
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


def run_rank(plan: Plan, result_path: Path) -> None:
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

    rank, tp_size, device = init_distributed(cuda=plan.device == "cuda")
    if plan.comm_priority == "realtime" and tp_size > 1 and prioritize_gloo_threads() == 0 and rank == 0:
        print(f"warning: no threads named {GLOO_THREADS}: gloo runs at normal priority", file=sys.stderr)
    torch.set_num_threads(plan.threads)
    torch.set_flush_denormal(True)  # random weights must not wander into slow denormal arithmetic
    dtype = DTYPES[plan.dtype]
    if plan.model.startswith(SYNTHETIC):
        shard = synthetic_shard(LlamaConfig(**plan.config), rank, tp_size, dtype, device)
    else:
        shard = load_shard(plan.model, rank, tp_size, dtype, device)
    if plan.compile:
        compile_branches(shard)

    def configure(variant: Variant) -> None:
        shard.set_ladder_layers(variant.ladder_layers)
        install_communication(shard, variant.communication)

    rows, begun = [], time.time()
    for batch in plan.batches:
        shard.setup_cache(batch, plan.prompt_length + plan.new_tokens)
        generator = torch.Generator().manual_seed(batch)  # the same prompts on every rank
        prompt = torch.randint(0, shard.shape.vocab_size, (batch, plan.prompt_length), generator=generator).to(device)
        steps = {}
        if plan.cuda_graphs:  # one graph per variant (the wiring is baked in), captured before any prefill
            for variant in plan.variants:
                configure(variant)
                steps[variant.name] = CUDAGraphStep(shard, batch)
        samples = {variant.name: ([], []) for variant in plan.variants}
        rounds = plan.warmup + plan.repeats
        for round_index in range(rounds):
            # Variants interleaved within each round, so slow drifts in machine load hit them all alike.
            for variant in plan.variants:
                configure(variant)
                prefill_s, first = timed(lambda: prefill(shard, prompt), device)
                step = steps.get(variant.name)
                decode_s, _ = timed(lambda: decode(shard, first, plan.prompt_length, plan.new_tokens - 1, step), device)
                if round_index >= plan.warmup:
                    samples[variant.name][0].append(1e3 * decode_s / (plan.new_tokens - 1))
                    samples[variant.name][1].append(1e3 * prefill_s)
            if rank == 0:
                print(
                    f"  [{plan.link}] batch {batch}: round {round_index + 1}/{rounds} ({time.time() - begun:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        for variant in plan.variants:
            decode_ms, prefill_ms = samples[variant.name]
            median = statistics.median(decode_ms)
            rows.append(
                dict(
                    link=plan.link,
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
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default=SYNTHETIC + "cpu",
        help=f"a checkpoint directory (safetensors) or {SYNTHETIC}NAME, NAME in {', '.join(SHAPES)} (default {SYNTHETIC}cpu)",
    )
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree: ranks launched (default 2)")
    parser.add_argument("--batch", default="1,4", help="batch sizes, comma-separated (default 1,4)")
    parser.add_argument("--prompt-length", type=int, default=32, help="prompt tokens per sequence (default 32)")
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=16,
        help="tokens generated per run; decode is timed over all but the first (default 16)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; medians are reported (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument(
        "--link",
        default=LOOPBACK,
        help=f"'{LOOPBACK}' and/or tbf-shaped rates, comma-separated, e.g. {LOOPBACK},100mbit (default {LOOPBACK})",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank (default 1)")
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
    parser.add_argument("--worker", nargs=2, metavar=("PLAN", "RESULT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def positive_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{name} {text!r} must be positive integers, comma-separated")
    return values


def make_plan(args: argparse.Namespace) -> tuple[Plan, str]:
    """Validate every option and the model's shape for every rank before anything is launched."""
    from ladder.tp.runtime import read_config

    for name in ("tp", "prompt_length", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.new_tokens < 2 or args.warmup < 0:
        raise UsageError("--new-tokens must be at least 2 (the first comes from the prefill) and --warmup at least 0")
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
        described = (
            f"checkpoint {args.model} (its own ladder layers: {getattr(config, 'ladder_layers', None) or 'none'})"
        )
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
    plan = Plan(
        model=args.model,
        config=config.to_dict() if args.model.startswith(SYNTHETIC) else {},
        tp=args.tp,
        batches=positive_ints(args.batch, "--batch"),
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
    return plan, described


def launch(plan: Plan, prefix: list[str]) -> list[dict]:
    """Run the ranks under torchrun (behind `prefix`, e.g. `ip netns exec NAME`) and collect rank 0's rows."""
    with tempfile.TemporaryDirectory(prefix="tp-speed-") as scratch:
        plan_path, result_path = Path(scratch, "plan.json"), Path(scratch, "result.json")
        plan_path.write_text(json.dumps(asdict(plan)))
        command = prefix + [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={plan.tp}",
            "-m", "benchmarks.tp_speed", "--worker", str(plan_path), str(result_path),
        ]  # fmt: skip
        # OMP_NUM_THREADS set here also silences torchrun's warning; c10d's warnings are noise here.
        env = os.environ | {"OMP_NUM_THREADS": str(plan.threads), "TORCH_CPP_LOG_LEVEL": "ERROR"}
        process = subprocess.Popen(command, env=env, cwd=REPOSITORY)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_rank(Plan.from_json(Path(args.worker[0]).read_text()), Path(args.worker[1]))
        return 0
    try:
        plan, described = make_plan(args)
        links = [check_rate(link.strip()) for link in args.link.split(",") if link.strip()] or [LOOPBACK]
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"TP={plan.tp} on {plan.device} ({'NCCL' if plan.device == 'cuda' else f'gloo, {plan.threads} thread(s) per rank, {plan.comm_priority} priority for gloo threads'}), "
            f"{plan.dtype}, {described}\nbatch {','.join(map(str, plan.batches))}, prompt {plan.prompt_length}, "
            f"{plan.new_tokens} new tokens, {plan.warmup} warm-up + {plan.repeats} timed rounds; links: {', '.join(links)}"
            + (f"{' compile' if plan.compile else ''}{' cuda-graphs' if plan.cuda_graphs else ''}"),
            flush=True,
        )
        if plan.tp == 1:
            print(
                "TP=1: no communication, so nothing for ladder to hide: a sanity run and kernel timings, not a TP figure."
            )
        if plan.device == "cpu" and plan.tp * plan.threads > (os.cpu_count() or 1):
            print(
                f"warning: {plan.tp} ranks x {plan.threads} threads exceed the {os.cpu_count()} CPUs: ranks will steal each other's time",
                file=sys.stderr,
            )
        rows, runs = [], []
        for link in links:
            plan.link = link
            load_before, started = os.getloadavg()[0], time.time()
            with emulated_link(link) as prefix:
                link_rows = launch(plan, prefix)
            rows += link_rows
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
                table([row for row in rows if row["link"] == link], [s for s in summaries if s["link"] == link]),
                flush=True,
            )
            report = dict(
                command=["python", "-m", "benchmarks.tp_speed", *(argv if argv is not None else sys.argv[1:])],
                model=described,
                plan={key: value for key, value in asdict(plan).items() if key not in ("config", "link")},
                machine=dict(platform=platform.platform(), cpus=os.cpu_count(), torch=torch.__version__),
                runs=runs,
                summaries=summaries,
                rows=rows,
            )
            atomic_write(out, json.dumps(report, indent=2) + "\n")
        print(f"results: {out}")
        return 0
    except UsageError as error:
        print(f"tp_speed: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tp_speed: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
