"""Conversion time and memory against a plain recursive copy, on a synthetic checkpoint of a few GB.

    .venv/bin/python -m benchmarks.convert_speed [--repeats 2] [--verify]

The checkpoint (written once into runs/bench/convert-source-<layers>l): Llama-3.1-8B shapes with 4
layers, tied embeddings, random float32 weights, 2 GB shards (5.6 GB, largest tensor 2.1 GB). For each
mode (`copy`: shutil.copyfile; `link`: hard links; `bfloat16`: every tensor read, cast and written)
and page-cache state (`cold`: evicted first, as for a checkpoint larger than RAM; `warm`: just read) it
times `cp -r SRC DST && sync` and `ladder convert SRC --out DST --no-verify` (`--verify`: with the
verification, for its peak memory), best of --repeats: the ratio, the conversion with its start-up
(`+start`), its own peak RSS (VmHWM) and the spread over the repeats. Goals (issue 41): copy <= 1.25x
`cp -r && sync`, link < 0.05x, peak RSS < 1.5x the largest shard.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from transformers import LlamaConfig

from benchmarks.common import PUBLISHED_SHAPES, REPOSITORY, run_benchmark, write_synthetic_checkpoint
from ladder.errors import ArgumentParser

CONVERT_IN_CHILD = """
import json, os, sys, time
from ladder.convert.convert import convert_checkpoint
source, out, dtype, weights, verify = sys.argv[1:6]
started = time.perf_counter()
convert_checkpoint(source, out=out, dtype=None if dtype == "keep" else dtype, verify=verify == "True", weights=weights)
os.sync()
seconds = time.perf_counter() - started
# VmHWM is this process's own peak: wait4's ru_maxrss would also count the parent's memory at fork.
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(json.dumps({"seconds": seconds, "peak_rss": peak_kib * 1024, "heavy_imports": heavy}))
"""


def prepare(source: Path, out: Path, cache: str) -> None:
    """No output yet, and the source's files dropped from the page cache (only clean pages go, so sync
    first), then read through once for `warm`."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    files = [path for path in source.rglob("*") if path.is_file()]
    for path in files:
        descriptor = os.open(path, os.O_RDONLY)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(descriptor)
    if cache == "warm":
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)


def time_copy(source: Path, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(f"cp -r '{source}' '{out}' && sync", shell=True, check=True)
    return time.perf_counter() - started


def time_conversion(source: Path, out: Path, dtype: str, weights: str, verify: bool) -> tuple[float, float, int]:
    """(seconds inside the process, seconds with start-up, peak RSS in bytes) of one conversion."""
    command = [sys.executable, "-c", CONVERT_IN_CHILD, str(source), str(out), dtype, weights, str(verify)]
    started = time.perf_counter()
    child = subprocess.run(command, cwd=REPOSITORY, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"conversion failed with status {child.returncode}")
    result = json.loads(child.stdout.strip().splitlines()[-1])
    if result["heavy_imports"] and dtype == "keep":
        print(f"  (the copy path imported {', '.join(result['heavy_imports'])})")
    return result["seconds"], wall, result["peak_rss"]


def measure(argv: list[str]) -> int:
    parser = ArgumentParser(prog="benchmarks.convert_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--verify", action="store_true", help="with verification (goal: peak RSS <= 2 shards)")
    parser.add_argument("--cache", choices=["cold", "warm"], nargs="+", default=["cold", "warm"])
    parser.add_argument("--mode", choices=["copy", "link", "bfloat16"], nargs="+", default=["copy", "link", "bfloat16"])
    parser.add_argument("--workdir", type=Path, default=REPOSITORY / "runs" / "bench")
    args = parser.parse_args(argv)

    source = args.workdir / f"convert-source-{args.layers}l"
    if not source.exists():
        print(f"writing the synthetic checkpoint into {source} (once) ...", flush=True)
        config = LlamaConfig(
            **{**PUBLISHED_SHAPES["llama-3.1-8b"], "num_hidden_layers": args.layers}, tie_word_embeddings=True
        )
        write_synthetic_checkpoint(source, config, max_shard_size=2 * 10**9)
    shards = sorted(source.glob("*.safetensors"))
    total, largest = sum(p.stat().st_size for p in shards), max(p.stat().st_size for p in shards)
    print(
        f"checkpoint: {total / 1e9:.2f} GB in {len(shards)} shards, largest {largest / 1e9:.2f} GB; "
        f"{os.cpu_count()} CPUs; best of {args.repeats}"
    )
    print(
        f"{'mode':<9}{'cache':<6}{'cp -r':>8}{'convert':>9}{'ratio':>7}{'+start':>8}{'ratio':>7}"
        f"{'peak RSS':>10}{'RSS/shard':>10}{'spread cp/conv':>16}"
    )
    out = args.workdir / "convert-out"
    for mode in args.mode:
        dtype = "keep" if mode in ("copy", "link") else mode
        weights = "link" if mode == "link" else "copy"
        for cache in args.cache:
            copies, conversions = [], []
            for _ in range(args.repeats):
                prepare(source, out, cache)
                copies.append(time_copy(source, out))
                prepare(source, out, cache)
                conversions.append(time_conversion(source, out, dtype, weights, args.verify))
            shutil.rmtree(out, ignore_errors=True)
            copy_seconds = min(copies)
            seconds, wall, _ = min(conversions)
            peak_rss = max(rss for _, _, rss in conversions)
            print(
                f"{mode:<9}{cache:<6}{copy_seconds:>7.2f}s{seconds:>8.2f}s{seconds / copy_seconds:>7.2f}"
                f"{wall:>7.2f}s{wall / copy_seconds:>7.2f}{peak_rss / 1e9:>8.2f}GB{peak_rss / largest:>10.2f}"
                f"{max(copies) / copy_seconds:>9.2f}/{max(c[0] for c in conversions) / seconds:.2f}",
                flush=True,
            )
    print("goals: copy ratio <= 1.25, link ratio < 0.05, RSS/shard < 1.5")
    return 0


if __name__ == "__main__":
    sys.exit(run_benchmark("convert_speed", measure))
