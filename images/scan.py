"""Secret and identity scanner for a built image tree.

The build refuses to export a tree with any finding, and the e2e tests run the same scan on
the exported artifact. A file that a Debian package ships is public (it is in the archive),
so key material inside package-owned files (test vectors, examples) is not a finding; key
material anywhere else is.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_PRIVATE_KEY = re.compile(rb"-----BEGIN ([A-Z0-9 ]*)PRIVATE KEY-----")
_STORAGE_PASS = re.compile(rb"^\s*StoragePass\s*=\s*(\S+)", re.MULTILINE)
_MYCNF_PASS = re.compile(rb"^\s*password\s*=\s*(\S+)", re.MULTILINE)
_HISTORY = {".bash_history", ".python_history", ".mysql_history", ".lesshst", ".viminfo",
            ".sqlite_history", ".zsh_history"}
_SKIP_TOP = {"proc", "sys", "dev", "run"}
_MAX_READ = 4 << 20
_CONFIG_SUFFIXES = (".conf", ".cnf", ".ini", ".yaml", ".yml", ".env", ".json", ".credentials")


@dataclass(frozen=True)
class Finding:
    path: str  # absolute path inside the image
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind} ({self.detail})"


def _dpkg_owned(tree: Path) -> set[str]:
    owned: set[str] = set()
    info = tree / "var/lib/dpkg/info"
    if info.is_dir():
        for lst in info.glob("*.list"):
            owned.update(lst.read_text(errors="replace").splitlines())
    return owned


def _rel(tree: Path, p: Path) -> str:
    return "/" + str(p.relative_to(tree))


def scan(tree: Path) -> list[Finding]:
    tree = tree.resolve()
    out: list[Finding] = []

    def add(p: Path | str, kind: str, detail: str) -> None:
        out.append(Finding(p if isinstance(p, str) else _rel(tree, p), kind, detail))

    for p in sorted((tree / "etc/ssh").glob("ssh_host_*")):
        add(p, "ssh-host-key", "host keys must be generated at first boot, per node")
    if (tree / "etc/munge/munge.key").exists():
        add("/etc/munge/munge.key", "munge-key", "the cluster key comes from node params at first boot")
    mid = tree / "etc/machine-id"
    if mid.is_file() and mid.stat().st_size > 0 and mid.read_text().strip() not in ("", "uninitialized"):
        add(mid, "machine-id", "must be empty so each node gets its own")
    dbus_mid = tree / "var/lib/dbus/machine-id"
    if dbus_mid.is_file() and not dbus_mid.is_symlink() and dbus_mid.stat().st_size > 0:
        add(dbus_mid, "machine-id", "D-Bus copy of the machine id must not be baked")
    if (tree / "etc/ssh/sshd_config.d/00-nodeforge-build.conf").exists():
        add("/etc/ssh/sshd_config.d/00-nodeforge-build.conf", "build-access", "build sshd drop-in left behind")
    secrets_dir = tree / "etc/nodeforge/secrets"
    if secrets_dir.is_dir() and any(secrets_dir.iterdir()):
        add(secrets_dir, "db-credential", "generated credentials belong to a booted node")
    cloud = tree / "var/lib/cloud"
    if cloud.is_dir() and any(cloud.iterdir()):
        add(cloud, "cloud-init-state", "would make cloud-init skip first boot on new instances")
    lists = tree / "var/lib/apt/lists"
    if lists.is_dir() and any(p.name.endswith("_Packages") for p in lists.iterdir()):
        add(lists, "apt-lists", "stale package lists; apt-get update at use time")
    debs = list((tree / "var/cache/apt/archives").glob("*.deb"))
    if debs:
        add("/var/cache/apt/archives", "apt-cache", f"{len(debs)} cached .deb files")
    for tmpd in ("tmp", "var/tmp"):
        d = tree / tmpd
        if d.is_dir():
            left = [x.name for x in d.iterdir()]
            if left:
                add(d, "temp-files", ", ".join(sorted(left)[:5]))

    owned = _dpkg_owned(tree)
    for dirpath, dirnames, filenames in os.walk(tree):
        rel_dir = "/" + os.path.relpath(dirpath, tree) if dirpath != str(tree) else "/"
        if rel_dir == "/":
            dirnames[:] = [d for d in dirnames if d not in _SKIP_TOP]
        for name in filenames:
            p = Path(dirpath, name)
            rel = (rel_dir.rstrip("/") + "/" + name)
            if name in _HISTORY:
                add(rel, "shell-history", "may hold commands with secrets")
                continue
            if name == "authorized_keys" or name == "authorized_keys2":
                add(rel, "authorized-keys", "build or user access must not be baked")
                continue
            if rel in owned or p.is_symlink() or not p.is_file():
                continue
            try:
                if p.stat().st_size > _MAX_READ:
                    continue
                data = p.read_bytes()
            except OSError:
                continue
            m = _PRIVATE_KEY.search(data)
            if m:
                add(rel, "private-key", f"{m.group(0).decode()} in a file no package ships")
            if not name.endswith(_CONFIG_SUFFIXES):
                continue  # credentials live in config files; code says "password = …" too
            for rx in (_STORAGE_PASS, _MYCNF_PASS):
                for mm in rx.finditer(data):
                    val = mm.group(1)
                    if val and not val.startswith(b"{{"):
                        add(rel, "db-credential", "a password value is set")
    return out
