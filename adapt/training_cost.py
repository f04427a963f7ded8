"""What a recipe's training costs before it runs (`ladder adapt RECIPE --plan`, and each layer choice's
retraining in `ladder plan --recipe`), from the model's config alone (ladder/plan/costs.py counts its
parameters; no weight is read): memory per device by part, whether it fits (and else the fewest
devices that do), FLOPs per token (model and hardware: recompute included; backward only where
gradients flow), tokens/s at an assumed utilisation beside a measured anchor, and device-hours.
docs/retraining.md describes each part and its sources.

Saved activations per trained layer and token, as autograd keeps them with adapt/memory.py's lean MLP
and norms and sdpa (tests/test_adapt_plan.py counts them with saved-tensor hooks): the layer's stream
inputs, the normed inputs of the attention and of the MLP, q, k, v, the attention output and its
fp32 log-sum-exp, gate and up. `full` recompute keeps only the stream inputs; `selective` recomputes
every other layer. The memory model is checked against torchtitan's published 8B FSDP runs
(`torchtitan_reserved_bytes`, as the program `TORCHTITAN` holds memory).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from dataclasses import dataclass

from ladder.errors import UsageError
from ladder.io.loading import EMBEDDED
from ladder.layers import parse_ladder_layers
from ladder.plan.calibrate import machine_memory, matmul_peak
from ladder.plan.costs import ModelShape, parameter_counts
from ladder.plan.models import model_config, published_config
from ladder.plan.speed import Device, device_names, device_profile

from .recipe import Recipe, model_path

POLICIES = ("none", "selective", "full")
TORCHTITAN_OP_POLICY = "op"  # torchtitan's selective policy: priced for its published check only
# Share of a device's memory a training may fill; the rest is for what the count misses.
MEMORY_MARGIN = 0.95
MAX_DEVICES = 1024  # the most devices a training that does not fit is tried on
# On a GPU: the caching allocator's peak reserve above its peak allocation (from torchtitan's tables),
# and what is held outside it: the CUDA context, NCCL's buffers (docs/retraining.md).
ALLOCATOR_RESERVE = 0.10
CUDA_CONTEXT_BYTES = 0.5 * 2**30
NCCL_BYTES = 0.75 * 2**30
# A CPU process's own memory, whatever the batch: Python, torch, the tokenizer, the data (measured 541-1,095 MiB).
CPU_RUNTIME_BYTES = 550 * 2**20
# Share of the peak FLOP/s spent on the hardware FLOPs, assumed on accelerators: the low end of what the
# measured anchor (ANCHOR) reaches by this module's count, recompute included.
UTILISATION = {"eager": 0.35, "compiled": 0.40}
UTILISATION_SOURCE = "assumed, {mode}"
# torchtitan's published throughput and peak reserve (GiB: name, GPUs, eager, compiled) for Llama-3.1-8B
# under FSDP2 (its benchmarks/llama3_h100_202412_torchtitan.md, commit 9dec370, Tables 1 and 3).
ANCHOR = dict(model="meta-llama/Llama-3.1-8B", gpus=8, tokens_per_second_per_gpu=6667, peak_flops=989e12)
ANCHOR_SOURCE = "torchtitan's Llama-3.1-8B on 8 H100s, FSDP2, compiled: 6,667 tokens/s/GPU, measured"
PUBLISHED_MEMORY = [("torchtitan 8B, 8 GPUs", 8, 82.4, 77.0), ("torchtitan 8B, 128 GPUs", 128, 67.0, 62.0)]


@dataclass(frozen=True)
class Program:
    """How a training program's own code holds memory, where programs differ."""

    name: str
    streams: int  # residual streams a decoder layer keeps for its backward (a ladder layer: two)
    loss: str  # "chunked" (adapt/losses.py) or "unchunked" (the micro-batch's float32 logits at once)


