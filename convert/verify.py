"""Conversion damage: how far the ladder model's outputs are from the original's, on fixed prompts.

Both models compute in float32 from the same weights, so the layers before the first ladder
layer must match bit for bit (max |Δ| = 0), and with no ladder layer so must the logits. The
rest measures what the rewiring costs before any retraining: next-token top-1 agreement and the
mean KL(original || ladder) over every prompt position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

PROMPTS = (
    "The capital of France is",
    "Water boils at 100 degrees Celsius at sea level, but on a high mountain it boils at",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
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


@torch.no_grad()
def measure_damage(original: PreTrainedModel, ladder_model: PreTrainedModel, prompts: list[torch.Tensor]) -> Damage:
    """Run each prompt alone (no padding) through both models and compare."""
    first = min(ladder_model.config.ladder_layers, default=None)
    hidden_diff = logits_diff = kl_sum = 0.0
    agreements = tokens = 0
    for ids in prompts:
        reference = original(ids[None], output_hidden_states=True)
        converted = ladder_model(ids[None], output_hidden_states=True)
        # hidden_states[i] is the stream entering layer i, so [: first + 1] is everything before it.
        compared = slice(None) if first is None else slice(first + 1)
        for expected, actual in zip(reference.hidden_states[compared], converted.hidden_states[compared], strict=True):
            hidden_diff = max(hidden_diff, (expected - actual).abs().max().item())
        logits_diff = max(logits_diff, (reference.logits - converted.logits).abs().max().item())
        log_p = F.log_softmax(reference.logits[0].float(), dim=-1)
        log_q = F.log_softmax(converted.logits[0].float(), dim=-1)
        kl_sum += F.kl_div(log_q, log_p, log_target=True, reduction="sum").item()
        agreements += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
        tokens += ids.numel()
    return Damage(len(prompts), tokens, first, hidden_diff, logits_diff, agreements / tokens, kl_sum / tokens)


def damage_problems(damage: Damage) -> list[str]:
    """What a correct conversion cannot show: any difference where the wiring did not change."""
    problems = []
    if damage.hidden_max_abs_diff != 0:
        problems.append(f"hidden states before the first ladder layer differ by {damage.hidden_max_abs_diff:.3g}")
    if damage.first_ladder_layer is None and damage.logits_max_abs_diff != 0:
        problems.append(f"with no ladder layer the logits differ by {damage.logits_max_abs_diff:.3g}")
    return problems
