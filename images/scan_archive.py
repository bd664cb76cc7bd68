"""Archives inside the image tree: tar, gzip, zstd and any nesting of them (.tar.gz, .tgz,
.tar.zst, a tarball inside a tarball), known by their magic bytes, not their names (a
renamed archive is still one). Each is read as a stream, and every member is checked as a file
of the tree is: the content rules, and the sealed items marked `archived` by its path.

Bounded, so a zip bomb cannot stall the build: one archive may expand to `max_bytes` (bytes
its decompressors yield, and the holes of sparse tar members; never more than one byte past
the bound is expanded), `max_members` members and `max_depth` layers; a tar header that tar holds in memory (long names, pax) to `max_header`; the whole scan
to `total_bytes`. An archive over a bound is a FINDING, not a pass and not a crash: the scanner
promises that every byte nobody shipped was read, and a secret can sit past any cap, so what it
could not read whole the build refuses to publish, naming the archive and the bound (remove it,
or ship it in a package). A corrupt or truncated archive is a finding for the same reason.
"""

from __future__ import annotations

import gzip
import re
import tarfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from . import scan_content
from .scan_content import Check, Hit, Reader
from .sealed_items import SealItem, SealList

HEAD = 512  # the tar magic is at byte 257
ARCHIVE_SUFFIXES = (".tgz", ".gz", ".gzip", ".zst", ".zstd")
_UNSAFE = re.compile(r"[^\x21-\x7e ]|\\")


@dataclass(frozen=True)
class Bounds:
    max_bytes: int = 1 << 30
    max_members: int = 100_000
    max_depth: int = 6  # layers: .tar.gz inside .tar.gz inside .tar.zst is 6
    max_header: int = 1 << 20
    total_bytes: int = 8 << 30


class OverBounds(Exception):
    """An archive larger than a bound allows; the message names the bound."""


class Unreadable(Exception):
    """Data that claims to be an archive and does not read as one through to its end."""


@dataclass
class Budget:
    """One scan's expansion budget (the scan makes it; no state outlives the scan)."""

    bounds: Bounds = field(default_factory=Bounds)
    spent: int = 0  # over the whole scan

    def archive(self) -> Spend:
        return Spend(self)


@dataclass
class Spend:
    """What one archive of the tree (with everything nested in it) has used."""

    budget: Budget
    bytes: int = 0
    members: int = 0

    def add(self, n: int) -> None:
        b = self.budget.bounds
        self.bytes += n
        self.budget.spent += n
        if self.bytes > b.max_bytes:
            raise OverBounds(f"expands past {_size(b.max_bytes)}")
        if self.budget.spent > b.total_bytes:
            raise OverBounds(f"the scan's archive budget ({_size(b.total_bytes)}) is spent")

    def left(self) -> int:
        b = self.budget.bounds
        return max(0, min(b.max_bytes - self.bytes, b.total_bytes - self.budget.spent))

    def member(self) -> None:
        self.members += 1
        if self.members > self.budget.bounds.max_members:
            raise OverBounds(f"has more than {self.budget.bounds.max_members} members")


@dataclass(frozen=True)
class ArchiveHit:
    member: str  # where inside the archive ("a.tar!etc/x"), printable; "" for the archive itself
    id: str
    reason: str
    what: str = ""


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def kind(head: bytes) -> str | None:
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    if head[257:262] == b"ustar":
        return "tar"
    return None


def printable(name: str, limit: int = 200) -> str:
    """A member name (hostile: any bytes) as it may appear in a log line."""
    out = _UNSAFE.sub(lambda m: "\\x%02x" % (ord(m.group()) & 0xFF), name)
    return out if len(out) <= limit else out[:limit] + "..."


def member_rel(name: str) -> str:
    """A member's path as it would land under the image root (./etc/x and /etc/x: etc/x)."""
    return "/".join(p for p in name.split("/") if p not in ("", "."))


