"""vLLM decode latency of the same model wired three ways, in one run, under vLLM's own tensor parallelism:

    standard            vLLM's own LlamaForCausalLM (every all-reduce inside its row-parallel layers)
    ladder (all)        every layer ladder (ladder/serving/model.py, through the plugin)
    ladder (upper half) the published conversion shape

It prints per-token decode latency, tokens/s, the speed-up over standard and the communication share:
the time the compute stream spends in vLLM's all-reduce (`ReductionTimer`, in every worker). Under CUDA
graphs (a GPU with --compiled) the reductions inside the graphs are not timed: the share is then a
lower bound. Weights are vLLM's dummy weights, the same for every variant (the models differ only in
config.json). Each engine runs in a spawned process of its own, one after another: vLLM does not
always give back GPU memory when an `LLM` is deleted, and the next engine would size its KV cache
from what was left.

    make bench-vllm                                          # CPU, TP=2, one core per rank
    .venv-serve/bin/python -m benchmarks.vllm_speed --tp 2 --batch 1,4
    python -m benchmarks.vllm_speed --tp 8 --shape llama-3.1-70b --batch 1,16 \\
        --prompt-length 1024 --new-tokens 128 --compiled                              # 8 GPUs, bfloat16

Runs in the serving environment (.venv-serve). Results go to runs/bench/vllm_speed.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks import common
from benchmarks.common import STANDARD
from ladder.cli_types import positive_int
from ladder.errors import ArgumentParser, UsageError

SHAPES = {
    # ~100M parameters in 8 layers: a decode step is a few ms per rank on one CPU core, so the
    # all-reduces weigh as they would on a GPU, and three engines start and run in a few minutes.
    "cpu": common.llama_shape(hidden=1024, intermediate=2816, heads=8, kv_heads=8, layers=8, vocab=8192),
    **common.PUBLISHED_SHAPES,
}


def write_config(directory: Path, shape: dict, ladder_layers: list[int] | None, max_len: int) -> Path:
    """A config.json only: vLLM's dummy loader makes the weights, and prompts are token ids."""
    directory.mkdir(parents=True)
    config = dict(
        shape,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=0,
        eos_token_id=1,
    )
    if ladder_layers is None:
        config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    else:
        config.update(model_type="llamaLadder", architectures=["LadderLlamaForCausalLM"], ladder_layers=ladder_layers)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


class ReductionTimer:
    """Seconds that reductions hold up the compute stream. On the CPU the call returns when the
    reduction is done: `perf_counter` around it. On a GPU it returns at the launch: CUDA events
    around it on the current stream, read by `total`. A reduction issued on `hidden_stream()`
    (vLLM's auxiliary stream, where the ladder's attention all-reduce runs beside the MLP) is not
    timed: the compute stream waits only for what is left of it at the join, which the decode time
    includes. Under CUDA-graph capture no event is recorded (a replay runs no Python)."""

    def __init__(self, hidden_stream):
        self.hidden_stream = hidden_stream
        self.seconds = 0.0
        self.events: list = []

    def call(self, reduce, tensor):
        import torch

        if tensor.is_cuda:  # a CUDA stream never equals None (no hidden stream)
            if torch.cuda.is_current_stream_capturing() or torch.cuda.current_stream() == self.hidden_stream():
                return reduce(tensor)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return reduce(tensor)
            finally:
                end.record()
                self.events.append((start, end))
        started = time.perf_counter()
        try:
            return reduce(tensor)
        finally:
            self.seconds += time.perf_counter() - started

    def total(self) -> float:
        """All the timed seconds so far (waits for the GPU when events are pending)."""
        if self.events:
            import torch

            torch.cuda.synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self.events) / 1000
            self.events.clear()
        return self.seconds


def all_reduce_timer():
    """Two functions for `collective_rpc`: one that times every all-reduce of vLLM's communicator in a
    worker through a `ReductionTimer`, and one that reads its total. Nested, so that cloudpickle sends
    them by value (the workers do not have the module that runs this script as __main__)."""

    def install(worker) -> None:
        from vllm.distributed import parallel_state
        from vllm.utils.torch_utils import aux_stream

        from benchmarks.vllm_speed import ReductionTimer

        group = parallel_state.GroupCoordinator  # installed once per worker process
        timer = group.ladder_timer = ReductionTimer(aux_stream)
        untimed = group._all_reduce_out_place

        def timed(self, input_):
            return timer.call(lambda tensor: untimed(self, tensor), input_)

        group._all_reduce_out_place = timed

    def total(worker) -> float:
        from vllm.distributed import parallel_state

        return parallel_state.GroupCoordinator.ladder_timer.total()

    return install, total


