"""Secret and identity scanner for a built image tree, driven by the sealed-items list.

The build refuses to export a tree with any finding, and the e2e tests run the same scan on
the exported artifact. Every item of images/sealed.yaml is checked (its `find` mode), and every
content rule is applied to every file no package ships, whatever its size (read in chunks: a
big file is not a place to hide a key). A file that a Debian package ships is public (it is in
the archive), and so is the bytecode compiled from it, so key-shaped text inside them (test
vectors, examples) is not a finding; anywhere else it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import sealed_items
from .sealed_items import SealItem, SealList


@dataclass(frozen=True)
class Finding:
    path: str  # absolute path inside the image
    kind: str  # the sealed-items id
    detail: str  # its reason

    def __str__(self) -> str:
        return f"{self.path}: {self.kind} ({self.detail})"


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


def _public(abs_path: str, owned: set[str]) -> bool:
    if abs_path in owned:
        return True
    # /usr/lib/python3/dist-packages/x/__pycache__/y.cpython-311.pyc compiled from a packaged y.py
    head, _, name = abs_path.rpartition("/__pycache__/")
    return bool(head) and name.endswith(".pyc") and f"{head}/{name.split('.', 1)[0]}.py" in owned


def scan(tree: Path, sealed: SealList | None = None) -> list[Finding]:
    tree = tree.resolve()
    sl = sealed or sealed_items.load()
    owned = sealed_items.dpkg_owned(tree)
    out: list[Finding] = []
    for rel, path, is_dir in sealed_items.walk(tree):
        a = "/" + rel
        public = _public(a, owned)
        hit = next(
            (
                i
                for i in sl.items
                if i.find != "never"
                and i.matches(rel)
                and i.applies_to(path, is_dir)
                and (i.owned or not public)
                and _found(i, path, is_dir)
            ),
            None,
        )
        if hit is not None:
            out.append(Finding(a, hit.id, hit.reason))
            continue
        if is_dir or public or path.is_symlink() or not path.is_file():
            continue
        for rule in sl.content_rules:
            if not rule.applies_to(path.name):
                continue
            try:
                m = sealed_items.content_matches(path, rule.pattern)
            except OSError:
                continue
            if m:
                # The first group names what was found (key type, setting), never the value.
                what = (m.group(1) or b"").decode(errors="replace").strip() if m.re.groups else ""
                out.append(Finding(a, rule.id, f"{rule.reason}" + (f" ({what})" if what else "")))
                break
    return out
