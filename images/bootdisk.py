"""A disk that firmware boots: GPT, a BIOS boot partition, an EFI system partition and root.

Layout (amd64; arm64 has no BIOS boot partition):

    1 MiB   GPT header and alignment
    1 MiB   BIOS boot (grub-pc's core.img: legacy BIOS/SeaBIOS)
   63 MiB   EFI system partition, FAT32 (Debian's signed shim + grub: UEFI and Secure Boot)
    rest    root, ext4, GPT type "root-<arch>" (systemd-repart grows it at first boot)
    1 MiB   backup GPT

Tools, and why: sfdisk writes the table from a script (no hand-made GPT); mkfs.ext4 -d
fills root from the sealed tree; the image's *own* grub-install (BIOS) and update-grub run
chrooted in the mounted root with a private /dev holding only the loop device, so the
loader and its config come from the image's grub version, not the build host's (Debian 12
host, Debian 13 image). The ESP is made with dosfstools and filled with mtools, because
many build hosts (and this project's) run kernels without vfat: the files are the ones
Debian's `grub-install --uefi-secure-boot --force-extra-removable` installs (shim as the
removable path's BOOTX64.EFI, grub and MokManager beside it, a grub.cfg that finds root by
filesystem UUID), copied from the image's own shim-signed and grub-efi-*-signed packages.

Loop partitions are added with partx (BLKPG), which works where the kernel has no GPT
parser of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from nodeforge import proc
from nodeforge.errors import NodeforgeError

log = logging.getLogger("nodeforge.bootdisk")

MIB = 1 << 20
SECTOR = 512
FS_LABEL = "nodeforge-root"
BIOS_BOOT_TYPE = "21686148-6449-6E6F-744E-656564454649"
ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
# The Discoverable Partitions Specification's root types: systemd-repart matches by type.
ROOT_TYPE = {
    "amd64": "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709",
    "arm64": "B921B045-1DF0-41C3-AF44-4C6F280D3FAE",
}
BIOS_MIB, ESP_MIB = 1, 63
# GPT + alignment before the first partition, backup GPT after the last.
LEAD_MIB, TAIL_MIB = 1, 1
NAMES = {"bios": "bios-boot", "esp": "esp", "root": FS_LABEL}
# What the EFI loader files are, per architecture: (removable-path name, source in the image).
EFI_FILES = {
    "amd64": {
        "BOOTX64.EFI": "usr/lib/shim/shimx64.efi.signed",
        "grubx64.efi": "usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed",
        "mmx64.efi": "usr/lib/shim/mmx64.efi.signed",
    },
    "arm64": {
        "BOOTAA64.EFI": "usr/lib/shim/shimaa64.efi.signed",
        "grubaa64.efi": "usr/lib/grub/arm64-efi-signed/grubaa64.efi.signed",
        "mmaa64.efi": "usr/lib/shim/mmaa64.efi.signed",
    },
}
_UUID = re.compile(r"[0-9A-Fa-f]{8}-(?:[0-9A-Fa-f]{4}-){3}[0-9A-Fa-f]{12}")
_DEV = re.compile(r"/dev/loop[0-9]{1,4}")


@dataclass(frozen=True)
class Partition:
    number: int
    role: str  # bios | esp | root
    type: str  # GPT type GUID (upper case)
    partuuid: str  # upper case
    start: int  # bytes
    bytes: int

    @property
    def name(self) -> str:
        return NAMES[self.role]


@dataclass(frozen=True)
class Layout:
    arch: str
    disk_bytes: int
    partitions: tuple[Partition, ...]

    def part(self, role: str) -> Partition:
        for p in self.partitions:
            if p.role == role:
                return p
        raise NodeforgeError(f"internal: the disk layout has no {role} partition")


def overhead_mib(arch: str) -> int:
    """MiB of the disk that are not root."""
    return LEAD_MIB + (BIOS_MIB if arch == "amd64" else 0) + ESP_MIB + TAIL_MIB


def plan(arch: str, disk_mib: int, root_needs_mib: int) -> Layout:
    """The partitions of a *disk_mib* disk. A disk too small for *root_needs_mib* of root is
    refused here, before anything is written."""
    if arch not in ROOT_TYPE:
        raise NodeforgeError(f"disk layout: architecture {arch!r} is not amd64 or arm64")
    root_mib = disk_mib - overhead_mib(arch)
    if root_mib < root_needs_mib:
        raise NodeforgeError(
            f"disk size {disk_mib} MiB is smaller than the image needs "
            f"({root_needs_mib + overhead_mib(arch)} MiB: {root_needs_mib} MiB of root "
            f"filesystem plus {overhead_mib(arch)} MiB of partition table, BIOS boot and EFI "
            "system partitions); raise disk_size (qemu target: in the var file)"
        )
    parts = []
    at = LEAD_MIB
    sizes = [("bios", BIOS_MIB, BIOS_BOOT_TYPE)] if arch == "amd64" else []
    sizes += [("esp", ESP_MIB, ESP_TYPE), ("root", root_mib, ROOT_TYPE[arch])]
    for i, (role, mib, typ) in enumerate(sizes, 1):
        parts.append(Partition(i, role, typ, str(uuid.uuid4()).upper(), at * MIB, mib * MIB))
        at += mib
    return Layout(arch, disk_mib * MIB, tuple(parts))


def sfdisk_script(layout: Layout) -> str:
    lines = ["label: gpt", "unit: sectors", f"first-lba: {LEAD_MIB * MIB // SECTOR}"]
    for p in layout.partitions:
        lines.append(
            f"start={p.start // SECTOR}, size={p.bytes // SECTOR}, type={p.type}, "
            f'uuid={p.partuuid}, name="{p.name}"'
        )
    return "\n".join(lines) + "\n"


def write_table(raw: Path, layout: Layout) -> None:
    proc.run(
        [proc.require_tool("sfdisk"), "--quiet", "--no-reread", "--no-tell-kernel", raw],
        input=sfdisk_script(layout),
        timeout=60,
    )


def read_table(raw: Path | str, arch: str) -> Layout | None:
    """The layout of a disk that nodeforge partitioned (its names and types), or None for any
    other disk (a bare filesystem, a cloud image's own layout)."""
    cp = proc.run([proc.require_tool("sfdisk"), "--json", raw], check=False, timeout=60)
    if cp.returncode != 0 or not cp.stdout.strip():
        return None
    try:
        table = json.loads(cp.stdout)["partitiontable"]
        sector = int(table.get("sectorsize", SECTOR))
        by_name = {str(p.get("name", "")): p for p in table.get("partitions", [])}
        roles = ["bios", "esp", "root"] if arch == "amd64" else ["esp", "root"]
        if table.get("label") != "gpt" or sorted(by_name) != sorted(NAMES[r] for r in roles):
            return None
        parts = []
        for role in roles:
            p = by_name[NAMES[role]]
            typ, puuid = str(p["type"]).upper(), str(p["uuid"]).upper()
            if not _UUID.fullmatch(puuid) or typ != {
                "bios": BIOS_BOOT_TYPE, "esp": ESP_TYPE, "root": ROOT_TYPE.get(arch, "")
            }[role]:  # fmt: skip
                return None
            num = int(re.sub(r"^.*?([0-9]+)$", r"\1", str(p["node"])))
            parts.append(
                Partition(num, role, typ, puuid, int(p["start"]) * sector, int(p["size"]) * sector)
            )
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    return Layout(arch, os.stat(raw).st_size, tuple(parts))


# Loop devices tried before giving up when each one found still carries partitions of an earlier
# attachment (see attached()).
LOOP_TRIES = 8
SYS_BLOCK = Path("/sys/block")


def stale_partitions(dev: str, sys_block: Path = SYS_BLOCK) -> list[str]:
    """Partitions the kernel still lists for loop device *dev* (/sys/block/loopN/loopNpK)."""
    name = Path(dev).name
    return sorted(p.name for p in (sys_block / name).glob(f"{name}p[0-9]*"))


@contextmanager
def attached(raw: Path | str, sys_block: Path = SYS_BLOCK) -> Iterator[str]:
    """*raw* as a loop device with its partitions (/dev/loopNpK, added by partx).

    partx's partitions outlive the loop device when one of them is still mounted somewhere at
    detach time (a mount namespace copied while it was mounted: a container started during an
    export). The kernel then hands out that loop device again with the stale partitions, and
    `partx --add` fails ("error adding partition 3"). So a device found with partitions that
    `partx --delete` cannot remove is kept attached (losetup --find skips it) and another one
    is taken; all are detached at the end."""
    held: list[str] = []  # loop devices with stale partitions, kept out of losetup's hands
    try:
        dev = _free_loop(raw, held, sys_block)
        try:
            proc.run([proc.require_tool("partx"), "--add", dev], timeout=60)
            yield dev
        finally:
            cp = proc.run([proc.require_tool("partx"), "--delete", dev], check=False, timeout=60)
            left = stale_partitions(dev, sys_block)
            if cp.returncode != 0 or left:
                log.warning(
                    "%s: partitions %s could not be removed (something still holds them: "
                    "`grep -l %s /proc/*/mountinfo` finds the mount); the next attachment "
                    "takes another loop device", dev, ", ".join(left) or "?",
                    left[0] if left else Path(dev).name,
                )  # fmt: skip
            proc.run([proc.require_tool("losetup"), "--detach", dev], check=False, timeout=60)
    finally:
        for h in held:
            proc.run([proc.require_tool("losetup"), "--detach", h], check=False, timeout=60)


def _free_loop(raw: Path | str, held: list[str], sys_block: Path) -> str:
    """A loop device for *raw* without stale partitions; those found stale are added to
    *held* (still attached, for the caller to detach)."""
    for _ in range(LOOP_TRIES):
        dev = proc.run(
            [proc.require_tool("losetup"), "--find", "--show", raw],
            timeout=60,
            hint="the disk layout needs a free loop device (modprobe loop)",
        ).stdout.strip()
        if not _DEV.fullmatch(dev):
            raise NodeforgeError(f"internal: losetup answered {dev!r}, not a loop device")
        if stale_partitions(dev, sys_block):
            proc.run([proc.require_tool("partx"), "--delete", dev], check=False, timeout=60)
        stale = stale_partitions(dev, sys_block)
        if not stale:
            return dev
        held.append(dev)
        log.warning(
            "%s still has partitions %s from an earlier attachment, held by a mount elsewhere "
            "(`grep -l %s /proc/*/mountinfo`); trying another loop device",
            dev, ", ".join(stale), stale[0],
        )  # fmt: skip
    raise NodeforgeError(
        f"{raw}: no usable loop device: the {LOOP_TRIES} tried ({', '.join(held)}) all still "
        "have partitions from an earlier attachment, held by mounts in other mount namespaces. "
        "Find them with `grep -l loop /proc/*/mountinfo`, stop those processes (or unmount "
        "there), then run `partx --delete /dev/loopN` and try again."
    )


def part_dev(dev: str, p: Partition) -> str:
    return f"{dev}p{p.number}"


def make_root(dev: str, layout: Layout, tree: Path, fs_uuid: str) -> None:
    """The root filesystem from *tree* (mkfs.ext4 -d: no mount needed)."""
    proc.run(
        [
            proc.require_tool("mkfs.ext4"), "-q", "-F", "-L", FS_LABEL, "-U", fs_uuid,
            "-d", tree, part_dev(dev, layout.part("root")),
        ],
        timeout=1800,
    )  # fmt: skip


@contextmanager
def mounted(device: str | Path, mountpoint: Path, options: str = "") -> Iterator[Path]:
    mountpoint.mkdir(parents=True, exist_ok=True)
    proc.run(["mount", *(["-o", options] if options else []), device, mountpoint], timeout=120)
    try:
        yield mountpoint
    finally:
        cp = proc.run(["umount", mountpoint], check=False, timeout=120)
        if cp.returncode != 0:  # something still holds it: do not leave the mount behind
            proc.run(["umount", "--lazy", mountpoint], check=False, timeout=120)


def _node(dst: Path, src: str) -> None:
    st = os.stat(src)
    os.mknod(dst, 0o600 | stat.S_IFBLK if stat.S_ISBLK(st.st_mode) else 0o666 | stat.S_IFCHR,
             st.st_rdev)  # fmt: skip


@contextmanager
def chroot_env(root: Path, dev: str, layout: Layout, fs_uuid: str) -> Iterator[Path]:
    """/proc, /sys and a private /dev (tmpfs: the loop device, its partitions, null/zero/
    urandom and the /dev/disk/by-uuid link update-grub looks for, as udev would make it)
    under the mounted root; all unmounted on the way out."""
    with ExitStack() as stack:
        for d in ("proc", "sys"):
            (root / d).mkdir(exist_ok=True)
            proc.run(["mount", "--bind", f"/{d}", root / d], timeout=60)
            stack.callback(proc.run, ["umount", "--lazy", root / d], check=False, timeout=60)
        (root / "dev").mkdir(exist_ok=True)
        proc.run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=1m", "nfdev", root / "dev"],
                 timeout=60)  # fmt: skip
        stack.callback(proc.run, ["umount", "--lazy", root / "dev"], check=False, timeout=60)
        d = root / "dev"
        for name in ("null", "zero", "urandom", "random", "full"):
            _node(d / name, f"/dev/{name}")
        name = Path(dev).name
        _node(d / name, dev)
        for p in layout.partitions:
            _node(d / f"{name}p{p.number}", part_dev(dev, p))
        (d / "disk/by-uuid").mkdir(parents=True)
        (d / "disk/by-uuid" / fs_uuid).symlink_to(f"../../{name}p{layout.part('root').number}")
        yield root


