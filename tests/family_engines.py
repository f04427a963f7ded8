"""The vLLM family job (tests/test_vllm_families.py reads its results; conftest's vllm_jobs starts it
beside the greedy job): tiny random checkpoints of every family, made by transformers' own classes
(tests/tiny.py), and the engines that serve them.

Head_dim 32 (the smallest vLLM's CPU attention takes), Qwen2's q/k/v biases and Qwen3's q/k norms
perturbed off their initial values, and sliding windows shorter than the prompts for Mistral and
Qwen2 (every layer of Qwen2: `max_window_layers` 0). Every family's ladder checkpoint is written by
`ladder convert`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from ladder import to_ladder
from ladder.convert.cli import main as convert_main
from tiny import save_word_tokenizer, tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
LADDER_LAYERS = [0, 2, 3]  # ladder first, ladder -> standard, standard -> ladder, ladder -> ladder
WINDOW = 6
SLIDING = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
}
MAX_MODEL_LEN = 64
NEW_TOKENS = 8
PROMPT_LENGTHS = (9, 17)  # both longer than the window


# Compiled too (an inductor build per engine: vLLM's compile cache keys on the model): the families
# whose layers differ from Llama's in what a compiled graph holds (Qwen2's biases and a window on
# every layer, Qwen3's q/k norms). Llama's ladder model runs compiled in the greedy job (SmolLM2;
# the tiny model at TP=2), and Mistral's window is Qwen2's.
COMPILED = ["qwen2", "qwen3"]


def engine_runs(family: str) -> list[tuple[str, str, bool]]:
    """(run name, checkpoint, eager) of a family's engines: its own model and its ladder form with no
    ladder layers, eager (and compiled for COMPILED), and its ladder form with LADDER_LAYERS, eager."""
    own = [family, f"{family}-ladder0"]
    runs = [(name, name, True) for name in [*own, f"{family}-ladder"]]
    return runs + [(f"{name}-compiled", name, False) for name in own if family in COMPILED]


def write_checkpoints(root: Path) -> dict[str, Path]:
    """Per family: the family's own checkpoint, its ladder form with no ladder layers, and with
    LADDER_LAYERS, written by `ladder convert` (the others by `to_ladder` and save_pretrained), with
    a word-level tokenizer; and "tokenizer", that tokenizer's folder."""
    tokenizer_dir = save_word_tokenizer(root / "words")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    paths = {"tokenizer": tokenizer_dir}
    for seed, family in enumerate(FAMILIES):
        model = tiny_model(
            family,
            seed,
            vocab_size=len(tokenizer),
            hidden_size=128,
            intermediate_size=256,
            head_dim=32,
            num_hidden_layers=4,
            max_position_embeddings=MAX_MODEL_LEN,
            **special,
            **SLIDING.get(family, {}),
        )
        model.generation_config = GenerationConfig(**special)
        for name, form in {family: model, f"{family}-ladder0": to_ladder(model, [])}.items():
            form.save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
            paths[name] = root / name
        paths[f"{family}-ladder"] = converted = root / f"{family}-ladder"
        layers = ",".join(map(str, LADDER_LAYERS))
        assert convert_main([str(paths[family]), "--layers", layers, "--out", str(converted), "--no-verify"]) == 0
    return paths


def random_prompts(tokenizer_dir: Path) -> list[list[int]]:
    """Random words (not <unk>, <s>, </s>)."""
    vocabulary = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocabulary, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def runs(checkpoints: dict[str, Path], prompts: list[list[int]]) -> list[dict]:
    """Every engine of every family, for one job."""
    return [
        dict(
            name=name,
            model=str(checkpoints[checkpoint]),
            tp=1,
            eager=eager,
            prompts=prompts,
            max_tokens=NEW_TOKENS,
            max_model_len=MAX_MODEL_LEN,
        )
        for family in FAMILIES
        for name, checkpoint, eager in engine_runs(family)
    ]
