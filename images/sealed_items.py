"""The one list of what a sealed image must not carry (images/sealed.yaml), typed and matched.

images/seal.py applies it, images/scan.py checks it, roles/seal reads the same YAML. One walk
of the tree finds every item's matches (no `**` glob per item over a whole image).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from nodeforge.errors import NodeforgeError

from .scan_content import Check, blocks

SEALED_FILE = Path(__file__).with_name("sealed.yaml")
ACTIONS = ("remove", "truncate", "replace", "keep")
FINDS = ("exists", "nonempty", "match", "never")
TYPES = ("any", "file")  # file: regular files only (not directories, links or devices)
_CLASS = re.compile(r"\[([A-Za-z0-9_.-]+)\]")  # a glob character class, e.g. [0-9]
SKIP_TOP = frozenset({"proc", "sys", "dev", "run"})  # never part of an image tree
_MD5 = re.compile(r"[0-9a-f]{32}")
CONFIG_SUFFIXES = (".conf", ".cnf", ".ini", ".yaml", ".yml", ".env", ".json", ".credentials")


@dataclass(frozen=True)
class SealItem:
    id: str
    paths: tuple[str, ...]
    action: str
    reason: str
    find: str = "exists"
    pattern: re.Pattern[bytes] | None = None
    content: str = ""  # for "replace"
    owned: bool = False  # also files a Debian package ships
    live: bool = False  # the Ansible seal role removes it during the build too
    type: str = "any"
    regex: re.Pattern[str] | None = None  # all of `paths`, compiled
    archived: bool = False  # also a finding as a member of an archive in the tree

    def matches(self, rel: str) -> bool:
        assert self.regex is not None
        return self.regex.fullmatch(rel) is not None

    def applies_to(self, path: Path, is_dir: bool) -> bool:
        """Whether the item's `type` admits *path* (a match of its globs)."""
        return self.type == "any" or (not is_dir and path.is_file() and not path.is_symlink())


@dataclass(frozen=True)
class ContentRule:
    id: str
    files: str  # any | config | listed
    pattern: re.Pattern[bytes]
    reason: str
    paths: re.Pattern[str] | None = None  # globs it also applies to, compiled
    needles: tuple[bytes, ...] = ()  # literals every match holds (lower case if `fold`)
    fold: bool = False  # the pattern ignores case

    def applies_to(self, name: str, rel: str = "") -> bool:
        """Whether the rule reads the file *name* at *rel* (relative to the image root)."""
        if self.files == "any" or (self.files == "config" and name.endswith(CONFIG_SUFFIXES)):
            return True
        return self.paths is not None and self.paths.fullmatch(rel) is not None

    def check(self) -> Check:
        return Check(self.id, self.pattern, self.reason, self.needles, self.fold)


@dataclass(frozen=True)
class SealList:
    items: tuple[SealItem, ...]
    content_rules: tuple[ContentRule, ...]


def glob_regex(pattern: str) -> str:
    """A path glob as a regex: `*` and `?` stay in one segment, `**/` spans any directories,
    `[0-9]` is one character of the class (letters, digits, `_.-` and ranges only)."""
    out, i = [], 0
    while i < len(pattern):
        cls = _CLASS.match(pattern, i)
        if cls:
            out.append(f"[{cls.group(1)}]")
            i = cls.end()
        elif pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def _fail(path: Path, where: str, msg: str) -> NoReturn:
    raise NodeforgeError(f"{path}: {where}: {msg}")