def chroot_run(root: Path, *argv: str, logfile: IO[str]) -> None:
    cp = proc.run(["chroot", root, *argv], timeout=900, env={"LC_ALL": "C.UTF-8",
                  "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})  # fmt: skip
    logfile.write(cp.stdout or "")


def require_loader(root: Path, arch: str) -> None:
    """The image must carry its own boot loader (roles/base: bootloader.yml)."""
    need = list(EFI_FILES[arch].values()) + ["usr/sbin/update-grub"]
    if arch == "amd64":
        need += ["usr/sbin/grub-install", "usr/lib/grub/i386-pc/boot.img"]
    missing = [p for p in need if not (root / p).is_file()]
    if missing:
        raise NodeforgeError(
            f"the image has no boot loader ({', '.join('/' + m for m in missing)} missing): "
            "the base role installs shim-signed, grub-efi-*-signed and grub-pc "
            "(roles/base/tasks/bootloader.yml); a playbook of your own must install them too"
        )


def esp_grub_cfg(fs_uuid: str) -> str:
    """What `grub-install` writes beside the signed grub: find root, read its grub.cfg."""
    return (
        f"search.fs_uuid {fs_uuid} root\n"
        "set prefix=($root)'/boot/grub'\n"
        "configfile $prefix/grub.cfg\n"
    )


def make_esp(esp_dev: str, root: Path, arch: str, fs_uuid: str, scratch: Path) -> Path:
    """FAT32 ESP with the removable-media path (firmware with no boot entries, as a cloud's
    is) and Debian's own path, both holding shim, grub, MokManager and grub.cfg. Returns
    a directory holding a copy of what was written, for the scanner."""
    proc.run([proc.require_tool("mkfs.vfat"), "-F", "32", "-n", "ESP", esp_dev], timeout=120)
    staged = scratch / "esp"
    shutil.rmtree(staged, ignore_errors=True)
    for sub in ("EFI/BOOT", "EFI/debian"):
        (staged / sub).mkdir(parents=True)
        for name, src in EFI_FILES[arch].items():
            # shim looks for grub by its own arch name beside itself; Debian's path names
            # the shim shim<arch>.efi, the removable path BOOT<ARCH>.EFI.
            dest = name if sub == "EFI/BOOT" or not name.startswith("BOOT") else (
                Path(src).name.removesuffix(".signed")
            )  # fmt: skip
            shutil.copyfile(root / src, staged / sub / dest)
        (staged / sub / "grub.cfg").write_text(esp_grub_cfg(fs_uuid))
    mm = proc.require_tool("mcopy")
    proc.run([proc.require_tool("mmd"), "-i", esp_dev, "::/EFI"], timeout=60)
    proc.run([mm, "-s", "-i", esp_dev, *sorted((staged / "EFI").iterdir()), "::/EFI/"],
             timeout=300)  # fmt: skip
    # Read back what the filesystem holds: the scanner looks at the partition, not our copy.
    back = scratch / "esp-readback"
    shutil.rmtree(back, ignore_errors=True)
    back.mkdir()
    proc.run([mm, "-s", "-n", "-i", esp_dev, "::/EFI", back], timeout=300)
    shutil.rmtree(staged)
    return back


def install_loader(
    dev: str, layout: Layout, root: Path, fs_uuid: str, scratch: Path, logfile: IO[str]
) -> Path:
    """BIOS and UEFI boot paths onto the attached disk whose root is mounted at *root*.
    Returns the ESP's files read back (for the scanner)."""
    require_loader(root, layout.arch)
    with chroot_env(root, dev, layout, fs_uuid):
        if layout.arch == "amd64":
            chroot_run(root, "grub-install", "--target=i386-pc", f"/dev/{Path(dev).name}",
                       logfile=logfile)  # fmt: skip
        chroot_run(root, "update-grub", logfile=logfile)
    cfg = (root / "boot/grub/grub.cfg").read_text(errors="replace")
    if f"root=UUID={fs_uuid}" not in cfg:
        raise NodeforgeError(
            "update-grub did not find root by its filesystem UUID "
            f"(no root=UUID={fs_uuid} in /boot/grub/grub.cfg): check "
            "/etc/default/grub and /etc/default/grub.d in the image"
        )
    return make_esp(part_dev(dev, layout.part("esp")), root, layout.arch, fs_uuid, scratch)


def partition_sums(raw: Path | str, layout: Layout, chunk: int = 8 * MIB) -> list[dict]:
    """The manifest's `disk.partitions`: each partition's GPT facts and the sha256 of its
    bytes (as `dd` of the partition from the raw disk would give)."""
    out = []
    with open(raw, "rb") as f:
        for p in layout.partitions:
            h = hashlib.sha256()
            f.seek(p.start)
            left = p.bytes
            while left:
                block = f.read(min(chunk, left))
                if not block:
                    raise NodeforgeError(f"internal: the raw disk ends inside partition {p.name}")
                h.update(block)
                left -= len(block)
            d = asdict(p)
            d.update(name=p.name, sha256=h.hexdigest())
            out.append(d)
    return out


def fs_uuid(device: str) -> str:
    """The filesystem UUID of *device* (blkid), checked against the UUID grammar."""
    out = proc.run(
        [proc.require_tool("blkid"), "-o", "value", "-s", "UUID", device], timeout=60
    ).stdout.strip()
    if not _UUID.fullmatch(out):
        raise NodeforgeError(f"the root filesystem on {device} has no UUID (blkid: {out!r})")
    return out.lower()