def decode_speed(llm, total_all_reduce, batch: int, prompt_length: int, new_tokens: int, repeats: int) -> dict:
    """Decode ms per token = (time of N new tokens - time of 1) / (N - 1): the prefill cancels out.
    The communication share is measured the same way, per worker, and averaged over workers."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [
        TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 8000 + 2 for j in range(prompt_length)]) for i in range(batch)
    ]

    def run(tokens: int) -> tuple[float, float]:
        before = llm.collective_rpc(total_all_reduce)
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        elapsed = time.perf_counter() - started
        after = llm.collective_rpc(total_all_reduce)
        return elapsed, statistics.mean(b - a for a, b in zip(before, after))

    run(new_tokens)  # warm-up (and the first prefix-cache miss)
    decode, communication = [], []
    for _ in range(repeats):
        full, full_comm = run(new_tokens)
        first, first_comm = run(1)
        decode.append((full - first) / (new_tokens - 1))
        communication.append((full_comm - first_comm) / (new_tokens - 1))
    median = statistics.median(decode)
    return dict(
        decode_ms_per_token=1000 * median,
        decode_spread=(max(decode) - min(decode)) / median,
        tokens_per_s=batch / median,
        all_reduce_ms_per_token=1000 * statistics.median(communication),
        communication_share=statistics.median(communication) / median,
        samples_ms=[1000 * d for d in decode],
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="benchmarks.vllm_speed", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--shape", choices=tuple(SHAPES), default="cpu", help="model shape, random (dummy) weights (default cpu)")
    add("--tp", type=positive_int, default=2, help="tensor-parallel degree (default 2)")
    common.add_decode_options(parser, "vllm_speed", prompt=32, tokens=32, rounds=3)
    add("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on GPUs, float32 on the CPU (slow bf16)")
    add("--compiled", action="store_true", help="vLLM's default torch.compile (and CUDA graphs on GPU), not eager")
    return parser.parse_args(argv)


def run_variant(name: str, model: Path, args: argparse.Namespace, max_len: int) -> list[dict]:
    """One variant's rows, from an engine that lives and dies in this (spawned) process."""
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        tensor_parallel_size=args.tp,
        dtype=args.dtype,
        enforce_eager=not args.compiled,
        max_model_len=max_len,
        seed=0,
    )
    startup = time.perf_counter() - started
    install_timer, total_all_reduce = all_reduce_timer()
    llm.collective_rpc(install_timer)
    rows = []
    for batch in args.batch:
        row = dict(variant=name, batch=batch, startup_s=startup)
        row |= decode_speed(llm, total_all_reduce, batch, args.prompt_length, args.new_tokens, args.repeats)
        rows.append(row)
        print(
            f"{name:<20} batch {batch:>3}: {row['decode_ms_per_token']:8.2f} ms/token (spread {row['decode_spread']:.0%}), "
            f"all-reduce {row['all_reduce_ms_per_token']:.2f} ms/token = {row['communication_share']:.0%}",
            flush=True,
        )
    # The engine's processes end when the LLM is collected (its finalizer); the exit of this spawned
    # process runs no such finalizer and would wait for them forever.
    del llm
    gc.collect()
    return rows


def measure(argv: list[str]) -> int:
    args = parse_args(argv)
    from ladder.serving.engine import cpu_binding, use_spawn_where_cuda_may_be

    use_spawn_where_cuda_may_be()  # before vLLM is imported
    try:
        from vllm.platforms import current_platform
    except ImportError:
        raise UsageError("vLLM is not installed here; run it with .venv-serve/bin/python (make bench-vllm)") from None
    if args.dtype is None:  # bf16 is slow on these CPUs
        args.dtype = "float32" if current_platform.is_cpu() else "bfloat16"
    shape = SHAPES[args.shape]
    layers = shape["num_hidden_layers"]
    variants = {
        STANDARD: None,
        "ladder (all)": list(range(layers)),
        "ladder (upper half)": list(range(layers // 2, layers)),
    }
    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(args.tp, sorted(os.sched_getaffinity(0))))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc ships the timer functions
    max_len = args.prompt_length + args.new_tokens + 8
    print(
        f"vLLM TP={args.tp} on {current_platform.device_name}, {args.dtype}, shape {args.shape} {shape}, "
        f"{'compiled' if args.compiled else 'eager'}; batch {args.batch}, prompt {args.prompt_length}, "
        f"{args.new_tokens} new tokens, {args.repeats} timed rounds; binding {os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '-')}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-speed-") as root:
        for number, (name, ladder_layers) in enumerate(variants.items()):
            model = write_config(Path(root) / f"variant-{number}", shape, ladder_layers, max_len)
            # A fresh spawned process per engine; its workers are not daemons (vLLM starts its own).
            with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
                rows += pool.submit(run_variant, name, model, args, max_len).result()
    for row in rows:
        standard = next(r for r in rows if r["variant"] == STANDARD and r["batch"] == row["batch"])
        row["speedup_vs_standard"] = standard["decode_ms_per_token"] / row["decode_ms_per_token"]
    columns = [
        ("batch", ">5", lambda row: str(row["batch"])),
        ("variant", "<20", lambda row: row["variant"]),
        *common.DECODE_COLUMNS,
        ("all-reduce share", ">16", lambda row: f"{row['communication_share']:.0%}"),
    ]
    print("", *common.table(sorted(rows, key=lambda row: row["batch"]), columns), sep="\n")
    print(
        "all-reduce share: time the compute stream spends in vLLM's all-reduce (waiting for the other rank included) / decode time, per rank."
    )
    record = dict(command=["python", "-m", "benchmarks.vllm_speed", *argv], shape=shape)
    record |= {
        name: getattr(args, name) for name in ("tp", "dtype", "compiled", "prompt_length", "new_tokens", "repeats")
    }
    where = common.machine() | {"device": current_platform.device_name}
    record |= dict(binding=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), machine=where, rows=rows)
    common.write_report(args.out, record)
    print(f"\nresults in {args.out}")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine and workers: they re-import this file
    sys.exit(common.run_benchmark("vllm_speed", measure))
