"""What one training step and one evaluation compute: batches on the device, the objective's loss
(with the teacher when there is one), gradients accumulated over micro-batches, the held-out loss."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from accelerate import Accelerator

from .data import BlockOrder, Blocks, Splits, document_positions
from .distill import Distiller
from .losses import block_loss_sums, head_losses, hidden_loss, losses_in_lm_head, next_token_labels
from .recipe import Recipe


@dataclass
class StepResult:
    loss: float  # the training loss, all processes
    lm_loss: float  # the next-token loss, all processes
    labelled: int  # positions whose next token is trained on, all processes
    data_seconds: float  # this process's time getting its blocks onto the device


@dataclass
class TrainingStep:
    accelerator: Accelerator
    model: torch.nn.Module  # as `accelerator.prepare` returned it
    recipe: Recipe
    data: Splits
    order: BlockOrder
    distiller: Distiller | None
    ladder_layers: list[int]
    fsdp: bool

    def gradients(self, step: int) -> StepResult:
        """Forward and backward over this process's micro-batches of `step`; the loss averaged over all
        processes."""
        accelerator, grad_accum = self.accelerator, self.recipe.batch.grad_accum
        started = time.perf_counter()
        counts = self.labelled_positions(step)
        shares = counts * counts.size / max(int(counts.sum()), 1)
        data_seconds = time.perf_counter() - started
        totals = torch.zeros(2, device=accelerator.device)
        for micro_step in range(grad_accum):
            started = time.perf_counter()
            rows = self.order.indices(step, micro_step, accelerator.process_index)
            input_ids, labels, position_ids = self.batch(self.data.train[rows])
            data_seconds += time.perf_counter() - started
            # FSDP must reduce-scatter every micro-step: unsharded gradients would not fit.
            skip_sync = micro_step < grad_accum - 1 and not self.fsdp
            with accelerator.no_sync(self.model) if skip_sync else contextlib.nullcontext():
                share = float(shares[micro_step, accelerator.process_index])
                loss, lm_loss = self.forward_loss(input_ids, labels, position_ids, share)
                accelerator.backward(loss / grad_accum)
            totals += torch.stack([loss.detach(), lm_loss.detach()]) / grad_accum
        totals = accelerator.reduce(totals, reduction="mean")
        return StepResult(float(totals[0]), float(totals[1]), int(counts.sum()), data_seconds)

    def labelled_positions(self, step: int) -> np.ndarray:
        """Per (micro-step, process) of `step`: its labelled positions. A micro-batch's next-token loss is
        weighted by its share of them: gradients are averaged over micro-batches and processes, so the
        loss is the mean over all the step's labelled positions, as one large batch would give, however
        unevenly masking spreads them."""
        order = self.order
        micro_steps = [
            [self.data.train[order.indices(step, a, p)] for p in range(order.processes)]
            for a in range(order.grad_accum)
        ]
        return np.array([[np.count_nonzero(self.label_mask(blocks)[:, 1:]) for blocks in row] for row in micro_steps])

    def label_mask(self, blocks: Blocks) -> np.ndarray:
        """1 where a token's prediction from the one before is trained on (with `data.isolate_documents`,
        not a document's first token)."""
        targets = np.array(blocks.targets, dtype=np.int64)
        if self.recipe.data.isolate_documents:
            targets[np.asarray(blocks.starts, dtype=bool)] = 0
        return targets

    def batch(self, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input ids, labels, position ids) of some blocks, on the device; with `data.isolate_documents`
        the position ids restart at each document (transformers' mask becomes block-diagonal)."""
        device = self.accelerator.device
        input_ids = torch.from_numpy(blocks.ids.astype(np.int64)).to(device)
        targets = torch.from_numpy(self.label_mask(blocks)).to(device)
        position_ids = None
        if self.recipe.data.isolate_documents:
            position_ids = torch.from_numpy(document_positions(blocks.starts)).to(device)
        return input_ids, next_token_labels(input_ids, targets), position_ids

    def forward_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None, share: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to train on, next-token loss) of the objective. The head's losses are computed chunk by
        chunk inside the model's forward (`losses_in_lm_head`); the teacher runs there too, once the
        student's layers have run, so that it can start from the student's streams (adapt/distill.py)."""
        spec = self.recipe.objective
        kd_weight = {"lm": 0.0, "hidden": 0.0, "kd": 1.0}.get(spec.name, spec.kd_weight)
        # The next-token term weighted by `share` (its positions against an even micro-batch's,
        # `labelled_positions`): the head computes (1 - k') lm + k' kd, which times `scale` is
        # (1 - kd_weight) share lm + kd_weight kd. (The head's gradients follow its first output only.)
        scale = (1 - kd_weight) * share + kd_weight
        head_kd_weight = kd_weight / scale if scale else kd_weight
        taught = []  # the teacher's output, from inside the student's forward
        with self.accelerator.autocast():

            def head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                teacher_hidden = teacher_weight = None
                if self.distiller is not None:
                    taught.append(
                        self.distiller.teacher_forward(
                            input_ids, captured, final=bool(kd_weight), position_ids=position_ids
                        )
                    )
                    teacher_hidden, teacher_weight = taught[0].final_hidden, self.distiller.teacher.lm_head.weight
                if spec.name == "hidden":  # the next-token loss is reported, not trained on
                    hidden, weight = hidden.detach(), weight.detach()
                return head_losses(
                    hidden,
                    weight,
                    labels,
                    teacher_hidden,
                    teacher_weight,
                    kd_weight=head_kd_weight,
                    temperature=spec.temperature,
                )

            with (
                self.distiller.capture() if self.distiller else contextlib.nullcontext() as captured,
                losses_in_lm_head(self.model, head) as results,
            ):
                self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        loss, next_token = results[0]
        loss, next_token = loss * scale, next_token * share
        if spec.uses_hidden():
            matched = hidden_loss([captured.streams[i] for i in self.ladder_layers], taught[0].streams)
            loss = matched if spec.name == "hidden" else loss + spec.hidden_weight * matched
        return loss, next_token

    @torch.no_grad()
    def held_out_loss(self) -> float | None:
        """Mean next-token loss over the labelled positions of the held-out blocks (split across
        processes); None when there are none."""
        accelerator, blocks = self.accelerator, self.data.eval
        if len(blocks) == 0:
            return None
        self.model.eval()
        micro_batch, processes = self.recipe.batch.micro_batch, accelerator.num_processes
        rounds = math.ceil(len(blocks) / (micro_batch * processes))
        totals = torch.zeros(2, device=accelerator.device)  # (summed loss, labelled positions)
        for round_index in range(rounds):
            # Every process runs the same number of forwards (FSDP needs it); padding rows count zero.
            start = (round_index * processes + accelerator.process_index) * micro_batch
            rows = np.arange(start, start + micro_batch)
            real = torch.from_numpy(rows < len(blocks)).to(accelerator.device)
            input_ids, labels, position_ids = self.batch(blocks[np.minimum(rows, len(blocks) - 1)])
            with accelerator.autocast():
                sums, counts = block_loss_sums(self.model, input_ids, labels, position_ids)
            totals += torch.stack([(sums * real).sum(), (counts * real).sum()])
        totals = accelerator.reduce(totals, reduction="sum")
        self.model.train()
        return float(totals[0] / totals[1])
