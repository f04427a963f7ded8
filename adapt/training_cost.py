"""What a recipe's training costs before it runs (`ladder adapt RECIPE --plan`, and each layer choice's
retraining in `ladder plan --recipe`), from the model's config alone (its sizes and parameter counts
from ladder/plan/costs.py: no weight is read).

Memory per device, by part: the parameters (fp32 master weights), the trained parameters' gradients
and AdamW's two moments (all three sharded over the devices under FSDP), the activations each
decoder layer saves for its backward pass at the recipe's micro-batch and seq_len under each
recompute policy, the head's logits chunks and gradients, and buffers (FSDP's gathered bf16 units,
one layer's backward); on a GPU the caching allocator's reserve above what is allocated, and what
the process holds outside it (the CUDA context, NCCL's buffers; on a CPU the runtime: Python,
torch, the tokenizer and the data). Whether that fits the device, and when not, the fewest devices
(then the micro-batch) that fit. FLOPs per token: the model FLOPs (forward, backward; MFU counts
these) and the hardware FLOPs (plus recompute; time is spent on these), with causal attention, and
the backward only where gradients flow (below the lowest trained layer nothing flows). Tokens/s at
an assumed utilisation of the device's peak, beside the measured anchor (torchtitan's 8B MFU);
device-hours for the budget at both.

Saved activations per trained layer and token, as autograd keeps them with adapt/memory.py's lean
MLP and norms and sdpa (tests/test_adapt_plan.py counts them with saved-tensor hooks): the layer's two
stream inputs (kept for the recomputed norms), the normed inputs of the attention and of the MLP
(q/k/v and gate/up read them), q, k, v, the attention output (o_proj reads it), the attention's
log-sum-exp (fp32, one per head), gate and up (SwiGLUDown). Under `full` recompute a layer keeps its
two input streams; `selective` recomputes every other layer (transformers' every_n_layers=2).

The memory model is checked against the one published measurement of an 8B FSDP run, torchtitan's
(`torchtitan_reserved_bytes`, docs/retraining.md): `TORCHTITAN` describes how that program holds memory
where it differs from adapt (one residual stream, its `op` recompute policy, an unchunked fp32 loss).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from dataclasses import dataclass

from ladder.errors import UsageError
from ladder.layers import parse_ladder_layers
from ladder.plan.calibrate import machine_memory, matmul_peak
from ladder.plan.costs import ModelShape, parameter_counts
from ladder.plan.models import published_config
from ladder.plan.speed import Device

from .recipe import Recipe

POLICIES = ("none", "selective", "full")
# torchtitan's selective "op" policy (not one adapt runs; priced for its published check, see Program).
TORCHTITAN_OP_POLICY = "op"
# Share of a device's memory a training may fill. The count includes the allocator's reserve, the CUDA
# context and NCCL; the rest is for what it does not (the spread of the reserve, a transient it misses).
MEMORY_MARGIN = 0.95
# The most devices a training that does not fit is tried on, looking for the fewest that fit.
MAX_DEVICES = 1024
# The CUDA caching allocator's peak reserve above its peak allocation, as a share of the allocation.
# From torchtitan's own tables (benchmarks/llama3_h100_202412_torchtitan.md): going from 8 to 128 GPUs
# shrinks only the sharded fp32 parameters, gradients and AdamW moments, by 14.0 GiB per GPU, and the
# measured peak reserve falls by 15.4 GiB eager and 15.0 GiB compiled: 1.10 and 1.07 per allocated byte.
ALLOCATOR_RESERVE = 0.10
# Held outside the caching allocator on a GPU (torchtitan's figures leave it out): the CUDA context,
# about 0.4 GB with lazy module loading (CUDA >= 11.7; pytorch/pytorch#109888) and cuBLAS's workspace;
# NCCL's buffers for one communicator over 8 H100s: NVLink SHARP's 288 MiB per rank (the log in
# vllm-project/vllm#9699) and the ring and tree channels' (NCCL_BUFFSIZE, 4 MiB per channel and peer).
CUDA_CONTEXT_BYTES = 0.5 * 2**30
NCCL_BYTES = 0.75 * 2**30
# The process's own memory on a CPU, whatever the batch: Python, torch and transformers, the tokenizer
# and the run's tokenized data (measured 541-1,095 MiB, 555 beside the CPU recipe's own setting,
# 2026-12-04/05: docs/retraining.md).
CPU_RUNTIME_BYTES = 550 * 2**20
# Share of the device's peak FLOP/s spent on the hardware FLOPs (recompute included), assumed on
# accelerators. The measured anchor, torchtitan's Llama-3.1-8B (8 H100s, FSDP2, seq_len 8192), is
# 5,762 tokens/s per GPU eager and 6,667 compiled (ANCHOR): MFU 0.30 and 0.35 by this module's count,
# 0.35-0.39 and 0.40-0.46 of the 989 TFLOP/s peak once its recompute (selective to full) is counted.
# The assumption is the low end of the latter, so its tokens/s lie above the anchor's MFU.
UTILISATION = {"eager": 0.35, "compiled": 0.40}
UTILISATION_SOURCE = "assumed, {mode}"
# torchtitan's published throughput (its benchmarks/llama3_h100_202412_torchtitan.md, commit 9dec370 of
# 2024-12-26, Table 1): Llama-3.1-8B, FSDP2 over 8 H100s, local batch 2 x 8192 tokens, compiled.
ANCHOR = dict(model="meta-llama/Llama-3.1-8B", gpus=8, tokens_per_second_per_gpu=6667, peak_flops=989e12)
ANCHOR_SOURCE = "torchtitan's Llama-3.1-8B on 8 H100s, FSDP2, compiled: 6,667 tokens/s/GPU, measured"
# torchtitan's published peak memory per GPU, same document (Tables 1 and 3), on H100s of 96 GB at
# 500 W: `max_reserved` in GiB, (name, GPUs, eager, compiled).
PUBLISHED_MEMORY = [("torchtitan 8B, 8 GPUs", 8, 82.4, 77.0), ("torchtitan 8B, 128 GPUs", 128, 67.0, 62.0)]
# What one node's processes write together per second into a checkpoint (each its shard), assumed: a
# network filesystem every node sees (multi-node runs need one); a node's local NVMe writes faster.
CHECKPOINT_WRITE_RATE = 1e9
GPUS_PER_NODE = 8


def model_shape(config) -> ModelShape:
    """The shape of a transformers config (ladder/plan/costs.py counts its parameters)."""
    return ModelShape.from_config(config.to_dict())


@dataclass(frozen=True)
class Program:
    """How a training program's own code holds memory, where programs differ."""

    name: str
    streams: int  # residual streams a decoder layer takes, kept for its backward (a ladder layer: two)
    # The loss: "chunked" (adapt/losses.py: float32 logits a chunk at a time, the head's gradient built
    # in the forward) or "unchunked" (the micro-batch's logits at once, upcast to float32).
    loss: str


