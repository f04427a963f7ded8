"""Tensor-parallel inference runtime for standard and ladder checkpoints of the Llama, Mistral, Qwen2
and Qwen3 families (gpt-fast's tp.py and generate.py, for the shard in `ladder.tp.shard`).

Launch one process per rank with torchrun (gloo on CPU, NCCL on GPU, one GPU per rank):

    torchrun --nproc_per_node 2 my_script.py

    rank, tp_size, device = init_distributed(cuda=torch.cuda.is_available())
    shard = load_shard(checkpoint_dir, rank, tp_size, device=device)  # reads only this rank's slices
    install_communication(shard)  # all-reduce over the group
    shard.setup_cache(batch, prompt_length + new_tokens)
    tokens = generate(shard, prompt_ids.to(device), new_tokens)

Fixed load order, as gpt-fast: build the shard on the meta device, read this rank's slices from the
safetensors files (`safe_open(...).get_slice`: no rank ever holds the whole model), assign, move.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from ladder.errors import UsageError
from ladder.io.loading import load_config
from ladder.io.tensors import LazyTensorLoader, ShardedTensorIndex
from ladder.serving.ops import InFlight
from ladder.tp.shard import ModelShard, Ready, local_sum

DecodeStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def init_distributed(cuda: bool) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and return
    (rank, world size, device): NCCL and one GPU per rank when `cuda`, else gloo on CPU. Without
    torchrun it is rank 0 of 1 and starts no process group."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return rank, world_size, device


# --- Loading this rank's slices ------------------------------------------------------------------


def read_config(path: str | Path) -> PretrainedConfig:
    """The config of a checkpoint directory of a supported family or its ladder form (with `ladder_layers`)."""
    path = Path(path)
    if path.suffix == ".gguf" or not (path / "config.json").is_file():
        raise UsageError(
            f"{path} is not a checkpoint directory with config.json and safetensors (convert a .gguf first)"
        )
    return load_config(path)  # checked first: an unknown model_type may ship code


# Where each module of a shard's layer is read from, under the checkpoint's `model.layers.N.` (weight
# and bias alike); a fused module concatenates its sources.
SOURCES = {
    "attention.norm": ("input_layernorm",),
    "attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.q_norm": ("self_attn.q_norm",),
    "attention.k_norm": ("self_attn.k_norm",),
    "attention.wo": ("self_attn.o_proj",),
    "mlp.norm": ("post_attention_layernorm",),
    "mlp.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.w2": ("mlp.down_proj",),
}


def load_shard(
    path: str | Path,
    rank: int = 0,
    tp_size: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ModelShard:
    """This rank's shard of a checkpoint, Megatron-style: q/k/v and gate/up column-parallel (rows of
    the HF weights and biases), o/down row-parallel (columns), embeddings, norms and LM head replicated."""
    path = Path(path)
    config = read_config(path)
    try:
        with torch.device("meta"):
            shard = ModelShard(config, rank, tp_size)
    except ValueError as error:
        raise UsageError(f"{path}: {error}") from None
    shape, width = shard.shape, shard.shape.head_dim
    q_rows, kv_rows = (range(heads.start * width, heads.stop * width) for heads in (shape.heads, shape.kv_heads))
    # This rank's part: rows of the column-parallel sources, columns of the row-parallel ones, the rest whole.
    rows = {"attention.wqkv": (q_rows, kv_rows, kv_rows), "mlp.w13": (shape.intermediate,) * 2}
    columns = {"attention.wo": q_rows, "mlp.w2": shape.intermediate}
    index = ShardedTensorIndex.from_directory(path)
    if index is None:
        raise UsageError(f"{path} has no model.safetensors (or index): the TP runtime reads safetensors only")
    with LazyTensorLoader(index) as checkpoint:

        def read(name: str, **part: range) -> torch.Tensor:
            return checkpoint.read(name, **part).to(dtype)

        def layer_parameter(key: str) -> torch.Tensor:  # "layers.N.branch.module.weight"
            _, number, branch, module, kind = key.split(".")
            module = f"{branch}.{module}"
            names = [f"model.layers.{number}.{source}.{kind}" for source in SOURCES[module]]
            if module in rows:
                return torch.cat([read(name, rows=part) for name, part in zip(names, rows[module])])
            if module in columns and kind == "weight":
                return read(names[0], columns=columns[module])
            if module in columns:  # the ranks' outputs are summed: only rank 0's adds the bias
                return read(names[0]) if rank == 0 else torch.zeros(shape.hidden_size, dtype=dtype)
            return read(names[0])

        embed = read("model.embed_tokens.weight")
        state = {
            "embed.weight": embed,
            "norm.weight": read("model.norm.weight"),
            "lm_head.weight": embed if config.tie_word_embeddings else read("lm_head.weight"),
        }
        state |= {key: layer_parameter(key) for key in shard.state_dict() if key.startswith("layers.")}
    try:
        shard.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:  # a shape that does not match config.json
        raise UsageError(f"{path}: weights do not match config.json: {str(error).splitlines()[-1].strip()}") from None
    return shard.to(device).eval()


# --- Communication -------------------------------------------------------------------------------


def all_reduce(partial: torch.Tensor, async_op: bool) -> InFlight | Ready:
    """Sums a branch output over the ranks in place: blocking for standard layers; for ladder layers
    launched with `async_op=True`, its handle waited on where the layer loop needs the sum."""
    work = dist.all_reduce(partial, async_op=async_op)
    return InFlight(partial, partial, work) if async_op else Ready(partial)


GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def prioritize_gloo_threads() -> int:
    """Give gloo's communication threads real-time priority (SCHED_FIFO 1), so a message is handled
    the moment it arrives instead of when the scheduler next preempts the compute thread sharing its
    core. A GPU's collectives progress on their own engine; this is the nearest CPU equivalent.
    Measured here: without it an asynchronous all-reduce mostly waits for a time slice, and every
    blocking one pays the wake-up latency too (standard decode gets slower as well)."""
    dist.barrier()  # gloo's threads exist once a collective has run
    boosted = 0
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() in GLOO_THREADS:
            os.sched_setscheduler(int(task.name), os.SCHED_FIFO, os.sched_param(1))
            boosted += 1
    return boosted


COMMUNICATION = ("all-reduce", "none")


def install_communication(shard: ModelShard, mode: str = "all-reduce") -> None:
    """Install how the shard sums its partial outputs across ranks.

    "all-reduce": the real thing (a no-op at TP=1). "none": the NO-COMMUNICATION BOUND: every rank
    keeps its own partial sums, so above TP=1 the OUTPUTS ARE WRONG; it only times the model as if
    the interconnect were free, an upper bound for any overlap of communication.
    """
    if mode not in COMMUNICATION:
        raise ValueError(f"communication {mode!r} is not one of {COMMUNICATION}")
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    shard.reduce = all_reduce if mode == "all-reduce" and distributed else local_sum


# --- Generation ----------------------------------------------------------------------------------


@torch.inference_mode()
def prefill(shard: ModelShard, prompt_ids: torch.Tensor) -> torch.Tensor:
    """Run the prompts (batch, length; equal lengths) through the cache; the greedy next tokens (batch, 1)."""
    positions = torch.arange(prompt_ids.shape[1], device=prompt_ids.device)
    return shard(prompt_ids, positions)[:, -1:].argmax(-1)


@torch.inference_mode()
def decode(
    shard: ModelShard, tokens: torch.Tensor, position: int, steps: int, step: DecodeStep | None = None
) -> torch.Tensor:
    """Greedy decoding: feed `tokens` (batch, 1) at cache `position`, then each new token; returns the
    `steps` tokens produced (batch, steps). `step` replaces the plain forward (e.g. a CUDA graph)."""
    step = step or shard
    produced = []
    for offset in range(steps):
        input_pos = torch.tensor([position + offset], device=tokens.device)
        tokens = step(tokens, input_pos)[:, -1:].argmax(-1)
        produced.append(tokens)
    return torch.cat(produced, dim=1) if produced else tokens[:, :0]


def generate(shard: ModelShard, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy generation with the static cache (no early stop at EOS); the new tokens (batch, max_new_tokens)."""
    length = prompt_ids.shape[1]
    if max_new_tokens < 1 or length + max_new_tokens > shard.max_length:
        raise ValueError(
            f"{length} prompt + {max_new_tokens} new tokens do not fit the cache of {shard.max_length}; call setup_cache"
        )
    first = prefill(shard, prompt_ids)
    return torch.cat([first, decode(shard, first, length, max_new_tokens - 1)], dim=1)


# --- GPU speed options ---------------------------------------------------------------------------


def compile_branches(shard: ModelShard) -> None:
    """torch.compile each attention and MLP branch; the layer loop and its collectives stay eager, so
    the asynchronous all-reduces overlap exactly as without compile (the official code's
    semi-compiled mode)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(shard.layers))
    for block in shard.layers:
        block.attention.compile()
        block.mlp.compile()


class CUDAGraphStep:
    """One decode step (every layer and every all-reduce, NCCL included) captured as a CUDA graph and
    replayed per token: the launch overhead gpt-fast removes with mode="reduce-overhead".

    Build it right after `setup_cache` and before any prefill: its warm-up writes cache position 0.
    """

    def __init__(self, shard: ModelShard, batch: int):
        device = shard.lm_head.weight.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture: kernels, NCCL communicators, allocator
                shard(self.tokens, self.position)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.logits = shard(self.tokens, self.position)

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.position.copy_(input_pos)
        self.graph.replay()
        return self.logits
