"""The adapt recipe script: one plain accelerate loop that retrains a ladder model.

    setup()    accelerator, model (rewired in memory when it is an original), teacher for `kd`,
               packed data, trainable parameters, AdamW, warmup + decay schedule, resume state
    train()    per step: micro-batches (forward, loss, backward), clip, NaN check, optimizer
               step, metrics line; evaluation and atomic checkpoints on their schedules
    cleanup()  save the final model (LoRA merged), close the log

The same code runs on one CPU process, on DDP and on FSDP: `accelerate launch` decides.
Checkpoints are `accelerator.save_state` (model, optimizer, scheduler, python/numpy/torch RNG
of every process) plus `TrainState` (step and data position) and the resolved recipe, written
atomically. Which blocks a step reads is a pure function of (seed, step) (`BlockOrder`), so a
resumed run computes exactly what an uninterrupted run computes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list, set_seed
from tqdm.auto import tqdm
from transformers import AutoTokenizer

import ladder
from ladder.errors import UsageError, first_line
from ladder.files import atomic_directory, atomic_write
from ladder.loading import load_model, read_config_dict, resolve_model_path

from .data import BlockOrder, Splits, local_files, prepare_data
from .recipe import RESUME_FREE_KEYS, Recipe, dump_recipe, expand_path, recipe_from_dict

STATE_FILE = "trainer_state.json"
RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; the message names the step and what was kept."""