ADAPT = Program("ladder adapt", streams=2, loss="chunked")
# torchtitan at the commit of its published Llama-3.1-8B figures (9dec370, 2024-12-26): a plain Llama
# block (one stream), FSDP2 with bf16 parameters and fp32 gradient reduction, the loss
# `cross_entropy(pred.flatten(0, 1).float(), labels)` on the whole micro-batch's bf16 logits.
TORCHTITAN = Program("torchtitan", streams=1, loss="unchunked")


def saved_bytes_per_token(shape: ModelShape, compute_bytes: int, stream_bytes: int, streams: int = 2) -> int:
    """Bytes one trained decoder layer keeps for backward per token, with no recompute (see above)."""
    hidden, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    computed = 4 * hidden + 2 * kv + 2 * shape.intermediate_size  # normed x2, q, out, k, v, gate, up
    return streams * hidden * stream_bytes + computed * compute_bytes + 4 * shape.num_heads


def op_policy_bytes_per_token(shape: ModelShape, compute_bytes: int, stream_bytes: int, streams: int) -> int:
    """Bytes a layer keeps per token under torchtitan's selective "op" policy (its parallelize_llama.py,
    `_save_list`): the outputs of the flash/efficient attention (the output and its fp32 log-sum-exp)
    and of every other matmul in call order (q of q, k, v, o; gate of gate, up, down; and down), all
    else recomputed from the layer's input, which the checkpoint keeps."""
    hidden, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    matmuls = hidden + kv + shape.intermediate_size + hidden  # q, v, gate, down: 1st, 3rd, 5th, 7th
    return streams * hidden * stream_bytes + (matmuls + hidden) * compute_bytes + 4 * shape.num_heads


