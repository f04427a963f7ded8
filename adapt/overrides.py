"""`key=value` overrides on a recipe's raw mapping, before it is typed: the value parsed as YAML, the
key dotted (a number addresses a list item: `data.train.0.max_tokens` or `data.train[0].max_tokens`)."""

from __future__ import annotations

import re
from typing import Any

import yaml

from ladder.errors import UsageError, excerpt
from ladder.io.yaml_files import UnboundedYAML, parse_yaml


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    pairs = []
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"override {excerpt(item)} is not key=value (e.g. optimizer.lr=1e-4)")
        try:
            value = parse_yaml(text) if text.strip() else ""
        except UnboundedYAML as error:
            raise UsageError(f"override {key.strip()}: {error}") from None
        except yaml.YAMLError:
            value = text
        pairs.append((key.strip(), value))
    return pairs


def set_dotted(raw: dict, key: str, value: Any) -> None:
    """Set the dotted `key` in the raw recipe. A list item written as a bare string (a source's path)
    becomes a mapping when one of its keys is set; the index one past the end appends an item."""
    node: dict | list = raw
    parts = re.sub(r"\[(\d+)\]", r".\1", key).split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[: depth + 1])
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit():
                raise UsageError(f"override {key}: {'.'.join(parts[:depth])} is a list; address its items by number")
            index = int(part)
            if index > len(node):
                raise UsageError(
                    f"override {key}: {'.'.join(parts[:depth])} has {len(node)} item(s); "
                    f"{index} is past the end (use {len(node)} to add one)"
                )
            if index == len(node):
                node.append({})
            if last:
                node[index] = value
                return
            if isinstance(node[index], str):
                node[index] = {"path": node[index]}  # a source written as just its path
            child = node[index]
        else:
            if last:
                node[part] = value
                return
            child = node.setdefault(part, [] if parts[depth + 1].isdigit() else {})
        if not isinstance(child, (dict, list)):
            raise UsageError(f"override {key}: {where} is not a section")
        node = child
