"""Checks on a GGUF file (llama.cpp's format) before transformers dequantizes it, which takes a
while and fails late with less clear errors: the architecture must be Llama, every tensor's type
one that gguf-py (what transformers dequantizes with) can dequantize, and the block count the one
its tensors hold."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np

from ladder.errors import UsageError

from .checks import is_every_layer

BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")  # llama.cpp's name for a layer's tensors: blk.0.attn_q.weight


def _can_dequantize(tensor_type: gguf.GGMLQuantizationType) -> bool:
    _, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    try:
        gguf.dequantize(np.zeros(type_size, dtype=np.uint8), tensor_type)  # one block of zeros
    except NotImplementedError:
        return False
    return True


def inspect_llama_gguf(path: Path) -> int:
    """The block count of a Llama GGUF file that transformers can dequantize."""
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as error:
        raise UsageError(f"cannot read GGUF file {path}: {error}") from None
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else None
    if architecture != "llama":
        raise UsageError(f"GGUF file {path} holds a {architecture!r} model; only the 'llama' architecture converts")
    types = sorted({tensor.tensor_type for tensor in reader.tensors}, key=lambda t: t.name)
    if unsupported := [t.name for t in types if not _can_dequantize(t)]:
        raise UsageError(
            f"GGUF file {path} uses quantization type {', '.join(unsupported)}, which gguf {version('gguf')} "
            f"cannot dequantize; export it as F16, BF16, Q8_0 or Q4_K_M instead"
        )
    block_count = reader.get_field("llama.block_count")
    if block_count is None:
        raise UsageError(f"GGUF file {path} has no llama.block_count: not a complete Llama GGUF")
    count = int(block_count.contents())
    # Checked before transformers builds the model, which has as many layers as the metadata says.
    blocks = {int(match.group(1)) for tensor in reader.tensors if (match := BLOCK_TENSOR.match(tensor.name))}
    if not is_every_layer(blocks, count):
        raise UsageError(f"GGUF file {path} has llama.block_count {count}, but its tensors hold {len(blocks)} blocks")
    return count
