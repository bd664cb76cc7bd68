"""The layered build cache: provisioned, unsealed root trees keyed by what affects installation.

Layout under the cache dir (`--cache-dir`, default /var/cache/nodeforge):

    .lock                      fcntl lock: one build (or prune) per cache dir at a time
    layers/<key>/tree/         a prefix layer: the first group's provisioned tree, or a
                               later group's overlayfs upper dir (its diff over the parent)
    layers/<key>/layer.json    its key inputs, parent key, content digest, size, last use
    layers/<key>/verified.json the last full content check that matched (VerifiedMark)
    layers/.tmp-<key>-<pid>/   an entry being written; renamed into place only when complete

The install pass runs in role groups (ROLE_GROUPS, in playbook order); each group's result
is one layer whose parent is the previous group's, so a build resumes after the last group
whose inputs did not change. A group's key is its parent's key (the base key for the first)
plus what the group's roles install from: their files except templates (tasks, defaults,
handlers, meta), the role variables that choose what is installed (INSTALL_VAR) that belong
to them, and the artifacts' sha256s with the versions file for the first group whose roles
read `nodeforge_artifacts`; the playbook (pre-tasks, role order) keys the first group.
Templates, other configuration variables, extensions/hooks and the agent's code are applied
over the last layer by an idempotent pass of the same playbook. A layer is verified by its
content digest before anything made from it is kept: a corrupt or partial entry is dropped
with every layer made over it (and rebuilt by the caller), never used. Within one boot of
the host, a layer whose content digest was checked once is checked again by its entries'
inode fields only, until any of them changes (VerifiedMark: why that is sound).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import swap_dir

from .export import write_json_atomic

LAYER_SCHEMA = 2  # bump when what a layer holds changes: every older entry then misses
LAYER_META = "layer.json"
DEFAULT_MAX_BYTES = 20 << 30
# Role variables that choose packages, sources or install locations: they key the layer.
# Any other variable (config files, limits, names) is applied by the pass over the layer.
INSTALL_VAR = re.compile(
    r"[a-z][a-z0-9_]*_(packages|packages_[a-z0-9_]+|source|url|key_url|version|prefix"
    r"|plugin_dir|stage_dir|build_dir|remove_build_packages|time_sync)"
)
# Sources whose change makes a build differ (no-change detection, see build_key).
SOURCE_DIRS = ("nodeforge", "images", "bootstrap", "gang", "lab", "extensions", "roles")
SOURCE_FILES = ("pyproject.toml", "ansible.cfg")
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
KEY_RE = re.compile(r"[0-9a-f]{64}")
_HASH_CHUNK = 1 << 20


# -- keys -----------------------------------------------------------------------------------


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def files_digest(root: Path, files: Iterable[Path]) -> str:
    """sha256 over (relative path, content) of *files*, in path order."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(_file_sha(f).encode() + b"\n")
    return h.hexdigest()


def _source_files(d: Path) -> list[Path]:
    return [
        p
        for p in d.rglob("*")
        if p.is_file()
        and not (_SKIP_PARTS & set(p.parts))
        and p.suffix != ".pyc"
        and not any(x.endswith(".egg-info") for x in p.parts)
    ]


# Roles that never run in the install pass (the layer is the tree before sealing).
NOT_IN_LAYER = frozenset({"seal"})


def _role_files(role: Path) -> list[Path]:
    """A role's install files: all but its templates (templates are configuration)."""
    return [f for f in _source_files(role) if f.relative_to(role).parts[0] != "templates"]


def role_install_digests(roles_dir: Path) -> dict[str, str]:
    """Per role: digest of every file that is not a template (templates are configuration).
    A role that never runs in the install pass (NOT_IN_LAYER) does not key the layer."""
    out = {}
    for role in sorted(p for p in roles_dir.iterdir() if p.is_dir()):
        if role.name in NOT_IN_LAYER:
            continue
        out[role.name] = files_digest(role, _role_files(role))
    return out


