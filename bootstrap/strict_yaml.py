"""The one YAML loader for untrusted documents (node.yaml, user-data, nodeforge.params URLs).

On top of PyYAML's SafeLoader it refuses what lets a document mean something else than it
appears to say: a duplicate key (the error names the key and its line), anchors and aliases
(billion-laughs expansion, one value silently shared by two fields), merge keys (`<<`), and
documents larger than MAX_BYTES. Scalars keep YAML 1.1 typing; the params validator then
checks every value (for instance it refuses `.nan` and `.inf` as numbers).
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent, CollectionStartEvent, ScalarEvent
from yaml.nodes import MappingNode

MAX_BYTES = 1 << 20  # node params are a few KiB; 1 MiB leaves room for hook lists and extra


class StrictYAMLError(ValueError):
    """A document breaks a strict rule; the message names the key or construct and the line."""


class _StrictLoader(yaml.SafeLoader):
    def compose_node(self, parent: Any, index: Any) -> Any:  # type: ignore[override]
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, AliasEvent):
            raise StrictYAMLError(
                f"line {line}: alias *{event.anchor} is not allowed; write the value out"
            )
        if isinstance(event, (ScalarEvent, CollectionStartEvent)) and event.anchor is not None:
            raise StrictYAMLError(
                f"line {line}: anchor &{event.anchor} is not allowed; write the value out"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:  # type: ignore[override]
        if not isinstance(node, MappingNode):
            raise ConstructorError(
                None, None, f"expected a mapping, found {node.id}", node.start_mark
            )
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise StrictYAMLError(
                    f"line {key_node.start_mark.line + 1}: merge key '<<' is not allowed"
                )
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise StrictYAMLError(
                    f"line {key_node.start_mark.line + 1}: a mapping key must be a plain value"
                ) from None
            line = key_node.start_mark.line + 1
            if key in seen:
                raise StrictYAMLError(
                    f"line {line}: duplicate key {key!r} (first on line {seen[key]}); keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load(text: str | bytes) -> Any:
    """Parse one YAML document strictly. Raises StrictYAMLError or yaml.YAMLError."""
    size = len(text.encode() if isinstance(text, str) else text)
    if size > MAX_BYTES:
        raise StrictYAMLError(f"{size} bytes; params documents are limited to {MAX_BYTES}")
    return yaml.load(text, Loader=_StrictLoader)
