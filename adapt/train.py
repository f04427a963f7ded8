"""The adapt recipe script: one plain accelerate loop that retrains a ladder model, the same code on one
CPU process, DDP or FSDP (`accelerate launch` decides).

`start` runs the checks that need no weights, then `AdaptRun.__init__` sets up what the loop reads;
`AdaptRun.train` runs the steps (adapt/step.py computes them) with evaluation, atomic checkpoints and
stop signals on their schedules; `save_final` writes the model with its card. Which blocks a step
reads is a pure function of (seed, step) (`BlockOrder`), so a resumed run computes exactly what an
uninterrupted run computes.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm

import ladder
from ladder.errors import UsageError, first_line
from ladder.io.files import atomic_directory, atomic_write, lock_output
from ladder.io.loading import load_tokenizer
from ladder.io.model_card import copy_licence_files
from ladder.layers import format_layers
from ladder.plan.costs import ModelShape

from .card import model_card
from .checkpoint import (
    METRICS_FILE,
    TrainState,
    check_random_states,
    check_same_data,
    checkpoints,
    load_checkpoint,
    plain_ladder_model,
    save_checkpoint,
    truncate_metrics,
)
from .data import BlockOrder, Splits, prepare_data
from .distill import Distiller
from .launch import fsdp_precision, make_accelerator, raised_by_a_collective, set_timeout, start_trackers
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
from .step import StepResult, TrainingStep
from .training_cost import checkpointing_policy, flops_per_token, peak_flops, setup_of

# The ladder logger (ladder/log.py) through accelerate's adapter: it speaks on the main process only.
log = get_logger("ladder")


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; the message names the step and what was kept."""


class ProcessesLost(RuntimeError):
    """A collective failed (a process hung past `timeout.collective`, or died); the message names the
    step and what was kept."""


def prepare(recipe: Recipe) -> Splits:
    """Tokenize and cache a recipe's data in this one process, loading no weights: run it before a
    multi-GPU launch, so that no GPU waits on the tokenizer."""
    model = source_path(recipe.model.path)
    check_outputs(recipe, ModelSources(model, None))
    return prepare_data(recipe.data, load_tokenizer(model))


def train(recipe: Recipe) -> Path:
    """Run a recipe to the end (or continue it, with `resume`); returns the final model directory.
    SIGTERM or SIGUSR1 ends it after the step in progress with a checkpoint: `Preempted`."""
    with contextlib.ExitStack() as releases:
        run = start(recipe, releases)
        if isinstance(run, Path):
            return run
        run.train()
        return run.save_final()


def start(recipe: Recipe, releases: contextlib.ExitStack) -> AdaptRun | Path:
    """The checks that need no weights, then the run set up; its final model instead when the run is
    already complete. What the run holds (the accelerator, the signal handlers, the run folder's
    lock, the progress bar) is released by `releases`, however the run ends."""
    stop_signals = releases.enter_context(StopSignals())
    sources = check_model(recipe)
    check_outputs(recipe, sources)  # before the accelerator, which may make the run folder
    accelerator = make_accelerator(recipe, recipe.run_dir())
    releases.callback(accelerator.end_training)
    resume_from = resume_point(recipe)
    if resume_from == recipe.run_dir() / "model":
        log.info(f"{resume_from} is already complete: nothing to resume")
        return resume_from
    return AdaptRun(recipe, accelerator, sources, resume_from, stop_signals, releases)


