"""The adapt recipe script: one plain accelerate loop that retrains a ladder model.

    setup()    named steps: accelerator, budget, model (rewired in memory when it is an original)
               and teacher for `kd`, packed data, trainable parameters, AdamW with warmup + decay,
               resume state
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
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.tracking import get_available_trackers
from accelerate.utils import DistributedType, InitProcessGroupKwargs, parse_flag_from_env, set_seed
from tqdm.auto import tqdm

import ladder
from ladder.errors import UsageError, first_line
from ladder.io.files import atomic_directory, atomic_write, lock_output
from ladder.io.loading import (
    check_llama_checkpoint,
    gguf_parsed_once,
    load_model,
    load_tokenizer,
    read_config_dict,
    resolve_model_path,
)
from ladder.io.model_card import (
    SourceFacts,
    copy_licence_files,
    loading_section,
    origin_line,
    render_card,
    source_facts,
)
from ladder.layer_search import calibration_from_blocks, choose_ladder_layers
from ladder.layers import LADDER_MODEL_TYPE, format_layers, parse_auto_layers, parse_ladder_layers

from .checkpoint import (
    RECIPE_FILE,
    TrainState,
    check_same_recipe,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .data import BlockOrder, Blocks, Splits, document_positions, local_files, prepare_data
from .distill import Distiller
from .losses import block_loss_sums, head_losses, hidden_loss, losses_in_lm_head, next_token_labels
from .memory import allocate_optimizer_state, keep_fewer_activations
from .recipe import Recipe, dump_recipe, model_path

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb-run-id"
LAYER_SEARCH_FILE = "layer_search.json"  # what `model.ladder_layers: auto:N` measured and chose


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; the message names the step and what was kept."""


