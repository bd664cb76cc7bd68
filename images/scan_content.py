"""Content rules over a byte stream: a file of the image, or a member inside an archive.

The stream is read in blocks (any size, never "the first N MB"), each block starting with the
tail of the one before so a match across a boundary is seen. A block with NUL bytes is also
read as UTF-16: ASCII text in UTF-16 is every other byte, so the even bytes and the odd bytes
of the block are the text of LE and BE at either alignment, with or without a BOM (a key that
an editor saved as UTF-16 is still a key).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

BLOCK = 1 << 20
OVERLAP = 512  # bytes each block repeats of the one before (a pattern's longest match)


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


@dataclass(frozen=True)
class Check:
    id: str
    pattern: re.Pattern[bytes]
    reason: str
    needles: tuple[bytes, ...] = ()  # one of them is in every match (lower case when `fold`)
    fold: bool = False


@dataclass(frozen=True)
class Hit:
    id: str
    reason: str
    what: str  # the pattern's first group: a key type or setting name, never the value


def blocks(reader: Reader, size: int = BLOCK) -> Iterator[bytes]:
    tail = b""
    while True:
        block = reader.read(size)
        if not block:
            return
        chunk = tail + block
        yield chunk
        tail = chunk[-OVERLAP:]  # of the chunk: a short read must not shorten the overlap


def views(block: bytes) -> tuple[bytes, ...]:
    if b"\0" not in block:
        return (block,)
    if block.count(0) == len(block):
        return ()  # NUL bytes only (database pages, sparse files): no text in any encoding
    return (block, block[0::2], block[1::2])


def _what(m: re.Match[bytes]) -> str:
    if not m.re.groups or m.group(1) is None:
        return ""
    # A name from the rule's own alternatives; still printable ASCII only in a log line.
    return re.sub(r"[^A-Za-z0-9 _.-]", "?", m.group(1).decode("ascii", "replace")).strip()


def first_hit(chunks: Iterable[bytes], checks: Sequence[Check]) -> Hit | None:
    """The first check that matches anywhere in the stream, or None (reads it all then)."""
    if not checks:
        for _ in chunks:  # still drain: an archive's stream must be read through
            pass
        return None
    for block in chunks:
        for view in views(block):
            folded: bytes | None = None
            for c in checks:
                if c.needles:
                    # A substring search runs at memory speed; most regexes do not.
                    if c.fold and folded is None:
                        folded = view.lower()
                    hay = folded if c.fold and folded is not None else view
                    if not any(n in hay for n in c.needles):
                        continue
                m = c.pattern.search(view)
                if m:
                    return Hit(c.id, c.reason, _what(m))
    return None
