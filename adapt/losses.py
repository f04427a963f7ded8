"""The training objectives' arithmetic, apart from the loop: next-token labels, per-block losses
(adapt's held-out evaluation, and the recovery benchmark), and the logit distillation term."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Each position's next token; the last position is ignored (-100). Shifting the labels rather
    than slicing the logits spares a copy of the logits (batch x seq_len x vocab)."""
    return F.pad(input_ids[:, 1:], (0, 1), value=-100)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), next_token_labels(input_ids).flatten())


def kd_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of the distributions at `temperature`, per position, times T² (so its
    gradients keep their scale as T changes, Hinton et al. 2015)."""
    student = F.log_softmax(logits.float() / temperature, dim=-1).flatten(0, 1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1).flatten(0, 1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean") * temperature**2


def block_losses(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of each row of `input_ids`."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    losses = F.cross_entropy(logits.flatten(0, 1).float(), next_token_labels(input_ids).flatten(), reduction="none")
    return losses.view(input_ids.shape).sum(dim=1) / (input_ids.shape[1] - 1)


__all__ = ["block_losses", "kd_loss", "lm_loss", "next_token_labels"]
