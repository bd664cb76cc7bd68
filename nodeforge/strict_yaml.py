"""The one YAML loader for documents from outside: node.yaml, user-data, nodeforge.params URLs,
gang.yaml and the versions file.

On top of PyYAML's SafeLoader it refuses what lets a document mean something else than it
appears to say: a duplicate key (the error names the key and its line), anchors and aliases
(billion-laughs expansion, one value silently shared by two fields), merge keys (`<<`) and
explicit tags (`!!int 010` would bring octal back).

Scalars are typed by a narrow resolver: `true`/`false` (and YAML 1.1's yes/no/on/off),
`null`, decimal integers without a leading zero, and decimal floats. Everything YAML 1.1
would also turn into a number or a date stays the string it reads as: `2:00:00` (base 60,
7200), `010` (octal, 8), `0o10`, `0x1f`, `0b1`, `1_000`, `2024-01-01`. Each field's own
parser then decides what such a string means (nodeforge/scalars.py), with an error naming the
accepted forms.

Bounds come before the parse: the byte size, then one pass over the event stream (no node
is built; libyaml's C parser where PyYAML has it) that stops at the first alias, anchor, tag,
level past `max_depth` or node past `max_nodes`. Only a document within all of them is
composed, so a hostile document costs at most that one pass, never a RecursionError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    CollectionStartEvent,
    MappingStartEvent,
    NodeEvent,
    ScalarEvent,
)
from yaml.nodes import MappingNode
from yaml.resolver import BaseResolver

MAX_BYTES = 1 << 20  # node params are a few KiB; 1 MiB leaves room for hook lists and extra
# Params nest about 12 levels at most (extra: 8, under hooks/partitions/controller); the
# versions file 5, gang.yaml 3. 32 leaves room; YAML itself has no limit.
MAX_DEPTH = 32
# Nodes (scalars, keys and collections): `extra` alone may hold 10000 items (20000 nodes with
# their keys); a versions file or gang.yaml a few hundred.
MAX_NODES = 25000


@dataclass(frozen=True)
class Bounds:
    max_bytes: int = MAX_BYTES
    max_depth: int = MAX_DEPTH
    max_nodes: int = MAX_NODES


DEFAULT = Bounds()


class StrictYAMLError(ValueError):
    """A document breaks a strict rule; the message names the key or construct and the line."""


# PyYAML's YAML 1.1 resolvers, minus base 60, octal, hex, binary, '_' and timestamps. An int
# is at most 19 digits: a longer one stays a string (int() refuses > 4300 digits with a
# ValueError, and no field takes one).
_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]{0,18})\Z")
_FLOAT = re.compile(
    r"(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))\Z"
)
_BOOL = re.compile(
    r"(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)\Z"
)
_NULL = re.compile(r"(?:~|null|Null|NULL|)\Z")


class _Resolver(BaseResolver):
    pass


for _tag, _re, _first in (
    ("tag:yaml.org,2002:bool", _BOOL, "yYnNtTfFoO"),
    ("tag:yaml.org,2002:int", _INT, "-+0123456789"),
    ("tag:yaml.org,2002:float", _FLOAT, "-+0123456789."),
    ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:merge", re.compile(r"<<\Z"), "<"),  # resolved only to be refused
):
    _Resolver.add_implicit_resolver(_tag, _re, list(_first))


class _Constructor(SafeConstructor):
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


if getattr(yaml, "__with_libyaml__", False):
    from yaml.cyaml import CParser  # type: ignore[attr-defined]

    class _Loader(CParser, _Constructor, _Resolver):  # type: ignore[misc]
        def __init__(self, stream: Any) -> None:
            CParser.__init__(self, stream)
            _Constructor.__init__(self)
            _Resolver.__init__(self)

else:  # pure Python (slower, same rules and bounds)
    from yaml.composer import Composer
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Loader(Reader, Scanner, Parser, Composer, _Constructor, _Resolver):  # type: ignore[no-redef,misc]
        def __init__(self, stream: Any) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)
            Composer.__init__(self)
            _Constructor.__init__(self)
            _Resolver.__init__(self)


_LOADER: Any = _Loader  # (PyYAML's stubs list only its own loader classes)


def _check_size(text: str | bytes, bounds: Bounds) -> None:
    # Characters are at most as many as bytes: a long str is refused before it is encoded.
    size = len(text)
    if size <= bounds.max_bytes and isinstance(text, str):
        size = len(text.encode("utf-8", "surrogatepass"))
    if size > bounds.max_bytes:
        raise StrictYAMLError(f"{size} bytes; documents are limited to {bounds.max_bytes}")


def _events(text: str | bytes, bounds: Bounds, *, strict: bool) -> Any:
    """Yield the document's events, refusing what breaks *bounds* (and, when *strict*,
    aliases, anchors and tags) at the event where it shows, before anything is built. The
    error names the line and the field (the key path) where it showed."""
    nodes = 0
    # One entry per open collection: [is a mapping, next node is a key (mapping) or the next
    # index (sequence), the label of the current child]; only read to name a field.
    stack: list[list[Any]] = []
    events = yaml.parse(text, Loader=_LOADER)
    while True:
        try:
            event = next(events, None)
        except yaml.MarkedYAMLError as exc:
            # libyaml looks ahead over '[' / '{' and stops itself at 1000 levels: the same
            # refusal as ours, named the same way (at the last field the events reached).
            if "maximum nesting depth" not in str(exc.problem) or exc.problem_mark is None:
                raise
            line = f"line {exc.problem_mark.line + 1}"
            raise StrictYAMLError(
                f"{_where(line, stack)}: nested deeper than {bounds.max_depth} levels; "
                "documents are limited to that"
            ) from None
        if event is None:
            return
        if isinstance(event, CollectionEndEvent):
            stack.pop()
        elif isinstance(event, NodeEvent):
            nodes += 1
            if stack:
                top = stack[-1]
                if not top[0]:
                    top[2] = f"[{top[1]}]"
                    top[1] += 1
                elif top[1]:  # a key: it names the value that follows
                    top[2] = _label(event)
                    top[1] = False
                else:
                    top[1] = True
            if nodes > bounds.max_nodes:
                raise StrictYAMLError(
                    f"{_where(event, stack)}: more than {bounds.max_nodes} values; documents "
                    "are limited to that"
                )
            if strict:
                _refuse_sharing(event, _where(event, stack))
            if isinstance(event, CollectionStartEvent):
                is_map = isinstance(event, MappingStartEvent)
                stack.append([is_map, True if is_map else 0, ""])
                if len(stack) > bounds.max_depth:
                    raise StrictYAMLError(
                        f"{_where(event, stack[:-1])}: nested deeper than {bounds.max_depth} "
                        "levels; documents are limited to that"
                    )
        yield event


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _label(event: NodeEvent) -> str:
    if isinstance(event, ScalarEvent):
        v = event.value
        return v if _PLAIN_KEY.fullmatch(v) else repr(v[:40])
    return "?"


def _where(event: NodeEvent | str, stack: list[list[Any]]) -> str:
    mark = None if isinstance(event, str) else event.start_mark
    line = event if isinstance(event, str) else f"line {mark.line + 1 if mark else '?'}"
    path = ""
    for entry in stack:
        part = entry[2]
        if not part:  # a collection whose first child has not shown yet
            break
        path += part if part.startswith("[") or not path else "." + part
    if len(path) > 80:
        path = path[:60] + "..." + path[-17:]
    return f"{line}, {path}" if path else line


_YAML_TAG = "tag:yaml.org,2002:"


def _refuse_sharing(event: NodeEvent, line: str) -> None:
    if isinstance(event, AliasEvent):
        raise StrictYAMLError(f"{line}: alias *{event.anchor} is not allowed; write the value out")
    if event.anchor is not None:
        raise StrictYAMLError(f"{line}: anchor &{event.anchor} is not allowed; write the value out")
    tag = getattr(event, "tag", None)
    # "!" (non-specific) only says "a string"; any other tag retypes the value.
    if tag is not None and not (isinstance(event, ScalarEvent) and tag == "!"):
        short = "!!" + tag[len(_YAML_TAG) :] if tag.startswith(_YAML_TAG) else tag
        raise StrictYAMLError(
            f"{line}: tag {short} is not allowed; write the plain value "
            "(quote it to make it a string)"
        )


def load(text: str | bytes, bounds: Bounds = DEFAULT) -> Any:
    """Parse one YAML document strictly. Raises StrictYAMLError or yaml.YAMLError."""
    _check_size(text, bounds)
    for _ in _events(text, bounds, strict=True):
        pass
    try:
        return yaml.load(text, Loader=_LOADER)
    except RecursionError:  # unreachable within the bounds above; never a traceback anyway
        raise StrictYAMLError(f"nested deeper than {bounds.max_depth} levels") from None


def top_level_keys(text: str | bytes, bounds: Bounds = DEFAULT) -> frozenset[str] | None:
    """The plain scalar keys of a document's top-level mapping (None if it is not a mapping),
    without building it. Anchors, aliases and tags are allowed here (the document may be
    another tool's); the bounds are not. Raises StrictYAMLError or yaml.YAMLError."""
    _check_size(text, bounds)
    keys: set[str] = set()
    depth = 0
    is_key = True
    root = False
    for event in _events(text, bounds, strict=False):
        if isinstance(event, CollectionEndEvent):
            depth -= 1
            continue
        if not isinstance(event, NodeEvent):
            continue
        if not root:
            root = True
            if not isinstance(event, MappingStartEvent):
                return None
            depth = 1
            continue
        if depth == 1:
            if is_key and isinstance(event, ScalarEvent):
                keys.add(event.value)
            is_key = not is_key
        if isinstance(event, CollectionStartEvent):
            depth += 1
    return frozenset(keys) if root else None
