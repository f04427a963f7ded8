"""Log-likelihoods of continuations with each shared context run once (where that saves at least a
third of a group's positions), and the head only where it is read, in float32 (docs/eval.md#scoring).
Same numbers as lm-eval's HFLM up to float rounding, same left truncation to `max_length + 1` tokens.
Sequences are right-padded, so that every real token keeps its position and never sees padding.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ladder.errors import UsageError
from ladder.model.modeling_ladder import CACHE_ARGUMENT

# The head's weight upcast to float32 this many vocabulary rows at a time (16k x 4096 x 4 bytes: 256 MB).
HEAD_ROWS_PER_SLICE = 16384
Request = tuple[Sequence[int], Sequence[int]]  # (context tokens, continuation tokens)
Group = tuple[tuple[int, ...], list[int]]  # (context tokens, indices of the requests that share it)
Whole = tuple[tuple[int, ...], int]  # (context tokens, index of a request scored with its context)


def score_continuations(
    backbone: nn.Module,
    head: nn.Module,
    requests: Sequence[Request],
    max_length: int,
    batch_size: int,
    done: Callable[[int], None] = lambda count: None,
) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether greedy decoding would produce it) for
    each request, in order. `backbone` maps token ids to the final-normed hidden states (a Llama's
    `model.model`), `head` maps those to logits (`lm_head`). A batch holds `batch_size` contexts
    and all their continuations, or `batch_size` whole requests. `done(count)` follows each batch."""
    groups: dict[tuple[int, ...], list[int]] = {}
    continuations = []
    for index, (context, continuation) in enumerate(requests):
        if not context or not continuation:
            raise ValueError(f"request {index}: a non-empty context and continuation")
        if len(continuation) > max_length:
            raise UsageError(
                f"an answer of {len(continuation)} tokens does not fit the model's context of {max_length} "
                "positions (max_position_embeddings): score this task with a model that reads longer text"
            )
        whole = (list(context) + list(continuation))[-(max_length + 1) :]
        groups.setdefault(tuple(whole[: -len(continuation)]), []).append(index)
        continuations.append(list(continuation))

    shared: list[Group] = []
    whole_requests: list[Whole] = []
    for context, members in groups.items():
        positions = sum(len(context) + len(continuations[index]) for index in members)
        if 3 * (len(members) - 1) * len(context) >= positions:
            shared.append((context, members))
        else:
            whole_requests += [(context, index) for index in members]

    results: list[tuple[float, bool] | None] = [None] * len(requests)
    # Longest first, as lm-eval does: similar lengths share a batch (less padding), and an
    # out-of-memory error comes at once.
    shared.sort(key=lambda group: (-len(group[0]), group[0]))
    for start in range(0, len(shared), batch_size):
        _score_shared(backbone, head, shared[start : start + batch_size], continuations, results)
        done(sum(len(members) for _, members in shared[start : start + batch_size]))
    whole_requests.sort(key=lambda request: (-len(request[0]) - len(continuations[request[1]]), request))
    for start in range(0, len(whole_requests), batch_size):
        _score_whole(backbone, head, whole_requests[start : start + batch_size], continuations, results)
        done(len(whole_requests[start : start + batch_size]))
    return results  # type: ignore[return-value]