class _Peeked:
    """A reader with its first bytes already read, handed back in front of the rest."""

    def __init__(self, head: bytes, rest: Reader) -> None:
        self._head, self._rest = head, rest

    def read(self, n: int = -1, /) -> bytes:
        if self._head:
            if n < 0:
                out, self._head = self._head + self._rest.read(), b""
                return out
            out, self._head = self._head[:n], self._head[n:]
            return out
        return self._rest.read(n)


class _Counted:
    """Every byte read through it is spent from the archive's budget."""

    def __init__(self, inner: Reader, spend: Spend) -> None:
        self._inner, self._spend = inner, spend

    def read(self, n: int = -1, /) -> bytes:
        if n < 0:  # tarfile reads with sizes; an unbounded read is never ours to grant
            n = scan_content.BLOCK
        # One byte past what is left proves the bound is crossed: never expand more.
        out = self._inner.read(min(n, self._spend.left() + 1))
        self._spend.add(len(out))
        return out


def _tarinfo_class(max_header: int) -> type[tarfile.TarInfo]:
    class _TarInfo(tarfile.TarInfo):
        # tarfile reads a long name or a pax header whole into memory: bound it first.
        def _proc_member(self, tf: tarfile.TarFile) -> Any:  # type: ignore[override]
            if self.type in _HEADER_TYPES and self.size > max_header:
                raise OverBounds(f"has a tar header of {self.size} bytes (over {max_header})")
            return super()._proc_member(tf)  # type: ignore[misc]

    return _TarInfo


_HEADER_TYPES = frozenset(
    {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE}
    | {tarfile.SOLARIS_XHDTYPE}
)


@dataclass(frozen=True)
class _Ctx:
    sl: SealList
    spend: Spend


def _items(sl: SealList, rel: str, is_dir: bool, size: int) -> tuple[SealItem | None, list[Check]]:
    """An archived item that the member's path alone makes a finding, or the `match` items
    whose pattern its content must be checked against. Its parent directories count as the
    directories they would be when extracted (home/x/.aws/credentials: home/x/.aws, not empty)."""
    extra: list[Check] = []
    parts = rel.split("/")
    for n in range(len(parts), 0, -1):
        path, own = "/".join(parts[:n]), n == len(parts)
        as_dir = is_dir or not own
        for i in sl.items:
            if not i.archived or i.find == "never" or not i.matches(path):
                continue
            if i.type == "file" and as_dir:
                continue
            if i.find == "exists" or (i.find == "nonempty" and (not own or size > 0)):
                return i, []
            if i.find == "match" and i.pattern is not None and own and not is_dir:
                extra.append(Check(i.id, i.pattern, i.reason))
    return None, extra


def _checks(sl: SealList, rel: str) -> list[Check]:
    name = rel.rpartition("/")[2]
    return [r.check() for r in sl.content_rules if r.applies_to(name, rel)]


def _leaf(
    reader: Reader, rel: str, where: Sequence[str], ctx: _Ctx, depth: int, size: int
) -> ArchiveHit | None:
    """A stream inside an archive: another archive (expanded), or content to check."""
    head = reader.read(HEAD)
    k = kind(head)
    stream = _Peeked(head, reader)
    if k is not None:
        return _expand(stream, k, rel, where, ctx, depth + 1)
    item, extra = _items(ctx.sl, rel, False, size if size >= 0 else len(head))
    if item is not None:
        return ArchiveHit("!".join(where), item.id, item.reason)
    hit: Hit | None = scan_content.first_hit(
        scan_content.blocks(stream), extra + _checks(ctx.sl, rel)
    )
    return None if hit is None else ArchiveHit("!".join(where), hit.id, hit.reason, hit.what)


def _strip(rel: str) -> str:
    for s in ARCHIVE_SUFFIXES:
        if rel.endswith(s) and len(rel) > len(s):
            return rel[: -len(s)] + (".tar" if s == ".tgz" else "")
    return rel