@dataclass
class TrainState:
    """What a checkpoint holds beside accelerate's state. Rules on resume: `step` continues as is;
    `data_position` must equal step * blocks_per_step (the batch shape cannot change mid-run);
    `processes` must equal the new run's (RNG states are saved per process)."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # step * tokens per step, all processes together
    data_position: int = 0  # blocks consumed from the shuffled stream (see BlockOrder)
    processes: int = 1


def prepare(recipe: Recipe) -> Splits:
    """Tokenize and cache a recipe's data in this one process, loading no weights: run it before a
    multi-GPU launch, so that no GPU waits on the tokenizer."""
    path = resolve_model_path(model_path(recipe.model.path))
    location, extra = (str(path.parent), {"gguf_file": path.name}) if path.suffix == ".gguf" else (str(path), {})
    return prepare_data(recipe.data, AutoTokenizer.from_pretrained(location, **extra))


def train(recipe: Recipe) -> Path:
    """Run a recipe to the end (or continue it, with `resume`); returns the final model directory."""
    run = AdaptRun(recipe)
    finished = run.setup()
    if finished is not None:
        return finished
    try:
        run.train()
        return run.save_final()
    finally:
        run.cleanup()


class AdaptRun:
    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.run_dir = recipe.run_dir()
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.final_dir = self.run_dir / "model"
        self.state = TrainState()
        self.progress = None
        self.postfix: dict[str, str] = {}

    # --- setup -----------------------------------------------------------------------------------

    def setup(self) -> Path | None:
        recipe = self.recipe
        tensorboard = recipe.logging.tensorboard == "on" or (
            recipe.logging.tensorboard == "auto" and importlib.util.find_spec("tensorboard") is not None
        )
        if recipe.logging.tensorboard == "on" and importlib.util.find_spec("tensorboard") is None:
            raise UsageError("logging.tensorboard=on needs the tensorboard package (pip install tensorboard)")
        warn_single_cpu_launch()
        self.accelerator = accelerator = Accelerator(
            # With no GPU, processes started by `accelerate launch --multi_gpu` train on CPU over gloo.
            cpu=not torch.accelerator.is_available(),
            mixed_precision="bf16" if recipe.precision == "bf16" else "no",
            step_scheduler_with_optimizer=False,
            log_with="tensorboard" if tensorboard else None,
            project_dir=str(self.run_dir),
            # The main process may tokenize for a long while (when --prepare-data was not run first)
            # while the others wait at a barrier.
            kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(hours=6))],
        )
        self.main = accelerator.is_main_process
        self.state = TrainState(processes=accelerator.num_processes)
        self.fsdp = accelerator.distributed_type == DistributedType.FSDP
        check_model(recipe)
        blocks_per_step = recipe.batch.micro_batch * recipe.batch.grad_accum * accelerator.num_processes
        self.tokens_per_step = blocks_per_step * recipe.data.seq_len
        self.total_steps = int(recipe.budget // self.tokens_per_step)
        if self.total_steps < 1:
            raise UsageError(f"budget {recipe.budget:g} is less than one step ({self.tokens_per_step} tokens)")
        if recipe.trainable.mode == "lora" and self.fsdp:
            raise UsageError("trainable.mode=lora runs with DDP or one process, not FSDP (the merge needs whole weights)")

        resume_from = self.find_resume_point()
        if resume_from == self.final_dir:
            accelerator.print(f"{self.final_dir} is already complete: nothing to resume")
            return self.final_dir

        set_seed(recipe.seed)
        for i, source in enumerate(recipe.data.train + recipe.data.eval):
            if not source.path.startswith("hf:"):
                local_files(source, f"data source {i} ({source.path})")

        model, self.tokenizer = load_model(model_path(recipe.model.path))
        teacher = None
        if recipe.objective.name != "lm":
            if recipe.model.teacher:
                teacher, _ = load_model(model_path(recipe.model.teacher))
            else:
                teacher = copy.deepcopy(model)  # the student below shares the original's tensors
        if recipe.model.ladder_layers is not None:
            try:
                model = ladder.to_ladder(model, recipe.model.ladder_layers)
            except ValueError as error:
                raise UsageError(f"model.ladder_layers: {error}") from None
        model.set_attn_implementation(recipe.model.attn_implementation)
        if recipe.model.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.ladder_layers = list(model.config.ladder_layers)

        with accelerator.main_process_first():
            self.data = prepare_data(recipe.data, self.tokenizer)
        batch = recipe.batch
        self.order = BlockOrder(len(self.data.train), recipe.seed, batch.micro_batch, batch.grad_accum,
                                accelerator.num_processes)
        if len(self.data.train) < self.order.per_step:
            raise UsageError(f"data.train gives {len(self.data.train)} blocks; one step needs {self.order.per_step}")

        model = self.select_trainable(model)
        parameters = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in parameters if p.ndim >= 2]  # no weight decay on norms, as usual
        rest = [p for p in parameters if p.ndim < 2]
        optimizer_spec = recipe.optimizer
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optimizer_spec.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=optimizer_spec.lr, betas=tuple(optimizer_spec.betas), eps=optimizer_spec.eps,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)
        if teacher is not None:
            teacher_dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float32
            self.teacher = teacher.to(device=accelerator.device, dtype=teacher_dtype).eval().requires_grad_(False)

        if resume_from is not None:
            self.load_checkpoint(resume_from)
        elif self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.run_dir / METRICS_FILE, "")
        if tensorboard:
            accelerator.init_trackers(recipe.name)
        trainable = sum(p.numel() for p in parameters)
        total = sum(p.numel() for p in model.parameters())
        accelerator.print(
            f"adapt {recipe.name}: ladder layers {compact(self.ladder_layers)} of {model.config.num_hidden_layers}, "
            f"trainable {recipe.trainable.mode} {trainable / 1e6:.1f}M of {total / 1e6:.1f}M parameters, "
            f"objective {recipe.objective.name}, {accelerator.num_processes} process(es) on {accelerator.device}\n"
            f"data: {len(self.data.train)} training blocks, {len(self.data.eval)} evaluation blocks of "
            f"{recipe.data.seq_len} tokens; {self.total_steps} steps of {self.tokens_per_step} tokens"
            + (f" (the run repeats the data {self.total_steps * self.order.per_step / len(self.data.train):.1f} times)"
               if self.total_steps * self.order.per_step > len(self.data.train) else "")
            + (f"; resuming at step {self.state.step}" if resume_from is not None else "")
        )
        return None

    def find_resume_point(self) -> Path | None:
        """The checkpoint to continue from (or the final model when the run is complete)."""
        if not self.recipe.resume:
            if self.final_dir.exists() or self.checkpoint_dir.exists() or (self.run_dir / METRICS_FILE).exists():
                raise UsageError(
                    f"{self.run_dir} holds an earlier run: pass resume=true to continue it, "
                    "or choose another output_dir (or delete that folder)"
                )
            return None
        if self.final_dir.exists():
            return self.final_dir
        return latest_checkpoint(self.checkpoint_dir)

    def select_trainable(self, model: torch.nn.Module) -> torch.nn.Module:
        mode = self.recipe.trainable.mode
        if mode in ("ladder", "layers"):
            if mode == "ladder":
                layers = self.ladder_layers
                if not layers:
                    raise UsageError("trainable.mode=ladder: the model has no ladder layer")
            else:
                try:
                    layers = ladder.parse_ladder_layers(self.recipe.trainable.layers, model.config.num_hidden_layers)
                except ValueError as error:
                    raise UsageError(f"trainable.layers: {error}") from None
            model.requires_grad_(False)
            for index in layers:
                model.model.layers[index].requires_grad_(True)
        elif mode == "lora":
            from peft import LoraConfig, get_peft_model

            lora = self.recipe.trainable.lora
            config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                target_modules=lora.target_modules, task_type="CAUSAL_LM")
            try:
                model = get_peft_model(model, config)
            except ValueError as error:
                raise UsageError(f"trainable.lora.target_modules: {first_line(error)}") from None
        return model

    def lr_factor(self, step: int) -> float:
        """Linear warmup, then cosine or linear decay to `min_lr_ratio` at the last step."""
        schedule = self.recipe.schedule
        warmup = schedule.warmup_steps or round(schedule.warmup_fraction * self.total_steps)
        if step < warmup:
            return (step + 1) / warmup
        if schedule.decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.decay == "cosine" else 1 - progress
        return schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * shape

    # --- the loop --------------------------------------------------------------------------------

    def train(self) -> None:
        recipe, accelerator = self.recipe, self.accelerator
        self.progress = tqdm(
            total=self.total_steps * self.tokens_per_step, initial=self.state.tokens_seen, unit="tok",
            unit_scale=True, dynamic_ncols=True, disable=not (self.main and recipe.logging.progress),
        )
        if self.state.step == 0:
            self.evaluate()
        self.model.train()
        while self.state.step < self.total_steps:
            started = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0]
            loss, lm_loss = self.accumulate_gradients()
            grad_norm = accelerator.clip_grad_norm_(
                self.model.parameters(), recipe.grad_clip if recipe.grad_clip > 0 else float("inf")
            )
            grad_norm = float(grad_norm)
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                kept = latest_checkpoint(self.checkpoint_dir)
                raise TrainingDiverged(
                    f"training stopped at step {self.state.step + 1}: loss {loss}, gradient norm {grad_norm}; "
                    + (f"the last checkpoint, written before that, is kept: {kept}" if kept else "no checkpoint had been written")
                    + " (try a lower optimizer.lr, or grad_clip)"
                )
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            self.state.data_position += self.order.per_step
            seconds = time.perf_counter() - started
            record = {"step": self.state.step, "tokens": self.state.tokens_seen, "loss": loss, "lm_loss": lm_loss,
                      "lr": lr, "grad_norm": grad_norm, "tokens_per_s": self.tokens_per_step / seconds}
            self.log(record)
            self.progress.update(self.tokens_per_step)
            self.postfix["loss"] = f"{loss:.4f}"
            self.progress.set_postfix(self.postfix, refresh=False)
            if self.state.step % recipe.eval_every == 0 or self.state.step == self.total_steps:
                self.evaluate()
            if self.state.step % recipe.checkpoint_every == 0 and self.state.step < self.total_steps:
                self.save_checkpoint()
        self.progress.close()

    def accumulate_gradients(self) -> tuple[float, float]:
        """Forward and backward over this process's micro-batches; the loss averaged over all processes."""
        accelerator, grad_accum = self.accelerator, self.recipe.batch.grad_accum
        totals = torch.zeros(2, device=accelerator.device)
        for micro_step in range(grad_accum):
            rows = self.order.indices(self.state.step, micro_step, accelerator.process_index)
            input_ids = torch.from_numpy(self.data.train[rows].astype(np.int64)).to(accelerator.device)
            # FSDP must reduce-scatter every micro-step: unsharded gradients would not fit.
            skip_sync = micro_step < grad_accum - 1 and not self.fsdp
            with accelerator.no_sync(self.model) if skip_sync else contextlib.nullcontext():
                loss, lm_loss = self.forward_loss(input_ids)
                accelerator.backward(loss / grad_accum)
            totals += torch.stack([loss.detach(), lm_loss.detach()]) / grad_accum
        totals = accelerator.reduce(totals, reduction="mean")
        return float(totals[0]), float(totals[1])

    def forward_loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to train on, next-token loss): `lm`, `kd` (T^2-scaled KL to the teacher's distribution at
        every position), or their mix. The logits die with this call, before the backward pass."""
        spec = self.recipe.objective
        with self.accelerator.autocast():
            logits = self.model(input_ids=input_ids, use_cache=False).logits
            if spec.name != "lm":
                with torch.no_grad():
                    teacher_logits = self.teacher(input_ids=input_ids, use_cache=False).logits
        lm_loss = F.cross_entropy(logits.flatten(0, 1).float(), next_token_labels(input_ids).flatten())
        if spec.name == "lm":
            return lm_loss, lm_loss
        temperature = spec.temperature
        student = F.log_softmax(logits.float() / temperature, dim=-1).flatten(0, 1)
        teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1).flatten(0, 1)
        kd_loss = F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2
        if spec.name == "kd":
            return kd_loss, lm_loss
        return (1 - spec.kd_weight) * lm_loss + spec.kd_weight * kd_loss, lm_loss

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean next-token loss over the held-out blocks (split across processes), logged."""
        accelerator, blocks = self.accelerator, self.data.eval
        if len(blocks) == 0:
            return None
        self.model.eval()
        micro_batch, processes = self.recipe.batch.micro_batch, accelerator.num_processes
        rounds = math.ceil(len(blocks) / (micro_batch * processes))
        totals = torch.zeros(2, device=accelerator.device)  # (sum of block losses, blocks)
        for round_index in range(rounds):
            # Every process runs the same number of forwards (FSDP needs it); padding rows count zero.
            start = (round_index * processes + accelerator.process_index) * micro_batch
            rows = np.arange(start, start + micro_batch)
            real = torch.from_numpy(rows < len(blocks)).to(accelerator.device)
            input_ids = torch.from_numpy(blocks[np.minimum(rows, len(blocks) - 1)].astype(np.int64))
            input_ids = input_ids.to(accelerator.device)
            with accelerator.autocast():
                per_block = block_losses(self.model, input_ids)
            totals += torch.stack([(per_block * real).sum(), real.sum()])
        totals = accelerator.reduce(totals, reduction="sum")
        eval_loss = float(totals[0] / totals[1])
        self.model.train()
        self.log({"step": self.state.step, "tokens": self.state.tokens_seen, "eval_loss": eval_loss,
                  "eval_perplexity": math.exp(min(eval_loss, 50.0))})
        self.postfix["eval_loss"] = f"{eval_loss:.4f}"
        message = f"step {self.state.step}: held-out loss {eval_loss:.4f} (perplexity {math.exp(min(eval_loss, 50)):.2f})"
        if self.progress is not None and not self.progress.disable:
            self.progress.write(message)
        else:
            accelerator.print(message)
        return eval_loss

    def log(self, record: dict) -> None:
        if self.main:
            with open(self.run_dir / METRICS_FILE, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    # --- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """An atomic `checkpoints/step-NNNNNN`; older ones beyond `keep_checkpoints` are removed."""
        accelerator = self.accelerator
        final = self.checkpoint_dir / f"step-{self.state.step:06d}"
        with contextlib.ExitStack() as stack:
            temporary = stack.enter_context(atomic_directory(final, force=True)) if self.main else None
            temporary = broadcast_object_list([str(temporary)])[0]
            accelerator.save_state(temporary)
            if self.main:
                Path(temporary, STATE_FILE).write_text(json.dumps(dataclasses.asdict(self.state), indent=1))
                Path(temporary, RECIPE_FILE).write_text(dump_recipe(self.recipe))
            accelerator.wait_for_everyone()
        accelerator.wait_for_everyone()
        if self.main:
            for old in checkpoints(self.checkpoint_dir)[: -self.recipe.keep_checkpoints]:
                shutil.rmtree(old)

    def load_checkpoint(self, path: Path) -> None:
        saved = recipe_from_dict(yaml.safe_load((path / RECIPE_FILE).read_text()))
        differences = differing_keys(saved.to_dict(), self.recipe.to_dict())
        if differences:
            raise UsageError(
                f"resume: the recipe differs from the one {path} was trained with at {', '.join(differences)}; "
                "resume with the same recipe, or start a new output_dir"
            )
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        assert state.data_position == state.step * self.order.per_step, "batch shape changed under an equal recipe"
        if state.processes != self.accelerator.num_processes:
            raise UsageError(f"resume: {path} was written by {state.processes} process(es); "
                             f"launch {state.processes}, not {self.accelerator.num_processes}")
        self.accelerator.load_state(str(path))
        self.state = state
        if self.main:
            # Lines logged after this checkpoint by the interrupted run are computed again.
            kept = []
            for line in (self.run_dir / METRICS_FILE).read_text().splitlines(keepends=True):
                try:
                    if json.loads(line)["step"] <= state.step:
                        kept.append(line)
                except json.JSONDecodeError:
                    pass  # a line cut short by the kill
            atomic_write(self.run_dir / METRICS_FILE, "".join(kept))

    # --- cleanup ---------------------------------------------------------------------------------

    def save_final(self) -> Path:
        """The trained model as a plain checkpoint (LoRA merged, in the recipe's precision) with its
        tokenizer and recipe. The weights go through a fresh model built on the meta device, so the
        same code serves one process, DDP and FSDP (whose `get_state_dict` gathers the shards)."""
        accelerator = self.accelerator
        if self.recipe.trainable.mode == "lora":
            trained = accelerator.unwrap_model(self.model).merge_and_unload()
            state_dict = trained.state_dict()
        else:
            trained = accelerator.unwrap_model(self.model)
            state_dict = accelerator.get_state_dict(self.model)
        if self.main:
            dtype = torch.bfloat16 if self.recipe.precision == "bf16" else torch.float32
            with torch.device("meta"):
                plain = ladder.LadderLlamaForCausalLM(trained.config)
            plain.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
            plain.tie_weights()
            plain.generation_config = trained.generation_config
            with atomic_directory(self.final_dir, force=True) as temporary:
                plain.save_pretrained(temporary, max_shard_size="5GB")
                self.tokenizer.save_pretrained(temporary)
                (temporary / RECIPE_FILE).write_text(dump_recipe(self.recipe))
            accelerator.print(f"final model: {self.final_dir}")
        accelerator.wait_for_everyone()
        return self.final_dir

    def cleanup(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.accelerator.end_training()


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Each position's next token; the last position is ignored (-100). Shifting the labels rather
    than slicing the logits spares a copy of the logits (batch x seq_len x vocab)."""
    return F.pad(input_ids[:, 1:], (0, 1), value=-100)


def block_losses(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of each row of `input_ids`."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    losses = F.cross_entropy(logits.flatten(0, 1).float(), next_token_labels(input_ids).flatten(), reduction="none")
    return losses.view(input_ids.shape).sum(dim=1) / (input_ids.shape[1] - 1)


def check_model(recipe: Recipe) -> bool:
    """Whether model.path is already a ladder checkpoint; refuses recipes that cannot work, before any
    weight loads."""
    path = resolve_model_path(model_path(recipe.model.path))
    config = read_config_dict(path) if path.is_dir() else {}  # a .gguf file holds an original Llama
    is_ladder = config.get("model_type") == ladder.LadderLlamaConfig.model_type
    if recipe.model.ladder_layers is None and not is_ladder:
        raise UsageError("model.ladder_layers: model.path is an original Llama, so name the layers to rewire")
    if recipe.model.ladder_layers is not None and "num_hidden_layers" in config:
        try:
            ladder.parse_ladder_layers(recipe.model.ladder_layers, config["num_hidden_layers"])
        except ValueError as error:
            raise UsageError(f"model.ladder_layers: {error}") from None
    if recipe.objective.name != "lm" and is_ladder and not recipe.model.teacher:
        raise UsageError(f"model.teacher: objective {recipe.objective.name} needs the original model as teacher, "
                         f"and model.path {path} is already a ladder checkpoint")
    if recipe.model.teacher:
        resolve_model_path(model_path(recipe.model.teacher))
    return is_ladder


def model_path(text: str) -> str | None:
    """A recipe's model path: "embedded" (or empty) is the default SmolLM2 model."""
    return None if text in ("", "embedded") else expand_path(text, "model path")


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporaries of interrupted saves are hidden `.step-...` names)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob("step-*") if (p / STATE_FILE).is_file())


def latest_checkpoint(directory: Path) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def differing_keys(saved: dict, current: dict, prefix: str = "") -> list[str]:
    keys = []
    for key in sorted(set(saved) | set(current)):
        if not prefix and key in RESUME_FREE_KEYS:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += differing_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


def compact(layers: list[int]) -> str:
    if layers and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers)) or "none"


def warn_single_cpu_launch() -> None:
    """`accelerate launch --cpu --num_processes N` starts one process unless mpirun is set up
    (accelerate issue #2741); say so instead of silently training alone."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") and "MASTER_ADDR" in os.environ \
            and "WORLD_SIZE" not in os.environ and "PMI_SIZE" not in os.environ:
        print("ladder adapt: warning: `accelerate launch --cpu` started a single process; for several CPU "
              "processes use `accelerate launch --multi_gpu --num_processes N` (adapt trains on CPU over "
              "gloo when no GPU is present)", file=sys.stderr)


__all__ = ["TrainState", "TrainingDiverged", "block_losses", "prepare", "train"]
