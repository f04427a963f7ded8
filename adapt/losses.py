"""The training objectives' arithmetic, apart from the loop: next-token labels (transformers'
convention: the token each position must predict, -100 where nothing is trained), per-block losses,
the training losses computed from the final hidden states and the LM head chunk by chunk, and the
hidden-state distillation term.

Full logits are tokens x vocabulary in float32: for Llama-3.1's 128k vocabulary about 4 GB per
8k-token micro-batch, and as much again for their gradient. `head_losses` instead computes the logits
of a chunk of positions at a time, takes the loss and its gradient with respect to them at once (the
softmax serves both, in place), turns that into the gradients of the hidden states and the head's
weight, and drops the chunk: the same FLOPs, the memory of one chunk. `losses_in_lm_head` runs it
inside a model's own forward (where FSDP has the head's weight gathered).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

# Float32 logits per chunk. On the CPU 16 MiB: glibc maps larger blocks afresh each time, which raised
# the CPU recipe's peak RSS by 140 MiB for no speed. On accelerators 512 MiB (1,046 positions of a 128k
# vocabulary): each chunk reads the whole head weight three times, so chunks must be long enough for
# those matmuls to be bound by compute, and few.
CPU_CHUNK_BYTES = 16 * 2**20
ACCELERATOR_CHUNK_BYTES = 512 * 2**20
IGNORE_INDEX = -100


def chunk_positions(vocab_size: int, device: torch.device | str = "cpu") -> int:
    """Positions per chunk of float32 logits on this device."""
    budget = CPU_CHUNK_BYTES if torch.device(device).type == "cpu" else ACCELERATOR_CHUNK_BYTES
    return max(1, budget // (4 * vocab_size))


def float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b from low-precision operands, accumulated in float32 and returned in float32: on CUDA in
    one kernel that writes float32 (`out_dtype`), elsewhere rounded to the operands' dtype first."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def next_token_labels(input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """Each position's next token; the last position is ignored (-100), and so is every position
    whose next token is not a target (`targets`: 1 = train on predicting this token). Shifting the
    labels rather than slicing the logits spares a copy of the logits (batch x seq_len x vocab)."""
    labels = F.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    if targets is not None:
        labels = labels.masked_fill(F.pad(targets[:, 1:], (0, 1), value=0) == 0, IGNORE_INDEX)
    return labels


class _ChunkedHeadLoss(torch.autograd.Function):
    """(lm_weight * next-token cross-entropy + kd_weight * T²-scaled KL to the teacher, next-token
    cross-entropy) from hidden states and the head's weight; gradients computed in the forward pass,
    chunk by chunk, and kept instead of the logits."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        teacher_hidden,
        teacher_weight,
        lm_weight,
        kd_weight,
        temperature,
        chunk_tokens,
        needs_grad,
    ):
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        rows = flat.shape[0]
        chunk_tokens = chunk_tokens or chunk_positions(weight.shape[0], weight.device)
        dtype = torch.promote_types(flat.dtype, torch.float32)  # logits in float32 at least, as usual
        counted = (targets != IGNORE_INDEX).sum().clamp(min=1).to(dtype)  # a fully masked batch gives 0, not NaN
        ce_sum = flat.new_zeros((), dtype=dtype)
        kd_sum = flat.new_zeros((), dtype=dtype)
        grad_hidden = torch.empty_like(flat) if needs_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if needs_grad[1] else None
        # Under autocast (bf16 recipes) each matmul takes bf16 operands (the weights cast once, not per
        # chunk) and accumulates in float32 (`float32_product`): no float32 GEMM; outside it, as given.
        device = flat.device.type
        low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32
        low = None if low == torch.float32 else low
        lhs, rhs = (flat, weight) if low is None else (flat.to(low), weight.to(low))
        if kd_weight:
            teacher_lhs, teacher_rhs = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), teacher_weight
            if low is not None:
                teacher_lhs, teacher_rhs = teacher_lhs.to(low), teacher_rhs.to(low)

        def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (a @ b).to(dtype) if low is None else float32_product(a, b)

        with torch.autocast(flat.device.type, enabled=False):
            for start in range(0, rows, chunk_tokens):
                chunk = lhs[start : start + chunk_tokens]
                target = targets[start : start + chunk_tokens]
                logits = product(chunk, rhs.T)
                log_probs = logits.sub_(logits.logsumexp(-1, keepdim=True))  # log-softmax in place
                valid = target != IGNORE_INDEX
                safe_target = target.clamp(min=0)
                ce_sum -= (log_probs.gather(1, safe_target[:, None])[:, 0] * valid).sum()
                if kd_weight:  # before the gradient below overwrites log_probs
                    teacher_log_probs = product(teacher_lhs[start : start + chunk_tokens], teacher_rhs.T)
                    if temperature != 1:
                        teacher_log_probs.div_(temperature)
                        # that of logits / T (log-softmax is shift-invariant); at T = 1 it is log_probs itself
                        student_log_probs = (log_probs / temperature).log_softmax(-1)
                    else:
                        student_log_probs = log_probs
                    teacher_log_probs.sub_(teacher_log_probs.logsumexp(-1, keepdim=True))
                    teacher_probs = teacher_log_probs.exp()
                    # KL(teacher || student) = sum p_t (log p_t - log p_s), summed over the chunk without a temporary.
                    kd_sum += torch.dot(teacher_probs.flatten(), teacher_log_probs.sub_(student_log_probs).flatten())
                if needs_grad[0] or needs_grad[1]:
                    # d(mean CE)/d logits = (softmax - one_hot) / counted, on the counted rows only;
                    # d(T² KL / rows)/d logits = T (softmax(z / T) - teacher) / rows.
                    ce_scale = valid.to(dtype) * (lm_weight / counted)
                    kd_scale = kd_weight * temperature / rows
                    grad = log_probs.exp_()
                    if kd_weight and temperature == 1:  # softmax(z / T) is the softmax just computed
                        grad.mul_((ce_scale + kd_scale)[:, None]).sub_(teacher_probs.mul_(kd_scale))
                    else:
                        grad.mul_(ce_scale[:, None])
                        if kd_weight:
                            grad.add_(student_log_probs.exp_().sub_(teacher_probs).mul_(kd_scale))
                    grad.scatter_add_(1, safe_target[:, None], -ce_scale[:, None])
                if needs_grad[0]:
                    grad_hidden[start : start + chunk_tokens] = (grad.to(rhs.dtype) @ rhs).to(flat.dtype)
                if needs_grad[1]:
                    if low is None:
                        grad_weight.addmm_(grad.T, chunk.to(dtype))
                    else:
                        grad_weight.add_(float32_product(grad.to(low).T, chunk))
        ce = ce_sum / counted
        loss = lm_weight * ce + kd_weight * temperature**2 * kd_sum / rows
        ctx.shapes = hidden.shape
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else flat.new_empty(0),
            grad_weight.to(weight.dtype) if grad_weight is not None else weight.new_empty(0),
        )
        ctx.needs = needs_grad
        ctx.mark_non_differentiable(ce)
        return loss, ce

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = grad_hidden.view(ctx.shapes) * grad_loss if ctx.needs[0] else None
        return grad_hidden, grad_weight * grad_loss if ctx.needs[1] else None, *[None] * 8


