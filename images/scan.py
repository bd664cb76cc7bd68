"""Secret and identity scanner for a built image tree, driven by the sealed-items list.

The build refuses to export a tree with any finding, and the e2e tests run the same scan on
the exported artifact. Every item of images/sealed.yaml is checked (its `find` mode), and every
content rule is applied to every file that is not public, whatever its size (read in blocks,
also as UTF-16: a big file is not a place to hide a key), and inside every tar, gzip or zstd
archive among them (images/scan_archive.py, bounded). Public means a file a Debian package
ships, byte for byte as dpkg recorded it (its md5), and the bytecode compiled from such a
module: key-shaped text in them (test vectors, examples) is in the archive, not a finding. A
packaged file the build changed (a conffile given a password) is the build's, and read.

A finding names the file, the rule and what the rule's first group names (a key type, a
setting), never the value.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from . import scan_archive, scan_content, sealed_items
from .scan_archive import Bounds, Budget
from .sealed_items import SealItem, SealList


@dataclass(frozen=True)
class Finding:
    path: str  # absolute path inside the image
    kind: str  # the sealed-items id or content rule id
    detail: str  # its reason
    member: str = ""  # where inside an archive at `path` ("" for the file itself)

    def __str__(self) -> str:
        where = scan_archive.printable(self.path, 400)
        if self.member:
            where += f" [{self.member}]"
        return f"{where}: {self.kind} ({self.detail})"


@dataclass
class _Public:
    """Whether a file is public: shipped by a package and unchanged since (md5), memoised
    for one scan (a module's bytecode asks about its source)."""

    tree: Path
    owned: set[str]
    sums: dict[str, str]
    seen: dict[str, bool] = field(default_factory=dict)

    def __call__(self, abs_path: str) -> bool:
        if abs_path not in self.seen:
            self.seen[abs_path] = self._check(abs_path)
        return self.seen[abs_path]

    def _check(self, abs_path: str) -> bool:
        if abs_path in self.owned:
            want, path = self.sums.get(abs_path), self.tree / abs_path.lstrip("/")
            # Only a regular file is hashed: a link could lead out of the tree (or to a device)
            if want is None or path.is_symlink() or not path.is_file():
                return False
            return _md5(path) == want
        # /usr/lib/python3/dist-packages/x/__pycache__/y.cpython-311.pyc compiled from a
        # packaged, unchanged y.py
        head, _, name = abs_path.rpartition("/__pycache__/")
        return bool(head) and name.endswith(".pyc") and self(f"{head}/{name.split('.', 1)[0]}.py")


def _md5(path: Path) -> str | None:
    h = hashlib.md5(usedforsecurity=False)
    try:
        with open(path, "rb") as f:
            while block := f.read(scan_content.BLOCK):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def _found(item: SealItem, path: Path, is_dir: bool) -> bool:
    if item.find == "exists":
        return True
    if item.find == "nonempty":
        if is_dir:
            return any(path.iterdir())
        return path.is_file() and not path.is_symlink() and path.stat().st_size > 0
    if item.find == "match":
        return (
            not is_dir
            and path.is_file()
            and not path.is_symlink()
            and item.pattern is not None
            and sealed_items.content_matches(path, item.pattern) is not None
        )
    return False


def _content(path: Path, rel: str, sl: SealList) -> scan_content.Hit | None:
    checks = [r.check() for r in sl.content_rules if r.applies_to(path.name, rel)]
    if not checks:
        return None
    try:
        with open(path, "rb") as f:
            return scan_content.first_hit(scan_content.blocks(f), checks)
    except OSError:
        return None


def scan(tree: Path, sealed: SealList | None = None, bounds: Bounds | None = None) -> list[Finding]:
    tree = tree.resolve()
    sl = sealed or sealed_items.load()
    owned = sealed_items.dpkg_owned(tree)
    public = _Public(tree, owned, sealed_items.dpkg_shipped(tree))
    budget = Budget(bounds or Bounds())
    out: list[Finding] = []
    for rel, path, is_dir in sealed_items.walk(tree):
        a = "/" + rel
        # Items judge by ownership, as the sealer acts (images/seal.py): what a package ships
        # at an item's path is the package's, and the sealer leaves it.
        hit = next(
            (
                i
                for i in sl.items
                if i.find != "never"
                and i.matches(rel)
                and i.applies_to(path, is_dir)
                and (i.owned or a not in owned)
                and _found(i, path, is_dir)
            ),
            None,
        )
        if hit is not None:
            out.append(Finding(a, hit.id, hit.reason))
            continue
        if is_dir or path.is_symlink() or not path.is_file() or public(a):
            continue
        # An archive's members first (a finding there names the member), then the file's
        # own bytes (a raw tar's, or what trails a compressed stream).
        inside = scan_archive.scan_file(path, rel, sl, budget)
        if inside is not None:
            out.append(Finding(a, inside.id, inside.reason + _what(inside.what), inside.member))
            continue
        found = _content(path, rel, sl)
        if found is not None:
            out.append(Finding(a, found.id, found.reason + _what(found.what)))
    return out


def _what(name: str) -> str:
    """What the rule's first group names (key type, setting), never the value."""
    return f" ({name})" if name else ""
