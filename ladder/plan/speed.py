"""Predicted tensor-parallel decode time, standard against ladder wiring, from published (or
calibrated) figures: devices.tsv and links.tsv beside this file, each row with its source.

- compute: a roofline per module at the device's achieved share of peak, plus a cost per kernel;
- communication: latency + 2 (T-1)/T n / bus bandwidth (nccl-tests' model); host_us + n host_ns_per_byte
  of it occupies the compute stream (a CPU's gloo thread; nothing for NCCL);
- overlap: Algorithm 1's layer loop replayed as ladder/tp/shard.py runs it, the compute stream and the
  link as two serial resources; an engine that hides fewer all-reduces (`overlapped_reductions`) runs
  the others as a standard layer does.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..cli_types import float_in, int_in
from ..errors import UsageError
from ..units import parse_size
from .costs import ModelShape, ModuleCost, forward_cost

PROFILES = Path(__file__).resolve().parent
# --hardware's default, and --train-devices (past any cluster a count is a typo).
DEFAULT_HARDWARE, TRAIN_DEVICES = "h100", int_in(1, 1 << 20)
# The range of each figure a command line may give (per second; microseconds), physical with room.
FIGURE_RANGES = {"FLOPS": (1e6, 1e18), "BANDWIDTH": (1e3, 1e15), "LATENCY_US": (1e-3, 1e6)}

# Kernels (compiled: gpt-fast's fused graph) or eager operators (those ladder/tp/shard.py dispatches)
# each module launches, each at the device's per-kernel cost.
KERNELS = {"compiled": {"attention": 6, "mlp": 4, "head": 2}, "eager": {"attention": 39, "mlp": 14, "head": 12}}

# A ladder layer's two all-reduces: its attention output's and its MLP output's.
BOTH = ("attention", "mlp")


@dataclass(frozen=True)
class Device:
    name: str
    flops: float  # peak FLOP/s in the dtype decoded in
    bandwidth: float  # peak memory bytes/s
    efficiency: float  # share of both peaks that decode kernels reach
    kernel_us: float  # per kernel replayed in a CUDA graph
    eager_kernel_us: float  # per kernel (or CPU operator) launched one by one
    memory: float = 0.0  # bytes a retraining fits into; 0: this machine's RAM
    source: str = ""

    @property
    def on_cpu(self) -> bool:
        return self.name.startswith("cpu")

    def module_seconds(self, cost: ModuleCost, kernels: int, graphs: bool) -> float:
        roofline = max(cost.bytes / self.bandwidth, cost.flops / self.flops) / self.efficiency
        return roofline + kernels * 1e-6 * (self.kernel_us if graphs else self.eager_kernel_us)


def overlapped_reductions(engine: str, device: Device, full_graph: bool) -> tuple[str, ...]:
    """Which of a ladder layer's all-reduces `engine` runs behind compute; the others block. vLLM hides
    the MLP's only in a full-graph step, since piecewise graphs split at attention and a fork there could
    not be joined; on a CPU neither (no streams: vLLM's all-reduce is synchronous)."""
    if engine == "tp-runtime":
        return BOTH
    if device.on_cpu:
        return ()
    return BOTH if full_graph else ("attention",)


@dataclass(frozen=True)
class Link:
    name: str
    base_us: float  # latency of any all-reduce
    hop_us: float  # latency per ring step, 2 (T - 1) of them
    bus_bandwidth: float  # bytes/s, nccl-tests convention
    host_us: float  # compute-stream time of any all-reduce (gloo's thread on a CPU; 0 for NCCL)
    host_ns_per_byte: float  # and per byte of the message (gloo's thread woken per packet)
    shared: bool = False  # all-reduces in flight share the link (gloo) rather than queue (NCCL)
    source: str = ""

    def all_reduce_seconds(self, nbytes: float, ranks: int) -> float:
        if ranks < 2:
            return 0.0
        steps = 2 * (ranks - 1)
        return 1e-6 * (self.base_us + steps * self.hop_us) + steps / ranks * nbytes / self.bus_bandwidth

    def host_seconds(self, nbytes: float, ranks: int) -> float:
        whole = self.all_reduce_seconds(nbytes, ranks)
        return min(whole, 1e-6 * self.host_us + 1e-9 * self.host_ns_per_byte * nbytes)


@functools.cache
def _table(name: str) -> dict[str, dict[str, str]]:
    lines = [line for line in (PROFILES / name).read_text().splitlines() if line and not line.startswith("#")]
    return {row["name"]: row for row in csv.DictReader(lines, delimiter="\t")}


def _profile(kind: type, row: dict) -> Device | Link:
    names = [name for name in kind.__dataclass_fields__ if name not in ("name", "source", "shared")]
    return kind(name=row["name"], source=row.get("source", ""), **{key: float(row[key]) for key in names})


def device_names() -> list[str]:
    return list(_table("devices.tsv"))


def link_names() -> list[str]:
    return list(_table("links.tsv"))


def _figures(parts: list[str], flag: str, names: tuple[str, ...]) -> list[float]:
    try:
        return [float_in(*FIGURE_RANGES[name])(part) for part, name in zip(parts, names)]
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"{flag} {','.join(parts)!r}: {' and '.join(names)}: {error}") from None


