"""The config a plan prices, with nothing downloaded and no weight read: a checkpoint folder, its
config.json, a .gguf file, `embedded`, or a Hub ID (the local Hugging Face cache, else models.tsv, the
one table of published shapes that benchmarks and tests read too)."""

from __future__ import annotations

import csv
import difflib
import functools
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError, first_line
from ..io.loading import EMBEDDED, HUB_MODEL_ID, embedded_model_path, load_config
from ..io.tokenizer_files import read_json_object
from ..layers import check_model_type
from ..model.config_rules import resolve_ladder_layers

PUBLISHED = Path(__file__).resolve().parent / "models.tsv"
# What the offline hint fetches: the config alone (never Meta's consolidated original/ weights).
HINT = "`hf download {repo} config.json --exclude 'original/*'`"


@dataclass(frozen=True)
class ModelConfig:
    """A config.json as a dict, its source (for messages), and its folder (None for a GGUF file or a
    published shape), which may hold a conversion's records."""

    config: dict
    source: str
    folder: Path | None = None


@functools.cache
def published_shapes() -> dict[str, dict]:
    """Hub ID (lower case) -> the config.json values models.tsv publishes for it, with their source."""
    lines = [line for line in PUBLISHED.read_text().splitlines() if line and not line.startswith("#")]
    shapes = {}
    for row in csv.DictReader(lines, delimiter="\t"):
        config = {key: int(value) for key, value in row.items() if value.isdigit()}
        config |= dict(rope_theta=float(row["rope_theta"]), rms_norm_eps=float(row["rms_norm_eps"]))
        config |= dict(tie_word_embeddings=row["tie_word_embeddings"] == "true", hidden_act="silu")
        config |= dict(model_type=row["model_type"], name=row["repo"], source=row["source"])
        config["sliding_window"] = config.get("sliding_window")  # "null": none
        shapes[row["repo"].lower()] = config
    return shapes


def published_repo(name: str) -> str | None:
    """The Hub ID in models.tsv that `name` means: the ID itself in any case, its name without the
    organisation (`Llama-3.1-70B`), or Meta's earlier name for a 3.1 repository (`Meta-Llama-3.1-70B`)."""
    shapes, key = published_shapes(), name.split("@")[0].lower()
    if key in shapes:
        return shapes[key]["name"]
    wanted = {key.split("/")[-1], re.sub(r"^meta-(llama-3\.\d)", r"\1", key.split("/")[-1])}
    found = [shape["name"] for repo, shape in shapes.items() if repo.split("/")[-1] in wanted]
    return found[0] if len(found) == 1 else None


def published_config(model_id: str) -> dict | None:
    """The published config of a Hub repository in models.tsv (see `published_repo`), or None."""
    if (repo := published_repo(model_id)) is None:
        return None
    return {key: value for key, value in published_shapes()[repo.lower()].items() if key not in ("name", "source")}


def model_config(model: str) -> ModelConfig:
    path = Path(model).expanduser()
    if model == EMBEDDED or path.suffix == ".gguf":
        gguf = embedded_model_path() if model == EMBEDDED else path
        return ModelConfig(_gguf_config(gguf), str(gguf))
    if path.name == "config.json" and path.is_file():
        return ModelConfig(_json_config(path), str(path), path.parent)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{model} is a folder without config.json: it is not a Hugging Face checkpoint")
        return ModelConfig(_json_config(path / "config.json"), str(path), path)
    if (match := HUB_MODEL_ID.fullmatch(model)) and not path.exists():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(match["repo"], "config.json", revision=match["revision"])
        if isinstance(cached, str):
            return ModelConfig(_json_config(Path(cached)), model, Path(cached).parent)
    if not path.exists() and (repo := published_repo(model)) is not None:
        return ModelConfig(published_config(repo), f"{repo} (published shape, {PUBLISHED.name})")
    if not path.exists() and (match or "/" not in model):
        names = [shape["name"] for shape in published_shapes().values()]
        close = difflib.get_close_matches(model, names, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(
            f"{model}: its config.json is not in the local Hugging Face cache nor among the published shapes "
            f"({PUBLISHED.name}); {hint}{HINT.format(repo=match['repo'] if match else 'ORG/' + model)} fetches "
            "just that file, and planning downloads nothing"
        )
    raise UsageError(f"{model} is not a folder with config.json, a config.json, a .gguf file, 'embedded' or a Hub ID")


def _json_config(path: Path) -> dict:
    config = read_json_object(path, "config")
    check_model_type(config.get("model_type"), str(path))
    return config


def _gguf_config(path: Path) -> dict:
    try:
        config = load_config(path).to_dict()
    # A malformed file fails inside gguf-py's or transformers' parsing with whatever its bytes provoke.
    except (IndexError, TypeError, struct.error, ArithmeticError) as error:
        raise UsageError(f"cannot read the config embedded in {path}: {first_line(error)}") from None
    check_model_type(config.get("model_type"), str(path))
    return config


def own_ladder_layers(config: dict) -> list[int]:
    layers = config.get("num_hidden_layers")
    try:
        return resolve_ladder_layers(config.get("ladder_layers"), layers) if isinstance(layers, int) else []
    except ValueError as error:
        raise UsageError(f"config.json: {error}") from None
