"""The models of a run as the user named them (`ModelRef`) and what scoring them gave (`ModelResults`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import TemplateError

from ladder.chat_template import PROBE_CHAT, TemplateWorker
from ladder.errors import UsageError, first_line
from ladder.io.loading import check_checkpoint, load_tokenizer, model_name, resolve_model_path

from .suite import Suite


@dataclass(frozen=True)
class ModelRef:
    spec: str
    path: Path
    label: str


@dataclass
class ModelResults:
    model: ModelRef
    fingerprint: str
    tasks: dict[str, dict] = field(default_factory=dict)  # suite task name -> task record
    cached: list[str] = field(default_factory=list)  # suite task names read from the cache

    def provenance(self) -> dict:
        spec, path = self.model.spec, str(self.model.path)
        return {"model": spec, "path": path, "fingerprint_sha256": self.fingerprint, "cached_tasks": self.cached}


def resolve_models(specs: list[str]) -> list[ModelRef]:
    """Models as `resolve_model_path` names them, each optionally `LABEL=MODEL`, with distinct labels."""
    refs = []
    for spec in specs:
        label, sep, model = spec.partition("=")
        if not sep or Path(spec).exists():
            label, model = "", spec
        elif not label:
            raise UsageError(f"model {spec!r}: the label before '=' is empty")
        path = resolve_model_path(model).resolve()
        check_checkpoint(path)  # before anything reads it: another model_type may ship code
        refs.append(ModelRef(model, path, label or model_name(path)))
    labels = [ref.label for ref in refs]
    return [
        ModelRef(ref.spec, ref.path, f"{ref.label} #{i + 1}") if labels.count(ref.label) > 1 else ref
        for i, ref in enumerate(refs)
    ]


def check_chat_templates(models: list[ModelRef], suite: Suite) -> None:
    """Every model has a chat template that renders a short chat within its limits, where the suite
    applies one: said before anything is scored. Other failures are left to the prompt that meets it."""
    if not any(task.apply_chat_template for task in suite.tasks):
        return
    with TemplateWorker() as worker:
        for ref in models:
            worker.owner, tokenizer = f"{ref.label} ({ref.path})", load_tokenizer(ref.path)
            templates = tokenizer.chat_template
            if not templates:
                raise UsageError(
                    f"{ref.label} ({ref.path}) has no chat template: drop --apply-chat-template (or the suite's "
                    "apply_chat_template) for a base model"
                )
            for template in templates.values() if isinstance(templates, dict) else [templates]:
                with contextlib.suppress(TemplateError):
                    worker.render(template, PROBE_CHAT, add_generation_prompt=True, **tokenizer.special_tokens_map)


def bound_chat_template(lm, worker: TemplateWorker, chat_template: bool | str) -> None:
    """lm-eval's `lm.apply_chat_template` (unbounded) rendered in `worker` instead: a prompt past its
    limits, or failed even without the system message (lm-eval's retry), is one line."""
    template = lm.chat_template(chat_template)
    options = {**lm.tokenizer.special_tokens_map, **getattr(lm, "chat_template_args", {})}

    def apply_chat_template(chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        for chat in (chat_history, [message for message in chat_history if message["role"] != "system"]):
            try:
                return worker.render(
                    template,
                    chat,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=not add_generation_prompt,
                    **options,
                )
            except TemplateError as error:
                failure = first_line(error)
        raise UsageError(f"the chat template of {worker.owner} failed on a prompt: {failure}")

    lm.apply_chat_template = apply_chat_template


def lm_eval_json(results: ModelResults) -> dict:
    """One model's results in lm-eval's layout, merged over the suite's tasks."""
    merged: dict = {}
    for record in results.tasks.values():
        for key, value in record.items():
            if key in ("per_item", "aggregations"):
                continue
            if isinstance(value, dict) and key != "config":
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    merged["ladder"] = {
        **results.provenance(),
        # Per suite task: they may differ between tasks, unlike the rest of lm-eval's `config`.
        "chat_options": {task: record.get("config", {}).get("chat") for task, record in results.tasks.items()},
    }
    return merged


def file_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
