"""Export a sealed tree: root filesystem archive, bootable ext4 disk (+ kernel/initrd), manifest."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_json

ROOTFS = "rootfs.tar.zst"
DISK = "disk.qcow2"
KERNEL = "vmlinuz"
INITRD = "initrd.img"
FS_LABEL = "nodeforge-root"
# ext4 sizing: content plus headroom for first-boot state, logs and a few small containers.
DISK_HEADROOM = 1.35
DISK_EXTRA_MIB = 1024

# Times a named part of the export (images/pipeline.py Phases.step); by default nothing.
Step = Callable[[str], AbstractContextManager]


def no_step(name: str) -> AbstractContextManager:
    return nullcontext()


# The raw ext4 image exists only to be converted to qcow2. On disk it is ~1.2 GB written
# (and waited for: mkfs.ext4 fsyncs it) only to be deleted, so it is made in memory (tmpfs)
# when that holds it with room to spare.
SHM_DIR = Path("/dev/shm")
RAM_SPARE = 2 << 30  # memory left for everything else while the raw image is held
RAW_OVERHEAD = 256 << 20  # ext4 metadata and journal beyond the files' blocks


def raw_fits_in_memory(content_bytes: int, shm_free: int, mem_available: int) -> bool:
    """Whether a raw image of *content_bytes* of files fits the tmpfs (*shm_free*) and
    leaves RAM_SPARE of *mem_available* (tmpfs pages are memory)."""
    need = content_bytes + RAW_OVERHEAD
    return shm_free >= need and mem_available >= need + RAM_SPARE


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable of *meminfo* in bytes; 0 when it cannot be read (then: on disk)."""
    try:
        for line in meminfo.read_text().splitlines():
            m = re.fullmatch(r"MemAvailable:\s+([0-9]{1,15}) kB", line.strip())
            if m:
                return int(m.group(1)) << 10
    except OSError:
        pass
    return 0


def raw_scratch_dir(content_bytes: int, fallback: Path, shm: Path = SHM_DIR) -> Path:
    """Where the raw image goes: the tmpfs when it fits there, else *fallback*."""
    try:
        st = os.statvfs(shm)
    except OSError:
        return fallback
    if raw_fits_in_memory(content_bytes, st.f_bavail * st.f_frsize, mem_available_bytes()):
        return shm
    return fallback


@contextmanager
def unnamed_file(directory: Path, size: int) -> Iterator[Path]:
    """A sparse file of *size* bytes with no name (O_TMPFILE), as a path other programs can
    open (/proc/<pid>/fd/N): the kernel frees it when it is closed here, also when the build
    is killed, so no interrupt can leave a raw image behind (in memory or on disk). Where
    the filesystem has no O_TMPFILE, a named file removed on the way out."""
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:
        fd = -1
    if fd < 0:
        named = directory / f".disk-{os.getpid()}.raw"
        try:
            fd = os.open(named, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            yield named
        finally:
            named.unlink(missing_ok=True)
        return
    try:
        os.ftruncate(fd, size)
        yield Path(f"/proc/{os.getpid()}/fd/{fd}")
    finally:
        os.close(fd)


def tree_size_bytes(tree: Path) -> int:
    out = proc.run(["du", "-sx", "--block-size=1", tree], timeout=600).stdout
    return int(out.split()[0])


def write_fstab(tree: Path) -> None:
    """The VM boots the disk by label; nspawn ignores the root entry."""
    (tree / "etc/fstab").write_text(
        "# nodeforge: the root filesystem of the exported disk image\n"
        f"LABEL={FS_LABEL} / ext4 defaults,errors=remount-ro 0 1\n"
    )


def export_rootfs(tree: Path, dest: Path) -> None:
    proc.run(
        [
            "tar",
            "-C",
            tree,
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "--acls",
            "--one-file-system",
            "-I",
            # Level 1: the export is CPU-bound on small build hosts. On the 1.2 GiB node tree
            # (2026-12-03, 2 cores) zstd took 4.3-4.9 s of CPU at level 2 and 3.3-3.4 s at
            # level 1 for a 4% larger archive (437 -> 455 MB); --fast=1 saves 1 s more for
            # +13%. Level 3 (zstd's default) cost a quarter more than 2 again.
            "zstd -T0 -1",
            "-cf",
            dest,
            ".",
        ],
        timeout=1800,
    )


def export_disk(
    tree: Path, dest_dir: Path, size_mib: int | None = None, step: Step = no_step
) -> list[Path]:
    """ext4 disk made with `mkfs.ext4 -d` (no loop devices or mounts needed), converted to
    qcow2, and the kernel + initrd beside it for direct boot.

    *size_mib* fixes the filesystem size (the qemu build's base disk must hold everything
    the playbook installs: the disk has no partition table, so growing the qcow2 alone
    would not grow the filesystem); by default it is the content plus headroom."""
    with step("export.disk_size"):
        content = tree_size_bytes(tree)
        fits = (int(content * DISK_HEADROOM) >> 20) + 1
    if size_mib is not None and size_mib < fits:
        raise NodeforgeError(
            f"disk_size {size_mib} MiB is smaller than the base tree needs ({fits} MiB): "
            "raise disk_size in the var file"
        )
    size_mib = size_mib or fits + DISK_EXTRA_MIB
    mkfs, qemu_img = proc.require_tool("mkfs.ext4"), proc.require_tool("qemu-img")
    with unnamed_file(raw_scratch_dir(content, dest_dir), size_mib << 20) as raw:
        with step("export.mkfs"):
            proc.run([mkfs, "-q", "-F", "-L", FS_LABEL, "-d", tree, raw], timeout=1800)
        with step("export.qcow2"):
            proc.run(
                [qemu_img, "convert", "-f", "raw", "-O", "qcow2", raw, dest_dir / DISK],
                timeout=1800,
            )
    with step("export.boot_files"):
        boot = copy_boot_files(tree, dest_dir)
    return [dest_dir / DISK, *boot]


def copy_boot_files(tree: Path, dest_dir: Path) -> list[Path]:
    """The newest kernel and initrd of *tree*, beside the disk, for direct boot."""
    boot = tree / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    initrds = sorted(boot.glob("initrd.img-*"))
    if not kernels or not initrds:
        raise NodeforgeError(
            f"no kernel/initrd under {boot}: the base must include the kernel package "
            "(linux-image-<arch>) and initramfs-tools"
        )
    shutil.copyfile(kernels[-1], dest_dir / KERNEL)
    shutil.copyfile(initrds[-1], dest_dir / INITRD)
    return [dest_dir / KERNEL, dest_dir / INITRD]


def dpkg_versions(tree: Path) -> dict[str, str]:
    out = proc.run(
        [
            "dpkg-query",
            f"--admindir={tree}/var/lib/dpkg",
            "-W",
            "-f=${Package}\t${Version}\t${db:Status-Abbrev}\n",
        ],
        timeout=120,
    ).stdout
    versions = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[2].startswith("ii"):
            versions[parts[0]] = parts[1]
    return versions


# The core's atomic writer (fsync, rename, fsync of the directory); the name stays for callers.
write_json_atomic = write_json


def write_image_json(tree: Path, manifest: dict) -> None:
    """The image manifest inside the image, at /etc/nodeforge/image.json (checked first)."""
    from . import manifest as manifest_mod

    manifest_mod.require_valid(manifest, outer=False)
    (tree / "etc/nodeforge").mkdir(parents=True, exist_ok=True)
    write_json_atomic(tree / "etc/nodeforge/image.json", manifest)
