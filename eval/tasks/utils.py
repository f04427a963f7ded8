"""Datasets and doc processing for the offline lm-eval tasks in this folder.

Each task YAML names a loader here as its `custom_dataset` and lists every file it reads in
`dataset_kwargs.data_files`, so that `ladder eval`'s cache key can hash their content.
The data folder is `metadata["data_dir"]` when given (`ladder eval --data`), else `ladder_data_dir()`.
Prompt formatting reuses the stock tasks' own functions, so formats cannot drift apart.
"""

from __future__ import annotations

import bz2
import json
import re
from pathlib import Path

import datasets
from lm_eval.tasks.hellaswag.utils import preprocess as hellaswag_preprocess
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results as wikitext_process_results  # noqa: F401
from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer  # noqa: F401

from ladder.io.files import ladder_data_dir


def data_file(relative: str, data_dir: str | None = None) -> Path:
    """A file of the data folder; a missing file is a FileNotFoundError naming it and the fix."""
    root = Path(data_dir).expanduser() if data_dir else ladder_data_dir()
    path = root / relative
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} is missing: point --data or $LADDER_DATA at the shared data folder")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _wikitext_pages(path: Path) -> list[dict]:
    """Split a raw WikiText file into articles exactly as EleutherAI/wikitext_document_level does:
    a top-level heading ` = Title = ` starts a new page. Text mode turns the files' CRLF into LF."""
    pages, lines = [], []
    for line in path.read_text(encoding="utf-8").split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            page = "\n".join(lines)
            if page.strip():
                pages.append({"page": page})
            lines = []
        lines.append(line)
    pages.append({"page": "\n".join(lines)})
    return pages


def load_wikitext(data_files: dict, data_dir: str | None = None, **_metadata) -> datasets.DatasetDict:
    # The 4,358-line test file has the blank separator lines of the original zip; the 2,891-line
    # copy lacks them and would give other token counts (see the data README).
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(_wikitext_pages(data_file(data_files[split], data_dir)))
            for split in ("validation", "test")
        }
    )


def load_piqa(data_files: dict, data_dir: str | None = None, **_metadata) -> datasets.DatasetDict:
    records = _read_jsonl(data_file(data_files["validation"], data_dir))
    labels_path = data_file(data_files["validation_labels"], data_dir)
    labels = [int(line) for line in labels_path.read_text().split()]
    if len(labels) != len(records):
        raise ValueError(f"{labels_path} has {len(labels)} labels for {len(records)} PIQA items")
    records = [{**record, "label": label} for record, label in zip(records, labels)]
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(records)})


def load_jsonl(data_files: dict, data_dir: str | None = None, **_metadata) -> datasets.DatasetDict:
    """Every split of `data_files`, a JSON-lines file each (ARC, LAMBADA)."""
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list(_read_jsonl(data_file(relative, data_dir)))
            for split, relative in data_files.items()
        }
    )


# The last sentence of an ActivityNet context: a lowercase fragment with no closing punctuation.
_UNFINISHED_SENTENCE = re.compile(r"(^|(?<=[.!?] ))([a-z][^.!?]*)$")


def load_hellaswag(data_files: dict, data_dir: str | None = None, **_metadata) -> datasets.DatasetDict:
    """The llama.cpp text layout, six lines per item (`label: context`, gold index, four endings), with
    the fields the stock `hellaswag` process_docs adds (here, once: lm-eval asks a task for its docs a
    dozen times per evaluation). The layout keeps `ctx` whole, so the stock `ctx_b.capitalize()` is
    redone on the unfinished last sentence, which is ctx_b."""
    path = data_file(data_files["validation"], data_dir)
    with bz2.open(path, "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise ValueError(f"{path}: {len(lines)} lines is not a whole number of 6-line HellaSwag items")
    records = []
    for i in range(0, len(lines), 6):
        context, label, endings = lines[i], int(lines[i + 1]), lines[i + 2 : i + 6]
        query = hellaswag_preprocess(_UNFINISHED_SENTENCE.sub(lambda match: match.group(2).capitalize(), context))
        choices = [hellaswag_preprocess(ending) for ending in endings]
        records.append(dict(context=context, label=label, endings=endings, query=query, choices=choices, gold=label))
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(records)})
