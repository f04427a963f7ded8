"""`ladder adapt RECIPE --plan`: what a recipe's training costs before it runs, from the model's
config alone (its sizes and parameter counts from ladder/plan/costs.py: no weight is read).

Memory per device, by part: the parameters (fp32 master weights), the trained parameters' gradients
and AdamW's two moments (all three sharded over the devices under FSDP), the activations each
decoder layer saves for its backward pass at the recipe's micro-batch and seq_len under each
recompute policy, the head's logits chunks and gradients, and buffers (FSDP's gathered bf16 units,
one layer's backward); on a GPU the caching allocator's reserve above what is allocated, and what
the process holds outside it (the CUDA context, NCCL's buffers; on a CPU the runtime: Python,
torch, the tokenizer and the data). FLOPs per token: the model FLOPs (forward, backward; MFU counts these) and
the hardware FLOPs (plus recompute; time is spent on these), with causal attention, and the backward
only where gradients flow (below the lowest trained layer nothing flows). Tokens/s at a stated
utilisation of the device's peak, device-hours for the budget.

Saved activations per trained layer and token, as autograd keeps them with adapt/memory.py's lean
MLP and norms and sdpa (tests/test_plan.py counts them with saved-tensor hooks): the layer's two
stream inputs (kept for the recomputed norms), the normed inputs of the attention and of the MLP
(q/k/v and gate/up read them), q, k, v, the attention output (o_proj reads it), the attention's
log-sum-exp (fp32, one per head), gate and up (SwiGLUDown). Under `full` recompute a layer keeps its
two input streams; `selective` recomputes every other layer (transformers' every_n_layers=2).

The memory model is checked against the one published measurement of an 8B FSDP run, torchtitan's
(benchmarks/plan_check.py, docs/retraining.md): `TORCHTITAN` describes how that program holds memory
where it differs from adapt (one residual stream, its `op` recompute policy, an unchunked fp32 loss).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ladder.errors import UsageError
from ladder.layers import parse_ladder_layers
from ladder.plan.calibrate import machine_memory, matmul_peak
from ladder.plan.costs import ModelShape, parameter_counts
from ladder.plan.speed import Device

from .recipe import Recipe

POLICIES = ("none", "selective", "full")
# torchtitan's selective "op" policy (not one adapt runs; priced for its published check, see Program).
TORCHTITAN_OP_POLICY = "op"
# Share of a device's memory a plan may fill. The plan counts the allocator's reserve, the CUDA context
# and NCCL; the rest is for what it does not (the spread of the reserve, a transient it misses).
MEMORY_MARGIN = 0.95
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
# and the run's tokenized data (benchmarks/plan_memory.py measures it: 541-1,095 MiB, 555 beside the CPU
# recipe's own setting, 2026-12-04/05).
CPU_RUNTIME_BYTES = 550 * 2**20
# Share of the device's peak FLOP/s spent on the plan's hardware FLOPs, assumed on accelerators.
# torchtitan publishes 5,762 tokens/s per H100 (96 GB parts at 500 W) for Llama-3.1-8B (8 GPUs, FSDP2,
# seq_len 8192) in eager mode and 6,667 compiled: by this module's count 0.30 and 0.35 MFU, and
# 0.35-0.39 and 0.40-0.46 of the 989 TFLOP/s peak once its recompute (selective to full) is counted.
# The lower ends:
UTILISATION = {"eager": 0.35, "compiled": 0.40}
UTILISATION_SOURCE = "assumed: the low end of torchtitan's published Llama-3.1-8B FSDP2 throughput, {mode}"
# What one node's processes write together per second into a checkpoint (each its shard), assumed: a
# network filesystem every node sees (multi-node runs need one); a node's local NVMe writes faster.
CHECKPOINT_WRITE_RATE = 1e9
GPUS_PER_NODE = 8


def model_shape(config) -> ModelShape:
    """The shape of a transformers config (ladder/plan/costs.py counts its parameters)."""
    return ModelShape.from_config(config.to_dict())


def read_model_config(path: Path):
    """The config of a checkpoint directory or of the Llama inside a GGUF file; no weight is read."""
    from transformers import AutoConfig

    import ladder.model.auto  # noqa: F401  (the ladder model type)
    from ladder.io.loading import from_pretrained_arguments

    location, extra = from_pretrained_arguments(path)
    try:
        return AutoConfig.from_pretrained(location, **extra)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"cannot read the config of {path}: {error}") from None


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
class Setting:
    """A recipe's training as the plan reads it."""

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