def _expand(
    reader: Reader, k: str, rel: str, where: Sequence[str], ctx: _Ctx, depth: int
) -> ArchiveHit | None:
    bounds = ctx.spend.budget.bounds
    if depth > bounds.max_depth:
        raise OverBounds(f"nests archives deeper than {bounds.max_depth} layers")
    if k == "gzip":
        gz = gzip.GzipFile(fileobj=reader, mode="rb")  # type: ignore[arg-type]
        return _leaf(_Counted(gz, ctx.spend), _strip(rel), where, ctx, depth, -1)
    if k == "zstd":
        # The window bound caps the decompressor's memory whatever the frame header asks.
        dz = zstandard.ZstdDecompressor(max_window_size=1 << 27)
        zr = dz.stream_reader(reader, read_across_frames=True, closefd=False)
        return _leaf(_Counted(zr, ctx.spend), _strip(rel), where, ctx, depth, -1)
    return _tar(reader, where, ctx, depth)


def _tar(reader: Reader, where: Sequence[str], ctx: _Ctx, depth: int) -> ArchiveHit | None:
    bounds = ctx.spend.budget.bounds
    tf = tarfile.open(
        fileobj=reader,  # type: ignore[arg-type]
        mode="r|",
        tarinfo=_tarinfo_class(bounds.max_header),
    )
    with tf:
        while (m := tf.next()) is not None:
            tf.members.clear()  # a stream is read once: keep no list of every member seen
            ctx.spend.member()
            rel = member_rel(m.name)
            here = [*where, printable(m.name)]
            if not (m.isreg() or m.isdir()):
                continue
            item, _ = _items(ctx.sl, rel, m.isdir(), m.size)
            if item is not None:
                return ArchiveHit("!".join(here), item.id, item.reason)
            if m.isdir():
                continue
            f = tf.extractfile(m)
            if f is None:
                continue
            # A member's bytes were counted as its decompressor yielded them (a raw tar's are
            # on disk); only a sparse member's holes expand here.
            body: Reader = _Counted(f, ctx.spend) if m.issparse() else f
            hit = _leaf(body, rel, here, ctx, depth, m.size)
            if hit is not None:
                return hit
        # tar stops at a header it cannot read as if the archive ended: whatever follows must
        # be the end-of-archive zeros, or members were left unread.
        rest: Reader = tf.fileobj  # type: ignore[assignment]
        while block := rest.read(scan_content.BLOCK):
            if block.count(0) != len(block):
                raise Unreadable("has data after a tar header that does not read")
    return None


_BROKEN = (
    Unreadable,
    tarfile.TarError,
    OSError,  # gzip.BadGzipFile is one
    EOFError,
    zlib.error,
    zstandard.ZstdError,
    ValueError,
    UnicodeError,
)


def scan_file(path: Path, rel: str, sl: SealList, budget: Budget) -> ArchiveHit | None:
    """The first finding inside the archive at *path* (its path *rel* in the image), or None
    (also when it is no archive). Never raises for what the file holds."""
    ctx = _Ctx(sl, budget.archive())
    try:
        with open(path, "rb") as f:
            head = f.read(HEAD)
            k = kind(head)
            if k is None:
                return None
            return _expand(_Peeked(head, f), k, rel, [], ctx, 1)
    except OverBounds as exc:
        return ArchiveHit(
            "",
            "archive-over-bounds",
            f"an archive that {exc}: it cannot be checked whole; remove it from the image "
            "or ship it in a package",
        )
    except _BROKEN as exc:
        return ArchiveHit(
            "",
            "archive-unreadable",
            f"an archive that does not read through to its end ({type(exc).__name__}): its "
            "content cannot be checked; remove or repair it",
        )
    except RecursionError:
        return ArchiveHit("", "archive-over-bounds", "an archive nested too deep to check")
