"""The one atomic file writer.

A reader (or a crash) sees the old file or the new one, never a part: the data goes to a
temporary file in the same directory with its final mode, is fsynced, renamed over the target,
and the directory is fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from .errors import NodeforgeError


def write_atomic(
    path: str | os.PathLike[str],
    data: str | bytes,
    mode: int = 0o644,
    *,
    skip_unchanged: bool = True,
    durable: bool = True,
) -> bool:
    """Replace *path* with *data*, mode *mode* (set before the content lands).

    Returns False, writing nothing, when the file already has exactly this content and mode
    (*skip_unchanged*; callers restart a daemon only on a change). Missing parent directories
    are created. *durable* False skips the two fsyncs: still atomic for every reader (the old
    file or the new one), but a power cut may bring the old one back; for a record rewritten
    many times whose last write is durable (the agent's state.json: ~1-13 ms per fsync pair on
    its path to ready, bench/README.md).
    """
    p = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    if skip_unchanged:
        try:
            if (p.stat().st_mode & 0o7777) == mode and p.read_bytes() == raw:
                return False
        except OSError:
            pass
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(p.parent)
    return True


@contextlib.contextmanager
def atomic_output(path: Path, *, tmp_name: str | None = None) -> Iterator[Path]:
    """A temp path beside *path* for a writer that makes the whole file itself (a tool, a
    zip): renamed onto *path* when the block ends without an error, removed otherwise, so
    *path* is the old file or the whole new one. *tmp_name* when the writer reads meaning
    from the name (mmdebstrap picks its format from the extension)."""
    tmp = path.with_name(tmp_name or f".{path.name}.part")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def swap_dir(new: Path, final: Path, *, old: Path | None = None) -> None:
    """Put the directory *new* in the place of *final* (both on one filesystem), whole.

    An existing *final* is renamed aside to *old* (default: *final*.old) first and removed
    after, so *final* is always the previous tree or the new one, never a half; a leftover
    *old* from an interrupted swap is removed first. One rename each, no copy.
    """
    old = final.with_name(final.name + ".old") if old is None else old
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def write_json(
    path: str | os.PathLike[str], obj: Any, mode: int = 0o644, *, compact: bool = False
) -> bool:
    """write_atomic of *obj* as JSON: indented with sorted keys and a final newline, or
    *compact* (one line, keys in insertion order) for files rewritten often."""
    import json

    if compact:
        text = json.dumps(obj, separators=(",", ":"))
    else:
        text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return write_atomic(path, text, mode)


# One component of a name that came from outside (a versions file, a mirror, an S3 listing, a
# hook name): no separator, no `.`/`..`, nothing a shell, a URL or a terminal reads specially.
NAME_PART = re.compile(r"[A-Za-z0-9_.+=@,-]{1,255}")
MAX_NAME = 1024


class UnsafeName(NodeforgeError):
    """*name* cannot be placed under its base; the message says why (never a traceback)."""


def safe_name(name: object, *, what: str, nested: bool = False) -> list[str]:
    """The parts of the untrusted relative *name*, each a full match of NAME_PART (with
    *nested*, several separated by single `/`); `.`, `..`, absolute and empty never match."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise UnsafeName(f"{what}: {name!r} is not a relative file name")
    parts = name.split("/") if nested else [name]
    for part in parts:
        if part in (".", "..") or not NAME_PART.fullmatch(part):
            sep = ", parts separated by /" if nested else ""
            raise UnsafeName(
                f"{what}: {name!r} is not a safe relative name (A-Z a-z 0-9 _ . + = @ , -{sep}; "
                "no '.', '..', absolute path or empty part)"
            )
    return parts


def confined(base: Path, name: str, *, what: str, nested: bool = False) -> Path:
    """*base* joined with the untrusted relative *name*, refused unless it stays inside *base*.

    The one helper for every path built from outside input (safe_name's grammar first). The
    result is then resolved (symlinks followed) and must still lie strictly under the resolved
    *base*, so a link planted inside *base* cannot lead out of it either. *what* names the
    field for the error (`artifacts.x.arch.amd64.file`).
    """
    joined = Path(base).joinpath(*safe_name(name, what=what, nested=nested))
    try:
        root = Path(base).resolve()
        real = joined.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise UnsafeName(f"{what}: {name!r} cannot be resolved under {base}: {exc}") from None
    if real == root or not real.is_relative_to(root):
        raise UnsafeName(f"{what}: {name!r} leads out of {base} (to {real}); refused")
    return joined


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems (9p, some FUSE) cannot fsync a directory; the rename still happened.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def restrict_mode(path: str | os.PathLike[str], mode: int) -> bool:
    """Narrow *path*'s permission bits to at most *mode* (never widen them); True if changed.

    For files written by an older version, or by a tool, with a wider mode (a 0644 state.json
    that holds an error). A missing path or a symlink is left alone (the link's target is not
    ours to change); the chmod goes through a descriptor opened without following links.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):
            return False
        raise
    try:
        cur = stat.S_IMODE(os.fstat(fd).st_mode)
        if not cur & ~mode:
            return False
        os.fchmod(fd, cur & mode)
        return True
    finally:
        os.close(fd)


def open_private_append(path: str | os.PathLike[str]) -> TextIO:
    """Open *path* for appending text, created 0600 and narrowed to 0600 if it is wider."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "a")
