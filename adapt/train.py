"""The adapt recipe script: one plain accelerate loop that retrains a ladder model.

    setup()    the steps in order (each a method below): accelerator, model checks (the paths resolved
               once), budget, resume point, data files, student, packed data, teacher for `kd` and
               `hidden`, rewiring (in memory when model.path is an original), trainable parameters,
               AdamW with warmup + decay, resume state, trackers
    train()    per step: micro-batches (forward, loss, backward; adapt/step.py), clip, NaN check,
               optimizer step, metrics line; evaluation and atomic checkpoints on their schedules;
               SIGTERM or SIGUSR1 ends it after the step with a checkpoint (adapt/preemption.py);
               collectives wait `timeout.collective` from the second step (`timeout.setup` before)
    cleanup()  save the final model (LoRA merged) with its card (adapt/card.py), close the log

The same code runs on one CPU process, on DDP and on FSDP: `accelerate launch` decides.
Checkpoints are `accelerator.save_state` (model, optimizer, scheduler, python/numpy/torch RNG
of every process) plus `TrainState` (step and data position) and the resolved recipe, written
atomically. Which blocks a step reads is a pure function of (seed, step) (`BlockOrder`), so a
resumed run computes exactly what an uninterrupted run computes.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm

import ladder
from ladder.errors import UsageError, first_line
from ladder.io.files import OutputLock, atomic_directory, atomic_write, lock_output
from ladder.io.loading import load_tokenizer
from ladder.io.model_card import copy_licence_files
from ladder.layers import (
    format_layers,
)

from .card import TrainingFacts, model_card
from .checkpoint import (
    METRICS_FILE,
    TrainState,
    check_same_data,
    latest_checkpoint,
    load_checkpoint,
    plain_ladder_model,
    save_checkpoint,
    truncate_metrics,
)
from .data import BlockOrder, Splits, prepare_data
from .distill import Distiller
from .launch import fsdp_precision, long_waits, make_accelerator, raised_by_a_collective, set_timeout, start_trackers
from .layer_choice import LAYER_SEARCH_FILE, resolve_ladder_layers
from .memory import allocate_optimizer_state, keep_fewer_activations
from .models import (
    configure_student,
    load_student,
    load_teacher,
    make_trainable,
    peak_host_memory,
    prepare_teacher,
    reset_peak_host_memory,
    weights_from_main,
)
from .optimizer import build_optimizer
from .preemption import Preempted, StopSignals
from .preflight import (
    ModelSources,
    check_data_files,
    check_data_prepared,
    check_model,
    check_outputs,
    resume_point,
    source_path,
    step_budget,
)
from .recipe import RECIPE_FILE, Recipe, dump_recipe
from .step import TrainingStep, step_metrics
from .training_cost import checkpointing_policy, flops_per_token, model_shape, peak_flops, setup_of

# The ladder logger (ladder/log.py) through accelerate's adapter: it speaks on the main process only.
log = get_logger("ladder")


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; the message names the step and what was kept."""


class ProcessesLost(RuntimeError):
    """A collective failed: another process hung past `timeout.collective`, or died; the message names
    the step and what was kept."""


def prepare(recipe: Recipe) -> Splits:
    """Tokenize and cache a recipe's data in this one process, loading no weights: run it before a
    multi-GPU launch, so that no GPU waits on the tokenizer."""
    model = source_path(recipe.model.path)
    check_outputs(recipe, ModelSources(model, None))
    return prepare_data(recipe.data, load_tokenizer(model))


