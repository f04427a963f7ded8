"""Checks a recipe passes before any weight loads: the model paths (resolved here, once), the run
folder (fresh, or a checkpoint of the same recipe to continue), the data files, the step budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator

from ladder.errors import UsageError
from ladder.io.files import sha256_file
from ladder.io.loading import check_checkpoint, load_tokenizer, read_config_dict, resolve_model_path
from ladder.io.outputs import check_output
from ladder.layers import is_ladder_model_type, parse_layer_choice

from .checkpoint import METRICS_FILE, check_same_recipe, checkpoints
from .data import data_prepared, local_files
from .recipe import Recipe, model_path
from .sources import source_root


@dataclass(frozen=True)
class ModelSources:
    """model.path and model.teacher resolved to files on disk (`ladder.io.loading.resolve_model_path`)."""

    student: Path
    teacher: Path | None


def source_path(text: str) -> Path:
    """A recipe's model.path or model.teacher as the folder or .gguf file it names."""
    return resolve_model_path(model_path(text))


def check_model(recipe: Recipe) -> ModelSources:
    """The recipe's model paths, resolved; refuses recipes that cannot work, before any weight loads."""
    path = source_path(recipe.model.path)
    check_checkpoint(path)  # any other model_type is refused, as convert does
    config = read_config_dict(path) if path.is_dir() else {}  # a .gguf file holds an original Llama
    is_ladder = is_ladder_model_type(config.get("model_type"))
    context = config.get("max_position_embeddings")
    if isinstance(context, int) and recipe.data.seq_len > context:
        raise UsageError(
            f"data.seq_len {recipe.data.seq_len} is longer than the model's context (max_position_embeddings "
            f"{context} in {path / 'config.json'})"
        )
    if recipe.model.ladder_layers is None and not is_ladder:
        raise UsageError("model.ladder_layers: model.path is not a ladder model yet, so name the layers to rewire")
    if recipe.model.ladder_layers is not None and "num_hidden_layers" in config:
        parse_layer_choice(recipe.model.ladder_layers, config["num_hidden_layers"], "model.ladder_layers")
    if recipe.objective.needs_teacher() and is_ladder and not recipe.model.teacher:
        raise UsageError(
            f"model.teacher: objective {recipe.objective.name} needs the original model as teacher, "
            f"and model.path {path} is already a ladder checkpoint"
        )
    teacher = source_path(recipe.model.teacher) if recipe.model.teacher else None
    return ModelSources(path, teacher)


def check_outputs(recipe: Recipe, sources: ModelSources) -> None:
    """output_dir and data.cache_dir under the output rule (`ladder.io.outputs.check_output`), a data
    source's whole folder an input, before any weight loads."""
    data = recipe.data.train + recipe.data.eval
    roots = [source_root(s, f"data source {i} ({s.path})") for i, s in enumerate(data) if not s.path.startswith("hf:")]
    inputs = [sources.student, sources.teacher, *roots]
    check_output(recipe.run_dir(), "adapt", inputs, existing="add", what="output_dir")
    check_output(recipe.data.cache_folder(), "adapt", inputs, existing="add", what="data.cache_dir")


@dataclass(frozen=True)
class StepBudget:
    tokens_per_step: int
    total_steps: int


def step_budget(recipe: Recipe, processes: int, fsdp: bool) -> StepBudget:
    """Steps and tokens per step from the budget and the batch shape; refuses what cannot run."""
    blocks_per_step = recipe.batch.micro_batch * recipe.batch.grad_accum * processes
    tokens_per_step = blocks_per_step * recipe.data.seq_len
    total_steps = int(recipe.budget // tokens_per_step)
    if total_steps < 1:
        raise UsageError(f"budget {recipe.budget:g} is less than one step ({tokens_per_step} tokens)")
    if recipe.trainable.mode == "lora" and fsdp:
        raise UsageError("trainable.mode=lora runs with DDP or one process, not FSDP (the merge needs whole weights)")
    return StepBudget(tokens_per_step, total_steps)


def resume_point(recipe: Recipe) -> Path | None:
    """Where a run of `recipe` continues: its final model when complete, else its latest checkpoint, else
    None. Either is refused when made with another recipe, and so is an earlier run without `resume`."""
    run_dir = recipe.run_dir()
    final_dir, checkpoint_dir = run_dir / "model", run_dir / "checkpoints"
    if not recipe.resume:
        if final_dir.exists() or checkpoint_dir.exists() or (run_dir / METRICS_FILE).exists():
            raise UsageError(
                f"{run_dir} holds an earlier run: pass resume=true to continue it, "
                "or choose another output_dir (or delete that folder)"
            )
        return None
    found = final_dir if final_dir.exists() else max(checkpoints(checkpoint_dir), default=None)
    if found is not None:
        check_same_recipe(found, recipe)
    return found


def check_data_files(recipe: Recipe) -> dict[str, str]:
    """The SHA-256 of each local data file (a checkpoint records them: a resumed run trains on the same data)."""
    return {
        str(path): sha256_file(path)
        for i, source in enumerate(recipe.data.train + recipe.data.eval)
        if not source.path.startswith("hf:")
        for path in local_files(source, f"data source {i} ({source.path})")
    }


def check_data_prepared(recipe: Recipe, accelerator: Accelerator) -> None:
    """Several processes refuse data not tokenized yet (all but one would wait); the main process says so."""
    processes = accelerator.num_processes
    if processes == 1 or data_prepared(recipe.data, load_tokenizer(source_path(recipe.model.path))):
        return
    if not accelerator.is_main_process:
        raise SystemExit(2)
    raise UsageError(
        f"the data is not prepared, and {processes - 1} of {processes} processes would wait while one "
        "tokenizes it: run `ladder adapt RECIPE.yaml [key=value ...] --prepare-data` first"
    )