def prepare(recipe: Recipe) -> Splits:
    """Tokenize and cache a recipe's data in this one process, loading no weights: run it before a
    multi-GPU launch, so that no GPU waits on the tokenizer."""
    return prepare_data(recipe.data, load_tokenizer(model_path(recipe.model.path)))


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
        self.teacher = None
        self.distiller: Distiller | None = None

    # --- setup: checks first, then model, teacher, trainable selection, data, optimizer, resume ---

    def setup(self) -> Path | None:
        """Everything `train` needs; returns the final model instead when the run is already complete."""
        self.setup_accelerator()
        check_model(self.recipe)
        self.setup_budget()
        resume_from = self.find_resume_point()
        if resume_from == self.final_dir:
            self.accelerator.print(f"{self.final_dir} is already complete: nothing to resume")
            return self.final_dir

        set_seed(self.recipe.seed)
        for i, source in enumerate(self.recipe.data.train + self.recipe.data.eval):
            if not source.path.startswith("hf:"):
                local_files(source, f"data source {i} ({source.path})")
        model = self.setup_model()  # it prepares the data too: `auto:N` calibrates on training blocks
        model = self.select_trainable(model)
        keep_fewer_activations(model)
        self.setup_optimizer(model)

        self.output_lock = lock_output(self.run_dir, "adapt") if self.main else None  # for the run's life
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        else:
            allocate_optimizer_state(self.optimizer.optimizer)  # a resumed run loads its own instead
            if self.main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(self.run_dir / METRICS_FILE, "")
        self.start_trackers()
        self.describe(model, resumed=resume_from is not None)
        return None

    def setup_accelerator(self) -> None:
        """The accelerator (one process, DDP or FSDP, as `accelerate launch` says) with the recipe's
        experiment trackers; a tracker whose package is missing is refused here, before any weight loads."""
        recipe = self.recipe
        for name in recipe.logging.log_with:
            if name not in {str(t) for t in get_available_trackers()}:
                raise UsageError(f"logging.log_with: {name} needs its package (pip install {name.replace('_', '-')})")
        warn_single_cpu_launch()
        # The main process may tokenize for a long while (when --prepare-data was not run first)
        # while the others wait at a barrier.
        process_group = InitProcessGroupKwargs(timeout=datetime.timedelta(hours=6))
        # With no GPU, processes started by `accelerate launch --multi_gpu` (or an FSDP config) train on CPU over gloo.
        cpu = not torch.accelerator.is_available()
        if cpu and parse_flag_from_env("ACCELERATE_USE_FSDP"):
            enable_fsdp_on_cpu(process_group)
        self.accelerator = Accelerator(
            cpu=cpu,
            mixed_precision="bf16" if recipe.precision == "bf16" else "no",
            step_scheduler_with_optimizer=False,
            log_with=list(recipe.logging.log_with) or None,
            project_dir=str(self.run_dir),
            kwargs_handlers=[process_group],
        )
        self.main = self.accelerator.is_main_process
        self.state = TrainState(processes=self.accelerator.num_processes)
        self.fsdp = self.accelerator.distributed_type == DistributedType.FSDP

    def start_trackers(self) -> None:
        """Open the trackers so that a resumed run continues its history instead of repeating it:
        TensorBoard purges the events the interrupted run logged after the checkpoint (`purge_step`),
        wandb reopens the same run (its id is kept in the run folder) and ignores steps it has already."""
        if not self.recipe.logging.log_with:
            return
        resumed_at = self.state.step
        init_kwargs = {"tensorboard": {"purge_step": resumed_at + 1} if resumed_at else {}}
        if "wandb" in self.recipe.logging.log_with and self.main:
            id_file = self.run_dir / WANDB_ID_FILE
            if not id_file.is_file():
                atomic_write(id_file, f"{self.recipe.name}-{os.urandom(4).hex()}")
            init_kwargs["wandb"] = {
                "id": id_file.read_text().strip(),
                "resume": "allow",
                "name": self.recipe.name,
                "dir": str(self.run_dir),
                "config": self.recipe.to_dict(),
            }
        self.accelerator.init_trackers(self.recipe.name, init_kwargs=init_kwargs)

    def setup_budget(self) -> None:
        """Steps and tokens per step from the budget and the batch shape; refuses what cannot run."""
        recipe, processes = self.recipe, self.accelerator.num_processes
        blocks_per_step = recipe.batch.micro_batch * recipe.batch.grad_accum * processes
        self.tokens_per_step = blocks_per_step * recipe.data.seq_len
        self.total_steps = int(recipe.budget // self.tokens_per_step)
        if self.total_steps < 1:
            raise UsageError(f"budget {recipe.budget:g} is less than one step ({self.tokens_per_step} tokens)")
        if recipe.trainable.mode == "lora" and self.fsdp:
            raise UsageError(
                "trainable.mode=lora runs with DDP or one process, not FSDP (the merge needs whole weights)"
            )

    def setup_model(self) -> torch.nn.Module:
        """The student (rewired in memory when model.path is an original Llama) and, for `kd` and
        `hidden`, the teacher: the original model, a copy taken before the rewiring."""
        recipe = self.recipe
        self.source = resolve_model_path(model_path(recipe.model.path))
        # The model card's facts now, from the load's own parse of a GGUF file: at the end of training
        # a second parse (1-2 s, 170 MiB for SmolLM2's vocabulary) would set the run's peak RSS.
        with gguf_parsed_once():
            model, self.tokenizer = load_model(self.source)
            self.source_facts = source_facts(self.source)
        self.setup_data()
        teacher = None
        if recipe.objective.needs_teacher():
            if recipe.model.teacher:
                teacher, _ = load_model(model_path(recipe.model.teacher))
            else:
                teacher = copy.deepcopy(model)  # the student below shares the original's tensors
        if recipe.model.ladder_layers is not None:
            model = ladder.to_ladder(model, self.resolve_ladder_layers(model))
        model.set_attn_implementation(recipe.model.attn_implementation)
        if recipe.model.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if recipe.model.compile:
            for layer in model.model.layers:
                layer.compile()  # in place: parameter names and checkpoints stay as they are
        self.ladder_layers = list(model.config.ladder_layers)
        self.num_hidden_layers = model.config.num_hidden_layers
        if teacher is not None:
            teacher_dtype = torch.bfloat16 if recipe.precision == "bf16" else torch.float32
            # As a ladder model with the teacher's own wiring (none, for an original), so that its layers
            # take the student's (attn_stream, mlp_stream) (adapt/distill.py).
            teacher = ladder.to_ladder(teacher, list(getattr(teacher.config, "ladder_layers", None) or []))
            teacher.set_attn_implementation(recipe.model.attn_implementation)  # the student's masks fit it
            self.teacher = teacher.to(device=self.accelerator.device, dtype=teacher_dtype).eval().requires_grad_(False)
        return model

    def resolve_ladder_layers(self, model: torch.nn.Module) -> list[int]:
        """model.ladder_layers as a list of layers. `auto:N` measures candidates on calibration blocks
        spread over data.train (the main process searches, the others read its record); a resumed run
        reuses the recorded choice."""
        spec, num_layers = self.recipe.model.ladder_layers, model.config.num_hidden_layers
        auto = parse_auto_layers(spec, num_layers, "model.ladder_layers")
        if auto is None:
            return parse_ladder_layers(spec, num_layers, "model.ladder_layers")
        record = self.run_dir / LAYER_SEARCH_FILE
        with self.accelerator.main_process_first():
            if self.main and not (
                self.recipe.resume and record.is_file() and json.loads(record.read_text())["spec"] == str(auto)
            ):
                search = choose_ladder_layers(model, calibration_from_blocks(self.data.train.ids), auto)
                self.run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(record, json.dumps(dataclasses.asdict(search), indent=1) + "\n")
                self.accelerator.print(search.summary())
            return json.loads(record.read_text())["chosen"]

    def setup_data(self) -> None:
        """The tokenized blocks (the main process tokenizes, the others then read its cache) and
        the order in which the steps read them."""
        batch, processes = self.recipe.batch, self.accelerator.num_processes
        with self.accelerator.main_process_first():
            self.data = prepare_data(self.recipe.data, self.tokenizer)
        self.order = BlockOrder(len(self.data.train), self.recipe.seed, batch.micro_batch, batch.grad_accum, processes)
        if len(self.data.train) < self.order.per_step:
            raise UsageError(f"data.train gives {len(self.data.train)} blocks; one step needs {self.order.per_step}")

    def setup_optimizer(self, model: torch.nn.Module) -> None:
        """AdamW over the trainable parameters (no weight decay on norms, as usual) with the warmup
        and decay schedule, everything handed to `accelerator.prepare`."""
        spec = self.recipe.optimizer
        parameters = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in parameters if p.ndim >= 2]
        rest = [p for p in parameters if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": spec.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=spec.lr,
            betas=tuple(spec.betas),
            eps=spec.eps,
            # One kernel for all parameters; torch's default on CPU loops over the tensors (the CPU
            # recipe's step: 0.018 s against 0.062). transformers' Trainer defaults to it too.
            fused=True,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)

    def describe(self, model: torch.nn.Module, resumed: bool) -> None:
        recipe = self.recipe
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        repeats = self.total_steps * self.order.per_step / len(self.data.train)
        self.accelerator.print(
            f"adapt {recipe.name}: ladder layers {format_layers(self.ladder_layers)} of {model.config.num_hidden_layers}, "
            f"trainable {recipe.trainable.mode} {trainable / 1e6:.1f}M of {total / 1e6:.1f}M parameters, "
            f"objective {recipe.objective.name}, {self.accelerator.num_processes} process(es) on {self.accelerator.device}\n"
            f"data: {len(self.data.train)} training blocks, {len(self.data.eval)} evaluation blocks of "
            f"{recipe.data.seq_len} tokens ({self.data.train.masked_share():.1%} of the training tokens masked from "
            f"the loss); {self.total_steps} steps of {self.tokens_per_step} tokens"
            + (f" (the run repeats the data {repeats:.1f} times)" if repeats > 1 else "")
            + (f"; resuming at step {self.state.step}" if resumed else "")
        )

    def find_resume_point(self) -> Path | None:
        """The checkpoint to continue from (or the final model when the run is complete)."""
        return resume_point(self.recipe)

    def select_trainable(self, model: torch.nn.Module) -> torch.nn.Module:
        """Freeze all but the ladder layers (`ladder`), the named layers (`layers`), or wrap the model
        in LoRA adapters (`lora`); `all` trains everything."""
        mode = self.recipe.trainable.mode
        if mode in ("ladder", "layers"):
            if mode == "ladder":
                layers = self.ladder_layers
                if not layers:
                    raise UsageError("trainable.mode=ladder: the model has no ladder layer")
            else:
                layers = parse_ladder_layers(
                    self.recipe.trainable.layers, model.config.num_hidden_layers, "trainable.layers"
                )
            model.requires_grad_(False)
            for index in layers:
                model.model.layers[index].requires_grad_(True)
        elif mode == "lora":
            from peft import LoraConfig, get_peft_model

            lora = self.recipe.trainable.lora
            config = LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
                task_type="CAUSAL_LM",
            )
            try:
                model = get_peft_model(model, config)
            except ValueError as error:
                raise UsageError(f"trainable.lora.target_modules: {first_line(error)}") from None
        if self.teacher is not None:
            if self.recipe.objective.uses_hidden() and not self.ladder_layers:
                raise UsageError("objective hidden: the model has no ladder layer whose stream could be matched")
            # The teacher starts from the student's streams when the layers below the first ladder
            # layer are frozen and the teacher is the same original (adapt/distill.py).
            shared = (
                mode in ("ladder", "layers")
                and not self.recipe.model.teacher
                and bool(self.ladder_layers)
                and min(layers, default=0) >= min(self.ladder_layers)
            )
            decoder_layers = next(module for name, module in model.named_modules() if name.endswith("model.layers"))
            self.distiller = Distiller(self.teacher, decoder_layers, self.ladder_layers, shared_prefix=shared)
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
            total=self.total_steps * self.tokens_per_step,
            initial=self.state.tokens_seen,
            unit="tok",
            unit_scale=True,
            dynamic_ncols=True,
            disable=not (self.main and recipe.logging.progress),
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
                    + (
                        f"the last checkpoint, written before that, is kept: {kept}"
                        if kept
                        else "no checkpoint had been written"
                    )
                    + " (try a lower optimizer.lr, or grad_clip)"
                )
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step += 1
            self.state.tokens_seen += self.tokens_per_step
            self.state.data_position += self.order.per_step
            seconds = time.perf_counter() - started
            record = {
                "step": self.state.step,
                "tokens": self.state.tokens_seen,
                "loss": loss,
                "lm_loss": lm_loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": self.tokens_per_step / seconds,
            }
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
            input_ids, labels, position_ids = self.batch(self.data.train[rows])
            # FSDP must reduce-scatter every micro-step: unsharded gradients would not fit.
            skip_sync = micro_step < grad_accum - 1 and not self.fsdp
            with accelerator.no_sync(self.model) if skip_sync else contextlib.nullcontext():
                loss, lm_loss = self.forward_loss(input_ids, labels, position_ids)
                accelerator.backward(loss / grad_accum)
            totals += torch.stack([loss.detach(), lm_loss.detach()]) / grad_accum
        totals = accelerator.reduce(totals, reduction="mean")
        return float(totals[0]), float(totals[1])

    def batch(self, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input ids, labels, position ids) of some blocks, on the device. Labels are -100 before tokens
        that are not targets; with `data.isolate_documents` the position ids restart at each document
        (which makes transformers' mask block-diagonal) and no label crosses into the next document."""
        device = self.accelerator.device
        input_ids = torch.from_numpy(blocks.ids.astype(np.int64)).to(device)
        targets = np.array(blocks.targets, dtype=np.int64)
        position_ids = None
        if self.recipe.data.isolate_documents:
            targets[np.asarray(blocks.starts, dtype=bool)] = (
                0  # a document's first token is not predicted from the one before
            )
            position_ids = torch.from_numpy(document_positions(blocks.starts)).to(device)
        return input_ids, next_token_labels(input_ids, torch.from_numpy(targets).to(device)), position_ids

    def forward_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to train on, next-token loss): `lm`, `kd` (T^2-scaled KL to the teacher's distribution at
        every position), their mix, or `hidden` (the residual streams after the ladder layers matched
        to the teacher's), plus `hidden_weight` times that. The head's losses are computed from the
        final hidden states chunk by chunk inside the model's forward (`losses_in_lm_head`): full
        logits never exist. The teacher runs there too, once the student's layers have run, so that it
        can start from the student's streams (adapt/distill.py)."""
        spec = self.recipe.objective
        kd_weight = {"lm": 0.0, "hidden": 0.0, "kd": 1.0}.get(spec.name, spec.kd_weight)
        taught = []  # the teacher's output, from inside the student's forward
        with self.accelerator.autocast():

            def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                teacher_hidden = teacher_weight = None
                if self.distiller is not None:
                    taught.append(
                        self.distiller.teacher_forward(
                            input_ids, captured, final=bool(kd_weight), position_ids=position_ids
                        )
                    )
                    teacher_hidden, teacher_weight = taught[0].final_hidden, self.teacher.lm_head.weight
                if spec.name == "hidden":  # the next-token loss is reported, not trained on
                    hidden, weight = hidden.detach(), weight.detach()
                return head_losses(
                    hidden,
                    weight,
                    labels,
                    teacher_hidden,
                    teacher_weight,
                    kd_weight=kd_weight,
                    temperature=spec.temperature,
                )

            with (
                self.distiller.capture() if self.distiller else contextlib.nullcontext() as captured,
                losses_in_lm_head(self.model, head) as results,
            ):
                self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        loss, next_token = results[0]
        if spec.name == "hidden" or spec.hidden_weight > 0:
            matched = hidden_loss([captured.streams[i] for i in self.ladder_layers], taught[0].streams)
            loss = matched if spec.name == "hidden" else loss + spec.hidden_weight * matched
        return loss, next_token

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean next-token loss over the labelled positions of the held-out blocks (split across
        processes), logged."""
        accelerator, blocks = self.accelerator, self.data.eval
        if len(blocks) == 0:
            return None
        self.model.eval()
        micro_batch, processes = self.recipe.batch.micro_batch, accelerator.num_processes
        rounds = math.ceil(len(blocks) / (micro_batch * processes))
        totals = torch.zeros(2, device=accelerator.device)  # (summed loss, labelled positions)
        for round_index in range(rounds):
            # Every process runs the same number of forwards (FSDP needs it); padding rows count zero.
            start = (round_index * processes + accelerator.process_index) * micro_batch
            rows = np.arange(start, start + micro_batch)
            real = torch.from_numpy(rows < len(blocks)).to(accelerator.device)
            input_ids, labels, position_ids = self.batch(blocks[np.minimum(rows, len(blocks) - 1)])
            with accelerator.autocast():
                sums, counts = block_loss_sums(self.model, input_ids, labels, position_ids)
            totals += torch.stack([(sums * real).sum(), (counts * real).sum()])
        totals = accelerator.reduce(totals, reduction="sum")
        eval_loss = float(totals[0] / totals[1])
        self.model.train()
        self.log(
            {
                "step": self.state.step,
                "tokens": self.state.tokens_seen,
                "eval_loss": eval_loss,
                "eval_perplexity": math.exp(min(eval_loss, 50.0)),
            }
        )
        self.postfix["eval_loss"] = f"{eval_loss:.4f}"
        message = (
            f"step {self.state.step}: held-out loss {eval_loss:.4f} (perplexity {math.exp(min(eval_loss, 50)):.2f})"
        )
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
        final = self.checkpoint_dir / f"step-{self.state.step:06d}"
        save_checkpoint(self.accelerator, final, self.state, self.recipe, self.recipe.keep_checkpoints)
        if self.main and "tensorboard" in self.recipe.logging.log_with:
            # Events up to the checkpoint reach the disk now: a resumed run purges only what comes after it.
            self.accelerator.get_tracker("tensorboard", unwrap=True).flush()

    def load_checkpoint(self, path: Path) -> None:
        self.state = load_checkpoint(self.accelerator, path, self.recipe, self.order.per_step)
        if self.main:
            # Lines logged after this checkpoint by the interrupted run are computed again.
            kept = []
            for line in (self.run_dir / METRICS_FILE).read_text().splitlines(keepends=True):
                try:
                    if json.loads(line)["step"] <= self.state.step:
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
                licences = copy_licence_files(self.source, temporary)
                (temporary / "README.md").write_text(self.model_card(self.source_facts, licences))
                if (self.run_dir / LAYER_SEARCH_FILE).is_file():
                    shutil.copyfile(self.run_dir / LAYER_SEARCH_FILE, temporary / LAYER_SEARCH_FILE)
            accelerator.print(f"final model: {self.final_dir}")
        accelerator.wait_for_everyone()
        return self.final_dir

    def model_card(self, source: SourceFacts, licences: list[str]) -> str:
        """README.md of the final model: what was rewired, how it was trained (recipe, data, budget)
        and the held-out loss before and after, from metrics.jsonl."""
        recipe = self.recipe
        evals = [
            r
            for r in (json.loads(line) for line in (self.run_dir / METRICS_FILE).read_text().splitlines())
            if "eval_loss" in r
        ]
        hub_datasets = [s.path.removeprefix("hf:") for s in recipe.data.train if s.path.startswith("hf:")]
        sources = ", ".join(
            f"`{Path(s.path).name if not s.path.startswith('hf:') else s.path}`" for s in recipe.data.train
        )
        lines = [
            origin_line(source),
            "",
            f"Layers {format_layers(self.ladder_layers)} of {self.num_hidden_layers} are ladder layers "
            "(each module reads the residual stream from before the previous module's output was added, so under "
            "tensor parallelism one module's all-reduce overlaps the next module's compute), and the model was "
            "retrained to win back the accuracy the rewiring costs.",
            "",
            "## Training",
            "",
            f"- recipe `{recipe.name}` (`{RECIPE_FILE}` beside the weights holds all of it)",
            f"- {self.state.tokens_seen:,} tokens in {self.state.step} steps of {self.tokens_per_step:,} "
            f"({recipe.data.seq_len}-token packed blocks), {self.accelerator.num_processes} process(es)",
            f"- data: {sources}",
            f"- trainable: {recipe.trainable.mode}; objective: {recipe.objective.name}; AdamW lr "
            f"{recipe.optimizer.lr:g}, {recipe.schedule.decay} decay; precision {recipe.precision}",
        ]
        if evals:
            lines += ["", "## Held-out loss", "", "| step | tokens | loss | perplexity |", "|---|---|---|---|"]
            lines += [
                f"| {r['step']} | {r['tokens']:,} | {r['eval_loss']:.4f} | {r['eval_perplexity']:.2f} |"
                for r in (evals if len(evals) <= 2 else [evals[0], evals[-1]])
            ]
            lines += [
                "",
                f"On {len(self.data.eval)} held-out blocks of {recipe.data.seq_len} tokens; every "
                f"evaluation is in `metrics.jsonl` of the run ({self.run_dir}).",
            ]
        lines += ["", loading_section()]
        if licences:
            lines += [
                "",
                f"The source's licence terms apply: {', '.join(f'`{name}`' for name in licences)} are copied from it.",
            ]
        return render_card(source, f"{recipe.name} (ladder, retrained)", "\n".join(lines), datasets=hub_datasets)

    def cleanup(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.accelerator.end_training()


def resume_point(recipe: Recipe) -> Path | None:
    """Where a run of `recipe` continues: its final model when complete, else its latest checkpoint,
    else None (a fresh start). Either is refused, before any weight loads, when it was made with a
    recipe that differs from `recipe` (the UsageError names the keys), and so is an earlier run
    without `resume`."""
    run_dir = recipe.run_dir()
    final_dir, checkpoint_dir = run_dir / "model", run_dir / "checkpoints"
    if not recipe.resume:
        if final_dir.exists() or checkpoint_dir.exists() or (run_dir / METRICS_FILE).exists():
            raise UsageError(
                f"{run_dir} holds an earlier run: pass resume=true to continue it, "
                "or choose another output_dir (or delete that folder)"
            )
        return None
    found = final_dir if final_dir.exists() else latest_checkpoint(checkpoint_dir)
    if found is not None:
        check_same_recipe(found, recipe)
    return found


def check_model(recipe: Recipe) -> bool:
    """Whether model.path is already a ladder checkpoint; refuses recipes that cannot work, before any
    weight loads."""
    path = resolve_model_path(model_path(recipe.model.path))
    check_llama_checkpoint(path)  # any other model_type is refused, as convert does
    config = read_config_dict(path) if path.is_dir() else {}  # a .gguf file holds an original Llama
    is_ladder = config.get("model_type") == LADDER_MODEL_TYPE
    if recipe.model.ladder_layers is None and not is_ladder:
        raise UsageError("model.ladder_layers: model.path is an original Llama, so name the layers to rewire")
    if recipe.model.ladder_layers is not None and "num_hidden_layers" in config:
        if parse_auto_layers(recipe.model.ladder_layers, config["num_hidden_layers"], "model.ladder_layers") is None:
            parse_ladder_layers(recipe.model.ladder_layers, config["num_hidden_layers"], "model.ladder_layers")
    if recipe.objective.needs_teacher() and is_ladder and not recipe.model.teacher:
        raise UsageError(
            f"model.teacher: objective {recipe.objective.name} needs the original model as teacher, "
            f"and model.path {path} is already a ladder checkpoint"
        )
    if recipe.model.teacher:
        resolve_model_path(model_path(recipe.model.teacher))
    return is_ladder


def enable_fsdp_on_cpu(process_group: InitProcessGroupKwargs) -> None:
    """Let an FSDP launch (`accelerate launch --config_file recipes/accelerate/fsdp-cpu-2proc.yaml`)
    run FSDP2 on CPU processes over gloo instead of silently falling back to DDP.

    accelerate 1.16 applies FSDP only to GPU-type process groups: `AcceleratorState.__init__`
    (accelerate/state.py:947, `elif self.distributed_type in [DistributedType.MULTI_GPU, ...]`)
    leaves a CPU group as MULTI_CPU, which `prepare` wraps in DDP. FSDP2 itself (`fully_shard`,
    DTensor parameters, the sharded checkpoints) runs over gloo, so the CPU process group is
    started here and marked MULTI_GPU: the Accelerator built next takes that FSDP branch, and its
    device stays the CPU. This is how the tests run the FSDP code path without GPUs."""
    state = PartialState(cpu=True, **process_group.to_kwargs())
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def warn_single_cpu_launch() -> None:
    """`accelerate launch --cpu --num_processes N` starts one process unless mpirun is set up
    (accelerate issue #2741); say so instead of silently training alone."""
    if (
        os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
        and "MASTER_ADDR" in os.environ
        and "WORLD_SIZE" not in os.environ
        and "PMI_SIZE" not in os.environ
    ):
        print(
            "ladder adapt: warning: `accelerate launch --cpu` started a single process; for several CPU "
            "processes use `accelerate launch --multi_gpu --num_processes N` (adapt trains on CPU over "
            "gloo when no GPU is present)",
            file=sys.stderr,
        )


__all__ = ["AdaptRun", "TrainingDiverged", "prepare", "resume_point", "train"]
