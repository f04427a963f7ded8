"""`ladder sample [MODEL] --tokens N --out FILE.jsonl`: text sampled from a model, to retrain on
(data-free distillation, as in LLM-QAT, arXiv 2305.17888; docs/recipes.md, docs/recovery.md).

Each document starts from a token drawn uniformly from the vocabulary, then samples at temperature 1
with no top-k or top-p (the model's own distribution), the end-of-text token suppressed. The same
model, seed and batch size give the same file, written atomically as JSON lines.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from ladder.cli_types import non_negative_int, positive_int
from ladder.errors import ArgumentParser
from ladder.io.files import atomic_write
from ladder.io.outputs import check_output
from ladder.log import log

if TYPE_CHECKING:  # transformers loads only once the arguments are checked
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="ladder sample",
        description="Sample documents from a model (the original, before rewiring) into a JSON-lines "
        "file that an adapt recipe trains on: data-free distillation.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="checkpoint directory, .gguf file or Hub model ID (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSON-lines file to write")
    parser.add_argument(
        "--tokens", type=positive_int, required=True, help="sampled tokens in all (rounded up to whole documents)"
    )
    parser.add_argument("--length", type=positive_int, default=512, help="new tokens per document (default 512)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="documents sampled together (default 32)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (a GPU when one is visible, else the CPU; the default), cpu, cuda or cuda:N",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing output file")
    return parser


def sample_documents(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    documents: int,
    length: int,
    batch_size: int,
    seed: int,
    progress: tqdm | None = None,
) -> list[list[int]]:
    """`documents` token lists of 1 + `length` tokens sampled from `model`; `progress` counts the sampled tokens."""
    import torch

    device = next(model.parameters()).device
    torch.manual_seed(seed)  # the first tokens and generate()'s sampling draw from torch's global generator
    sampled = []
    for start in range(0, documents, batch_size):
        rows = min(batch_size, documents - start)
        first = torch.randint(len(tokenizer), (rows, 1)).to(device)
        with torch.no_grad():
            ids = model.generate(
                first,
                attention_mask=torch.ones_like(first),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=length,
                min_new_tokens=length,  # suppresses the end-of-text token
                pad_token_id=tokenizer.eos_token_id,
            )
        sampled += ids.tolist()
        if progress is not None:
            progress.update(rows * length)
    return sampled


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from ladder.io.loading import load_model, process_device, resolve_model_path

    device = process_device(args.device)

    # The output rule before the model loads: never the weights it reads, nor a folder (ladder/io/outputs.py).
    out = check_output(args.out, "sample", [resolve_model_path(args.model)], kind="file", force=args.force)
    model, tokenizer = load_model(args.model, device_map={"": device} if device != "cpu" else None)
    documents = math.ceil(args.tokens / args.length)
    started = time.perf_counter()
    # tokens sampled, their rate and the time left, as adapt's bar shows them; -q hides it
    bar = tqdm(total=documents * args.length, unit="tok", unit_scale=True, disable=not log.isEnabledFor(logging.INFO))
    with bar:
        sampled = sample_documents(model, tokenizer, documents, args.length, args.batch_size, args.seed, bar)
    lines = [json.dumps({"text": tokenizer.decode(ids)}) + "\n" for ids in sampled]
    out.parent.mkdir(parents=True, exist_ok=True)  # as every output folder of ladder's commands
    atomic_write(out, "".join(lines), replace=args.force)
    log.info(f"{out}: {documents} documents of {args.length} sampled tokens ({time.perf_counter() - started:.0f} s)")
    return 0
