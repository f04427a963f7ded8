"""Evaluation suites: a small YAML file naming lm-eval tasks with their settings (its format:
docs/eval.md#suites). The shipped suites live in eval/suites/."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from ladder.errors import UsageError, excerpt
from ladder.io.yaml_files import load_yaml_file

SUITES_DIR = Path(__file__).parent / "suites"
TASKS_DIR = Path(__file__).parent / "tasks"  # our task YAMLs, each named as its task

Count = Annotated[StrictInt, Field(ge=1)]


class SuiteTask(BaseModel):
    """One task of a suite, as its YAML entry gives it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    task: Annotated[StrictStr, Field(min_length=1)]
    num_fewshot: Annotated[StrictInt, Field(ge=0)] | None = None
    limit: Count | None = None
    every: Count = 1
    # A share of the items (lm-eval's --limit below 1): ceil(fraction x the items `every` picks).
    fraction: Annotated[float, Field(gt=0, lt=1)] | None = None
    # lm-eval's chat options (simple_evaluate's arguments of the same names).
    apply_chat_template: StrictBool | Annotated[StrictStr, Field(min_length=1)] = False
    fewshot_as_multiturn: StrictBool = False
    system_instruction: StrictStr | None = None
    gen_kwargs: dict[StrictStr, StrictStr | StrictBool | StrictInt | float | list] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _turns_need_the_template(self) -> SuiteTask:
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError("fewshot_as_multiturn needs apply_chat_template (the turns are chat messages)")
        return self

    def chat_options(self) -> dict:
        options = self.model_dump(include={"apply_chat_template", "fewshot_as_multiturn", "system_instruction"})
        return {**options, "gen_kwargs": self.gen_kwargs or None}

    def describe(self) -> str:
        settings = []
        if self.num_fewshot:
            settings.append(f"{self.num_fewshot}-shot")
        if self.every > 1:
            settings.append(f"one item in {self.every}")
        if self.fraction is not None:
            settings.append(f"a share of {self.fraction:g}")
        if self.limit:
            settings.append(f"at most {self.limit}")
        if self.apply_chat_template:
            template = "" if self.apply_chat_template is True else f" {self.apply_chat_template}"
            settings.append(f"chat template{template}" + (", few-shot as turns" if self.fewshot_as_multiturn else ""))
        if self.system_instruction:
            settings.append("system instruction")
        if self.gen_kwargs:
            settings.append(", ".join(f"{key}={value}" for key, value in self.gen_kwargs.items()))
        return f"{self.task} ({', '.join(settings)})" if settings else self.task

    def item_indices(self, size: int) -> list[int]:
        """Every `every`-th item, the `fraction` of those (rounded up, as lm-eval does), at most `limit`."""
        picked = list(range(0, size, self.every))
        if self.fraction is not None:
            picked = picked[: math.ceil(self.fraction * len(picked))]
        return picked[: self.limit]


class _SuiteFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str = ""
    offline: StrictBool = False  # every task reads local files: run with the Hub switched off
    tasks: Annotated[list, Field(min_length=1)]


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    offline: bool
    tasks: tuple[SuiteTask, ...]

    def with_limit(self, limit: int | float | None) -> Suite:
        """Every task capped at `limit` items, or that share below 1; a task's own smaller limit stays."""
        if limit is None:
            return self
        key = "fraction" if isinstance(limit, float) else "limit"
        capped = (min(limit, getattr(t, key) or limit) for t in self.tasks)
        return replace(self, tasks=tuple(t.model_copy(update={key: value}) for t, value in zip(self.tasks, capped)))

    def with_options(self, **given) -> Suite:
        """Every task with the command line's lm-eval settings (SuiteTask's names; None: the suite's own)."""
        if given.get("apply_chat_template") is False and given.get("fewshot_as_multiturn") is None:
            given["fewshot_as_multiturn"] = False  # plain prompts have no turns
        given = {key: value for key, value in given.items() if value is not None}
        if not given:
            return self
        where = "with the command-line options"
        tasks = tuple(_task({**t.model_dump(), **given}, f"suite {self.name} ({t.task}) {where}") for t in self.tasks)
        return replace(self, tasks=tasks)


def suite_names() -> list[str]:
    return sorted(path.stem for path in SUITES_DIR.glob("*.yaml"))


def _validated(model: type[BaseModel], data: object, where: str) -> BaseModel:
    """pydantic's first fault as one UsageError line naming `where` and the key."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        fault = error.errors()[0]
        key = str(fault["loc"][0]) if fault["loc"] else ""
        if fault["type"] == "extra_forbidden":
            raise UsageError(f"{where}: unknown key {excerpt(key)}; allowed: {sorted(model.model_fields)}") from None
        message = fault["msg"].removeprefix("Value error, ")
        value = f"{key} = {excerpt(fault['input'])}: " if key else ""
        raise UsageError(f"{where}: {value}{message[0].lower()}{message[1:]}") from None


def _task(entry: object, where: str) -> SuiteTask:
    return _validated(SuiteTask, {"task": entry} if isinstance(entry, str) else entry, where)


def parse_suite(data, name: str) -> Suite:
    if not isinstance(data, dict):
        raise UsageError(f"suite {name}: expected a mapping with keys {sorted(_SuiteFile.model_fields)}")
    suite = _validated(_SuiteFile, data, f"suite {name}")
    tasks = []
    for position, entry in enumerate(suite.tasks, 1):
        named = f" ({entry.get('task')})" if isinstance(entry, dict) and isinstance(entry.get("task"), str) else ""
        tasks.append(_task(entry, f"suite {name}, task {position}{named}"))
    names = [t.task for t in tasks]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise UsageError(f"suite {name}: task(s) listed twice: {excerpt(duplicates)}")
    return Suite(name=name, description=suite.description, offline=suite.offline, tasks=tuple(tasks))


def load_suite(name_or_path: str) -> Suite:
    path = Path(name_or_path).expanduser()
    if path.suffix not in (".yaml", ".yml"):
        path = SUITES_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise UsageError(
                f"unknown suite {name_or_path!r}: choose from {', '.join(suite_names())} or give a suite .yaml file"
            )
    elif not path.is_file():
        raise UsageError(f"suite file {path} does not exist")
    return parse_suite(load_yaml_file(path, "suite file"), path.stem)


def tasks_suite(names: str) -> Suite:
    """A suite of `--tasks` names, each with its own settings; offline when all are ours."""
    tasks = [name.strip() for name in names.split(",")]
    if not all(tasks):
        raise UsageError(f"--tasks {excerpt(names)}: expected task names separated by commas")
    offline = all((TASKS_DIR / f"{task}.yaml").is_file() for task in tasks)
    name = tasks[0] if len(tasks) == 1 else "tasks"
    return parse_suite({"description": f"--tasks {','.join(tasks)}", "offline": offline, "tasks": tasks}, name)