@torch.no_grad()
def _score_shared(
    backbone: nn.Module, head: nn.Module, groups: list[Group], continuations: list[list[int]], results: list
) -> None:
    device = backbone.get_input_embeddings().weight.device
    # Pass 1: each context once. The logits at its last token predict every member's first token.
    context_lengths = torch.tensor([len(context) for context, _ in groups], device=device)
    context_ids, context_mask = _right_padded([list(context) for context, _ in groups], device)
    output = backbone(input_ids=context_ids, use_cache=True)
    # Selections index with CPU tensors, which torch accepts for a tensor on any device: under
    # `--parallelize` the hidden states come out on the last GPU, not the inputs' first.
    last = output.last_hidden_state[torch.arange(len(groups)), context_lengths.cpu() - 1]
    first_logprobs = _head_log_softmax(head, last)  # [groups, vocab]
    members = {index: group_index for group_index, (_, indices) in enumerate(groups) for index in indices}
    rest_logprobs: dict[int, torch.Tensor] = {}

    # Pass 2: each member's continuation but its last token, after its group's cached context; in
    # chunks of similar length (the longest at most twice the shortest), since a chunk is padded
    # to its longest.
    rows = sorted((index for index in members if len(continuations[index]) > 1), key=lambda i: -len(continuations[i]))
    while rows:
        longest = len(continuations[rows[0]])
        chunk = [index for index in rows if 2 * len(continuations[index]) > longest]
        rows = rows[len(chunk) :]
        # Selecting a chunk's rows changes the cache in place: copied while later chunks need it.
        cache = copy.deepcopy(output[CACHE_ARGUMENT]) if rows else output[CACHE_ARGUMENT]
        chunk_groups = torch.tensor([members[index] for index in chunk], device=device)
        cache.batch_select_indices(chunk_groups)
        inputs, inputs_mask = _right_padded([continuations[index][:-1] for index in chunk], device)
        hidden = backbone(
            input_ids=inputs,
            attention_mask=torch.cat([context_mask[chunk_groups], inputs_mask], dim=1),
            position_ids=context_lengths[chunk_groups, None] + torch.arange(inputs.shape[1], device=device),
            use_cache=True,
            **{CACHE_ARGUMENT: cache},
        ).last_hidden_state
        logprobs = _head_log_softmax(head, hidden[inputs_mask.bool().cpu()])
        rest_logprobs.update(zip(chunk, logprobs.split([len(continuations[index]) - 1 for index in chunk])))

    for index, group_index in members.items():
        predicted = first_logprobs[group_index, None]
        if index in rest_logprobs:
            predicted = torch.cat([predicted, rest_logprobs[index]])
        results[index] = _answer(predicted, continuations[index])


@torch.no_grad()
def _score_whole(
    backbone: nn.Module, head: nn.Module, requests: list[Whole], continuations: list[list[int]], results: list
) -> None:
    device = backbone.get_input_embeddings().weight.device
    ids, _ = _right_padded([list(context) + continuations[index][:-1] for context, index in requests], device)
    hidden = backbone(input_ids=ids).last_hidden_state
    predicting = torch.zeros(ids.shape, dtype=torch.bool)
    for row, (context, index) in enumerate(requests):
        predicting[row, len(context) - 1 : len(context) - 1 + len(continuations[index])] = True
    logprobs = _head_log_softmax(head, hidden[predicting])
    for (_, index), predicted in zip(requests, logprobs.split([len(continuations[index]) for _, index in requests])):
        results[index] = _answer(predicted, continuations[index])


def _head_log_softmax(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Log-probabilities over the vocabulary at each row of `hidden` ([rows, hidden]), the head and
    the log-softmax in float32 whatever the model's dtype: bf16 logits keep 8 bits, which moves a
    log-probability by up to |logit| / 256 (0.05 at a logit of 12). The head's weight is upcast a
    slice of the vocabulary at a time, never whole (an 8B's head is 2 GB in float32)."""
    if not isinstance(head, nn.Linear) or head.weight.dtype == torch.float32:
        return torch.log_softmax(head(hidden).float(), dim=-1)
    weight = head.weight
    hidden = hidden.to(weight.device, torch.float32)
    logits = torch.cat([hidden @ rows.float().T for rows in weight.split(HEAD_ROWS_PER_SLICE)], dim=-1)
    if head.bias is not None:
        logits += head.bias.float()
    return torch.log_softmax(logits, dim=-1)


def _answer(logprobs: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
    """(log-probability of the continuation, whether it is the greedy one) from the log-softmax at
    the positions that predict its tokens ([tokens, vocab])."""
    tokens = torch.tensor(continuation, device=logprobs.device)
    return float(logprobs.gather(1, tokens[:, None]).sum()), bool((logprobs.argmax(dim=-1) == tokens).all())


def _right_padded(sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids right-padded with token 0, and the mask of real tokens (1) and padding (0)."""
    rows = [torch.tensor(sequence, dtype=torch.long) for sequence in sequences]
    ids = nn.utils.rnn.pad_sequence(rows, batch_first=True)
    lengths = torch.tensor([len(row) for row in rows])
    return ids.to(device), (torch.arange(ids.shape[1]) < lengths[:, None]).long().to(device)
