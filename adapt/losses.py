"""The training objectives' arithmetic, apart from the loop: next-token labels, per-block losses
(adapt's held-out evaluation, and the recovery benchmark), the logit distillation term and the
hidden-state distillation term."""

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


def hidden_loss(student_streams: list[torch.Tensor], teacher_streams: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers and positions of ||s - t||² / ||t||², the student's residual stream after
    each ladder layer against the teacher's after the same layer. Relative per position because every
    module reads the stream through RMSNorm, which divides each position by its own scale: what the
    next module sees is the error relative to that scale. Raw MSE would let the upper layers (larger
    streams) and the few positions with huge activations (the first token's) outweigh the rest."""
    terms = [
        ((student.float() - teacher.float()).pow(2).sum(-1) / teacher.float().pow(2).sum(-1).clamp_min(1e-12)).mean()
        for student, teacher in zip(student_streams, teacher_streams, strict=True)
    ]
    return torch.stack(terms).mean()


def block_losses(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of each row of `input_ids`."""
    logits = model(input_ids=input_ids, use_cache=False).logits
    losses = F.cross_entropy(logits.flatten(0, 1).float(), next_token_labels(input_ids).flatten(), reduction="none")
    return losses.view(input_ids.shape).sum(dim=1) / (input_ids.shape[1] - 1)


__all__ = ["block_losses", "hidden_loss", "kd_loss", "lm_loss", "next_token_labels"]
