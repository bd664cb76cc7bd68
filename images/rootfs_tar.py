"""The one `tar -x` of a root filesystem: numeric owners (the archive's, never this host's
names) and, for a tree that will boot, its extended attributes (file capabilities)."""

from __future__ import annotations

import os

from nodeforge import proc


def untar(
    archive: str | os.PathLike[str],
    tree: str | os.PathLike[str],
    *,
    zstd: bool = False,
    xattrs: bool = True,
    timeout: float = 900,
) -> None:
    """Extract *archive* into the existing directory *tree* (*zstd*: a .tar.zst)."""
    argv: list[str | os.PathLike[str]] = ["tar", "-C", tree, "--numeric-owner"]
    if xattrs:
        argv += ["--xattrs", "--xattrs-include=*"]
    if zstd:
        argv += ["-I", "zstd"]
    proc.run([*argv, "-xf", archive], timeout=timeout)
