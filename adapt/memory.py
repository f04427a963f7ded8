"""Training in less memory, for the same forward and the same gradients: fewer saved activations per
trained decoder layer, and the optimizer's state allocated before the first forward.

- The MLP (`down(silu(gate(x)) * up(x))`) keeps silu(gate) and the product, each tokens x the
  intermediate size; `SwiGLUDown` keeps only gate and up and recomputes the elementwise products in
  the backward (not the matmuls).
- Each RMSNorm keeps its input and its normalized input; under `torch.utils.checkpoint` only the input.

On the CPU recipe that is 127 of 346 MiB of saved activations (benchmarks/train_speed.py measures the
effect; tests/test_adapt_objectives.py checks the gradients, fp32 and bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm


class SwiGLUDown(torch.autograd.Function):
    """down_proj(silu(gate) * up) without a bias, saving gate and up instead of silu(gate) and the product."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        device_type = gate.device.type
        # The backward recomputes under the forward's autocast: its matmuls take the forward's dtypes.
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate).mul_(up), weight)  # in place: one transient instead of two

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        device_type, dtype, enabled = ctx.autocast
        grad_gate = grad_up = grad_weight = None
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            activated = F.silu(gate)
            grad_product = grad_output @ weight
            if ctx.needs_input_grad[2]:
                grad_weight = (grad_output.flatten(0, -2).T @ (activated * up).flatten(0, -2)).to(weight.dtype)
        # What autograd computes for `silu(gate) * up`, from the recomputed silu(gate).
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad_product.mul_(activated)  # grad_product is not read after this
        return grad_gate, grad_up, grad_weight


class LeanLlamaMLP(LlamaMLP):
    """Llama's MLP through `SwiGLUDown`: the same parameters and output, less kept for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight)


class CheckpointedLlamaRMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm under `torch.utils.checkpoint` when it is trained through: keeps its input only."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad):
            return checkpoint(super().forward, hidden_states, use_reentrant=False)
        return super().forward(hidden_states)


def keep_fewer_activations(model: torch.nn.Module) -> int:
    """Turn the model's Llama MLPs and RMSNorms into the classes above, in place (same parameters and
    names); returns how many changed. An MLP whose projections are not bias-free `nn.Linear` (LoRA's) stays."""
    changed = 0
    for module in model.modules():
        if (
            type(module) is LlamaMLP
            and module.config.hidden_act == "silu"
            and all(
                type(projection) is torch.nn.Linear and projection.bias is None
                for projection in (module.gate_proj, module.up_proj, module.down_proj)
            )
        ):
            module.__class__ = LeanLlamaMLP
        elif type(module) is LlamaRMSNorm:
            module.__class__ = CheckpointedLlamaRMSNorm
        else:
            continue
        changed += 1
    return changed


def allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an AdamW optimizer its zero moments now, as its first step would: before the first forward they
    sit below the activations on the CPU heap, instead of filling the holes freed activations leave (the
    CPU recipe's peak RSS: about 40 MiB less)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    zeros = {
        index: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        for index, p in enumerate(params)
    }
    optimizer.load_state_dict({"state": zeros, "param_groups": optimizer.state_dict()["param_groups"]})