def install_vars(ansible_vars: dict[str, object]) -> dict[str, object]:
    return {k: ansible_vars[k] for k in sorted(ansible_vars) if INSTALL_VAR.fullmatch(k)}


@dataclass(frozen=True)
class RoleGroup:
    name: str
    roles: tuple[str, ...]


# The install pass's groups in playbook order (images/site.yml; a unit test holds them equal).
# Each is one cached layer over the previous one: a change resumes after the last group it
# leaves alone. The Slurm stack every node shares changes rarely; the container runtime and
# the variant/operator choices (docker_source, the gpu role, the agent) change more often.
ROLE_GROUPS: tuple[RoleGroup, ...] = (
    RoleGroup("slurm_stack", ("base", "ssh", "munge", "slurm", "accounting")),
    RoleGroup(
        "runtime", ("docker", "enroot", "pyxis", "gpu", "logrotate", "metrics", "node_agent")
    ),
)
_ARTIFACTS_READ = re.compile(rb"\bnodeforge_artifacts\b")


def group_index(role: str, groups: tuple[RoleGroup, ...] = ROLE_GROUPS) -> int:
    """The group a role runs in; one in no group keys the first (the safe side)."""
    return next((i for i, g in enumerate(groups) if role in g.roles), 0)


def var_owner(name: str, roles: Iterable[str]) -> str | None:
    """The role a variable belongs to by the roles' `<role>_` naming rule (longest match)."""
    owners = [r for r in roles if name.startswith(r + "_")]
    return max(owners, key=len) if owners else None


def artifacts_group(roles_dir: Path, groups: tuple[RoleGroup, ...] = ROLE_GROUPS) -> int:
    """The first group with a role whose install files read `nodeforge_artifacts`: the
    artifacts' sha256s and the versions file key that group (and so every later one)."""
    readers = [
        group_index(role.name, groups)
        for role in roles_dir.iterdir()
        if role.is_dir()
        and role.name not in NOT_IN_LAYER
        and any(_ARTIFACTS_READ.search(f.read_bytes()) for f in _role_files(role))
    ]
    return min(readers, default=0)


@dataclass(frozen=True)
class PrefixInputs:
    """What one group of the install pass adds to the tree, over its parent."""

    group: str
    parent: str  # the previous group's key; the base key for the first group
    roles: dict[str, str]  # role name -> digest of its non-template files
    install_vars: dict[str, object]
    artifacts: dict[str, str]  # artifact name -> sha256 (in the group that reads them)
    files: dict[str, str]  # playbook / versions file -> sha256 (in the group they key)

    def key(self) -> str:
        blob = json.dumps({"schema": LAYER_SCHEMA, **self.__dict__}, sort_keys=True)
        return sha256_bytes(blob.encode())


@dataclass(frozen=True)
class LayerInputs:
    """Everything that affects what the install pass puts into the tree, per group."""

    base_key: str
    prefixes: tuple[PrefixInputs, ...]

    def keys(self) -> list[str]:
        return [p.key() for p in self.prefixes]

    def key(self) -> str:
        """The last group's key: the whole provisioned tree."""
        return self.prefixes[-1].key()


def layer_inputs(
    *,
    base_key: str,
    roles_dir: Path,
    playbook: Path,
    versions_file: Path,
    artifacts: dict[str, str],
    ansible_vars: dict[str, object],
    groups: tuple[RoleGroup, ...] = ROLE_GROUPS,
) -> LayerInputs:
    roles = role_install_digests(roles_dir)
    ivars = install_vars(ansible_vars)
    arts_at = artifacts_group(roles_dir, groups)
    prefixes: list[PrefixInputs] = []
    parent = base_key
    for i, g in enumerate(groups):
        files = {"playbook": _file_sha(playbook)} if i == 0 else {}
        if i == arts_at:
            files["versions_file"] = _file_sha(versions_file)
        mine = {r: d for r, d in roles.items() if group_index(r, groups) == i}
        p = PrefixInputs(
            group=g.name,
            parent=parent,
            roles=mine,
            install_vars={
                k: v
                for k, v in ivars.items()
                if group_index(var_owner(k, roles) or "", groups) == i
            },
            artifacts=dict(sorted(artifacts.items())) if i == arts_at else {},
            files=files,
        )
        prefixes.append(p)
        parent = p.key()
    return LayerInputs(base_key, tuple(prefixes))


