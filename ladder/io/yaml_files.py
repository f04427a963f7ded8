"""YAML the way every command reads it: safe types only, and bounded. Through aliases a few hundred
bytes can describe 9^12 values ("billion laughs"), which anything that walks them fills memory with:
`BoundedLoader` refuses a document that expands past `MAX_EXPANDED_NODES` while composing it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ladder.errors import UsageError, first_line

# Far above any recipe or suite (a few hundred nodes), far below what fills memory.
MAX_EXPANDED_NODES = 100_000
MAX_FILE_BYTES = 16 << 20


class UnboundedYAML(yaml.YAMLError):
    """Past MAX_EXPANDED_NODES through aliases, an alias inside its own anchor, or nested too deep."""


class BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self._expanded: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded

    def compose_node(self, parent, index):
        alias = self.check_event(yaml.AliasEvent)
        node = super().compose_node(parent, index)
        if alias:  # its anchor's node, counted already (unless it is open)
            self._size_of(node)
            return node
        children = node.value if isinstance(node, yaml.SequenceNode) else []
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        self._expanded[id(node)] = size = 1 + sum(self._size_of(child) for child in children)
        if size > MAX_EXPANDED_NODES:
            raise UnboundedYAML(
                f"its aliases expand it past {MAX_EXPANDED_NODES:,} values (line {node.start_mark.line + 1}); "
                "write the values out, or use fewer aliases"
            )
        return node

    def _size_of(self, node) -> int:
        if id(node) not in self._expanded:  # still being composed: an alias inside its own anchor
            raise UnboundedYAML(f"an alias refers to a value that contains it (line {node.start_mark.line + 1})")
        return self._expanded[id(node)]


def parse_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=BoundedLoader)  # a SafeLoader: safe types only
    except RecursionError:  # PyYAML composes and builds nested values recursively
        raise UnboundedYAML("it nests values too deeply") from None


def load_yaml_file(path: Path, what: str) -> Any:
    """The YAML file at `path`, or one UsageError line that names it as `what` (e.g. "recipe")."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise UsageError(f"{what} {path} is {size:,} bytes; a YAML file here holds at most {MAX_FILE_BYTES:,}")
        return parse_yaml(path.read_text())
    except yaml.YAMLError as error:
        raise UsageError(f"{what} {path} is not valid YAML: {first_line(error)}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {what} {path}: {first_line(error)}") from None
