"""Tiny random models of each supported family for tests: a few layers, hidden 64, GQA, norms and
biases perturbed off their initial values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

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


def family_config(family: str = "llama", **overrides) -> PretrainedConfig:
    """A tiny config of a supported family (llama, mistral, qwen2, qwen3), made by transformers' own
    config class for that model_type; `overrides` set any key (e.g. Mistral's `sliding_window`,
    Qwen2's `use_sliding_window` and `max_window_layers`)."""
    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return AutoConfig.for_model(family, **values)


def tiny_config(**overrides) -> LlamaConfig:
    return family_config("llama", **overrides)


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny random model of a family, built by transformers' own class (Qwen3ForCausalLM, ...)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **overrides)).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so a wrong norm placement or a lost bias shows.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    return tiny_model("llama", seed, **overrides)


def save_tiny_checkpoint(directory: Path, tokenizer_dir: Path, family: str = "llama", **overrides) -> Path:
    """A tiny model of `family` with the tokenizer at `tokenizer_dir` (its vocabulary and special tokens), saved to
    `directory` as `save_pretrained` writes it: config, weights, generation config, tokenizer."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = tiny_model(family, vocab_size=len(tokenizer), max_position_embeddings=512, **special, **overrides)
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