def load(path: Path = SEALED_FILE) -> SealList:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise NodeforgeError(f"cannot read the sealed-items list {path}: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("schema") != 1:
        _fail(path, "schema", "expected a mapping with schema: 1")
    ids: set[str] = set()
    items = [_item(path, n, it, ids) for n, it in enumerate(raw.get("items") or [])]
    rules = [_content_rule(path, n, r) for n, r in enumerate(raw.get("content_rules") or [])]
    return SealList(tuple(items), tuple(rules))


def _item(path: Path, n: int, it: Any, ids: set[str]) -> SealItem:
    """items[n], checked (its id must be new: *ids* collects them)."""
    w = f"items[{n}]"
    if not isinstance(it, dict):
        _fail(path, w, "expected a mapping")
    unknown = set(it) - {
        "id",
        "paths",
        "action",
        "reason",
        "find",
        "pattern",
        "content",
        "owned",
        "live",
        "type",
        "archived",
    }
    if unknown:
        _fail(path, w, f"unknown keys {sorted(unknown)}")
    iid = it.get("id")
    if not isinstance(iid, str) or not re.fullmatch(r"[a-z0-9-]{1,40}", iid) or iid in ids:
        _fail(path, f"{w}.id", f"{iid!r} is missing, not [a-z0-9-] or a duplicate")
    ids.add(iid)
    paths = it.get("paths")
    if (
        not isinstance(paths, list)
        or not paths
        or not all(isinstance(p, str) and p and not p.startswith("/") for p in paths)
    ):
        _fail(path, f"{iid}.paths", "expected a list of globs relative to the image root")
    if it.get("action") not in ACTIONS:
        _fail(path, f"{iid}.action", f"one of {', '.join(ACTIONS)}")
    find = it.get("find", "exists")
    if find not in FINDS:
        _fail(path, f"{iid}.find", f"one of {', '.join(FINDS)}")
    if not isinstance(it.get("reason"), str) or not it["reason"].strip():
        _fail(path, f"{iid}.reason", "every item says why")
    if it.get("type", "any") not in TYPES:
        _fail(path, f"{iid}.type", f"one of {', '.join(TYPES)}")
    pat = it.get("pattern")
    if find == "match" and not pat:
        _fail(path, f"{iid}.pattern", "find: match needs a pattern")
    return SealItem(
        id=iid,
        paths=tuple(paths),
        action=it["action"],
        reason=it["reason"].strip(),
        find=find,
        pattern=re.compile(pat.encode()) if pat else None,
        content=str(it.get("content", "")),
        owned=bool(it.get("owned", False)),
        live=bool(it.get("live", False)),
        type=it.get("type", "any"),
        regex=_globs(paths),
        archived=bool(it.get("archived", False)),
    )


def _content_rule(path: Path, n: int, r: Any) -> ContentRule:
    """content_rules[n], checked."""
    globs = r.get("paths") if isinstance(r, dict) else None
    if (
        not isinstance(r, dict)
        or set(r) - {"id", "files", "pattern", "reason", "paths", "needles"}
        or not _needles_ok(r.get("needles", []))
        or r.get("files") not in ("any", "config", "listed")
        or not isinstance(r.get("pattern"), str)
        or not r.get("reason")
        or not r.get("id")
        or (globs is not None and not _glob_list(globs))
        or (r.get("files") == "listed" and not globs)
    ):
        _fail(
            path,
            f"content_rules[{n}]",
            "expected {id, files: any|config|listed, pattern, reason, paths (globs; "
            "required for listed), needles (non-empty strings)}",
        )
    try:
        pattern = re.compile(r["pattern"].encode())
    except re.error as exc:
        _fail(path, f"{r['id']}.pattern", f"not a regex: {exc}")
    return ContentRule(
        r["id"],
        r["files"],
        pattern,
        r["reason"],
        paths=_globs(globs) if globs else None,
        needles=tuple(
            (n.lower() if pattern.flags & re.IGNORECASE else n).encode()
            for n in r.get("needles", [])
        ),
        fold=bool(pattern.flags & re.IGNORECASE),
    )


def _needles_ok(needles: object) -> bool:
    return isinstance(needles, list) and all(
        isinstance(n, str) and n.isascii() and n for n in needles
    )


def _glob_list(globs: object) -> bool:
    return (
        isinstance(globs, list)
        and bool(globs)
        and all(isinstance(p, str) and p and not p.startswith("/") for p in globs)
    )


def _globs(paths: list[str]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{glob_regex(p)})" for p in paths))


def dpkg_owned(tree: Path) -> set[str]:
    """Absolute paths (inside the image) of every file a Debian package ships."""
    owned: set[str] = set()
    info = tree / "var/lib/dpkg/info"
    if info.is_dir():
        for lst in info.glob("*.list"):
            owned.update(lst.read_text(errors="replace").splitlines())
    return owned


def dpkg_shipped(tree: Path) -> dict[str, str]:
    """The md5 dpkg recorded for every file a package ships (absolute path inside the image):
    the packages' md5sums, and the conffiles' sums from the status file."""
    sums: dict[str, str] = {}
    info = tree / "var/lib/dpkg/info"
    if info.is_dir():
        for f in info.glob("*.md5sums"):
            for line in f.read_text(errors="replace").splitlines():
                digest, sep, rel = line.partition("  ")
                if sep and _MD5.fullmatch(digest):
                    sums["/" + rel.lstrip("/")] = digest
    status = tree / "var/lib/dpkg/status"
    if status.is_file():
        in_conffiles = False
        for line in status.read_text(errors="replace").splitlines():
            if line.startswith("Conffiles:"):
                in_conffiles = True
            elif in_conffiles and line.startswith(" "):
                # " /etc/x.conf <md5>" or " /etc/x.conf <md5> obsolete"
                parts = line.split()
                if len(parts) >= 2 and _MD5.fullmatch(parts[1]):
                    sums[parts[0]] = parts[1]
            else:
                in_conffiles = False
    return sums


def walk(tree: Path) -> Iterator[tuple[str, Path, bool]]:
    """(relative path, path, is a real directory) of everything in *tree*, top-down, without
    following symlinks. A caller may prune a directory by removing it before descending."""
    tree_s = str(tree)
    for dirpath, dirnames, filenames in os.walk(tree):
        rel_dir = os.path.relpath(dirpath, tree_s)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        if not rel_dir:
            dirnames[:] = [d for d in dirnames if d not in SKIP_TOP]
        keep = []
        for d in sorted(dirnames):
            p = Path(dirpath, d)
            real = not p.is_symlink()
            yield rel_dir + d, p, real
            if real and p.is_dir():
                keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            yield rel_dir + f, Path(dirpath, f), False


def content_matches(path: Path, pattern: re.Pattern[bytes]) -> re.Match[bytes] | None:
    """The first match of *pattern* in the file, read whole in blocks (scan_content.blocks)."""
    with open(path, "rb") as f:
        for block in blocks(f):
            m = pattern.search(block)
            if m:
                return m
    return None
