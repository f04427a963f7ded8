"""The teacher's side of `kd` and `hidden`, without redoing the student's work.

When the layers below the first ladder layer are frozen and the teacher is a copy of the same original,
those layers compute the same streams in both: hooks on the student's decoder layers keep the streams
entering the first ladder layer (and what every layer takes besides), and the teacher starts there
(for the upper 8 of 30 layers it runs 8). The same hooks keep the student's stream after each ladder
layer for `hidden`. Otherwise the teacher runs from its own embeddings. The teacher is a ladder model
with no ladder layer, so its layers take and return the student's two streams.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ladder.layer_search import layer_inputs


@dataclass
class StudentCapture:
    """What one student forward leaves for the teacher."""

    prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # (attn_stream, mlp_stream) entering the first ladder layer
    layer_kwargs: dict = field(default_factory=dict)
    streams: dict[int, torch.Tensor] = field(default_factory=dict)  # ladder layer -> mlp_stream after it


@dataclass
class TeacherOutput:
    streams: list[torch.Tensor]  # the teacher's stream after each ladder layer, in order
    final_hidden: torch.Tensor | None  # after the final norm: what its LM head reads (logit distillation)


class Distiller:
    def __init__(
        self,
        teacher: torch.nn.Module,
        student_layers: torch.nn.ModuleList,
        ladder_layers: list[int],
        shared_prefix: bool,
    ):
        self.teacher, self.student_layers = teacher, student_layers
        self.ladder_layers, self.shared_prefix = list(ladder_layers), shared_prefix
        assert not shared_prefix or self.ladder_layers, "a shared prefix ends at the first ladder layer"
        self.first = min(self.ladder_layers, default=None)

    @contextlib.contextmanager
    def capture(self) -> Iterator[StudentCapture]:
        """Hooks on the student's layers for the duration of one forward (not during a recomputation in
        the backward, which would overwrite the captures)."""
        captured, layers = StudentCapture(), self.student_layers

        def keep_prefix(module, args, kwargs):
            captured.prefix = (args[0].detach(), args[1].detach())
            captured.layer_kwargs = {
                key: kwargs[key] for key in ("attention_mask", "position_ids", "position_embeddings")
            }

        def keep_stream(index, module, args, output):
            captured.streams[index] = output[1]

        with contextlib.ExitStack() as hooks:  # each hook's handle removes it on the way out
            if self.shared_prefix:
                hooks.enter_context(layers[self.first].register_forward_pre_hook(keep_prefix, with_kwargs=True))
            for index in self.ladder_layers:
                hooks.enter_context(layers[index].register_forward_hook(functools.partial(keep_stream, index)))
            yield captured

    @torch.no_grad()
    def teacher_forward(
        self, input_ids: torch.Tensor, captured: StudentCapture, final: bool, position_ids: torch.Tensor | None = None
    ) -> TeacherOutput:
        """The teacher's streams after the ladder layers and (when `final`) its final normed hidden
        states; it stops after the last ladder layer when those are not needed."""
        if self.shared_prefix:
            start, (attn_stream, mlp_stream), layer_kwargs = self.first, captured.prefix, captured.layer_kwargs
        else:
            embeds, layer_kwargs = layer_inputs(self.teacher, input_ids, position_ids)
            start, attn_stream, mlp_stream = 0, embeds, embeds
        layers = self.teacher.model.layers
        stop = len(layers) if final or not self.ladder_layers else max(self.ladder_layers) + 1
        streams = []
        for index in range(start, stop):
            attn_stream, mlp_stream = layers[index](attn_stream, mlp_stream, **layer_kwargs)
            if index in self.ladder_layers:
                streams.append(mlp_stream)
        return TeacherOutput(streams, self.teacher.model.norm(mlp_stream) if final else None)
