"""User-data from a seed device, for machines with neither cloud-init nor an IMDSv2.

OpenStack's config drive (a vfat or ISO 9660 filesystem labelled `config-2`, user-data in
`openstack/latest/user_data`) and cloud-init's NoCloud seed (labelled `cidata`, user-data in
`user-data`; Proxmox, libvirt and others attach one) carry the same user-data cloud-init would
read. The image ships no cloud-init, so the agent reads it itself: the device is found by its
label (blkid), mounted read-only with nosuid,nodev,noexec on a private directory, the one file
is read (never through a symlink, at most one byte past the document cap), and the device is
unmounted whatever happened.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import CompletedProcess

from nodeforge import strict_yaml

from .params import ParamsError


@dataclass(frozen=True)
class Seed:
    kind: str  # "config-drive" | "nocloud": the params source's name
    device: str
    fstype: str
    user_data: str  # the file's path inside the filesystem

    @property
    def label(self) -> str:
        """How errors name it: the device, what it is and the file."""
        what = "OpenStack config drive" if self.kind == "config-drive" else "NoCloud seed"
        return f"{self.device} ({what}) {self.user_data}"


# Filesystem label -> (kind, user-data path). vfat labels are stored upper-case, so both forms
# (as cloud-init accepts them).
LABELS = {
    "config-2": ("config-drive", "openstack/latest/user_data"),
    "CONFIG-2": ("config-drive", "openstack/latest/user_data"),
    "cidata": ("nocloud", "user-data"),
    "CIDATA": ("nocloud", "user-data"),
}
FSTYPES = ("iso9660", "vfat")  # what both formats use, and all that is mounted
MOUNT_OPTIONS = "ro,nosuid,nodev,noexec"
_DEVNAME = re.compile(r"/dev/[A-Za-z0-9][A-Za-z0-9/_.:+-]{0,127}")


def _run(argv: list[str], timeout: float) -> CompletedProcess:
    from nodeforge import proc

    return proc.run(argv, check=False, timeout=timeout)


@dataclass
class SeedDevices:
    """Finding, mounting and unmounting seed devices: blkid, mount and umount through the
    one runner (tests pass a fake *run*). *workdir*: where the private mount points are made."""

    workdir: Path = Path("/run/nodeforge")
    run: Callable[[list[str], float], CompletedProcess] = _run
    device_exposure: Callable[[str], str | None] = field(default=lambda dev: device_exposure(dev))

    def find(self) -> list[Seed]:
        """Every block device whose filesystem label is a seed's (blkid -o export)."""
        # -c /dev/null: probe the devices, never blkid's cache (a loop or hot-plugged device
        # re-used for another filesystem kept its old label there)
        cp = self.run(["blkid", "-c", "/dev/null", "-o", "export"], 15)
        if cp.returncode == 2:  # blkid: no device matched (none at all, e.g. a container)
            return []
        if cp.returncode != 0:
            raise ParamsError(
                f"seed devices: `blkid -o export` failed (exit {cp.returncode}): "
                f"{_one_line(cp.stdout)}"
            )
        seeds = []
        for block in re.split(r"\n\s*\n", cp.stdout or ""):
            tags = dict(ln.split("=", 1) for ln in block.splitlines() if "=" in ln)
            label = tags.get("LABEL", "")
            if label not in LABELS:
                continue
            dev, fstype = tags.get("DEVNAME", ""), tags.get("TYPE", "")
            kind, path = LABELS[label]
            if not _DEVNAME.fullmatch(dev) or ".." in dev.split("/"):
                raise ParamsError(
                    f"seed devices: blkid named a device {dev!r:.80}; not a /dev path"
                )
            if fstype not in FSTYPES:
                raise ParamsError(
                    f"{dev}: labelled {label!r} (a {kind} seed) but its filesystem is "
                    f"{fstype!r:.40}; a seed is {' or '.join(FSTYPES)}"
                )
            seeds.append(Seed(kind, dev, fstype, path))
        return seeds

    def read(self, seed: Seed) -> str | None:
        """The user-data text of *seed* (None: the file is not there), the device mounted only
        for the read. Unmounted and the mount point removed on every path out."""
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        target = Path(tempfile.mkdtemp(prefix="seed-", dir=self.workdir))  # 0700, ours alone
        mounted = False
        try:
            cp = self.run(
                ["mount", "-t", seed.fstype, "-o", MOUNT_OPTIONS, seed.device, str(target)], 30
            )
            if cp.returncode != 0:
                raise ParamsError(
                    f"{seed.label}: cannot mount it read-only "
                    f"({_one_line(cp.stdout) or f'exit {cp.returncode}'})"
                )
            mounted = True
            return read_in(target, seed.user_data, seed.label)
        finally:
            try:
                if mounted:
                    self._umount(target, seed)
            finally:
                # rmdir, never a recursive delete: this may still be a mount of the device
                with contextlib.suppress(OSError):
                    target.rmdir()

    def _umount(self, target: Path, seed: Seed) -> None:
        if self.run(["umount", str(target)], 30).returncode == 0:
            return
        # busy (something opened it meanwhile): detach it now, the kernel frees it when idle
        cp = self.run(["umount", "--lazy", str(target)], 30)
        if cp.returncode != 0:
            raise ParamsError(
                f"{seed.label}: cannot unmount {target} "
                f"({_one_line(cp.stdout) or f'exit {cp.returncode}'}); "
                f"unmount it by hand"
            )


