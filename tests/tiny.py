"""Tiny random Llama models for tests: a few layers, hidden 64, GQA, norms perturbed off 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

NUM_LAYERS = 6

# The two-process tests run on the CPU over gloo, or one process per GPU: a machine with one GPU
# has neither (accelerate puts the second rank on a GPU that does not exist).
two_processes = pytest.mark.skipif(
    0 < torch.cuda.device_count() < 2, reason="two processes need no GPU (gloo) or two GPUs; this machine has one"
)


# One test for both devices: the CUDA form is a GPU check (`pytest -m gpu`, make gpu-check), skipped
# where torch sees no CUDA device; `make test` runs the CPU form.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
    ),
]


def tiny_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**overrides)).eval()
    # Random init leaves norms at 1; perturb them so a wrong norm placement shows.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def save_tiny_checkpoint(directory: Path, tokenizer_dir: Path, **overrides) -> Path:
    """A tiny Llama with the tokenizer at `tokenizer_dir` (its vocabulary and special tokens), saved to
    `directory` as `save_pretrained` writes it: config, weights, generation config, tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=512, **special, **overrides)
    model.generation_config = GenerationConfig(**special)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_word_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer over adapt_runs.WORDS, built by `tokenizers` from nothing: for the tests
    that run on the lent GPU machine, which has neither the embedded model's GGUF file nor a network."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from adapt_runs import WORDS

    vocabulary = {token: index for index, token in enumerate(["<unk>", "<s>", "</s>", *WORDS, "."])}
    words = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    words.normalizer = normalizers.Lowercase()
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    return directory


def random_ids(batch: int = 2, length: int = 12, seed: int = 1, vocab_size: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