# The agent wheel is built from these (images/agent_wheel.py: the core, bootstrap and gang;
# never the build code or the test bed) plus the unit file the node_agent role copies from
# gang/. A change to images/ or lab/ alone does not re-apply node_agent.
AGENT_SOURCE_DIRS = ("nodeforge", "bootstrap", "gang")


def config_inputs(
    *, roles_dir: Path, repo: Path, ansible_vars: dict[str, object]
) -> dict[str, object]:
    """What a pass over a cached layer applies: each role's templates, the configuration
    variables and the agent's sources. Recorded with the layer, compared on reuse."""
    templates = {}
    for role in sorted(p for p in roles_dir.iterdir() if p.is_dir()):
        t = role / "templates"
        templates[role.name] = files_digest(t, _source_files(t)) if t.is_dir() else ""
    agent = [f for d in AGENT_SOURCE_DIRS if (repo / d).is_dir() for f in _source_files(repo / d)]
    agent += [repo / "pyproject.toml"] if (repo / "pyproject.toml").is_file() else []
    return {
        "templates": templates,
        "vars": {k: v for k, v in sorted(ansible_vars.items()) if not INSTALL_VAR.fullmatch(k)},
        "agent": files_digest(repo, agent),
    }


def roles_to_reapply(
    old: dict, new: dict, roles: list[str], *, among: list[str] | None = None
) -> list[str] | None:
    """The roles (in playbook order) whose configuration differs between the layer (*old*)
    and this build (*new*); None when that cannot be told (then every role runs). A variable
    belongs to the role its name starts with (the roles' `<role>_` naming rule). *among*:
    only these of *roles* (the groups a cached prefix layer holds) are asked about."""
    try:
        changed = {r for r in roles if old["templates"].get(r) != new["templates"].get(r)}
        for k in set(old["vars"]) | set(new["vars"]):
            if old["vars"].get(k) != new["vars"].get(k):
                owner = [r for r in roles if k.startswith(r + "_")]
                if not owner:
                    return None
                changed.update(owner)
        if old["agent"] != new["agent"]:
            changed.add("node_agent")
    except (KeyError, TypeError, AttributeError):
        return None
    return [r for r in roles if r in changed and (among is None or r in among)]


def sources_digest(repo: Path) -> str:
    """Digest of every source file of the checkout that a build reads or packs (the wheel
    carries package data too, so the roles and extensions are in it)."""
    files = [f for d in SOURCE_DIRS if (repo / d).is_dir() for f in _source_files(repo / d)]
    files += [repo / f for f in SOURCE_FILES if (repo / f).is_file()]
    return files_digest(repo, files)


def build_key(
    *,
    layer_key: str,
    repo: Path,
    playbook: Path,
    user_vars: dict[str, object],
    options: dict[str, object],
) -> str:
    """Key of the whole build: the layer key plus every source the build reads (roles with
    their templates, the agent and build code, extensions), the playbook, every var-file
    value and the build options. Equal keys mean an identical build."""
    blob = json.dumps(
        {
            "layer": layer_key,
            "sources": sources_digest(repo),
            "playbook": _file_sha(playbook),
            "vars": user_vars,
            "options": options,
        },
        sort_keys=True,
        default=str,
    )
    return sha256_bytes(blob.encode())


# -- tree digest ----------------------------------------------------------------------------


class Cancelled(Exception):
    """A digest given up because its build is stopping."""


RACY_NS = 100_000_000  # 0.1 s: many times the kernel's coarse timestamp tick (1-10 ms)