def _one_line(out: str | None) -> str:
    """A tool's output in an error: one line, at most 200 characters."""
    return " ".join((out or "").split())[:200]


def read_in(root: Path, rel: str, label: str) -> str | None:
    """*rel* under *root*, every component a real directory or file (a symlink on the medium
    could point anywhere on this machine), at most one byte past the YAML document cap."""
    here = root
    parts = rel.split("/")
    for i, part in enumerate(parts):
        here = here / part
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ParamsError(f"{label}: cannot read: {exc.strerror}") from None
        last = i == len(parts) - 1
        if stat.S_ISLNK(st.st_mode):
            raise ParamsError(f"{label}: {'/'.join(parts[: i + 1])} is a symlink; refused")
        if not (stat.S_ISREG(st.st_mode) if last else stat.S_ISDIR(st.st_mode)):
            want = "a regular file" if last else "a directory"
            raise ParamsError(f"{label}: {'/'.join(parts[: i + 1])} is not {want}")
    try:
        fd = os.open(here, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ParamsError(f"{label}: cannot read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(strict_yaml.MAX_BYTES + 1)  # one byte past the cap: enough to refuse it
    return data.decode(errors="replace")


def device_exposure(dev: str) -> str | None:
    """Why users other than root can read *dev*, or None. A seed carries the same secrets as
    user-data; they are taken only from a device no unprivileged user can read."""
    try:
        st = os.stat(dev)
    except OSError as exc:
        return f"{dev} cannot be checked ({exc.strerror})"
    return exposure_of(st, _group_members)


def exposure_of(st: os.stat_result, members: Callable[[int], list[str]]) -> str | None:
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != 0:
        return f"the device is owned by uid {st.st_uid}, not root"
    if mode & stat.S_IROTH:
        return f"the device (mode {mode:04o}) can be read by every local user"
    if mode & stat.S_IRGRP:
        who = members(st.st_gid)
        if who:
            shown = ", ".join(who[:5]) + (", ..." if len(who) > 5 else "")
            return f"the device (mode {mode:04o}) can be read by its group's members ({shown})"
    return None


def _group_members(gid: int) -> list[str]:
    """Users in group *gid*: its listed members and the users whose primary group it is."""
    try:
        listed = list(grp.getgrgid(gid).gr_mem)
    except KeyError:
        listed = []
    return sorted(set(listed) | {p.pw_name for p in pwd.getpwall() if p.pw_gid == gid} - {"root"})