ADAPT = Program("ladder adapt", streams=2, loss="chunked")
# torchtitan at its published figures' commit: plain Llama blocks, the loss on the whole micro-batch's logits.
TORCHTITAN = Program("torchtitan", streams=1, loss="unchunked")


def layer_saved_bytes(
    shape: ModelShape, tokens: int, policy: str, compute_bytes: int, stream_bytes: int, streams: int = 2
) -> float:
    """Average bytes one trained decoder layer keeps for backward at `tokens` per micro-batch under
    `policy` (see above). torchtitan's "op" policy (its `_save_list`) keeps the attention's output and
    log-sum-exp, every other matmul's output in call order, and the layer's input."""
    hidden, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    inputs = streams * hidden * stream_bytes * tokens  # a recomputed layer keeps its streams
    if policy == TORCHTITAN_OP_POLICY:
        computed = hidden + kv + shape.intermediate_size + hidden + hidden  # q, v, gate, down (1st, 3rd, 5th, 7th); out
    else:
        computed = 4 * hidden + 2 * kv + 2 * shape.intermediate_size  # normed x2, q, out, k, v, gate, up
    kept = inputs + (computed * compute_bytes + 4 * shape.num_heads) * tokens  # and the fp32 log-sum-exp
    return {"none": kept, "full": inputs, "selective": (kept + inputs) / 2, TORCHTITAN_OP_POLICY: kept}[policy]


@dataclass(frozen=True)
class TrainingSetup:
    """A recipe's training as its cost is priced."""

    micro_batch: int
    seq_len: int
    devices: int
    fsdp: bool
    bf16: bool
    trained: list[int]  # the decoder layers whose weights train
    grads_from: int  # the lowest layer gradients flow through (layers when none)
    head_trained: bool
    accelerator: bool
    tokens: float  # the budget
    program: Program = ADAPT


def setup_of(
    recipe: Recipe,
    shape: ModelShape,
    devices: int,
    accelerator: bool,
    fsdp: bool | None = None,
    ladder_layers: list[int] | None = None,
) -> TrainingSetup:
    """The recipe's training on `devices` devices (FSDP over them by default when more than one);
    `ladder_layers`: the model's, where a run knows them (a ladder checkpoint's own, or auto:N's choice)."""
    mode, layers = recipe.trainable.mode, shape.num_layers
    trained = []  # lora: adapters on every layer, base weights frozen
    if mode == "all":
        trained = list(range(layers))
    elif mode == "ladder" and ladder_layers is not None:
        trained = ladder_layers
    elif mode == "ladder":
        trained = parse_ladder_layers(recipe.model.ladder_layers or [], layers, "model.ladder_layers")
    elif mode == "layers":
        trained = parse_ladder_layers(recipe.trainable.layers, layers, "trainable.layers")
    return TrainingSetup(
        micro_batch=recipe.batch.micro_batch,
        seq_len=recipe.data.seq_len,
        devices=devices,
        fsdp=devices > 1 if fsdp is None else fsdp,
        bf16=recipe.precision == "bf16",
        trained=sorted(trained),
        grads_from=0 if mode == "lora" else min(trained, default=layers),
        head_trained=mode == "all",
        accelerator=accelerator,
        tokens=recipe.budget,
    )