@dataclass(frozen=True)
class TreeDigest:
    content: str  # sha256 over every entry's metadata, xattrs and content (the layer's digest)
    stat: str  # sha256 over every entry's path and inode fields, nothing read (VerifiedMark)
    bytes: int
    entries: int
    # No entry's ctime was within RACY_NS before its lstat: a later change to any entry gets
    # a later ctime, so the stat digest can stand for the content read here.
    settled: bool


def _walk(
    tree: Path, cancelled: Callable[[], bool], now_ns: Callable[[], int] = lambda: 0
) -> Iterator[tuple[str, str, os.stat_result, int]]:
    """(path, path relative to *tree*, lstat, *now_ns* just before that lstat) of every
    entry below *tree*, in the digests' order; *cancelled* is asked once per directory
    (raises Cancelled)."""
    root = str(tree)
    for dirpath, dirnames, filenames in os.walk(root):
        if cancelled():
            raise Cancelled(tree)
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            t = now_ns()
            yield p, os.path.relpath(p, root), os.lstat(p), t


def _stat_line(rel: str, st: os.stat_result) -> bytes:
    """An entry's inode fields for the stat digest. ctime (which no user call can set: any
    write, truncate, chmod, chown, xattr or link change moves it to now) with the inode and
    device numbers (a file replaced or the tree copied elsewhere has others)."""
    return (
        f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0{st.st_mtime_ns}\0"
        f"{st.st_ctime_ns}\0{st.st_ino}\0{st.st_dev}\0{st.st_nlink}\0{st.st_rdev}\n"
    ).encode("utf-8", "surrogateescape")


def tree_digests(
    tree: Path,
    cancelled: Callable[[], bool] = lambda: False,
    now_ns: Callable[[], int] = time.time_ns,
) -> TreeDigest:
    """The content digest and the stat digest of *tree* in one walk (see tree_digest). Each
    entry's lstat is taken before its content is read, so a change after it (while reading,
    or at any time later) shows in the stat digest as well: it gets a ctime of at least the
    lstat's time less one tick, later than the recorded ctime when that was more than
    RACY_NS older than the lstat (else the walk is not `settled`)."""
    h, hs = hashlib.sha256(), hashlib.sha256()
    total = count = 0
    settled = True
    for p, rel, st, t in _walk(tree, cancelled, now_ns):
        hs.update(_stat_line(rel, st))
        settled = settled and st.st_ctime_ns < t - RACY_NS
        h.update(
            f"{rel}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0".encode("utf-8", "surrogateescape")
        )
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode("utf-8", "surrogateescape"))
        elif stat.S_ISREG(st.st_mode):
            h.update(f"{st.st_size}\0".encode() + _file_sha(Path(p)).encode())
            total += st.st_size
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            h.update(f"{st.st_rdev}".encode())
        for attr, value in _xattrs(p):
            h.update(b"\0" + attr.encode("utf-8", "surrogateescape") + b"=" + value)
        h.update(b"\n")
        count += 1
    return TreeDigest(h.hexdigest(), hs.hexdigest(), total, count, settled)


def tree_stat_digest(tree: Path, cancelled: Callable[[], bool] = lambda: False) -> str:
    """The stat digest of *tree* alone: one lstat per entry, no content read (~0.3 s of CPU
    for the 26k entries of a node tree, against ~2.7 s for the content digest)."""
    hs = hashlib.sha256()
    for _, rel, st, _ in _walk(tree, cancelled):
        hs.update(_stat_line(rel, st))
    return hs.hexdigest()


def tree_digest(tree: Path, cancelled: Callable[[], bool] = lambda: False) -> tuple[str, int, int]:
    """(sha256, bytes, entries) over every entry of *tree*: path, type, mode, owner, size,
    link target, device number, extended attributes and the content of regular files. Any
    truncated, missing, extra or altered file changes it. The xattrs carry file capabilities
    and, in an overlayfs upper dir (a later group's layer), the opaque-dir and redirect marks;
    its whiteouts are 0/0 character devices. *cancelled* is asked once per directory
    (raises Cancelled)."""
    d = tree_digests(tree, cancelled)
    return d.content, d.bytes, d.entries


