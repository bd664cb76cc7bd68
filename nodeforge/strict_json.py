"""Bounds for a JSON document from outside (HyperPod's files), checked before the parse.

`json.loads` recurses once per nesting level (a RecursionError past ~1000) and builds every
value before anyone looks at it. So the size, the nesting depth and a lower bound on the
number of values are checked first, on the text with its strings blanked out (C-speed regex
work): refusing a hostile megabyte costs milliseconds. An integer of more than 19 digits is
refused while parsing (int() raises a plain ValueError past 4300 digits).
"""

from __future__ import annotations

import re

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
# A HyperPod resource_config.json lists every instance (about 10 values each): 200000 values
# is ~20000 instances, more than a 1 MiB file holds anyway.
MAX_VALUES = 200_000
MAX_INT_DIGITS = 19

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class BoundsError(ValueError):
    """The document is larger, deeper or has more values than its bounds; says which."""


def check(text: str) -> None:
    """Raise BoundsError if *text* is over the bounds; a malformed document passes (the
    parser reports it)."""
    size = len(text)
    if size <= MAX_BYTES:
        size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise BoundsError(f"{size} bytes; documents are limited to {MAX_BYTES}")
    bare = _STRING.sub('""', text)
    # Each ',' separates two values, so values >= commas: never more than the document holds.
    if bare.count(",") > MAX_VALUES:
        raise BoundsError(f"more than {MAX_VALUES} values; documents are limited to that")
    brackets = _NOT_BRACKET.sub("", bare)
    if len(brackets) > 2 * MAX_VALUES:
        raise BoundsError(f"more than {MAX_VALUES} values; documents are limited to that")
    depth = 0
    for ch in brackets:
        if ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise BoundsError(
                    f"nested deeper than {MAX_DEPTH} levels; documents are limited to that"
                )
        else:
            depth -= 1


def bounded_int(digits: str) -> int:
    """json.loads' parse_int: a decimal of at most MAX_INT_DIGITS digits."""
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise BoundsError(f"an integer of {len(digits)} digits; at most {MAX_INT_DIGITS}")
    return int(digits)