def layer_saved_bytes(
    shape: ModelShape, tokens: int, policy: str, compute_bytes: int, stream_bytes: int, streams: int = 2
) -> float:
    """Average bytes one layer keeps for backward at `tokens` per micro-batch under `policy`."""
    if policy == TORCHTITAN_OP_POLICY:
        return op_policy_bytes_per_token(shape, compute_bytes, stream_bytes, streams) * tokens
    kept = saved_bytes_per_token(shape, compute_bytes, stream_bytes, streams) * tokens
    inputs = streams * shape.hidden_size * stream_bytes * tokens  # a recomputed layer keeps its streams
    return {"none": kept, "full": inputs, "selective": (kept + inputs) / 2}[policy]


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
    mode = recipe.trainable.mode
    if mode == "all":
        trained, head = list(range(shape.num_layers)), True
    elif mode == "ladder":
        if ladder_layers is None:
            ladder_layers = parse_ladder_layers(
                recipe.model.ladder_layers or [], shape.num_layers, "model.ladder_layers"
            )
        trained, head = ladder_layers, False
    elif mode == "layers":
        trained, head = parse_ladder_layers(recipe.trainable.layers, shape.num_layers, "trainable.layers"), False
    else:  # lora: adapters on every layer, base weights frozen
        trained, head = [], False
    return TrainingSetup(
        micro_batch=recipe.batch.micro_batch,
        seq_len=recipe.data.seq_len,
        devices=devices,
        fsdp=devices > 1 if fsdp is None else fsdp,
        bf16=recipe.precision == "bf16",
        trained=sorted(trained),
        grads_from=0 if mode == "lora" else min(trained, default=shape.num_layers),
        head_trained=head,
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
        # Largest in the loss's backward: log-softmax's float32 output (kept for backward), its gradient
        # and the logits' gradient, all float32 over every position (in the forward: the bf16 logits,
        # their float32 copy and the output, fewer bytes); then the hidden states and their gradient.
        head = tokens * shape.vocab_size * 4 * 3 + tokens * shape.hidden_size * compute_bytes * 2
    else:
        # The chunk's logits and their gradient; the hidden states and theirs.
        head = chunk_positions * shape.vocab_size * 4 * 2 + tokens * shape.hidden_size * 4 * 2
        if setup.head_trained:
            # The head's gradient, built in the forward: a float32 sum; in bf16 also each chunk's float32
            # product and the sum's cast to the weight's dtype (adapt/losses.py).
            head += head_weight * (4 + 4 + compute_bytes if setup.bf16 else 4)
    # FSDP2 leaves the root unit (the embedding and the head) gathered from its forward to its backward;
    # a layer's unit is gathered, the next one prefetched, and a layer's gradients reduce-scattered in
    # float32.
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
    if policy == TORCHTITAN_OP_POLICY:  # k, o and up recomputed (op_policy_bytes_per_token)
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


def choose_policy(peaks: dict[str, float], device_memory: float) -> str:
    """The least recompute whose peak fits `device_memory` with the margin (full when none fits)."""
    for policy in POLICIES:
        if peaks[policy] <= MEMORY_MARGIN * device_memory:
            return policy
    return "full"


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
    chosen = choose_policy(peaks, device_memory) if policy == "auto" else policy
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
    """torchtitan's published Llama-3.1-8B runs (ANCHOR, PUBLISHED_MEMORY): FSDP2 over `gpus` GPUs,
    local batch 2 x 8192 tokens, every weight trained, its own program (TORCHTITAN)."""
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
    """The cost of `recipe`'s training on `devices` of `device` (a ladder/plan/devices.tsv row, a
    FLOPS,BANDWIDTH,MEMORY description or a calibration, as `ladder adapt --plan --hardware` and `ladder
    plan --recipe` name it), for the recipe's model (nothing downloaded: a Hub ID is priced from its
    cached config.json or its published shape) or one of `shape`, whose `ladder_layers` train under
    trainable.mode ladder. A CPU trains with every core: its measured matmul peak, not the one-core
    decode rate its profile holds, and this machine's RAM unless a calibration recorded it. A GPU whose
    memory is not known is refused, never guessed."""
    if not (device.on_cpu or device.memory):
        raise UsageError(
            f"the memory of device {device.name} is not known: give it as FLOPS,BANDWIDTH,MEMORY "
            "(e.g. 989e12,3.35e12,80GB)"
        )
    if shape is None:
        from ladder.io.loading import EMBEDDED
        from ladder.plan.models import model_config

        from .recipe import model_path

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
    shape = model_shape(config)
    return training_cost(
        shape, setup_of(recipe, shape, processes, accelerator, fsdp), memory, 1.0
    ).activation_checkpointing


def peak_flops(recipe: Recipe, device) -> float | None:
    """The FLOP/s per device that MFU is measured against (recipe key logging.peak_flops, which says
    where the default comes from)."""
    if recipe.logging.peak_flops:
        return recipe.logging.peak_flops
    if device.type == "cuda":
        import torch

        from ladder.plan.speed import device_names, device_profile

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
