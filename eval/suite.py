"""Evaluation suites: a small YAML file naming lm-eval tasks with their few-shot and item limits.

    description: what the suite is for
    offline: true          # every task reads local files: run with the Hub switched off
    tasks:
      - task: ladder_piqa  # an lm-eval task, group or tag name
        num_fewshot: 0     # optional; default: the task's own setting
        every: 5           # optional; score items 0, 5, 10, ...: a spread-out subset
        limit: 100         # optional; at most this many items (after `every`); default: all

The shipped suites live in eval/suites/; `--suite` takes one of their names or a path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ladder.errors import UsageError, first_line

SUITES_DIR = Path(__file__).parent / "suites"

_SUITE_KEYS = {"description", "offline", "tasks"}
_TASK_KEYS = {"task", "num_fewshot", "every", "limit"}


@dataclass(frozen=True)
class SuiteTask:
    task: str
    num_fewshot: int | None = None
    limit: int | None = None
    every: int = 1


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    offline: bool
    tasks: tuple[SuiteTask, ...]

    def with_limit(self, limit: int | None) -> Suite:
        """The suite with every task capped at `limit` items (a task's own smaller limit stays)."""
        if limit is None:
            return self
        capped = tuple(
            SuiteTask(t.task, t.num_fewshot, limit if t.limit is None else min(t.limit, limit), t.every)
            for t in self.tasks
        )
        return Suite(self.name, self.description, self.offline, capped)


def suite_names() -> list[str]:
    return sorted(path.stem for path in SUITES_DIR.glob("*.yaml"))


def _natural(value, key: str, where: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise UsageError(f"{where}: {key} must be {kind}, got {value!r}")
    return value


def parse_suite(data, name: str) -> Suite:
    """Validate a suite's parsed YAML; errors name the suite, the entry and the key."""
    if not isinstance(data, dict):
        raise UsageError(f"suite {name}: expected a mapping with keys {sorted(_SUITE_KEYS)}")
    if unknown := set(data) - _SUITE_KEYS:
        raise UsageError(f"suite {name}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_SUITE_KEYS)}")
    entries = data.get("tasks")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"suite {name}: `tasks` must be a non-empty list")
    offline = data.get("offline", False)
    if not isinstance(offline, bool):
        raise UsageError(f"suite {name}: offline must be true or false, got {offline!r}")
    tasks = []
    for position, entry in enumerate(entries, 1):
        where = f"suite {name}, task {position}"
        if isinstance(entry, str):
            entry = {"task": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("task"), str) or not entry["task"]:
            raise UsageError(f"{where}: expected a task name or a mapping with a `task` name")
        if unknown := set(entry) - _TASK_KEYS:
            raise UsageError(f"{where} ({entry['task']}): unknown key(s) {sorted(unknown)}; allowed: {sorted(_TASK_KEYS)}")
        where = f"{where} ({entry['task']})"
        tasks.append(
            SuiteTask(
                task=entry["task"],
                num_fewshot=_natural(entry.get("num_fewshot"), "num_fewshot", where, 0),
                limit=_natural(entry.get("limit"), "limit", where, 1),
                every=_natural(entry.get("every", 1), "every", where, 1),
            )
        )
    names = [t.task for t in tasks]
    if duplicates := sorted({n for n in names if names.count(n) > 1}):
        raise UsageError(f"suite {name}: task(s) listed twice: {duplicates}")
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
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UsageError(f"suite file {path} is not valid YAML: {first_line(error)}") from None
    return parse_suite(data, path.stem)
