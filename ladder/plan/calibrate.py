"""`ladder plan --calibrate`: this machine's profile for the model in speed.py, measured by two gloo
ranks at once (one thread each, float32): the device's rates on what decode does, and the link's
latency and bandwidth from blocking all-reduces; an asynchronous all-reduce beside a longer matmul
gives, by its excess, the all-reduce's cost to the compute stream (gloo's thread wakes per packet).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from dataclasses import asdict
from pathlib import Path

from ..launch import rank_environment, torchrun
from .emulated_link import LOOPBACK, emulated_link
from .speed import KERNELS, Device, Link

LINK_SIZES = (2048, 8192, 32768)  # bytes: the branch outputs of the CPU benchmark shapes at batch 1-4
LINK_REPEATS = 12
DEVICE_REPEATS = 25


def fit_latency_bandwidth(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares (latency s, bandwidth bytes/s); a slope lost in noise is infinite bandwidth. Fewer
    than two different sizes: `statistics.StatisticsError`, a ValueError."""
    slope, latency = statistics.linear_regression(sizes, seconds)
    return max(latency, 0.0), (1 / slope if slope > 0 else float("inf"))


def _median_seconds(function, repeats: int) -> float:
    return statistics.median(timeit.repeat(function, number=1, repeat=repeats))


def device_rates() -> dict[str, float]:
    """Achieved float32 rates over 128 MiB of weights (beyond the caches): memory bandwidth at one
    token, the matmul rate at four (far below a large matmul's on a CPU); microseconds per operator.
    On the thread count the caller set (1 per rank)."""
    import torch

    torch.manual_seed(0)
    weights = [torch.randn(2048, 2048) for _ in range(8)]

    def one_pass(tokens: torch.Tensor) -> None:
        for weight in weights:
            torch.nn.functional.linear(tokens, weight)

    one, four = torch.randn(1, 2048), torch.randn(4, 2048)
    one_pass(one), one_pass(four)
    elements = sum(weight.numel() for weight in weights)
    # Medians of many short passes: a pass is ~10 ms, and single passes vary by 20% on a shared machine.
    bandwidth = 4 * elements / _median_seconds(lambda: one_pass(one), DEVICE_REPEATS)
    flops = 2 * 4 * elements / _median_seconds(lambda: one_pass(four), DEVICE_REPEATS)
    return {"flops": flops, "bandwidth": bandwidth, "operator_us": measure_operator_us()}


def machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.cache
def matmul_peak(size: int = 1024, seconds: float = 1.0) -> float:
    """This CPU's float32 peak with every thread (training's MFU reference), once per process."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # the first call starts the thread pool
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        a @ b
        best = max(best, 2 * size**3 / (time.perf_counter() - started))
    return best


def measure_operator_us() -> float:
    """A tiny model's one-token decode step (its roofline time nil) over the operators it dispatches."""
    import torch
    from transformers import LlamaConfig

    from ..tp.shard import ModelShard

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    shard = ModelShard(config).eval()
    shard.setup_cache(1, 32)
    ids, position = torch.zeros(1, 1, dtype=torch.long), torch.tensor([3])
    with torch.inference_mode():
        shard(ids, position)
        seconds = _median_seconds(lambda: shard(ids, position), 30)
    kernels = KERNELS["eager"]
    operators = config.num_hidden_layers * (kernels["attention"] + kernels["mlp"]) + kernels["head"]
    return 1e6 * seconds / operators