def memory_parts(shape: ModelShape, setup: TrainingSetup, policy: str, chunk_positions: int) -> dict[str, float]:
    """Bytes per device by part, at the peak (the last layer's backward of a micro-batch), each part
    at its own largest: the sum errs high where two do not coincide."""
    n, program = setup.devices, setup.program
    tokens = setup.micro_batch * setup.seq_len
    counts = parameter_counts(shape)
    total = counts.total(shape.num_layers)
    trained = counts.per_layer * len(setup.trained) + (counts.embedding + counts.lm_head) * setup.head_trained
    compute_bytes = 2 if setup.bf16 else 4
    # Under FSDP's bf16 policy the residual streams are bf16 too; under autocast alone they stay fp32.
    stream_bytes = 2 if setup.bf16 and setup.fsdp else 4
    # Autograd keeps activations for every layer from the lowest trained one up.
    saving = shape.num_layers - setup.grads_from
    per_layer = layer_saved_bytes(shape, tokens, policy, compute_bytes, stream_bytes, program.streams)
    # One layer's backward: its recomputed activations (when recomputed) and the gradients flowing through it.
    backward = (
        layer_saved_bytes(shape, tokens, "none", compute_bytes, stream_bytes, program.streams) * (policy != "none")
        + tokens * (2 * shape.hidden_size + 2 * shape.intermediate_size) * 4
    )
    head_weight = counts.lm_head or counts.embedding
    if program.loss == "unchunked":
        # Largest in the loss's backward: log-softmax's float32 output, its gradient and the logits', over
        # every position; then the hidden states and their gradient.
        head = tokens * shape.vocab_size * 4 * 3 + tokens * shape.hidden_size * compute_bytes * 2
    else:
        # The chunk's logits and their gradient; the hidden states and theirs.
        head = chunk_positions * shape.vocab_size * 4 * 2 + tokens * shape.hidden_size * 4 * 2
        if setup.head_trained:
            # The head's gradient, a float32 sum built in the forward (in bf16 also a chunk's product and the cast).
            head += head_weight * (4 + 4 + compute_bytes if setup.bf16 else 4)
    # FSDP2 keeps the root unit (embedding, head) gathered from forward to backward; a layer's unit is
    # gathered with the next one prefetched, and its gradients reduce-scattered in float32.
    root = counts.embedding + counts.lm_head
    buffers = ((root + 2 * counts.per_layer) * compute_bytes + counts.per_layer * 4) if setup.fsdp else 0
    allocated = {
        "parameters": total * 4 / n,
        "gradients": trained * 4 / n,
        "optimizer_state": trained * 8 / n,
        "activations": per_layer * saving,
        "backward_transient": backward if saving else 0,
        "head_loss": head,
        "buffers": buffers,
    }
    if setup.accelerator:
        # The caching allocator reserves more than it allocates; the CUDA context and NCCL sit outside it.
        reserve = ALLOCATOR_RESERVE * sum(allocated.values())
        runtime = CUDA_CONTEXT_BYTES + NCCL_BYTES * (n > 1)
    else:
        reserve, runtime = 0.0, CPU_RUNTIME_BYTES
    return allocated | {"allocator_reserve": reserve, "runtime": runtime}