def _xattrs(path: str) -> list[tuple[str, bytes]]:
    """The entry's extended attributes (not followed through a link), by name; none where
    the filesystem has no xattr support."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return []
        raise
    return [(n, os.getxattr(path, n, follow_symlinks=False)) for n in sorted(names)]


# -- the verified mark ----------------------------------------------------------------------
#
# Reading a layer back costs ~2.7 s of CPU per GiB-sized tree: on a 2-core host it competed
# with every config-only rebuild's Ansible pass and export. What the content digest guards
# against is an accident: a build or copy interrupted mid-write, a file removed, truncated or
# edited in the cache by a person or a program, a disk that returns other bytes. Not a
# deliberate forger: whoever can write the layer can rewrite its layer.json (the digest
# itself) too, so no check inside the cache stops them.
#
# A full check that matched leaves a mark: the stat digest of the tree (path, mode, owner,
# size, mtime, ctime, inode, device, link count of every entry), the boot and the time. A
# later check with the same layer digest, the same boot, within MARK_MAX_AGE, and the same
# stat digest reads nothing more. That is sound because every change made through the
# kernel (write, truncate, rename, unlink, chmod, chown, xattr, a link) sets the entry's
# ctime to now, and no call lets a program set ctime back: only changing the system clock
# (root: the forger above) or editing the block device under the filesystem could. A tree
# copied elsewhere has other inode/device numbers. What is not seen between two full checks:
# the disk changing bytes under the page cache without the kernel knowing (no data checksums
# on ext4), so a mark holds for one boot (the page cache is gone after it) and MARK_MAX_AGE
# at most. An entry changed within RACY_NS before the walk reached it (the kernel's ctime has
# a coarse tick, so a second change in the same tick could keep it) leaves no mark: the next
# check is full again.

VERIFIED_MARK = "verified.json"
MARK_SCHEMA = 1
MARK_MAX_AGE = 24 * 3600.0  # a full content check at least once a day per layer
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_BOOT_ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def read_boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id; empty when it cannot be read (then no mark is written or trusted)."""
    try:
        value = path.read_text().strip()
    except OSError:
        return ""
    return value if _BOOT_ID_RE.fullmatch(value) else ""


@dataclass(frozen=True)
class VerifiedMark:
    digest: str  # the layer's content digest that the full check matched
    stat: str  # the tree's stat digest taken by that check (before reading each entry)
    boot_id: str
    at: float  # when (the store's clock)

    @classmethod
    def load(cls, path: Path) -> VerifiedMark | None:
        """The mark at *path*, or None when there is none or it is not a sound one."""
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(m, dict) or m.get("schema") != MARK_SCHEMA:
            return None
        digest, st, boot, at = m.get("digest"), m.get("stat"), m.get("boot_id"), m.get("at")
        if not (
            isinstance(digest, str)
            and KEY_RE.fullmatch(digest)
            and isinstance(st, str)
            and KEY_RE.fullmatch(st)
            and isinstance(boot, str)
            and _BOOT_ID_RE.fullmatch(boot)
            and (
                (isinstance(at, float) and math.isfinite(at))
                or (type(at) is int and abs(at) < 1 << 53)  # not bool; float() cannot overflow
            )
        ):
            return None
        return cls(digest, st, boot, float(at))

    def holds_for(self, digest: str, boot_id: str, now: float) -> bool:
        """Whether this mark may stand for a full check of a layer with *digest* now (its
        tree's stat digest still to be compared)."""
        return (
            bool(boot_id)
            and self.digest == digest
            and self.boot_id == boot_id
            and 0.0 <= now - self.at <= MARK_MAX_AGE
        )

    def write(self, path: Path) -> None:
        write_json_atomic(path, {"schema": MARK_SCHEMA, **self.__dict__})