class AdaptRun:
    """One run of a recipe. `__init__` sets up everything the loop reads, step by step (each
    refusal before the first weight loads); `train` runs the loop; `save_final` writes the model."""

    def __init__(
        self,
        recipe: Recipe,
        accelerator: Accelerator,
        sources: ModelSources,
        resume_from: Path | None,
        stop_signals: StopSignals,
        releases: contextlib.ExitStack,
    ):
        self.recipe, self.accelerator, self.sources, self.stop_signals = recipe, accelerator, sources, stop_signals
        self.run_dir = recipe.run_dir()
        self.checkpoint_dir, self.final_dir = self.run_dir / "checkpoints", self.run_dir / "model"
        self.main = accelerator.is_main_process
        self.fsdp = accelerator.distributed_type == DistributedType.FSDP
        self.budget = step_budget(recipe, accelerator.num_processes, self.fsdp)
        set_seed(recipe.seed)
        data_files = check_data_files(recipe)
        if resume_from is not None:
            check_same_data(resume_from, data_files)
            check_random_states(resume_from, accelerator.process_index)
        check_data_prepared(recipe, accelerator)

        # The student as loaded, on the meta device in a process that receives its weights from the
        # main one (adapt/models.py); the data before the rewiring: `auto:N` calibrates on its blocks.
        self.weights_from_main = weights_from_main(accelerator)
        receives_weights = self.weights_from_main and not self.main
        reset_peak_host_memory()  # `describe` reports the peak from here
        student, self.tokenizer, self.source_facts = load_student(sources.student, empty=receives_weights)
        with accelerator.main_process_first():  # the main process tokenizes, the others read its cache
            self.data = prepare_data(recipe.data, self.tokenizer)
        batch = recipe.batch
        self.order = BlockOrder(
            len(self.data.train), recipe.seed, batch.micro_batch, batch.grad_accum, accelerator.num_processes
        )
        if len(self.data.train) < self.order.per_step:
            raise UsageError(f"data.train gives {len(self.data.train)} blocks; one step needs {self.order.per_step}")
        teacher = load_teacher(recipe, sources.teacher, student, empty=receives_weights)
        if recipe.model.ladder_layers is not None:  # rewired in memory when model.path is an original
            layers = resolve_ladder_layers(recipe, student, accelerator, self.run_dir, self.data.train.ids)
            student = ladder.to_ladder(student, layers)
        self.checkpointing = checkpointing_policy(recipe, student.config, accelerator.num_processes, self.fsdp)
        configure_student(student, recipe.model, self.checkpointing)
        self.ladder_layers = list(student.config.ladder_layers)
        self.num_hidden_layers = student.config.num_hidden_layers
        self.teacher = prepare_teacher(teacher, recipe, accelerator.device, self.weights_from_main) if teacher else None
        student, self.trained_layers = make_trainable(student, recipe.trainable, self.ladder_layers)
        self.distiller = self.make_distiller(student)
        self.flops_per_token, self.peak_flops = self.mfu_basis(student)
        keep_fewer_activations(student)

        optimizer, scheduler = build_optimizer(student, recipe.optimizer, recipe.schedule, self.budget.total_steps)
        self.model, self.optimizer, self.scheduler = accelerator.prepare(student, optimizer, scheduler)
        self.training_step = TrainingStep(
            accelerator, self.model, recipe, self.data, self.order, self.distiller, self.ladder_layers, fsdp=self.fsdp
        )
        # The run folder is locked for the run's life (a second run into it is refused), and checked
        # again under the lock: a run that finished while this one loaded its model wrote there.
        if self.main:
            releases.callback(lock_output(self.run_dir, "adapt").release)
            if resume_point(recipe) != resume_from:
                raise UsageError(
                    f"{self.run_dir} changed while this run loaded its model (another run wrote it): run again"
                )
        self.state = self.restored(resume_from, data_files)
        start_trackers(accelerator, recipe, self.run_dir, resumed_at=self.state.step)
        self.progress = tqdm(
            total=self.budget.total_steps * self.budget.tokens_per_step,
            initial=self.state.tokens_seen,
            unit="tok",
            unit_scale=True,
            dynamic_ncols=True,
            disable=not (self.main and recipe.logging.progress),
        )
        releases.callback(self.progress.close)
        self.postfix: dict[str, str] = {}
        self.describe(student, resumed=resume_from is not None)

    def make_distiller(self, model: torch.nn.Module) -> Distiller | None:
        """The distiller, when there is a teacher; it starts from the student's streams when the layers
        below the first ladder layer are frozen and the teacher is the same original (adapt/distill.py)."""
        if self.teacher is None:
            return None
        if self.recipe.objective.uses_hidden() and not self.ladder_layers:
            raise UsageError("objective hidden: the model has no ladder layer whose stream could be matched")
        shared = (
            self.recipe.trainable.mode in ("ladder", "layers")
            and not self.recipe.model.teacher
            and bool(self.ladder_layers)
            and min(self.trained_layers, default=0) >= min(self.ladder_layers)
        )
        decoder_layers = next(module for name, module in model.named_modules() if name.endswith("model.layers"))
        return Distiller(self.teacher, decoder_layers, self.ladder_layers, shared_prefix=shared)

    def mfu_basis(self, model: torch.nn.Module) -> tuple[float, float | None]:
        """The model FLOPs per token and the peak the log lines' MFU is measured against (training_cost.py)."""
        accelerator, shape = self.accelerator, ModelShape.from_config(model.config.to_dict())
        layers = self.trained_layers if self.recipe.trainable.mode == "ladder" else None
        cuda = accelerator.device.type == "cuda"
        setup = setup_of(self.recipe, shape, accelerator.num_processes, cuda, self.fsdp, layers)
        return flops_per_token(shape, setup, self.checkpointing)[0], peak_flops(self.recipe, accelerator.device)

    def restored(self, resume_from: Path | None, data_files: dict[str, str]) -> TrainState:
        """The state of a checkpoint, loaded; or a fresh start, with an empty metrics log."""
        if resume_from is not None:
            state = load_checkpoint(self.accelerator, resume_from, self.recipe, self.order.per_step)
            if self.main:
                truncate_metrics(self.run_dir / METRICS_FILE, state.step)
        else:
            state = TrainState(processes=self.accelerator.num_processes)
            allocate_optimizer_state(self.optimizer)  # a resumed run loads its own instead
            if self.main:
                atomic_write(self.run_dir / METRICS_FILE, "")
        state.data_files = data_files  # (empty in checkpoints written before they recorded it)
        return state

    def describe(self, model: torch.nn.Module, resumed: bool) -> None:
        recipe, budget = self.recipe, self.budget
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        repeats = budget.total_steps * self.order.per_step / len(self.data.train)
        log.info(
            f"adapt {recipe.name}: ladder layers {format_layers(self.ladder_layers)} of {model.config.num_hidden_layers}, "
            f"trainable {recipe.trainable.mode} {trainable / 1e6:.1f}M of {total / 1e6:.1f}M parameters, "
            f"objective {recipe.objective.name}, {self.accelerator.num_processes} process(es) on {self.accelerator.device}\n"
            f"data: {len(self.data.train)} training blocks, {len(self.data.eval)} evaluation blocks of "
            f"{recipe.data.seq_len} tokens ({self.data.train.masked_share():.1%} of the training tokens masked from "
            f"the loss); {budget.total_steps} steps of {budget.tokens_per_step} tokens"
            + (f" (the run repeats the data {repeats:.1f} times)" if repeats > 1 else "")
            + (f"; resuming at step {self.state.step}" if resumed else "")
            + f"\n{peak_host_memory(self.accelerator)}"
            + (f"\nFSDP2: {fsdp_precision(self.model)}" if self.fsdp else "")
        )

    # --- the loop ---------------------------------------------------------------------------------

    def train(self) -> None:
        """Every step to the end of the budget; a failed collective becomes `ProcessesLost`."""
        try:
            if self.state.step == 0:
                self.evaluate()
            self.model.train()
            first = self.state.step
            while self.state.step < self.budget.total_steps:
                self.step()
                if self.state.step == first + 1:  # the first step may compile: the long timeout until it ends
                    set_timeout(self.recipe.timeout.collective)
                saved = self.on_schedule()
                if self.state.step < self.budget.total_steps and (
                    received := self.stop_signals.agreed(self.accelerator)
                ):
                    self.stop(received, saved)
        except RuntimeError as error:
            if not raised_by_a_collective(error):
                raise
            raise ProcessesLost(
                f"process {self.accelerator.process_index}: step {self.state.step + 1}: the processes lost touch "
                f"(timeout.collective={self.recipe.timeout.collective:g}s): {first_line(error)}; {self.kept()}"
            ) from None
        self.progress.close()

    def step(self) -> None:
        """One optimizer step: gradients, clipping, the NaN guard, the update; then its metrics line."""
        started = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]
        result = self.training_step.gradients(self.state.step)
        clip = self.recipe.grad_clip if self.recipe.grad_clip > 0 else float("inf")
        grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), clip))
        if not (math.isfinite(result.loss) and math.isfinite(grad_norm)):  # the NaN guard, before the update
            raise TrainingDiverged(
                f"training stopped at step {self.state.step + 1}: loss {result.loss}, gradient norm {grad_norm}; "
                f"{self.kept(written_before=True)} (try a lower optimizer.lr, or grad_clip)"
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += self.budget.tokens_per_step
        self.state.data_position += self.order.per_step
        self.log_step(result, lr, grad_norm, time.perf_counter() - started)

    def kept(self, written_before: bool = False) -> str:
        checkpoint = max(checkpoints(self.checkpoint_dir), default=None)
        if checkpoint is None:
            return "no checkpoint had been written"
        return f"the last checkpoint{', written before that,' if written_before else ''} is kept: {checkpoint}"

    def log_step(self, result: StepResult, lr: float, grad_norm: float, seconds: float) -> None:
        """The step's metrics line (metrics.jsonl and the trackers) and the progress bar: besides the loss,
        tokens/s per device (all, and those trained on), MFU against `peak_flops`, the peak memory (the
        allocator's, or the RSS on CPU) and the share of the step spent getting data."""
        tokens, devices = self.budget.tokens_per_step, self.accelerator.num_processes
        if self.accelerator.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated(self.accelerator.device)
        else:
            memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        per_device = tokens / seconds / devices
        self.log(
            {
                "step": self.state.step,
                "tokens": self.state.tokens_seen,
                "loss": result.loss,
                "lm_loss": result.lm_loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens / seconds,
                "tokens_per_s_per_device": per_device,
                **({"mfu": per_device * self.flops_per_token / self.peak_flops} if self.peak_flops else {}),
                "labelled_tokens_per_s_per_device": result.labelled / seconds / devices,
                "peak_memory_bytes": memory,
                "data_wait_share": result.data_seconds / seconds,
            }
        )
        self.progress.update(tokens)
        self.postfix["loss"] = f"{result.loss:.4f}"
        self.progress.set_postfix(self.postfix, refresh=False)

    def on_schedule(self) -> bool:
        """Evaluation and a checkpoint when their schedules say so; whether a checkpoint was written."""
        step, total = self.state.step, self.budget.total_steps
        if step % self.recipe.eval_every == 0 or step == total:
            self.evaluate()
        saved = step % self.recipe.checkpoint_every == 0 and step < total
        if saved:
            self.save_checkpoint()
        return saved

    def stop(self, received: int, saved: bool) -> None:
        """End the run after this step on a stop signal, with a checkpoint of it (adapt/preemption.py)."""
        checkpoint = self.checkpoint_dir / f"step-{self.state.step:06d}"
        if not saved:
            self.save_checkpoint()
        raise Preempted(received, self.state.step, checkpoint, self.accelerator)

    def evaluate(self) -> None:
        """The held-out loss (adapt/step.py), logged and printed."""
        eval_loss = self.training_step.held_out_loss()
        if eval_loss is None:
            return
        perplexity = math.exp(min(eval_loss, 50.0))
        self.log(
            {
                "step": self.state.step,
                "tokens": self.state.tokens_seen,
                "eval_loss": eval_loss,
                "eval_perplexity": perplexity,
            }
        )
        self.postfix["eval_loss"] = f"{eval_loss:.4f}"
        message = f"step {self.state.step}: held-out loss {eval_loss:.4f} (perplexity {perplexity:.2f})"
        (log.info if self.progress.disable else self.progress.write)(message)

    def log(self, record: dict) -> None:
        """One metrics line, to metrics.jsonl and accelerate's trackers."""
        if self.main:
            with open(self.run_dir / METRICS_FILE, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.accelerator.trackers:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    # --- checkpoints and the final model ---------------------------------------------------------

    def save_checkpoint(self) -> None:
        """An atomic `checkpoints/step-NNNNNN`; older ones beyond `keep_checkpoints` are removed."""
        final = self.checkpoint_dir / f"step-{self.state.step:06d}"
        set_timeout(self.recipe.timeout.setup)  # the main process may write for long while the others wait
        try:
            save_checkpoint(self.accelerator, final, self.state, self.recipe, self.recipe.keep_checkpoints)
        finally:
            set_timeout(self.recipe.timeout.collective)

    def save_final(self) -> Path:
        """The trained model as a plain checkpoint (LoRA merged, in the recipe's precision) with its
        tokenizer, recipe and card; FSDP's `get_state_dict` gathers the shards."""
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
                (temporary / "README.md").write_text(model_card(self, licences))
                if (self.run_dir / LAYER_SEARCH_FILE).is_file():
                    shutil.copyfile(self.run_dir / LAYER_SEARCH_FILE, temporary / LAYER_SEARCH_FILE)
            log.info(f"final model: {self.final_dir}")
        accelerator.wait_for_everyone()
        return self.final_dir