def device_profile(spec: str, flag: str = "--hardware") -> Device:
    """A device by name (devices.tsv), `FLOPS,BANDWIDTH[,MEMORY]` (without MEMORY no retraining is
    priced), or a `ladder plan --calibrate` JSON file."""
    if (row := _table("devices.tsv").get(spec.lower())) is not None:
        return _profile(Device, row)
    if spec.endswith(".json"):
        return Device(**_calibration(spec)["device"])
    parts = spec.split(",")
    if len(parts) not in (2, 3):
        raise UsageError(
            f"{flag} {spec!r} is not one of {', '.join(device_names())}, FLOPS,BANDWIDTH[,MEMORY] "
            "(e.g. 989e12,3.35e12,80GB) or a calibration .json"
        )
    flops, bandwidth = _figures(parts[:2], flag, ("FLOPS", "BANDWIDTH"))
    memory = parse_size(parts[2], f"{flag} MEMORY") if len(parts) == 3 else 0.0
    return Device(spec, flops, bandwidth, 1.0, 1.0, 4.5, memory, "given on the command line")


def link_profile(spec: str) -> Link:
    if (row := _table("links.tsv").get(spec.lower())) is not None:
        return _profile(Link, row)
    if spec.endswith(".json"):
        return Link(**_calibration(spec)["links"][0])
    parts = spec.split(",")
    if len(parts) != 2:
        raise UsageError(
            f"--interconnect {spec!r} is not one of {', '.join(link_names())}, BANDWIDTH,LATENCY_US "
            "(e.g. 370e9,20) or a calibration .json"
        )
    bandwidth, latency = _figures(parts, "--interconnect", ("BANDWIDTH", "LATENCY_US"))
    return Link(spec, latency, 0.0, bandwidth, 0.0, 0.0, source="given on the command line")