def train(recipe: Recipe) -> Path:
    """Run a recipe to the end (or continue it, with `resume`); returns the final model directory.
    SIGTERM or SIGUSR1 ends it after the step in progress with a checkpoint: `Preempted`."""
    run = AdaptRun(recipe)
    with run.stop_signals, contextlib.ExitStack() as releases:
        # The output folder's lock goes with the run however it ends (a caller may run again in-process).
        releases.callback(lambda: run.output_lock and run.output_lock.close())
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
        self.stop_signals = StopSignals()
        self.output_lock: OutputLock | None = None  # held from restore_or_start to the run's end

    # --- setup: checks first (no weight loads before them), then models, data, optimizer, resume --

    def setup(self) -> Path | None:
        """Everything `train` needs, step by step; returns the final model instead when the run is
        already complete."""
        self.sources = check_model(self.recipe)
        check_outputs(self.recipe, self.sources)  # before the accelerator, which may make the run folder
        self.setup_accelerator()
        self.setup_budget()
        resume_from = resume_point(self.recipe)
        if resume_from == self.final_dir:
            log.info(f"{self.final_dir} is already complete: nothing to resume")
            return self.final_dir
        set_seed(self.recipe.seed)
        self.data_files = check_data_files(self.recipe)
        if resume_from is not None:
            check_same_data(resume_from, self.data_files)
        check_data_prepared(self.recipe, self.accelerator)
        student = self.setup_student()
        self.setup_data()  # before the rewiring: `auto:N` calibrates on training blocks
        teacher = load_teacher(self.recipe, self.sources.teacher, student, empty=self.receives_weights)
        student = self.rewire(student)
        self.setup_teacher(teacher)
        student = self.select_trainable(student)
        self.setup_mfu(student)
        keep_fewer_activations(student)
        self.setup_optimizer(student)
        self.setup_training_step()
        self.restore_or_start(resume_from)
        start_trackers(self.accelerator, self.recipe, self.run_dir, resumed_at=self.state.step)
        self.describe(student, resumed=resume_from is not None)
        return None

    def setup_accelerator(self) -> None:
        """One process, DDP or FSDP, as `accelerate launch` says (adapt/launch.py)."""
        self.accelerator = make_accelerator(self.recipe, self.run_dir)
        self.main = self.accelerator.is_main_process
        self.state = TrainState(processes=self.accelerator.num_processes)
        self.fsdp = self.accelerator.distributed_type == DistributedType.FSDP

    def setup_budget(self) -> None:
        """Steps and tokens per step (adapt/preflight.py)."""
        budget = step_budget(self.recipe, self.accelerator.num_processes, self.fsdp)
        self.tokens_per_step, self.total_steps = budget.tokens_per_step, budget.total_steps

    def setup_student(self) -> torch.nn.Module:
        """model.path as loaded, with its tokenizer and the facts the model card names; on the meta
        device in a process that receives its weights from the main one (adapt/models.py)."""
        self.weights_from_main = weights_from_main(self.accelerator)
        self.receives_weights = self.weights_from_main and not self.main
        reset_peak_host_memory()  # `describe` reports the peak from here
        model, self.tokenizer, self.source_facts = load_student(self.sources.student, empty=self.receives_weights)
        return model

    def rewire(self, model: torch.nn.Module) -> torch.nn.Module:
        """The student rewired in memory when model.path is an original Llama, set up for training."""
        if self.recipe.model.ladder_layers is not None:
            layers = resolve_ladder_layers(self.recipe, model, self.accelerator, self.run_dir, self.data.train.ids)
            model = ladder.to_ladder(model, layers)
        self.checkpointing = checkpointing_policy(self.recipe, model.config, self.accelerator.num_processes, self.fsdp)
        configure_student(model, self.recipe.model, self.checkpointing)
        self.ladder_layers = list(model.config.ladder_layers)
        self.num_hidden_layers = model.config.num_hidden_layers
        return model

    def setup_data(self) -> None:
        """The tokenized blocks (the main process tokenizes, the others then read its cache) and
        the order in which the steps read them."""
        batch, processes = self.recipe.batch, self.accelerator.num_processes
        with self.accelerator.main_process_first():
            self.data = prepare_data(self.recipe.data, self.tokenizer)
        self.order = BlockOrder(len(self.data.train), self.recipe.seed, batch.micro_batch, batch.grad_accum, processes)
        if len(self.data.train) < self.order.per_step:
            raise UsageError(f"data.train gives {len(self.data.train)} blocks; one step needs {self.order.per_step}")

    def setup_teacher(self, teacher: torch.nn.Module | None) -> None:
        """The teacher frozen on the device (adapt/models.py), once the student is rewired."""
        if teacher is not None:
            self.teacher = prepare_teacher(teacher, self.recipe, self.accelerator.device, self.weights_from_main)

    def select_trainable(self, model: torch.nn.Module) -> torch.nn.Module:
        """The trainable set (adapt/models.py: `make_trainable`), then the distiller over it."""
        mode = self.recipe.trainable.mode
        model, layers = make_trainable(model, self.recipe.trainable, self.ladder_layers)
        self.trained_layers = layers
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

    def setup_mfu(self, model: torch.nn.Module) -> None:
        """The model FLOPs per token and the peak the log lines' MFU is measured against (training_cost.py)."""
        accelerator = self.accelerator
        shape = model_shape(model.config)
        layers = self.trained_layers if self.recipe.trainable.mode == "ladder" else None
        setup = setup_of(
            self.recipe, shape, accelerator.num_processes, accelerator.device.type == "cuda", self.fsdp, layers
        )
        self.flops_per_token = flops_per_token(shape, setup, self.checkpointing)[0]
        self.peak_flops = peak_flops(self.recipe, accelerator.device)

    def setup_optimizer(self, model: torch.nn.Module) -> None:
        """AdamW with the warmup and decay schedule (adapt/optimizer.py), everything handed to
        `accelerator.prepare`."""
        optimizer, scheduler = build_optimizer(model, self.recipe.optimizer, self.recipe.schedule, self.total_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)

    def setup_training_step(self) -> None:
        """What each step and each evaluation computes (adapt/step.py), over the prepared model."""
        self.training_step = TrainingStep(
            self.accelerator,
            self.model,
            self.recipe,
            self.data,
            self.order,
            self.distiller,
            self.ladder_layers,
            fsdp=self.fsdp,
        )

    def restore_or_start(self, resume_from: Path | None) -> None:
        """Continue from a checkpoint, or start the run folder with an empty metrics log; either way
        the run folder is locked for the run's life (a second run into it is refused)."""
        self.output_lock = lock_output(self.run_dir, "adapt") if self.main else None
        # Checked again under the lock: a run that finished while this one loaded its model wrote here after
        # `setup`'s check (a fresh run then sees an earlier run; a resumed one, a newer resume point).
        if self.main and resume_point(self.recipe) != resume_from:
            raise UsageError(
                f"{self.run_dir} changed while this run loaded its model (another run wrote it): run again"
            )
        if resume_from is not None:
            self.load_checkpoint(resume_from)
            self.state.data_files = self.data_files  # (empty in checkpoints written before they recorded it)
        else:
            self.state.data_files = self.data_files
            allocate_optimizer_state(self.optimizer.optimizer)  # a resumed run loads its own instead
            if self.main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(self.run_dir / METRICS_FILE, "")

    def describe(self, model: torch.nn.Module, resumed: bool) -> None:
        recipe = self.recipe
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        repeats = self.total_steps * self.order.per_step / len(self.data.train)
        log.info(
            f"adapt {recipe.name}: ladder layers {format_layers(self.ladder_layers)} of {model.config.num_hidden_layers}, "
            f"trainable {recipe.trainable.mode} {trainable / 1e6:.1f}M of {total / 1e6:.1f}M parameters, "
            f"objective {recipe.objective.name}, {self.accelerator.num_processes} process(es) on {self.accelerator.device}\n"
            f"data: {len(self.data.train)} training blocks, {len(self.data.eval)} evaluation blocks of "
            f"{recipe.data.seq_len} tokens ({self.data.train.masked_share():.1%} of the training tokens masked from "
            f"the loss); {self.total_steps} steps of {self.tokens_per_step} tokens"
            + (f" (the run repeats the data {repeats:.1f} times)" if repeats > 1 else "")
            + (f"; resuming at step {self.state.step}" if resumed else "")
            + f"\n{peak_host_memory(self.accelerator)}"
            + (f"\nFSDP2: {fsdp_precision(self.model)}" if self.fsdp else "")
        )

    # --- the loop ---------------------------------------------------------------------------------

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
        try:
            self.train_steps()
        except RuntimeError as error:
            if not raised_by_a_collective(error):
                raise
            kept = latest_checkpoint(self.checkpoint_dir)
            raise ProcessesLost(
                f"process {accelerator.process_index}: step {self.state.step + 1}: the processes lost touch "
                f"(timeout.collective={recipe.timeout.collective:g}s): {first_line(error)}; "
                + (f"the last checkpoint is kept: {kept}" if kept else "no checkpoint had been written")
            ) from None
        self.progress.close()

    def train_steps(self) -> None:
        recipe, accelerator = self.recipe, self.accelerator
        if self.state.step == 0:
            self.evaluate()
        self.model.train()
        first = self.state.step
        while self.state.step < self.total_steps:
            started = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0]
            result = self.training_step.gradients(self.state.step)
            loss, lm_loss = result.loss, result.lm_loss
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
            if self.state.step == first + 1:  # the first step may compile: the long timeout until it ends
                set_timeout(recipe.timeout.collective)
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
                **step_metrics(
                    result, seconds, self.tokens_per_step, accelerator, self.flops_per_token, self.peak_flops
                ),
            }
            self.log(record)
            self.progress.update(self.tokens_per_step)
            self.postfix["loss"] = f"{loss:.4f}"
            self.progress.set_postfix(self.postfix, refresh=False)
            if self.state.step % recipe.eval_every == 0 or self.state.step == self.total_steps:
                self.evaluate()
            saved = self.state.step % recipe.checkpoint_every == 0 and self.state.step < self.total_steps
            if saved:
                self.save_checkpoint()
            if self.state.step < self.total_steps and (received := self.stop_signals.agreed(accelerator)):
                self.stop(received, saved)

    def stop(self, received: int, saved: bool) -> None:
        """End the run after this step on a stop signal, with a checkpoint of it (adapt/preemption.py)."""
        checkpoint = self.checkpoint_dir / f"step-{self.state.step:06d}"
        if not saved:
            self.save_checkpoint()
        raise Preempted(received, self.state.step, checkpoint, self.accelerator)

    def evaluate(self) -> float | None:
        """The held-out loss (adapt/step.py), logged and printed."""
        eval_loss = self.training_step.held_out_loss()
        if eval_loss is None:
            return None
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
            log.info(message)
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
        with long_waits(self.recipe):  # the main process may write for long while the others wait
            save_checkpoint(self.accelerator, final, self.state, self.recipe, self.recipe.keep_checkpoints)
        if self.main and "tensorboard" in self.recipe.logging.log_with:
            # Events up to the checkpoint reach the disk now: a resumed run purges only what comes after it.
            self.accelerator.get_tracker("tensorboard", unwrap=True).flush()

    def load_checkpoint(self, path: Path) -> None:
        self.state = load_checkpoint(self.accelerator, path, self.recipe, self.order.per_step)
        if self.main:
            truncate_metrics(self.run_dir / METRICS_FILE, self.state.step)

    # --- cleanup ---------------------------------------------------------------------------------

    def save_final(self) -> Path:
        """The trained model as a plain checkpoint (LoRA merged, in the recipe's precision) with its
        tokenizer and recipe. The weights go through a fresh model built on the meta device, so the
        same code serves one process, DDP and FSDP (whose `get_state_dict` gathers the shards)."""
        accelerator = self.accelerator
        set_timeout(self.recipe.timeout.setup)  # the others wait while the main process writes
        if self.recipe.trainable.mode == "lora":
            trained = accelerator.unwrap_model(self.model).merge_and_unload()
            state_dict = trained.state_dict()
        else:
            trained = accelerator.unwrap_model(self.model)
            state_dict = accelerator.get_state_dict(self.model)
        if self.main:
            dtype = torch.bfloat16 if self.recipe.precision == "bf16" else torch.float32
            plain = plain_ladder_model(trained, state_dict, dtype)
            with atomic_directory(self.final_dir, force=True) as temporary:
                plain.save_pretrained(temporary, max_shard_size="5GB")
                self.tokenizer.save_pretrained(temporary)
                (temporary / RECIPE_FILE).write_text(dump_recipe(self.recipe))
                licences = copy_licence_files(self.sources.student, temporary)
                card = model_card(self.recipe, self.source_facts, licences, self.training_facts())
                (temporary / "README.md").write_text(card)
                if (self.run_dir / LAYER_SEARCH_FILE).is_file():
                    shutil.copyfile(self.run_dir / LAYER_SEARCH_FILE, temporary / LAYER_SEARCH_FILE)
            log.info(f"final model: {self.final_dir}")
        accelerator.wait_for_everyone()
        return self.final_dir

    def training_facts(self) -> TrainingFacts:
        return TrainingFacts(
            self.ladder_layers,
            self.num_hidden_layers,
            self.state,
            self.tokens_per_step,
            self.accelerator.num_processes,
            len(self.data.eval),
        )

    def cleanup(self) -> None:
        if self.progress is not None:
            self.progress.close()
        self.accelerator.end_training()


__all__ = [
    "AdaptRun",
    "Preempted",
    "ProcessesLost",
    "TrainingDiverged",
    "prepare",
    "resume_point",
    "train",
]