def _link_rank(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from ..tp.runtime import prioritize_gloo_threads

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if os.geteuid() == 0:
        prioritize_gloo_threads()
    rank = dist.get_rank()
    dist.barrier()
    # Both ranks at once, as they decode: they share the memory bus (and the machine's other load).
    rates = device_rates()
    slowest = torch.tensor([rates["bandwidth"], rates["flops"], -rates["operator_us"]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    rates = {"bandwidth": slowest[0].item(), "flops": slowest[1].item(), "operator_us": -slowest[2].item()}
    blocking = {size: [] for size in LINK_SIZES}
    for _ in range(LINK_REPEATS):
        for size in LINK_SIZES:
            tensor = torch.ones(size // 4)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            blocking[size].append(time.perf_counter() - start)
    # Overlap probe, per size: an asynchronous all-reduce launched beside a matmul loop that runs about
    # twice as long; the excess over the loop alone is what the all-reduce cost the compute stream.
    a = torch.randn(256, 256)
    one = _median_seconds(lambda: a @ a, 20)

    def compute(loops: int) -> None:
        for _ in range(loops):
            a @ a

    alone, beside = {size: [] for size in LINK_SIZES}, {size: [] for size in LINK_SIZES}
    for size in LINK_SIZES:
        loops = max(1, round(2 * statistics.median(blocking[size]) / one))
        for _ in range(LINK_REPEATS):
            dist.barrier()
            start = time.perf_counter()
            compute(loops)
            alone[size].append(time.perf_counter() - start)
            tensor = torch.ones(size // 4)
            dist.barrier()
            start = time.perf_counter()
            work = dist.all_reduce(tensor, async_op=True)
            compute(loops)
            work.wait()
            beside[size].append(time.perf_counter() - start)
    if rank == 0:  # medians by LINK_SIZES
        medians = {name: [statistics.median(series[size]) for size in LINK_SIZES]
                   for name, series in (("blocking", blocking), ("alone", alone), ("beside", beside))}  # fmt: skip
        out.write_text(json.dumps(medians | {"device": rates}))
    dist.destroy_process_group()


def measure_link(name: str, prefix: list[str] | None = None) -> tuple[Device, Link]:
    """Two gloo ranks (behind `prefix`, e.g. `ip netns exec NAME`): the slower rank's device, and the link."""
    with tempfile.TemporaryDirectory(prefix="ladder-plan-link-") as scratch:
        out = Path(scratch, "link.json")
        command = [*torchrun(2, prefix), "-m", "ladder.plan.calibrate", "--link-rank", str(out)]
        result = subprocess.run(command, env=rank_environment(1), capture_output=True, text=True)
        if result.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the link probe failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
        medians = json.loads(out.read_text())
    latency, bandwidth = fit_latency_bandwidth(LINK_SIZES, medians["blocking"])
    hosts = [max(0.0, beside - alone) for beside, alone in zip(medians["beside"], medians["alone"], strict=True)]
    host_latency, host_bandwidth = fit_latency_bandwidth(LINK_SIZES, hosts)
    rates = medians["device"]
    device = Device(
        name="cpu (measured)",
        flops=rates["flops"],
        bandwidth=rates["bandwidth"],
        efficiency=1.0,
        kernel_us=rates["operator_us"],
        eager_kernel_us=rates["operator_us"],
        memory=machine_memory(),
        source=f"measured here by ladder plan --calibrate: 2 ranks at once ({name}), float32, 1 thread per rank",
    )
    return device, Link(
        name=name,
        base_us=1e6 * latency,
        hop_us=0.0,
        bus_bandwidth=bandwidth,  # at T=2 the bus and algorithm bandwidths are equal
        host_us=1e6 * host_latency,
        host_ns_per_byte=1e9 / host_bandwidth,
        shared=True,  # gloo runs each collective in flight on its own worker thread
        source=f"measured here by ladder plan --calibrate: gloo, 2 ranks, {name}",
    )


def calibrate(link: str = LOOPBACK) -> dict:
    with emulated_link(link) as prefix:
        device, measured = measure_link(link, prefix)
    return {
        "device": asdict(device),
        "links": [asdict(measured)],
        "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0]},
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--link-rank":
        _link_rank(Path(sys.argv[2]))
    else:
        sys.exit("usage: python -m ladder.plan.calibrate --link-rank OUT (run by measure_link under torchrun)")
