"""Which layers to rewire: `auto:N` measures the damage of each candidate layer set on calibration
text and keeps the least damaged (docs/recovery.md: the candidates, the measure and the cost).

Damage is the mean KL(original || rewired) of the next-token distributions, not the loss: a
rewiring that happens to lower the loss on a few thousand tokens is no less damaged. The
original's residual streams entering every layer are computed once per batch; a candidate whose
first ladder layer is `s` runs only layers s..L-1 and the LM head from them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ladder.errors import UsageError
from ladder.io.files import ladder_data_dir
from ladder.layers import AutoLayers, format_layers, overlapped_all_reduces
from ladder.rewire import to_ladder

CALIBRATION_BLOCKS = 8  # of 512 tokens: 4,096 tokens, a few seconds of forward per candidate here
CALIBRATION_SEQ_LEN = 512
# `ladder convert --layers auto:N` without --calibration: training books (the CPU recipe's), never
# the evaluation sets nor the recipe's held-out books.
DEFAULT_CALIBRATION_BOOKS = (
    "1342_pride_and_prejudice/1342-0.txt",
    "1661_adventures_of_sherlock_holmes/1661-0.txt",
    "2701_moby_dick/2701-0.txt",
    "345_dracula/pg345.txt",
    "120_treasure_island/pg120.txt",
    "2591_grimms_fairy_tales/2591-0.txt",
    "1400_great_expectations/1400-0.txt",
    "174_the_picture_of_dorian_gray/pg174.txt",
)


@dataclass
class Candidate:
    layers: list[int]
    kl: float  # mean KL(original || rewired), nats per token
    loss_increase: float  # mean next-token loss minus the original's: the log-perplexity increase


@dataclass
class LayerSearch:
    """What `auto:N` measured and chose; `conversion.json` and adapt's `layer_search.json` record it."""

    spec: str
    chosen: list[int]
    chosen_kl: float
    chosen_loss_increase: float
    overlapped_all_reduces: int  # of 2 * len(chosen)
    calibration_tokens: int
    original_loss: float
    forward_passes: float  # the cost in full forward passes over the calibration text, counted in decoder layers
    seconds: float
    candidates: list[Candidate] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.spec} chose layers {format_layers(self.chosen)} (KL {self.chosen_kl:.4f} nats/token, "
            f"log-perplexity +{self.chosen_loss_increase:.4f}; {self.overlapped_all_reduces} of "
            f"{2 * len(self.chosen)} all-reduces overlapped) from {len(self.candidates)} candidates on "
            f"{self.calibration_tokens} calibration tokens in {self.seconds:.0f} s"
        )


def calibration_from_files(
    tokenizer: PreTrainedTokenizerBase,
    paths: list[Path] | None = None,
    blocks: int = CALIBRATION_BLOCKS,
    seq_len: int = CALIBRATION_SEQ_LEN,
) -> torch.Tensor:
    """`blocks` rows of `seq_len` tokens, each from the middle of a file (past licence headers)."""
    if paths is None:
        paths = [ladder_data_dir() / "train" / "gutenberg" / book for book in DEFAULT_CALIBRATION_BOOKS]
    paths = sorted(
        file for path in map(Path, paths) for file in (sorted(path.rglob("*.txt")) if path.is_dir() else [path])
    )
    if not paths:
        raise UsageError("calibration: no .txt file found")
    rows = []
    for index in range(blocks):
        path = paths[index % len(paths)]
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise UsageError(f"calibration file {path}: {error.strerror}") from None
        # Repeated files (fewer files than blocks) give further windows, not the same one.
        middle = len(text) // 2 + (index // len(paths)) * seq_len * 8
        ids = tokenizer(text[middle : middle + seq_len * 8], add_special_tokens=False)["input_ids"][:seq_len]
        if len(ids) < seq_len:
            raise UsageError(
                f"calibration file {path} is too short: {len(ids)} tokens from its middle, {seq_len} needed"
            )
        rows.append(ids)
    return torch.tensor(rows, dtype=torch.long)


def calibration_from_blocks(blocks: np.ndarray, count: int = CALIBRATION_BLOCKS) -> torch.Tensor:
    rows = np.unique(np.linspace(0, len(blocks) - 1, min(count, len(blocks))).round().astype(int))
    return torch.from_numpy(np.asarray(blocks[rows]).astype(np.int64))


