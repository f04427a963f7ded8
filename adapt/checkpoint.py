"""Training checkpoints: `accelerator.save_state` (model, optimizer, scheduler, every process's RNG)
plus `TrainState` and the resolved recipe, in an atomic `checkpoints/step-NNNNNN` folder."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, load

from ladder.errors import UsageError
from ladder.io.files import atomic_directory, atomic_write, write_failure
from ladder.io.yaml_files import load_yaml_file

from .recipe import RECIPE_FILE, RESUME_FREE_KEYS, Recipe, dump_recipe, recipe_from_dict

STATE_FILE = "trainer_state.json"
METRICS_FILE = "metrics.jsonl"  # in the run folder: one JSON line per step and per evaluation


@dataclass
class TrainState:
    """What a checkpoint holds beside accelerate's state. On resume `step` continues; `data_position`
    must equal step * blocks_per_step, `processes` the new run's (RNG states are per process), and
    `data_files` the same contents."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # step * tokens per step, all processes together
    data_position: int = 0  # blocks consumed from the shuffled stream (see BlockOrder)
    processes: int = 1
    data_files: dict[str, str] = dataclasses.field(default_factory=dict)  # path -> SHA-256 of each local data file


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first (an interrupted save's temporary is a hidden name): the latest
    is `max(checkpoints(directory), default=None)`."""
    return sorted(p for p in directory.glob("step-*") if (p / STATE_FILE).is_file())


def differing_keys(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two recipe dicts (keys free to change on resume skipped)."""
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


def save_checkpoint(accelerator: Accelerator, final: Path, state: TrainState, recipe: Recipe, keep: int) -> None:
    """Write `final` atomically from every process; then keep only the newest `keep` checkpoints."""
    main = accelerator.is_main_process
    kept = max(checkpoints(final.parent), default=None)
    with contextlib.ExitStack() as stack:
        temporary = stack.enter_context(atomic_directory(final, force=True)) if main else None
        temporary = broadcast_object_list([str(temporary)])[0]
        try:
            accelerator.save_state(temporary)
            if main:
                Path(temporary, STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=1))
                Path(temporary, RECIPE_FILE).write_text(dump_recipe(recipe))
        except Exception as error:  # the temporary is removed on the way out; `kept` stays as it was
            if (failure := write_failure(error, final.parent)) is None:
                raise
            previous = json.loads((kept / STATE_FILE).read_text())["step"] if kept else None
            raise UsageError(
                f"{failure} while writing the checkpoint at step {state.step} ({final}); "
                + (f"the checkpoint at step {previous} is kept: " if kept else "no checkpoint was written before: ")
                + ("free some space and " if failure.startswith("no space") else "")
                + ("resume with resume=true" if kept else "start again")
            ) from None
        accelerator.wait_for_everyone()
    accelerator.wait_for_everyone()
    if main:
        for old in checkpoints(final.parent)[:-keep]:
            shutil.rmtree(old)


def check_same_recipe(path: Path, recipe: Recipe) -> None:
    """Refuse the checkpoint or final model at `path` unless its recipe equals `recipe` (but for the keys
    free to change on resume)."""
    if not (path / RECIPE_FILE).is_file():
        raise UsageError(
            f"resume: {path} has no {RECIPE_FILE}, so which recipe made it is unknown; "
            "start a new output_dir (or delete that folder)"
        )
    saved = recipe_from_dict(load_yaml_file(path / RECIPE_FILE, "the saved recipe"))
    if differences := differing_keys(saved.model_dump(), recipe.model_dump()):
        raise UsageError(
            f"resume: the recipe differs from the one {path} was trained with at {', '.join(differences)}; "
            "resume with the same recipe, or start a new output_dir (or delete that folder)"
        )


def check_same_data(path: Path, data_files: dict[str, str]) -> None:
    """Refuse the checkpoint at `path` when a local data file's contents differ from those it trained on."""
    recorded = json.loads((path / STATE_FILE).read_text()).get("data_files")
    if not recorded:  # written before checkpoints recorded the data
        return
    for name in sorted(set(recorded) | set(data_files)):
        if recorded.get(name) == data_files.get(name):
            continue
        if name not in data_files:
            change = "no longer exists"
        elif name not in recorded:
            change = "is new"
        else:
            change = f"changed (SHA-256 {recorded[name][:12]}... then, {data_files[name][:12]}... now)"
        raise UsageError(
            f"resume: the data differ from those {path} was trained on: {name} {change}; "
            "resume with the same data, or start a new output_dir"
        )


def load_checkpoint(accelerator: Accelerator, path: Path, recipe: Recipe, blocks_per_step: int) -> TrainState:
    """Restore accelerate's state from `path` (the same recipe and number of processes); its `TrainState`."""
    check_same_recipe(path, recipe)
    state = TrainState(**json.loads((path / STATE_FILE).read_text()))
    assert state.data_position == state.step * blocks_per_step, "batch shape changed under an equal recipe"
    if state.processes != accelerator.num_processes:
        raise UsageError(
            f"resume: {path} was written by {state.processes} process(es); "
            f"launch {state.processes}, not {accelerator.num_processes}"
        )
    accelerator.load_state(str(path))
    return state


def check_random_states(checkpoint: Path, process_index: int) -> None:
    """accelerate reads a checkpoint's random states with `torch.load(weights_only=True)`, and goes on
    without them, in silence, when that fails. Read them the same way before any weight loads: a file
    missing or holding anything else (a pickle crafted to run code) is refused in one line, never run."""
    path = checkpoint / f"random_states_{process_index}.pkl"
    try:
        with warnings.catch_warnings():  # torch's note on the pickle protocol: the refusal is the one line
            warnings.simplefilter("ignore")
            load(path)
    except Exception as error:  # any reason the file is not a random state accelerate wrote
        raise UsageError(
            f"resume: {path} is not the random state a checkpoint of ladder adapt holds ({type(error).__name__}); "
            "refused, nothing in it was run: resume from a checkpoint this tool wrote"
        ) from None


def truncate_metrics(metrics: Path, step: int) -> None:
    """Keep the metrics log's lines up to `step` (the resumed run computes the rest again)."""
    kept = []
    for line in metrics.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except json.JSONDecodeError:
            pass  # a line cut short by the kill
    atomic_write(metrics, "".join(kept))


def plain_ladder_model(trained: torch.nn.Module, state_dict: dict, dtype: torch.dtype) -> torch.nn.Module:
    """The trained weights in a fresh ladder model built on the meta device (in `dtype`): one process, DDP
    and FSDP save the same plain checkpoint."""
    from ladder.model.auto import ladder_causal_lm  # here: the checks before training stay free of transformers

    with torch.device("meta"):
        plain = ladder_causal_lm(trained.config)(trained.config)
    plain.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = trained.generation_config
    return plain
