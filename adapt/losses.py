"""The training objectives' arithmetic, apart from the loop: next-token labels, per-block losses
(adapt's held-out evaluation, and the recovery benchmark), and the logit distillation term.

Labels follow transformers' convention: the token each position must predict, -100 where nothing
is trained (the last position, and before tokens that are not targets, such as a chat's user turns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def next_token_labels(input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Each position's next token; the last position is ignored (-100), and so is every position
    whose next token is not a target (`targets`: 1 = train on predicting this token). Shifting the
    labels rather than slicing the logits spares a copy of the logits (batch x seq_len x vocab)."""
    labels = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE)
    if targets is not None:
        labels = labels.masked_fill(F.pad(targets[:, 1:], (0, 1), value=0) == 0, IGNORE)
    return labels


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions (0 when there are none), in float32."""
    total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return total / labels.ne(IGNORE).sum().clamp(min=1)


def kd_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the distributions at `temperature`, per position, times T² (so its
    gradients keep their scale as T changes, Hinton et al. 2015)."""
    student = F.log_softmax(logits.float() / temperature, dim=-1).flatten(0, 1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1).flatten(0, 1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2


def block_loss_sums(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `input_ids`: the summed next-token loss over its labelled positions, and their count."""
    labels = next_token_labels(input_ids) if labels is None else labels
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="none")
    return losses.view(input_ids.shape).sum(dim=1), labels.ne(IGNORE).sum(dim=1)


def block_losses(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of each row of `input_ids`."""
    sums, counts = block_loss_sums(model, input_ids)
    return sums / counts


__all__ = ["IGNORE", "block_loss_sums", "block_losses", "kd_loss", "lm_loss", "next_token_labels"]