# -- the lock -------------------------------------------------------------------------------


@contextmanager
def locked(cache_dir: Path) -> Iterator[None]:
    """Hold the cache dir's lock for one build or prune; a second one fails at once, naming
    the holder, instead of sharing half-written layers and artifacts."""
    path = cache_dir / ".lock"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise NodeforgeError(
            f"cannot lock the build cache {cache_dir}: {e.strerror}; builds "
            "run as root, or pass a --cache-dir you can write"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise NodeforgeError(
                f"the build cache {cache_dir} is in use by another nodeforge build or prune "
                f"(pid {holder}); wait for it to finish, or pass another --cache-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# -- the layer store ------------------------------------------------------------------------


@dataclass
class Layer:
    key: str
    path: Path  # layers/<key>
    config: dict  # config_inputs() of the build that made it
    digest: str = ""  # the content digest recorded when it was stored
    parent: str | None = None  # the layer this one is an overlayfs diff over

    @property
    def tree(self) -> Path:
        return self.path / "tree"


@dataclass
class LayerInfo:
    key: str
    bytes: int
    entries: int
    created: float
    last_used: float
    parent: str | None = None


class LayerStore:
    """Layers under `<cache>/layers`; callers hold locked(cache_dir)."""

    def __init__(
        self,
        cache_dir: Path,
        *,
        clock: Callable[[], float] = time.time,
        log: Callable[[str], None] = lambda msg: None,
        boot_id: Callable[[], str] = read_boot_id,
    ):
        self.root = cache_dir / "layers"
        self.clock = clock  # the wall clock: also what entries' ctimes are compared with
        self.log = log
        self.boot_id = boot_id

    def _meta(self, key: str) -> Path:
        return self.root / key / LAYER_META

    def drop_unfinished(self) -> list[str]:
        """Remove entries whose write never finished (an interrupted or killed build)."""
        gone = []
        if self.root.is_dir():
            for p in self.root.iterdir():
                if p.name.startswith(".tmp-"):
                    shutil.rmtree(p, ignore_errors=True)
                    gone.append(p.name)
        return gone

    def lookup(self, key: str) -> Layer | None:
        """The verified layer for *key*, or None. An entry that fails verification (no or
        bad layer.json, a digest that no longer matches its tree) is dropped."""
        layer = self.open(key)
        if layer is not None:
            problem = self.verify(layer)
            if problem:
                self.drop(layer, problem)
                return None
        return layer

    def open_chain(self, keys: list[str]) -> list[Layer]:
        """The longest cached prefix of *keys* (each group's layer key, in order), records
        sound and each one's parent the key before it; content NOT yet verified (see open).
        A layer past the first missing one has lost its parent: it is dropped, a miss."""
        chain: list[Layer] = []
        for key in keys:
            layer = self.open(key)
            want = chain[-1].key if chain else None
            if layer is not None and layer.parent != want:
                self.drop(layer, f"its parent is {layer.parent}, not {want}")
                layer = None
            if layer is None:
                break
            chain.append(layer)
        for key in keys[len(chain) + 1 :]:
            orphan = self.root / key
            if orphan.exists():
                self.drop(Layer(key, orphan, {}), "the layer it was made over is gone")
        return chain

    def open(self, key: str) -> Layer | None:
        """The layer for *key* when its record is sound (schema, key, digest, tree present),
        its content NOT yet verified: a caller that starts work on it must finish verify()
        before anything made from it is kept, and drop() it when that fails. An entry with
        an unsound record is dropped here."""
        if not KEY_RE.fullmatch(key):
            raise NodeforgeError(f"internal: bad layer key {key!r}")
        path = self.root / key
        if not path.exists():
            return None
        meta, problem = self._record(path, key)
        if problem:
            self.drop(Layer(key, path, {}), problem)
            return None
        meta["last_used"] = self.clock()
        write_json_atomic(self._meta(key), meta)
        return Layer(key, path, meta.get("config") or {}, meta["digest"], meta.get("parent"))

    def verify(self, layer: Layer, cancelled: Callable[[], bool] = lambda: False) -> str:
        """Empty when the layer's tree has the content digest recorded with it, else why not.
        A full check is skipped only where the layer's mark holds (see VerifiedMark): then no
        entry has changed since a full check in this boot."""
        mark_path = layer.path / VERIFIED_MARK
        mark = VerifiedMark.load(mark_path)
        boot = self.boot_id()
        try:
            if (
                mark is not None
                and mark.holds_for(layer.digest, boot, self.clock())
                and tree_stat_digest(layer.tree, cancelled) == mark.stat
            ):
                self.log(
                    f"cache: layer {layer.key[:16]} verified by its mark (no entry changed "
                    "since its content digest matched in this boot)"
                )
                return ""
            mark_path.unlink(missing_ok=True)  # stale or unsound: a full check follows
            d = tree_digests(layer.tree, cancelled, self._now_ns)
        except OSError as e:
            return f"its tree cannot be read ({e})"
        if d.content != layer.digest:
            return "its content digest does not match (corrupt or altered tree)"
        marked = self._mark(layer.path, d, boot)
        self.log(
            f"cache: layer {layer.key[:16]} verified by reading its {d.entries} entries"
            + ("" if marked else " (no mark left: an entry changed just before, or no boot id)")
        )
        return ""

    def _now_ns(self) -> int:
        return int(self.clock() * 1e9)

    def _mark(self, path: Path, d: TreeDigest, boot: str) -> bool:
        """Leave the mark of a full check that matched, where it may stand for the next."""
        if d.settled and boot:
            VerifiedMark(d.content, d.stat, boot, self.clock()).write(path / VERIFIED_MARK)
            return True
        return False

    def drop(self, layer: Layer, problem: str) -> None:
        """Remove *layer* and every layer made over it (they would have no parent)."""
        self.log(f"cache: layer {layer.key[:16]} is unusable ({problem}); dropped, rebuilding")
        for key in self.descendants(layer.key):
            self.log(f"cache: layer {key[:16]} was made over it; dropped with it")
            shutil.rmtree(self.root / key, ignore_errors=True)
        shutil.rmtree(layer.path, ignore_errors=True)

    def descendants(self, key: str) -> list[str]:
        """The layers made over *key*, directly or not (children first)."""
        children: dict[str | None, list[str]] = {}
        for i in self.entries():
            children.setdefault(i.parent, []).append(i.key)
        out: list[str] = []
        todo = list(children.get(key, []))
        while todo:
            k = todo.pop(0)
            if k in out or k == key:  # a record that names itself (or a loop): once
                continue
            out.append(k)
            todo += children.get(k, [])
        return out

    def _record(self, path: Path, key: str) -> tuple[dict, str]:
        try:
            meta = json.loads((path / LAYER_META).read_text())
        except (OSError, ValueError) as e:
            return {}, f"no readable {LAYER_META}: {e}"
        parent = meta.get("parent") if isinstance(meta, dict) else None
        if (
            not isinstance(meta, dict)
            or meta.get("schema") != LAYER_SCHEMA
            or meta.get("key") != key
            or not KEY_RE.fullmatch(str(meta.get("digest", "")))
            or not (parent is None or (isinstance(parent, str) and KEY_RE.fullmatch(parent)))
        ):
            return {}, f"{LAYER_META} is not a schema-{LAYER_SCHEMA} record of this key"
        if not (path / "tree").is_dir():
            return {}, "its tree is missing"
        return meta, ""

    def store(
        self,
        key: str,
        tree: Path,
        inputs: PrefixInputs,
        config: dict | None = None,
        *,
        parent: str | None = None,
    ) -> Layer:
        """Move *tree* into the cache as the layer for *key* (with *parent*: *tree* is an
        overlayfs upper dir over that layer): written under a temp name and renamed into
        place once its digest is recorded, so an interrupted write leaves no entry. *tree*
        must be on the cache's filesystem (the build's work dir is)."""
        if parent is not None and not (self.root / parent / LAYER_META).is_file():
            raise NodeforgeError(f"internal: layer {key[:16]} stored over a missing parent")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{key}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        os.rename(tree, tmp / "tree")
        d = tree_digests(tmp / "tree", now_ns=self._now_ns)
        digest, size, entries = d.content, d.bytes, d.entries
        self._mark(tmp, d, self.boot_id())  # the store's own full read counts as a check
        now = self.clock()
        write_json_atomic(
            tmp / LAYER_META,
            {
                "schema": LAYER_SCHEMA,
                "key": key,
                "digest": digest,
                "bytes": size,
                "entries": entries,
                "created": now,
                "last_used": now,
                "parent": parent,
                "inputs": inputs.__dict__,
                "config": config or {},
            },
        )
        final = self.root / key
        # the old entry aside under a .tmp- name: an interrupted swap leaves it to the sweep
        swap_dir(tmp, final, old=self.root / f".tmp-old-{key}-{os.getpid()}")
        return Layer(key, final, config or {}, digest, parent)

    def entries(self) -> list[LayerInfo]:
        out: list[LayerInfo] = []
        if not self.root.is_dir():
            return out
        for p in sorted(self.root.iterdir()):
            if p.name.startswith(".tmp-") or not KEY_RE.fullmatch(p.name):
                continue
            try:
                m = json.loads((p / LAYER_META).read_text())
                parent = m.get("parent")
                out.append(
                    LayerInfo(
                        p.name,
                        int(m["bytes"]),
                        int(m["entries"]),
                        float(m["created"]),
                        float(m["last_used"]),
                        parent if isinstance(parent, str) and KEY_RE.fullmatch(parent) else None,
                    )
                )
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                out.append(LayerInfo(p.name, 0, 0, 0.0, 0.0))  # unusable: pruned first
        return out

    def prune(self, max_bytes: int, *, keep: Iterable[str] = ()) -> list[str]:
        """Remove unfinished entries and layers whose parent is gone, then the least
        recently used layers, each with the layers made over it, until the rest fit in
        *max_bytes* (0 removes all). *keep* (the layers in use) and their parents are
        never removed, so no layer is ever left without its parent."""
        removed = [f"{n} (unfinished)" for n in self.drop_unfinished()]
        kept = set(keep)
        by_key = {i.key: i for i in self.entries()}
        gone: set[str] = set()

        def remove(key: str, why: str = "") -> None:
            for k in [key, *self.descendants(key)]:
                if k in gone:
                    continue
                shutil.rmtree(self.root / k, ignore_errors=True)
                gone.add(k)
                removed.append(k + why if k == key else f"{k} (made over {key[:16]})")

        for info in list(by_key.values()):
            if info.parent is not None and info.parent not in by_key and info.key not in gone:
                remove(info.key, " (its parent is gone)")

        # A layer counts as used when any layer made over it was: a parent goes only after
        # (and with) the last of its children; of equal use, the one with fewer over it first.
        def order(info: LayerInfo) -> tuple[float, int]:
            under = [k for k in self.descendants(info.key) if k in by_key]
            return max([info.last_used, *(by_key[k].last_used for k in under)]), len(under)

        for info in sorted(by_key.values(), key=order):
            total = sum(i.bytes for k, i in by_key.items() if k not in gone)
            if total <= max_bytes and info.bytes:
                break
            if info.key in gone or kept & {info.key, *self.descendants(info.key)}:
                continue
            remove(info.key)
        return removed


def parse_size(value: str) -> int:
    """A size with an optional K/M/G/T suffix (powers of 1024); bare means bytes."""
    m = re.fullmatch(r"([0-9]{1,15})([KMGT]?)i?B?", value, re.IGNORECASE)
    if not m:
        raise NodeforgeError(
            f"size {value!r} is not a size: use a number with K, M, G or T (e.g. 20G)"
        )
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2).upper()]