def flops_per_token(shape: ModelShape, setup: TrainingSetup, policy: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token: forward everywhere, backward where gradients
    flow (weights' gradients only for trained layers), plus the recomputed forwards."""
    matmul = 2 * (parameter_counts(shape).per_layer - 2 * shape.hidden_size)  # a layer's matmuls (its norms are not)
    attention = 2 * setup.seq_len * shape.num_heads * shape.head_dim  # causal: QK and AV over s/2 keys each
    layer_forward = matmul + attention
    head_forward = 2 * shape.hidden_size * shape.vocab_size
    flowing = shape.num_layers - setup.grads_from
    trained = len(setup.trained)
    backward = flowing * (matmul + 2 * attention) + trained * matmul  # input grads, weight grads
    backward += head_forward * ((flowing > 0) + setup.head_trained)
    model = shape.num_layers * layer_forward + head_forward + backward
    if policy == TORCHTITAN_OP_POLICY:  # k, o and up recomputed (layer_saved_bytes)
        kv = shape.num_kv_heads * shape.head_dim
        matmuls = 2 * shape.hidden_size * (kv + shape.hidden_size + shape.intermediate_size)
        return model, model + flowing * matmuls
    recomputed = {"none": 0, "selective": math.ceil(flowing / 2), "full": flowing}[policy]
    return model, model + recomputed * layer_forward


@dataclass
class TrainingCost:
    devices: int
    device_memory: float
    device_flops: float
    utilisation: float
    utilisation_source: str
    activation_checkpointing: str
    peak_bytes_per_device: float
    memory: dict[str, float]
    peak_by_policy: dict[str, float]
    saved_activation_bytes_per_layer: float
    fits: bool  # the peak within MEMORY_MARGIN of the device's memory
    fits_with: dict | None  # when it does not: the fewest devices (then micro-batch 1) that fit, or None
    model_flops_per_token: float
    flops_per_token: float  # hardware FLOPs, with recompute
    tokens_per_second: float  # all devices
    tokens_per_second_per_device: float
    mfu: float
    device_hours: float
    anchor_mfu: float  # the measured anchor's (ANCHOR) MFU by this module's count
    anchor_device_hours: float  # the budget's device-hours at that MFU


def smallest_fit(shape: ModelShape, setup: TrainingSetup, device_memory: float, policy: str, chunk: int) -> dict | None:
    """The fewest devices (FSDP over them) on which the training fits, at its micro-batch, else at
    micro-batch 1; None when not even MAX_DEVICES hold it. The peak only falls with more devices."""
    policies = POLICIES if policy == "auto" else (policy,)

    def fits(micro_batch: int, devices: int) -> bool:
        trial = dataclasses.replace(setup, micro_batch=micro_batch, devices=devices, fsdp=setup.fsdp or devices > 1)
        peaks = (sum(memory_parts(shape, trial, p, chunk).values()) for p in policies)
        return min(peaks) <= MEMORY_MARGIN * device_memory

    counts = range(setup.devices, MAX_DEVICES + 1)
    for micro_batch in dict.fromkeys((setup.micro_batch, 1)):
        if (index := bisect.bisect_left(counts, True, key=functools.partial(fits, micro_batch))) < len(counts):
            return dict(train_devices=counts[index]) | ({} if micro_batch == setup.micro_batch else dict(micro_batch=1))
    return None


def training_cost(
    shape: ModelShape,
    setup: TrainingSetup,
    device_memory: float,
    device_flops: float,
    utilisation: float = UTILISATION["eager"],
    utilisation_source: str = UTILISATION_SOURCE.format(mode="eager"),
    policy: str = "auto",
    chunk_positions: int | None = None,
) -> TrainingCost:
    from .losses import chunk_positions as positions_for

    chunk = chunk_positions or positions_for(shape.vocab_size, "cuda" if setup.accelerator else "cpu")
    priced = POLICIES if policy in ("auto", *POLICIES) else (*POLICIES, policy)
    parts = {p: memory_parts(shape, setup, p, chunk) for p in priced}
    peaks = {p: sum(parts[p].values()) for p in priced}
    # auto: the least recompute whose peak fits the device with the margin (full when none fits)
    fitting = (p for p in POLICIES if peaks[p] <= MEMORY_MARGIN * device_memory)
    chosen = next(fitting, "full") if policy == "auto" else policy
    fits = peaks[chosen] <= MEMORY_MARGIN * device_memory
    model, hardware = flops_per_token(shape, setup, chosen)
    per_device = utilisation * device_flops / hardware
    tokens_per_second = per_device * setup.devices
    compute_bytes, stream_bytes = (2 if setup.bf16 else 4), (2 if setup.bf16 and setup.fsdp else 4)
    tokens = setup.micro_batch * setup.seq_len
    return TrainingCost(
        devices=setup.devices, device_memory=device_memory, device_flops=device_flops, utilisation=utilisation,
        utilisation_source=utilisation_source, activation_checkpointing=chosen, peak_bytes_per_device=peaks[chosen],
        memory=parts[chosen], peak_by_policy=peaks,
        saved_activation_bytes_per_layer=layer_saved_bytes(
            shape, tokens, chosen, compute_bytes, stream_bytes, setup.program.streams
        ),
        fits=fits, fits_with=None if fits else smallest_fit(shape, setup, device_memory, policy, chunk),
        model_flops_per_token=model, flops_per_token=hardware, tokens_per_second=tokens_per_second,
        tokens_per_second_per_device=per_device, mfu=model * per_device / device_flops,
        device_hours=setup.tokens / tokens_per_second / 3600 * setup.devices,
        anchor_mfu=anchor_mfu(), anchor_device_hours=setup.tokens * model / (anchor_mfu() * device_flops) / 3600,
    )  # fmt: skip


def torchtitan_setup(gpus: int) -> tuple[ModelShape, TrainingSetup]:
    """torchtitan's published Llama-3.1-8B runs on `gpus` GPUs: local batch 2 x 8192, all weights trained."""
    shape = ModelShape.from_config(published_config(ANCHOR["model"]))
    layers = list(range(shape.num_layers))
    setup = TrainingSetup(
        micro_batch=2, seq_len=8192, devices=gpus, fsdp=True, bf16=True, trained=layers, grads_from=0,
        head_trained=True, accelerator=True, tokens=1.0, program=TORCHTITAN,
    )  # fmt: skip
    return shape, setup


@functools.cache
def anchor_mfu() -> float:
    """The anchor's measured tokens/s per GPU as MFU, by this module's model FLOPs (0.35)."""
    shape, setup = torchtitan_setup(ANCHOR["gpus"])
    return ANCHOR["tokens_per_second_per_gpu"] * flops_per_token(shape, setup, "none")[0] / ANCHOR["peak_flops"]


def torchtitan_reserved_bytes(gpus: int) -> float:
    """The peak per GPU of torchtitan's published Llama-3.1-8B runs, less what is held outside the
    caching allocator (torchtitan reports the allocator's peak reserve)."""
    shape, setup = torchtitan_setup(gpus)
    cost = training_cost(shape, setup, device_memory=96e9, device_flops=989e12, policy=TORCHTITAN_OP_POLICY)
    return cost.peak_bytes_per_device - cost.memory["runtime"]


def recipe_cost(
    recipe: Recipe,
    device: Device,
    devices: int = 1,
    utilisation: float | None = None,
    shape: ModelShape | None = None,
    ladder_layers: list[int] | None = None,
) -> TrainingCost:
    """The cost of `recipe`'s training on `devices` of `device` (as `--hardware` names it), for the
    recipe's model (nothing downloaded) or one of `shape`, whose `ladder_layers` train under
    trainable.mode ladder. A CPU trains with every core: its measured matmul peak, not its profile's
    one-core decode rate. A GPU whose memory is not known is refused, never guessed."""
    if not (device.on_cpu or device.memory):
        raise UsageError(
            f"the memory of device {device.name} is not known: give it as FLOPS,BANDWIDTH,MEMORY "
            "(e.g. 989e12,3.35e12,80GB)"
        )
    if shape is None:
        shape = ModelShape.from_config(model_config(model_path(recipe.model.path) or EMBEDDED).config)
    mode = "compiled" if recipe.model.compiles(not device.on_cpu) else "eager"
    flops, source = device.flops, UTILISATION_SOURCE.format(mode=mode)
    if device.on_cpu:
        flops, source = matmul_peak(), f"of this machine's measured fp32 matmul peak; {source}"
    return training_cost(
        shape,
        setup_of(recipe, shape, devices, not device.on_cpu, ladder_layers=ladder_layers),
        device.memory or machine_memory(),
        flops,
        UTILISATION[mode] if utilisation is None else utilisation,
        source if utilisation is None else "given",
        policy=recipe.model.checkpointing(),
    )


def checkpointing_policy(recipe: Recipe, config, processes: int, fsdp: bool) -> str:
    """The recompute policy a run uses: the recipe's, or for `auto` the least that fits this
    machine's device (its memory; the RAM on a CPU) with this many processes."""
    import torch

    policy = recipe.model.checkpointing()
    if policy != "auto":
        return policy
    accelerator = torch.accelerator.is_available()
    memory = torch.cuda.mem_get_info()[1] if accelerator else machine_memory()  # (free, total) bytes
    shape = ModelShape.from_config(config.to_dict())
    return training_cost(
        shape, setup_of(recipe, shape, processes, accelerator, fsdp), memory, 1.0
    ).activation_checkpointing


def peak_flops(recipe: Recipe, device) -> float | None:
    """The FLOP/s per device that MFU is measured against (recipe key logging.peak_flops)."""
    if recipe.logging.peak_flops:
        return recipe.logging.peak_flops
    if device.type == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(device).lower()
        return next((device_profile(name).flops for name in device_names() if name != "cpu" and name in gpu), None)
    return matmul_peak(seconds=0.5) if device.type == "cpu" else None


def smallest_setting(found: dict | None) -> str:
    """A `fits_with` as the flags and overrides that ask for it."""
    if found is None:
        return f"none, up to {MAX_DEVICES} devices at micro-batch 1"
    return f"--train-devices {found['train_devices']}" + (" batch.micro_batch=1" if "micro_batch" in found else "")


def fit_note(cost: TrainingCost) -> str:
    """Whether the training fits its devices, and when not, the smallest setting that does."""
    peak, memory = f"peak {cost.peak_bytes_per_device / 2**30:.1f} GiB per device", cost.device_memory / 1e9
    if cost.fits:
        return f"fits: yes, {peak} of {memory:.1f} GB"
    return (
        f"fits: NO, {peak} is above {MEMORY_MARGIN:.0%} of {memory:.1f} GB; the smallest setting that fits: "
        + smallest_setting(cost.fits_with)
    )


def format_cost(cost: TrainingCost, recipe: Recipe) -> str:
    gib = 2**30
    lines = [
        f"cost of {recipe.name}: {cost.devices} device(s) of {cost.device_memory / 1e9:.1f} GB and "
        f"{cost.device_flops / 1e12:.3g} TFLOP/s; micro-batch {recipe.batch.micro_batch} x {recipe.data.seq_len} "
        f"tokens, trainable {recipe.trainable.mode}, precision {recipe.precision}",
        fit_note(cost),
        f"activation checkpointing: {cost.activation_checkpointing} (peak per device: "
        + ", ".join(f"{p} {cost.peak_by_policy[p] / gib:.1f} GiB" for p in POLICIES)
        + f"; fits when at most {MEMORY_MARGIN:.0%} of the device)",
        "memory per device: "
        + ", ".join(f"{name.replace('_', ' ')} {value / gib:.2f} GiB" for name, value in cost.memory.items())
        + f"; peak {cost.peak_bytes_per_device / gib:.2f} GiB",
        f"saved activations per trained layer: {cost.saved_activation_bytes_per_layer / 2**20:.1f} MiB",
        f"FLOPs per token: {cost.model_flops_per_token / 1e9:.1f} G (model), {cost.flops_per_token / 1e9:.1f} G "
        "with recompute",
        f"tokens/s: {cost.tokens_per_second:,.0f} ({cost.tokens_per_second_per_device:,.0f} per device) at "
        f"{cost.utilisation:.0%} of the peak on the hardware FLOPs ({cost.utilisation_source}): MFU {cost.mfu:.1%}",
        f"MFU basis: model FLOPs / peak FLOP/s; the measured anchor ({ANCHOR_SOURCE}) is MFU "
        f"{cost.anchor_mfu:.1%} by this count: {cost.anchor_device_hours:,.1f} device-hours here at it",
        f"device-hours for {recipe.budget:.3g} tokens: {min(cost.device_hours, cost.anchor_device_hours):,.1f} to "
        f"{max(cost.device_hours, cost.anchor_device_hours):,.1f} (the assumption: {cost.device_hours:,.1f}, "
        f"{cost.device_hours / cost.devices:,.1f} h on {cost.devices}; the anchor's MFU: {cost.anchor_device_hours:,.1f})",
    ]
    return "\n".join(lines)