def layer_inputs(
    model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict]:
    """The embeddings and the keyword arguments every decoder layer takes, as `LadderModel.forward`
    builds them."""
    inner = model.model
    embeds = inner.embed_tokens(input_ids)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    return embeds, dict(
        attention_mask=inner.attention_masks(embeds, None, position_ids, None),
        position_ids=position_ids,
        position_embeddings=inner.rotary_emb(embeds, position_ids=position_ids),
    )


def forward_from(
    model: PreTrainedModel, streams: tuple[torch.Tensor, torch.Tensor], start: int, layer_kwargs: dict
) -> torch.Tensor:
    """The logits of a ladder model whose layers below `start` produced `streams` (attn_stream, mlp_stream)."""
    attn_stream, mlp_stream = streams
    for layer in model.model.layers[start:]:
        attn_stream, mlp_stream = layer(attn_stream, mlp_stream, **layer_kwargs)
    return model.lm_head(model.model.norm(mlp_stream))


@torch.no_grad()
def measure_candidates(
    model: PreTrainedModel, calibration: torch.Tensor, candidates: list[list[int]], batch: int = 2
) -> tuple[list[Candidate], float, float]:
    """Each candidate's damage, the original's mean loss, and the cost in full forward passes."""
    num_layers = model.config.num_hidden_layers
    original = to_ladder(model, []).eval()
    rewired = [to_ladder(model, layers).eval() for layers in candidates]
    kl_sums = torch.zeros(len(candidates), dtype=torch.float64)
    loss_sums = torch.zeros_like(kl_sums)
    original_loss_sum, tokens, passes = 0.0, 0, 0
    for first_row in range(0, len(calibration), batch):
        input_ids = calibration[first_row : first_row + batch]
        labels = input_ids[:, 1:].flatten()
        embeds, layer_kwargs = layer_inputs(original, input_ids)
        streams = [(embeds, embeds)]  # streams[i]: what enters layer i
        for layer in original.model.layers:
            streams.append(layer(*streams[-1], **layer_kwargs))
        logits = forward_from(original, streams[-1], num_layers, layer_kwargs)
        reference = F.log_softmax(logits[:, :-1].float(), dim=-1).flatten(0, 1)
        original_loss_sum += F.nll_loss(reference, labels, reduction="sum").item()
        tokens += labels.numel()
        passes += num_layers * len(input_ids)
        for index, (layers, candidate) in enumerate(zip(candidates, rewired, strict=True)):
            start = min(layers)
            logits = forward_from(candidate, streams[start], start, layer_kwargs)
            log_q = F.log_softmax(logits[:, :-1].float(), dim=-1).flatten(0, 1)
            kl_sums[index] += F.kl_div(log_q, reference, log_target=True, reduction="sum").item()
            loss_sums[index] += F.nll_loss(log_q, labels, reduction="sum").item()
            passes += (num_layers - start) * len(input_ids)
    original_loss = original_loss_sum / tokens
    measured = [
        Candidate(layers, float(kl / tokens), float(loss / tokens - original_loss))
        for layers, kl, loss in zip(candidates, kl_sums, loss_sums, strict=True)
    ]
    return measured, original_loss, passes / (num_layers * len(calibration))


def choose_ladder_layers(
    model: PreTrainedModel, calibration: torch.Tensor, auto: AutoLayers, batch: int = 2
) -> LayerSearch:
    """Run the `auto` search on a loaded model (a ladder model's own wiring is ignored); ties go to the
    higher layers (the paper's shape)."""
    started = time.perf_counter()
    num_layers, count = model.config.num_hidden_layers, auto.count
    width = count if auto.contiguous else 1  # auto:N:any measures each layer alone, then the N least damaged
    candidates = [list(range(start, start + width)) for start in range(num_layers - width + 1)]
    measured, original_loss, passes = measure_candidates(model, calibration, candidates, batch)
    if auto.contiguous:
        best = min(reversed(measured), key=lambda candidate: candidate.kl)
    else:
        ranked = sorted(reversed(measured), key=lambda candidate: candidate.kl)
        chosen_set, _, set_passes = measure_candidates(
            model, calibration, [sorted(c.layers[0] for c in ranked[:count])], batch
        )
        best, passes = chosen_set[0], passes + set_passes
        measured.append(best)
    return LayerSearch(
        spec=str(auto),
        chosen=best.layers,
        chosen_kl=best.kl,
        chosen_loss_increase=best.loss_increase,
        overlapped_all_reduces=overlapped_all_reduces(best.layers),
        calibration_tokens=int(calibration[:, 1:].numel()),
        original_loss=original_loss,
        forward_passes=round(passes, 2),
        seconds=round(time.perf_counter() - started, 2),
        candidates=measured,
    )