def _calibration(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        device, *links = Device(**data["device"]), *(Link(**link) for link in data["links"])
        figures = [
            value for profile in (device, *links) for value in asdict(profile).values() if not isinstance(value, str)
        ]
        rates = [device.flops, device.bandwidth, device.efficiency, *(link.bus_bandwidth for link in links)]
        if not links or any(math.isnan(value) or value < 0 for value in figures) or min(rates) <= 0:
            raise ValueError("a figure is missing, negative, nan, or a rate 0")  # inf: a rate too fast to measure
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{path} is not a calibration `ladder plan --calibrate` wrote ({error})") from None
    return data


class _SerialLink:
    """NCCL: all-reduces on one communicator run one after another, in launch order."""

    def __init__(self, wire: float):
        self.wire, self.free, self.done = wire, 0.0, {}

    def start(self, index: int, now: float) -> None:
        self.free = max(now, self.free) + self.wire
        self.done[index] = self.free

    def finish(self, index: int) -> float:
        return self.done[index]


class _SharedLink:
    """gloo: each all-reduce in flight runs on its own worker thread and they share the link equally
    (measured here: two 32 KB all-reduces launched together on a 100 Mbit/s link finish the first at
    8.4 ms and both at 10.9 ms, one alone in 5.0 ms; sharing predicts 10 and 10, one after another 5 and 10)."""

    def __init__(self, wire: float):
        self.wire, self.now, self.active, self.done = wire, 0.0, {}, {}

    def _advance(self, until: float) -> None:
        """Run the link to time `until`: in-flight all-reduces progress at 1 / (how many are in flight)."""
        while self.active and self.now < until:
            share, smallest = len(self.active), min(self.active.values())
            if self.now + smallest * share > until:
                for index in self.active:
                    self.active[index] -= (until - self.now) / share
                break
            self.now += smallest * share
            for index, left in list(self.active.items()):
                if left == smallest:
                    self.done[index] = self.now
                    del self.active[index]
                else:
                    self.active[index] = left - smallest
        self.now = max(self.now, until)

    def start(self, index: int, now: float) -> None:
        self._advance(now)
        if self.wire > 0:
            self.active[index] = self.wire
        else:  # nothing on the wire (all of it is host time)
            self.done[index] = now

    def finish(self, index: int) -> float:
        while index not in self.done:  # nothing is launched while the compute stream waits
            self._advance(self.now + min(self.active.values()) * len(self.active))
        return self.done[index]


class Timeline:
    """One forward replayed: its duration (the compute stream's clock), and which all-reduces ran behind
    compute. An all-reduce costs the compute stream `host` seconds and the link `wire` seconds, one at a
    time (NCCL) or sharing it (gloo); `wire` < 0: no communication at all (the bound)."""

    def __init__(self, wire: float, host: float, shared: bool):
        self.communicate, self.host = wire >= 0, host
        self.link = _SharedLink(max(wire, 0.0)) if shared else _SerialLink(max(wire, 0.0))
        self.seconds = 0.0
        self.hidden: list[int] = []  # indices (2 per layer: attention, MLP) of overlapped all-reduces
        self.launched_at: dict[int, int] = {}  # each all-reduce launched (index) -> computes issued so far then
        self.computes = 0

    def compute(self, seconds: float) -> None:
        self.seconds += seconds
        self.computes += 1

    def reduce(self, index: int, blocking: bool) -> int | None:
        """Launch all-reduce `index`: pending (returned) unless `blocking`, which waits for it at once."""
        if not self.communicate:
            return None
        self.seconds += self.host
        self.link.start(index, self.seconds)
        self.launched_at[index] = self.computes
        if blocking:
            self.wait(index)
            return None
        return index

    def wait(self, index: int | None) -> None:
        if index is None:
            return
        if self.computes > self.launched_at[index]:
            self.hidden.append(index)
        self.seconds = max(self.seconds, self.link.finish(index))


def replay(
    ladder: list[bool],
    attention_s: float,
    mlp_s: float,
    head_s: float,
    wire_s: float,
    host_s: float,
    shared_link: bool = False,
    overlapped: tuple[str, ...] = BOTH,
) -> Timeline:
    """Replay ladder/tp/shard.py's `ModelShard.forward` (one ladder flag per layer); `wire_s` < 0: no
    communication at all (the bound)."""
    run = Timeline(wire_s, host_s, shared_link)
    pending_attention = pending_mlp = None
    for layer, is_ladder in enumerate(ladder):
        run.wait(pending_attention)
        if not is_ladder:  # a standard layer starts from the whole residual: every all-reduce done
            run.wait(pending_mlp)
            pending_mlp = None
        run.compute(attention_s)
        pending_attention = run.reduce(2 * layer, blocking=not is_ladder or "attention" not in overlapped)
        run.wait(pending_mlp)
        run.compute(mlp_s)
        pending_mlp = run.reduce(2 * layer + 1, blocking=not is_ladder or "mlp" not in overlapped)
    run.wait(pending_attention)
    run.wait(pending_mlp)
    run.compute(head_s)
    return run


@dataclass(frozen=True)
class Setting:
    device: Device
    link: Link
    tp: int
    batch: int
    prompt: int = 1024
    new_tokens: int = 512
    dtype_bytes: int = 2
    cuda_graphs: bool = True
    engine: str = "tp-runtime"  # or "vllm": which ladder all-reduces run behind compute (overlapped_reductions)
    piecewise: bool = False  # vLLM's CUDA graphs split at attention, never one full graph per step


@dataclass
class Prediction:
    layers: list[int]
    standard_ms: float  # decode, per token (per step of the whole batch)
    ladder_ms: float
    bound_ms: float  # no communication at all
    hidden: int  # all-reduces overlapped, of 2 * num_layers
    all_reduces: int
    standard_prefill_ms: float
    ladder_prefill_ms: float

    @property
    def speedup(self) -> float:
        return self.standard_ms / self.ladder_ms

    @property
    def bound_speedup(self) -> float:
        return self.standard_ms / self.bound_ms


def step_times(shape: ModelShape, setting: Setting, ladder_layers: list[int], query_tokens: int) -> dict[str, Timeline]:
    context = setting.prompt + setting.new_tokens  # the static cache is attended whole (gpt-fast, ladder/tp/runtime.py)
    cost = forward_cost(shape, setting.batch, query_tokens, context, setting.tp, setting.dtype_bytes)
    kernels = KERNELS["compiled" if setting.cuda_graphs else "eager"]
    attention, mlp, head = (
        setting.device.module_seconds(getattr(cost, name), kernels[name], setting.cuda_graphs)
        for name in ("attention", "mlp", "head")
    )
    host = setting.link.host_seconds(cost.all_reduce_bytes, setting.tp)
    wire = setting.link.all_reduce_seconds(cost.all_reduce_bytes, setting.tp) - host if setting.tp > 1 else -1.0
    chosen = set(ladder_layers)
    flags = [index in chosen for index in range(shape.num_layers)]
    full_graph = setting.cuda_graphs and not setting.piecewise and query_tokens == 1  # vLLM: uniform decode
    overlapped = overlapped_reductions(setting.engine, setting.device, full_graph)
    return {
        "standard": replay([False] * shape.num_layers, attention, mlp, head, wire, host, setting.link.shared),
        "ladder": replay(flags, attention, mlp, head, wire, host, setting.link.shared, overlapped),
        "bound": replay([False] * shape.num_layers, attention, mlp, head, -1.0, 0.0),
    }


def predict(shape: ModelShape, setting: Setting, ladder_layers: list[int]) -> Prediction:
    decode = step_times(shape, setting, ladder_layers, query_tokens=1)
    prefill = step_times(shape, setting, ladder_layers, query_tokens=setting.prompt)
    return Prediction(
        layers=sorted(ladder_layers),
        standard_ms=1e3 * decode["standard"].seconds,
        ladder_ms=1e3 * decode["ladder"].seconds,
        bound_ms=1e3 * decode["bound"].seconds,
        hidden=len(decode["ladder"].hidden),
        all_reduces=len(decode["ladder"].launched_at),
        standard_prefill_ms=1e3 * prefill["standard"].seconds,
        ladder_prefill_ms=1e3 * prefill["ladder"].seconds,
    )
