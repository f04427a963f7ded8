"""The config a plan prices, from whatever names the model, with nothing downloaded and no weight read:
a checkpoint folder, its config.json, a .gguf file or `embedded`, or a Hub ID (its config in the local
Hugging Face cache, else the published Llama 3.x shapes shipped in llama3.tsv). Shared by `ladder plan`
(which also takes a recipe, for its model.path) and `ladder adapt --plan`."""

from __future__ import annotations

import csv
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..io.loading import EMBEDDED, HUB_MODEL_ID, embedded_model_path
from ..layers import check_llama_model_type

PUBLISHED = Path(__file__).resolve().parent / "llama3.tsv"


@dataclass(frozen=True)
class ModelConfig:
    """A model's config.json as a dict, where it came from (for messages), and the folder holding it
    (None for a GGUF file or a published shape): the folder may hold a conversion's records."""

    config: dict
    source: str
    folder: Path | None = None


@functools.cache
def published_shapes() -> dict[str, dict]:
    """Hub ID (lower case) -> the config.json values llama3.tsv publishes for it, with their source."""
    lines = [line for line in PUBLISHED.read_text().splitlines() if line and not line.startswith("#")]
    shapes = {}
    for row in csv.DictReader(lines, delimiter="\t"):
        config = {key: int(value) for key, value in row.items() if value.isdigit()}
        config |= dict(rope_theta=float(row["rope_theta"]), tie_word_embeddings=row["tie_word_embeddings"] == "true")
        config |= dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, source=row["source"])
        shapes[row["repo"].lower()] = config
    return shapes


def published_config(model_id: str) -> dict | None:
    """The published config of a Llama 3.x Hub repository (llama3.tsv), or None."""
    found = published_shapes().get(model_id.split("@")[0].lower())
    return None if found is None else {key: value for key, value in found.items() if key != "source"}


def model_config(model: str) -> ModelConfig:
    """The config of the model `model` names (see the module's docstring); anything else is one
    UsageError line."""
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
    if not path.exists() and (match := HUB_MODEL_ID.fullmatch(model)):
        if (cached := _cached_hub_config(match["repo"], match["revision"])) is not None:
            return ModelConfig(_json_config(cached), model, cached.parent)
        if (published := published_config(model)) is not None:
            return ModelConfig(published, f"{model} (published shape, {PUBLISHED.name})")
        raise UsageError(
            f"{model}: its config.json is not in the local Hugging Face cache nor among the published Llama 3.x "
            f"shapes ({PUBLISHED.name}); `hf download {match['repo']} config.json` fetches just that file, and "
            "planning downloads nothing"
        )
    raise UsageError(f"{model} is not a folder with config.json, a config.json, a .gguf file, 'embedded' or a Hub ID")


def _json_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:
        raise UsageError(f"cannot read {path}: {str(error)[:200]}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a JSON object")
    check_llama_model_type(config.get("model_type"), str(path))
    return config


def _cached_hub_config(repo: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, "config.json", revision=revision)
    return Path(found) if isinstance(found, str) else None


def _gguf_config(path: Path) -> dict:
    if not path.is_file():
        raise UsageError(f"GGUF file {path} does not exist")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"cannot read the config embedded in {path}: {str(error).splitlines()[0]}") from None
    check_llama_model_type(config.get("model_type"), str(path))
    return config


def own_ladder_layers(config: dict) -> list[int]:
    """The layers a ladder checkpoint's config rewires (none for an original Llama)."""
    from ..model.config_rules import resolve_ladder_layers

    layers = config.get("num_hidden_layers")
    try:
        return resolve_ladder_layers(config.get("ladder_layers"), layers) if isinstance(layers, int) else []
    except ValueError as error:
        raise UsageError(f"config.json: {error}") from None


__all__ = ["ModelConfig", "model_config", "own_ladder_layers", "published_config", "published_shapes"]
