"""Reading a file that may hold a secret: never through a symlink, and say who else can read it.

A secret (munge key, users keypair) is accepted only from a file that unprivileged users cannot
read: a regular file, not a symlink, owned by root (or by the user running the check, for
`nodeforge params check` on a workstation), with no group or other permission bits for reading.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from nodeforge.errors import NodeforgeError

MAX_BYTES = 1 << 20


class UnsafeFileError(NodeforgeError):
    """The file itself is unusable (a symlink, not a regular file, too large)."""


@dataclass(frozen=True)
class PrivateText:
    data: bytes
    exposure: str | None  # None: root-only; else why unprivileged users can read it

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="strict")


def exposure(st: os.stat_result, allowed_uids: frozenset[int] | None = None) -> str | None:
    """Why a file with this stat is readable by someone other than root, or None."""
    allowed = allowed_uids if allowed_uids is not None else frozenset({0, os.geteuid()})
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in allowed:
        return f"owned by uid {st.st_uid}, not root"
    if mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {mode:04o} lets group/others read or change it (chmod 0600)"
    return None


def read_private(path: Path, label: str, max_bytes: int = MAX_BYTES) -> PrivateText:
    """Read *path* without following a symlink; raise UnsafeFileError naming *label*."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symlink
            raise UnsafeFileError(
                f"{label}: {path} is a symlink; params are read only from a regular file "
                "(copy the file there instead of linking it)"
            ) from None
        raise UnsafeFileError(f"{label}: cannot read {path}: {exc.strerror}") from None
    except ValueError:  # a NUL in the path (a file:// URL from the kernel command line)
        raise UnsafeFileError(f"{label}: {str(path)!r:.120} is not a file path (NUL)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{label}: {path} is not a regular file")
        if st.st_size > max_bytes:
            raise UnsafeFileError(f"{label}: {path} is {st.st_size} bytes; at most {max_bytes}")
        chunks = []
        total = 0
        while chunk := os.read(fd, 65536):
            total += len(chunk)
            if total > max_bytes:
                raise UnsafeFileError(f"{label}: {path} grew past {max_bytes} bytes while read")
            chunks.append(chunk)
        return PrivateText(b"".join(chunks), exposure(st))
    finally:
        os.close(fd)
