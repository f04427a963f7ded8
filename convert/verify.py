"""Conversion damage on fixed prompts. Both models compute in float32 from the same weights, so the
layers before the first ladder layer must match bit for bit, and with no ladder layer so must the
logits; top-1 agreement and mean KL(original || ladder) measure what the rewiring costs."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

PROMPTS = (
    "The capital of France is",
    "Water boils at 100 degrees Celsius at sea level, but on a high mountain it boils at",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is 12 times 7?\nA:",
)


@dataclass(frozen=True)
class Damage:
    prompts: int
    tokens: int
    first_ladder_layer: int | None  # None: no ladder layer, every state is compared
    hidden_max_abs_diff: float  # over the hidden states before the first ladder layer; must be 0
    logits_max_abs_diff: float
    top1_agreement: float  # fraction of positions where both models predict the same next token
    mean_kl: float  # KL(original || ladder) in nats, averaged over positions


def prompt_ids(tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> list[torch.Tensor]:
    """The fixed prompts as token ids; fixed random ids when the checkpoint has no tokenizer."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (24,), generator=generator) for _ in PROMPTS]
    return [torch.tensor(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]


def largest(*values: float) -> float:
    """The largest value, or NaN if any is NaN (Python's `max` may skip a NaN)."""
    return math.nan if any(math.isnan(value) for value in values) else max(values)


def damage_not_finite(damage: Damage) -> str | None:
    values = {
        "hidden states": damage.hidden_max_abs_diff,
        "logits": damage.logits_max_abs_diff,
        "mean KL": damage.mean_kl,
    }
    if broken := [f"{name} {value}" for name, value in values.items() if not math.isfinite(value)]:
        return (
            f"the damage measured is not finite ({', '.join(broken)}): the source's weights hold NaN or "
            "infinite values, or its activations overflow float32"
        )
    return None


def damage_problems(damage: Damage) -> list[str]:
    """What a correct conversion cannot show: any difference where the wiring did not change."""
    problems = []
    if damage.hidden_max_abs_diff != 0:
        problems.append(f"hidden states before the first ladder layer differ by {damage.hidden_max_abs_diff:.3g}")
    if damage.first_ladder_layer is None and damage.logits_max_abs_diff != 0:
        problems.append(f"with no ladder layer the logits differ by {damage.logits_max_abs_diff:.3g}")
    return problems


TensorReader = Callable[[str], torch.Tensor]


@contextlib.contextmanager
def _loaded(module: torch.nn.Module, prefix: str, read: TensorReader, dtypes: dict[str, torch.dtype]) -> Iterator:
    """A meta-device submodule given its weights in float32, rounded first to the converted dtype, for
    the block; released to the meta device after it."""
    state = {name: read(prefix + name).to(dtypes[prefix + name]).float() for name in module.state_dict()}
    module.load_state_dict(state, strict=True, assign=True)
    yield module
    module.to("meta")


@torch.no_grad()
def measure_damage_layerwise(
    original: PreTrainedModel,
    ladder_model: PreTrainedModel,
    read_original: TensorReader,
    read_ladder: TensorReader,
    dtypes: dict[str, torch.dtype],
    prompts: list[torch.Tensor],
) -> Damage:
    """The damage of `ladder_model` against `original` (both on the meta device) on each prompt alone,
    one module at a time: loaded in float32, applied to every prompt, released. Peak memory is about
    two of the largest modules whatever the model's size. `dtypes`: the converted dtype of each tensor."""
    first = min(ladder_model.config.ladder_layers, default=None)

    def embed(model: PreTrainedModel, read: TensorReader) -> list[torch.Tensor]:
        with _loaded(model.model.embed_tokens, "model.embed_tokens.", read, dtypes) as table:
            return [table(ids[None]) for ids in prompts]

    reference = embed(original, read_original)
    attn_streams = mlp_streams = embed(ladder_model, read_ladder)
    hidden_diff = largest(*((a - b).abs().max().item() for a, b in zip(reference, mlp_streams)))
    rotary = type(ladder_model.model.rotary_emb)(config=ladder_model.config)  # inv_freq is computed, not stored
    extras = []
    for states in reference:
        position_ids = torch.arange(states.shape[1])[None]
        extras.append(
            dict(
                position_ids=position_ids,
                attention_mask=ladder_model.model.attention_masks(states, None, position_ids, None),  # by type
                position_embeddings=rotary(states, position_ids=position_ids),
            )
        )
    for index in range(ladder_model.config.num_hidden_layers):
        prefix = f"model.layers.{index}."
        plain, rewired = original.model.layers[index], ladder_model.model.layers[index]
        with _loaded(plain, prefix, read_original, dtypes), _loaded(rewired, prefix, read_ladder, dtypes):
            reference = [
                plain(state, **extra | {"attention_mask": extra["attention_mask"][rewired.attention_type]})
                for state, extra in zip(reference, extras)
            ]
            streams = [rewired(a, m, **extra) for a, m, extra in zip(attn_streams, mlp_streams, extras)]
        attn_streams, mlp_streams = [s[0] for s in streams], [s[1] for s in streams]
        if first is None or index < first:  # the stream entering layer index + 1
            hidden_diff = largest(hidden_diff, *((a - b).abs().max().item() for a, b in zip(reference, mlp_streams)))

    def logits(model: PreTrainedModel, read: TensorReader, states: list[torch.Tensor]) -> list[torch.Tensor]:
        head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
        weight = read(head).to(dtypes[head]).float()
        with _loaded(model.model.norm, "model.norm.", read, dtypes) as norm:
            return [F.linear(norm(state), weight)[0] for state in states]

    logits_diff = kl_sum = 0.0
    agreements = tokens = 0
    for expected, actual in zip(
        logits(original, read_original, reference), logits(ladder_model, read_ladder, mlp_streams)
    ):
        logits_diff = largest(logits_diff, (expected - actual).abs().max().item())
        log_p, log_q = F.log_softmax(expected, dim=-1), F.log_softmax(actual, dim=-1)
        kl_sum += F.kl_div(log_q, log_p, log_target=True, reduction="sum").item()
        agreements += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
        tokens += expected.shape[0]
    return Damage(len(prompts), tokens, first, hidden_diff, logits_diff, agreements / tokens, kl_sum / tokens)
