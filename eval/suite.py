"""Evaluation suites: a small YAML file naming lm-eval tasks with their few-shot and item limits.

    description: what the suite is for
    offline: true          # every task reads local files: run with the Hub switched off
    tasks:
      - task: ladder_piqa  # an lm-eval task, group or tag name
        num_fewshot: 0     # optional; default: the task's own setting
        every: 5           # optional; score items 0, 5, 10, ...: a spread-out subset
        limit: 100         # optional; at most this many items (after `every`); default: all
        # lm-eval's chat options, for instruct models (optional; `ladder eval` flags override them):
        apply_chat_template: true    # render prompts with the tokenizer's chat template (or a template name)
        fewshot_as_multiturn: true   # few-shot examples as alternating user/assistant turns
        system_instruction: "..."    # a system message before the prompt
        gen_kwargs: {max_gen_toks: 512}   # generation settings of a generating task

The shipped suites live in eval/suites/; `--suite` takes one of their names or a path.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ladder.errors import UsageError, excerpt
from ladder.io.yaml_files import load_yaml_file

SUITES_DIR = Path(__file__).parent / "suites"
TASKS_DIR = Path(__file__).parent / "tasks"  # our task YAMLs, each named as its task

_SUITE_KEYS = {"description", "offline", "tasks"}
_CHAT_KEYS = {"apply_chat_template", "fewshot_as_multiturn", "system_instruction", "gen_kwargs"}
_TASK_KEYS = {"task", "num_fewshot", "every", "limit"} | _CHAT_KEYS


@dataclass(frozen=True)
class SuiteTask:
    task: str
    num_fewshot: int | None = None
    limit: int | None = None
    every: int = 1
    # A share of the items (lm-eval's --limit below 1): ceil(fraction x the items `every` picks).
    fraction: float | None = None
    # lm-eval's chat options (simple_evaluate's arguments of the same names).
    apply_chat_template: bool | str = False
    fewshot_as_multiturn: bool = False
    system_instruction: str | None = None
    gen_kwargs: tuple[tuple[str, object], ...] = ()  # sorted (key, value) pairs: hashable, one order

    def chat_options(self) -> dict:
        """simple_evaluate's keyword arguments for this task's chat options."""
        return {
            "apply_chat_template": self.apply_chat_template,
            "fewshot_as_multiturn": self.fewshot_as_multiturn,
            "system_instruction": self.system_instruction,
            "gen_kwargs": self.gen_kwargs_dict() or None,
        }

    def gen_kwargs_dict(self) -> dict:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in self.gen_kwargs}

    def as_dict(self) -> dict:
        return {**asdict(self), "gen_kwargs": self.gen_kwargs_dict()}

    def item_indices(self, size: int) -> list[int]:
        """The items scored of a leaf task of `size` items: every `every`-th, the `fraction` of
        those (rounded up, as lm-eval rounds its fractional limit), then at most `limit`."""
        picked = list(range(0, size, self.every))
        if self.fraction is not None:
            picked = picked[: math.ceil(self.fraction * len(picked))]
        return picked[: self.limit]


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    offline: bool
    tasks: tuple[SuiteTask, ...]

    def with_limit(self, limit: int | float | None) -> Suite:
        """The suite with every task capped at `limit` items, or at that share of them for a
        fraction below 1 (as lm-eval's --limit); a task's own smaller limit stays."""
        if limit is None:
            return self
        if isinstance(limit, float):
            capped = tuple(
                replace(t, fraction=limit if t.fraction is None else min(t.fraction, limit)) for t in self.tasks
            )
        else:
            capped = tuple(replace(t, limit=limit if t.limit is None else min(t.limit, limit)) for t in self.tasks)
        return replace(self, tasks=capped)

    def with_chat(
        self,
        apply_chat_template: bool | str | None = None,
        fewshot_as_multiturn: bool | None = None,
        system_instruction: str | None = None,
        gen_kwargs: dict | None = None,
    ) -> Suite:
        """The suite with the chat options that are not None set on every task (command-line flags)."""
        given = {
            "apply_chat_template": apply_chat_template,
            "fewshot_as_multiturn": fewshot_as_multiturn,
            "system_instruction": system_instruction,
            "gen_kwargs": None if gen_kwargs is None else _gen_kwargs_pairs(gen_kwargs),
        }
        if apply_chat_template is False and fewshot_as_multiturn is None:
            given["fewshot_as_multiturn"] = False  # plain prompts have no turns
        given = {key: value for key, value in given.items() if value is not None}
        if not given:
            return self
        tasks = tuple(replace(t, **given) for t in self.tasks)
        for task in tasks:
            _check_chat(task, f"suite {self.name} ({task.task}) with the command-line chat options")
        return replace(self, tasks=tasks)


def suite_names() -> list[str]:
    return sorted(path.stem for path in SUITES_DIR.glob("*.yaml"))


def _natural(value, key: str, where: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise UsageError(f"{where}: {key} must be {kind}, got {excerpt(value)}")
    return value


def _check_chat(task: SuiteTask, where: str) -> None:
    if task.fewshot_as_multiturn and not task.apply_chat_template:
        raise UsageError(f"{where}: fewshot_as_multiturn needs apply_chat_template (the turns are chat messages)")


def _chat_options(entry: dict, where: str) -> dict:
    """The chat keys of a suite entry, type-checked."""
    options = {}
    template = entry.get("apply_chat_template", False)
    if not isinstance(template, (bool, str)) or template == "":
        raise UsageError(
            f"{where}: apply_chat_template must be true, false or a template name, got {excerpt(template)}"
        )
    options["apply_chat_template"] = template
    multiturn = entry.get("fewshot_as_multiturn", False)
    if not isinstance(multiturn, bool):
        raise UsageError(f"{where}: fewshot_as_multiturn must be true or false, got {excerpt(multiturn)}")
    options["fewshot_as_multiturn"] = multiturn
    system = entry.get("system_instruction")
    if system is not None and not isinstance(system, str):
        raise UsageError(f"{where}: system_instruction must be a string, got {excerpt(system)}")
    options["system_instruction"] = system
    gen_kwargs = entry.get("gen_kwargs") or {}
    if not isinstance(gen_kwargs, dict) or not all(
        isinstance(key, str) and isinstance(value, (str, int, float, bool, list)) for key, value in gen_kwargs.items()
    ):
        raise UsageError(f"{where}: gen_kwargs must be a mapping of generation settings, got {excerpt(gen_kwargs)}")
    options["gen_kwargs"] = _gen_kwargs_pairs(gen_kwargs)
    return options


def _gen_kwargs_pairs(gen_kwargs: dict) -> tuple[tuple[str, object], ...]:
    return tuple(sorted((key, tuple(v) if isinstance(v, list) else v) for key, v in gen_kwargs.items()))


def parse_suite(data, name: str) -> Suite:
    """Validate a suite's parsed YAML; errors name the suite, the entry and the key."""
    if not isinstance(data, dict):
        raise UsageError(f"suite {name}: expected a mapping with keys {sorted(_SUITE_KEYS)}")
    if unknown := set(data) - _SUITE_KEYS:
        raise UsageError(
            f"suite {name}: unknown key(s) {excerpt(sorted(map(str, unknown)))}; allowed: {sorted(_SUITE_KEYS)}"
        )
    entries = data.get("tasks")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"suite {name}: `tasks` must be a non-empty list")
    offline = data.get("offline", False)
    if not isinstance(offline, bool):
        raise UsageError(f"suite {name}: offline must be true or false, got {excerpt(offline)}")
    tasks = []
    for position, entry in enumerate(entries, 1):
        where = f"suite {name}, task {position}"
        if isinstance(entry, str):
            entry = {"task": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("task"), str) or not entry["task"]:
            raise UsageError(f"{where}: expected a task name or a mapping with a `task` name")
        if unknown := set(entry) - _TASK_KEYS:
            raise UsageError(
                f"{where} ({entry['task']}): unknown key(s) {excerpt(sorted(map(str, unknown)))}; allowed: {sorted(_TASK_KEYS)}"
            )
        where = f"{where} ({entry['task']})"
        task = SuiteTask(
            task=entry["task"],
            num_fewshot=_natural(entry.get("num_fewshot"), "num_fewshot", where, 0),
            limit=_natural(entry.get("limit"), "limit", where, 1),
            every=_natural(entry.get("every", 1), "every", where, 1),
            **_chat_options(entry, where),
        )
        _check_chat(task, where)
        tasks.append(task)
    names = [t.task for t in tasks]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise UsageError(f"suite {name}: task(s) listed twice: {excerpt(duplicates)}")
    return Suite(name=name, description=str(data.get("description", "")), offline=offline, tasks=tuple(tasks))


def load_suite(name_or_path: str) -> Suite:
    """A shipped suite by name (`smoke`, `offline`, `paper`) or a suite YAML file by path."""
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
    """A suite of the comma-separated task names `names` (as `lm_eval --tasks` takes them: ours,
    stock lm-eval tasks, groups or tags), each with its own settings; offline when all are ours."""
    tasks = [name.strip() for name in names.split(",")]
    if not all(tasks):
        raise UsageError(f"--tasks {excerpt(names)}: expected task names separated by commas")
    if duplicates := sorted({t for t in tasks if tasks.count(t) > 1}):
        raise UsageError(f"--tasks: task(s) listed twice: {excerpt(duplicates)}")
    offline = all((TASKS_DIR / f"{task}.yaml").is_file() for task in tasks)
    return Suite(
        name=tasks[0] if len(tasks) == 1 else "tasks",
        description=f"--tasks {','.join(tasks)}",
        offline=offline,
        tasks=tuple(SuiteTask(task) for task in tasks),
    )