def setting_of(
    recipe: Recipe,
    shape: ModelShape,
    devices: int,
    accelerator: bool,
    fsdp: bool | None = None,
    ladder_layers: list[int] | None = None,
) -> Setting:
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
    return Setting(
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


def memory_parts(shape: ModelShape, setting: Setting, policy: str, chunk_positions: int) -> dict[str, float]:
    """Bytes per device by part, at the peak (the last layer's backward of a micro-batch), each part
    at its own largest: the sum errs high where two do not coincide."""
    n, program = setting.devices, setting.program
    tokens = setting.micro_batch * setting.seq_len
    counts = parameter_counts(shape)
    total = counts.total(shape.num_layers)
    trained = counts.per_layer * len(setting.trained) + (counts.embedding + counts.lm_head) * setting.head_trained
    compute_bytes = 2 if setting.bf16 else 4
    # Under FSDP's bf16 policy the residual streams are bf16 too; under autocast alone they stay fp32.
    stream_bytes = 2 if setting.bf16 and setting.fsdp else 4
    # Autograd keeps activations for every layer from the lowest trained one up.
    saving = shape.num_layers - setting.grads_from
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
        if setting.head_trained:
            # The head's gradient, built in the forward: a float32 sum; in bf16 also each chunk's float32
            # product and the sum's cast to the weight's dtype (adapt/losses.py).
            head += head_weight * (4 + 4 + compute_bytes if setting.bf16 else 4)
    # FSDP2 leaves the root unit (the embedding and the head) gathered from its forward to its backward;
    # a layer's unit is gathered, the next one prefetched, and a layer's gradients reduce-scattered in
    # float32.
    root = counts.embedding + counts.lm_head
    buffers = ((root + 2 * counts.per_layer) * compute_bytes + counts.per_layer * 4) if setting.fsdp else 0
    allocated = {
        "parameters": total * 4 / n,
        "gradients": trained * 4 / n,
        "optimizer_state": trained * 8 / n,
        "activations": per_layer * saving,
        "backward_transient": backward if saving else 0,
        "head_loss": head,
        "buffers": buffers,
    }
    if setting.accelerator:
        # The caching allocator reserves more than it allocates; the CUDA context and NCCL sit outside it.
        reserve = ALLOCATOR_RESERVE * sum(allocated.values())
        runtime = CUDA_CONTEXT_BYTES + NCCL_BYTES * (n > 1)
    else:
        reserve, runtime = 0.0, CPU_RUNTIME_BYTES
    return allocated | {"allocator_reserve": reserve, "runtime": runtime}


def flops_per_token(shape: ModelShape, setting: Setting, policy: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token: forward everywhere, backward where gradients
    flow (weights' gradients only for trained layers), plus the recomputed forwards."""
    matmul = 2 * (parameter_counts(shape).per_layer - 2 * shape.hidden_size)  # a layer's matmuls (its norms are not)
    attention = 2 * setting.seq_len * shape.num_heads * shape.head_dim  # causal: QK and AV over s/2 keys each
    layer_forward = matmul + attention
    head_forward = 2 * shape.hidden_size * shape.vocab_size
    flowing = shape.num_layers - setting.grads_from
    trained = len(setting.trained)
    backward = flowing * (matmul + 2 * attention) + trained * matmul  # input grads, weight grads
    backward += head_forward * ((flowing > 0) + setting.head_trained)
    model = shape.num_layers * layer_forward + head_forward + backward
    if policy == TORCHTITAN_OP_POLICY:  # k, o and up recomputed (op_policy_bytes_per_token)
        kv = shape.num_kv_heads * shape.head_dim
        matmuls = 2 * shape.hidden_size * (kv + shape.hidden_size + shape.intermediate_size)
        return model, model + flowing * matmuls
    recomputed = {"none": 0, "selective": math.ceil(flowing / 2), "full": flowing}[policy]
    return model, model + recomputed * layer_forward


@dataclass
class Plan:
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
    model_flops_per_token: float
    flops_per_token: float  # hardware FLOPs, with recompute
    tokens_per_second: float  # all devices
    tokens_per_second_per_device: float
    mfu: float
    device_hours: float


def choose_policy(peaks: dict[str, float], device_memory: float) -> str:
    """The least recompute whose peak fits `device_memory` with the margin (full when none fits)."""
    for policy in POLICIES:
        if peaks[policy] <= MEMORY_MARGIN * device_memory:
            return policy
    return "full"


def make_plan(
    shape: ModelShape,
    setting: Setting,
    device_memory: float,
    device_flops: float,
    utilisation: float = UTILISATION["eager"],
    utilisation_source: str = UTILISATION_SOURCE.format(mode="eager"),
    policy: str = "auto",
    chunk_positions: int | None = None,
) -> Plan:
    from .losses import chunk_positions as positions_for

    chunk = chunk_positions or positions_for(shape.vocab_size, "cuda" if setting.accelerator else "cpu")
    priced = POLICIES if policy in ("auto", *POLICIES) else (*POLICIES, policy)
    parts = {p: memory_parts(shape, setting, p, chunk) for p in priced}
    peaks = {p: sum(parts[p].values()) for p in priced}
    chosen = choose_policy(peaks, device_memory) if policy == "auto" else policy
    model, hardware = flops_per_token(shape, setting, chosen)
    per_device = utilisation * device_flops / hardware
    tokens_per_second = per_device * setting.devices
    return Plan(
        devices=setting.devices,
        device_memory=device_memory,
        device_flops=device_flops,
        utilisation=utilisation,
        utilisation_source=utilisation_source,
        activation_checkpointing=chosen,
        peak_bytes_per_device=peaks[chosen],
        memory=parts[chosen],
        peak_by_policy=peaks,
        saved_activation_bytes_per_layer=layer_saved_bytes(
            shape,
            setting.micro_batch * setting.seq_len,
            chosen,
            2 if setting.bf16 else 4,
            2 if setting.bf16 and setting.fsdp else 4,
            setting.program.streams,
        ),
        model_flops_per_token=model,
        flops_per_token=hardware,
        tokens_per_second=tokens_per_second,
        tokens_per_second_per_device=per_device,
        mfu=model * per_device / device_flops,
        device_hours=setting.tokens / tokens_per_second / 3600 * setting.devices,
    )


def recipe_plan(
    recipe: Recipe,
    devices: int = 1,
    device_memory: float | None = None,
    device_flops: float | None = None,
    utilisation: float | None = None,
    accelerator: bool | None = None,
) -> Plan:
    """The plan of `recipe` on `devices` devices of `device_memory` bytes and `device_flops` peak
    FLOP/s each (accelerators, unless `accelerator` says otherwise); without them, this machine (its
    RAM; its measured fp32 matmul peak)."""
    import torch

    from ladder.io.loading import EMBEDDED
    from ladder.plan.models import model_config

    from .recipe import model_path

    # Nothing is downloaded: a Hub ID plans from its cached config.json or its published shape.
    shape = ModelShape.from_config(model_config(model_path(recipe.model.path) or EMBEDDED).config)
    if accelerator is None:  # planning for GPUs (their flops given), or for this machine
        accelerator = device_flops is not None or torch.accelerator.is_available()
    return shape_plan(recipe, shape, devices, device_memory, device_flops, accelerator, utilisation)


def device_figures(device: Device) -> tuple[float | None, float | None, bool]:
    """(memory, FLOP/s, accelerator) of a training on `device` (a ladder/plan/devices.tsv row, a
    FLOPS,BANDWIDTH,MEMORY description or a calibration), as `ladder adapt --plan --hardware` and
    `ladder plan --recipe` read it. A CPU trains with every core: its measured matmul peak (None, the
    default of shape_plan), not the one-core decode rate its profile holds, and this machine's RAM
    unless a calibration recorded it. A GPU whose memory is not known is refused, never guessed."""
    if device.on_cpu:
        return device.memory or None, None, False
    if not device.memory:
        raise UsageError(
            f"the memory of device {device.name} is not known: give it as FLOPS,BANDWIDTH,MEMORY "
            "(e.g. 989e12,3.35e12,80GB)"
        )
    return device.memory, device.flops, True


def shape_plan(
    recipe: Recipe,
    shape: ModelShape,
    devices: int,
    device_memory: float | None,
    device_flops: float | None,
    accelerator: bool,
    utilisation: float | None = None,
    ladder_layers: list[int] | None = None,
) -> Plan:
    """The plan of `recipe`'s training of a model of this shape; a memory or FLOP rate not given is this
    machine's (its RAM; its measured fp32 matmul peak). `ladder plan --recipe` plans each layer choice
    with its `ladder_layers`, which decide what trains under trainable.mode ladder."""
    mode = "compiled" if recipe.model.compiles(accelerator) else "eager"
    source = UTILISATION_SOURCE.format(mode=mode)
    if device_flops is None:
        device_flops, source = matmul_peak(), f"of this machine's measured fp32 matmul peak; {source}"
    if utilisation is not None:
        source = "given"
    return make_plan(
        shape,
        setting_of(recipe, shape, devices, accelerator, ladder_layers=ladder_layers),
        device_memory or machine_memory(),
        device_flops,
        UTILISATION[mode] if utilisation is None else utilisation,
        source,
        policy=recipe.model.checkpointing(),
    )


def checkpointing_policy(recipe: Recipe, config, processes: int, fsdp: bool) -> str:
    """The recompute policy a run uses: the recipe's, or for `auto` the plan's choice for this
    machine's device (its memory; the RAM on a CPU) and this many processes."""
    import torch

    policy = recipe.model.checkpointing()
    if policy != "auto":
        return policy
    accelerator = torch.accelerator.is_available()
    if accelerator:
        memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    else:
        memory = machine_memory()
    shape = model_shape(config)
    return make_plan(
        shape, setting_of(recipe, shape, processes, accelerator, fsdp), memory, 1.0
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


def measured_saved_bytes(model, input_ids, layer_index: int) -> int:
    """Bytes autograd keeps for backward inside decoder layer `layer_index` in a forward of `model`
    on `input_ids`, counted with saved-tensor hooks (each storage once, parameters not counted)."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, kept = [False], {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    layer = model.model.layers[layer_index]
    handles = [
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return sum(kept.values())


def stop_seconds(plan: Plan, recipe: Recipe) -> dict[str, float]:
    """What a preempted run needs after SIGTERM or SIGUSR1 (adapt/preemption.py): the step in progress,
    then a checkpoint of it, written by every process at once: its shard of the fp32 parameters and of
    AdamW's moments, a node's share at CHECKPOINT_WRITE_RATE. torchrun's shutdown timeout
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default) must exceed their sum, or it kills the
    processes mid-write (recipes/accelerate/*.yaml)."""
    step_tokens = recipe.batch.micro_batch * recipe.batch.grad_accum * recipe.data.seq_len * plan.devices
    per_device = plan.memory["parameters"] + plan.memory["optimizer_state"]
    write = per_device * min(plan.devices, GPUS_PER_NODE) / CHECKPOINT_WRITE_RATE
    return {"step": step_tokens / plan.tokens_per_second, "checkpoint_write": write}


def format_plan(plan: Plan, recipe: Recipe) -> str:
    gib = 2**30
    lines = [
        f"plan for {recipe.name}: {plan.devices} device(s) of {plan.device_memory / 1e9:.1f} GB and "
        f"{plan.device_flops / 1e12:.3g} TFLOP/s; micro-batch {recipe.batch.micro_batch} x {recipe.data.seq_len} "
        f"tokens, trainable {recipe.trainable.mode}, precision {recipe.precision}",
        f"activation checkpointing: {plan.activation_checkpointing} (peak per device: "
        + ", ".join(f"{p} {plan.peak_by_policy[p] / gib:.1f} GiB" for p in POLICIES)
        + f"; fits when at most {MEMORY_MARGIN:.0%} of the device)",
        "memory per device: "
        + ", ".join(f"{name.replace('_', ' ')} {value / gib:.2f} GiB" for name, value in plan.memory.items())
        + f"; peak {plan.peak_bytes_per_device / gib:.2f} GiB",
        f"saved activations per trained layer: {plan.saved_activation_bytes_per_layer / 2**20:.1f} MiB",
        f"FLOPs per token: {plan.model_flops_per_token / 1e9:.1f} G (model), {plan.flops_per_token / 1e9:.1f} G "
        "with recompute",
        f"tokens/s: {plan.tokens_per_second:,.0f} ({plan.tokens_per_second_per_device:,.0f} per device) at "
        f"{plan.utilisation:.0%} utilisation ({plan.utilisation_source}); MFU {plan.mfu:.1%}",
        f"device-hours for {recipe.budget:.3g} tokens: {plan.device_hours:,.1f} "
        f"({plan.device_hours / plan.devices:,.1f} h on {plan.devices})",
    ]
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    return json.dumps(dataclasses.asdict(plan), indent=1)


__all__ = [
    "POLICIES",
    "Plan",
    "checkpointing_policy",
    "device_figures",
    "format_plan",
    "layer_saved_bytes",
    "make_plan",
    "measured_saved_bytes",
    "model_shape",
    "plan_json",
    "recipe_plan",
    "shape_plan",
    "stop_seconds",
]