def head_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    kd_weight: float = 0.0,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss, next-token loss) from the final hidden states (after the final norm) and the LM
    head's weight, chunk by chunk: the next-token loss is the mean cross-entropy over the labels that
    are not -100; the training loss (1 - kd_weight) x that + kd_weight x T² x KL(teacher || student) at
    `temperature`, mean over every position (T² keeps the gradients' scale as T changes, Hinton et al.
    2015). Equal to computing full logits first (a test checks loss and gradients)."""
    if kd_weight and (teacher_hidden is None or teacher_weight is None):
        raise ValueError("kd_weight > 0 needs the teacher's hidden states and LM head weight")
    needs_grad = (torch.is_grad_enabled() and hidden.requires_grad, torch.is_grad_enabled() and weight.requires_grad)
    return _ChunkedHeadLoss.apply(
        hidden,
        weight,
        labels,
        teacher_hidden,
        teacher_weight,
        1.0 - kd_weight,
        kd_weight,
        temperature,
        chunk_tokens,
        needs_grad,
    )


@contextlib.contextmanager
def losses_in_lm_head(
    model: torch.nn.Module, compute: Callable[[torch.Tensor, torch.Tensor], object]
) -> Iterator[list]:
    """While active, a forward of `model` calls `compute(hidden_states, head_weight)` where the logits
    would be computed, and its LM head returns logits for no position; the yielded list receives what
    `compute` returned. Inside the model's forward, so DDP and FSDP see an ordinary forward."""
    head = extract_model_from_parallel(model).get_output_embeddings()  # the model inside DDP and the like
    results: list = []

    def replace_input(module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        results.append(compute(hidden, module.weight))
        return (hidden[..., :0, :],)

    with head.register_forward_pre_hook(replace_input):  # the handle removes the hook on the way out
        yield results


def token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Each position's next-token cross-entropy in float32 (0 where the label is -100), from the final
    hidden states and the head's weight, chunk by chunk; for evaluation (no gradient)."""
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk_tokens = chunk_tokens or chunk_positions(weight.shape[0], weight.device)
    losses = torch.empty(targets.shape, dtype=torch.promote_types(flat.dtype, torch.float32), device=flat.device)
    for start in range(0, targets.shape[0], chunk_tokens):
        logits = (flat[start : start + chunk_tokens] @ weight.T).to(losses.dtype)
        losses[start : start + chunk_tokens] = F.cross_entropy(
            logits, targets[start : start + chunk_tokens], ignore_index=IGNORE_INDEX, reduction="none"
        )
    return losses.view(labels.shape)


@torch.no_grad()
def block_loss_sums(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `input_ids`: the summed next-token loss over its labelled positions, and their count."""
    labels = next_token_labels(input_ids) if labels is None else labels
    with losses_in_lm_head(model, lambda hidden, weight: token_losses(hidden, weight, labels)) as results:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return results[0].sum(dim=1), labels.ne(IGNORE_INDEX).sum(dim=1)


def hidden_loss(student_streams: list[torch.Tensor], teacher_streams: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers and positions of ||s - t||² / ||t||², the student's residual stream after each
    ladder layer against the teacher's. Relative per position because every module reads the stream
    through RMSNorm, which divides each position by its own scale; raw MSE would let the larger upper
    streams and the few huge positions (the first token's) outweigh the rest."""
    terms = [
        ((student.float() - teacher.float()).pow(2).sum(-1) / teacher.float().pow(2).sum(-1).clamp_min(1e-12)).mean()
        for student, teacher in zip(student_streams, teacher_streams, strict=True)
    ]
    return torch.stack(terms).mean()


def block_losses(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of each row of `input_ids`."""
    sums, counts = block_loss_sums(model, input_ids)
    return sums / counts
