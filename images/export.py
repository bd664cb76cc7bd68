"""Export a sealed tree: root filesystem archive, firmware-bootable disk (+ kernel/initrd), manifest."""

from __future__ import annotations

import io
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_json

from . import bootdisk

ROOTFS = "rootfs.tar.zst"
DISK = "disk.qcow2"
KERNEL = "vmlinuz"
INITRD = "initrd.img"
FS_LABEL = bootdisk.FS_LABEL
# ext4 sizing: content plus headroom for first-boot state, logs and a few small containers.
DISK_HEADROOM = 1.35
DISK_EXTRA_MIB = 1024

# Times a named part of the export (images/pipeline.py Phases.step); by default nothing.
Step = Callable[[str], AbstractContextManager]


def no_step(name: str) -> AbstractContextManager:
    return nullcontext()


# The raw disk exists only to be converted to qcow2. On disk it is ~1.2 GB written
# (and waited for: mkfs.ext4 fsyncs it) only to be deleted, so it is made in memory (tmpfs)
# when that holds it with room to spare.
SHM_DIR = Path("/dev/shm")
RAM_SPARE = 2 << 30  # memory left for everything else while the raw image is held
# ext4 metadata and journal beyond the files' blocks, the ESP and the boot loader.
RAW_OVERHEAD = 320 << 20


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
    """Root by label; nspawn ignores the root entry. x-systemd.growfs: systemd-growfs grows
    the filesystem online after systemd-repart (roles/base: /etc/repart.d) grew the
    partition to the disk's end (the generated unit is ordered after it)."""
    (tree / "etc/fstab").write_text(
        "# nodeforge: the root filesystem of the exported disk image\n"
        f"LABEL={FS_LABEL} / ext4 defaults,errors=remount-ro,x-systemd.growfs 0 1\n"
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


@dataclass(frozen=True)
class DiskExport:
    files: list[Path]  # disk.qcow2, and the kernel + initrd beside it
    disk: dict  # the manifest's `disk`: table, size, partitions (GPT facts + sha256)


def disk_fits_mib(content_bytes: int) -> int:
    """MiB of root filesystem that *content_bytes* of files need."""
    return (int(content_bytes * DISK_HEADROOM) >> 20) + 1


def export_disk(
    tree: Path,
    dest_dir: Path,
    size_mib: int | None = None,
    step: Step = no_step,
    *,
    arch: str = "amd64",
    loader: bool = True,
    logfile: IO[str] | None = None,
) -> DiskExport:
    """A GPT disk (images/bootdisk.py) whose root is *tree*, with the image's own boot
    loader for BIOS and UEFI (*loader*: False for the qemu target's base disk, whose tree
    has no loader yet: Packer boots its kernel directly), converted to qcow2, and the
    kernel + initrd beside it for direct boot.

    *size_mib* is the whole disk (the qemu build's base disk must hold everything the
    playbook installs); by default the content plus headroom. A disk too small for the
    tree is refused before anything is written."""
    log = logfile or io.StringIO()
    with step("export.disk_size"):
        content = tree_size_bytes(tree)
        fits = disk_fits_mib(content)
        disk_mib = size_mib or fits + DISK_EXTRA_MIB + bootdisk.overhead_mib(arch)
        layout = bootdisk.plan(arch, disk_mib, fits)
    fs_uuid = str(uuid.uuid4())
    qemu_img = proc.require_tool("qemu-img")
    with (
        tempfile.TemporaryDirectory(prefix="nodeforge-disk-") as scratch_s,
        unnamed_file(raw_scratch_dir(content, dest_dir), layout.disk_bytes) as raw,
    ):
        scratch = Path(scratch_s)
        with step("export.partition"):
            bootdisk.write_table(raw, layout)
        with bootdisk.attached(raw) as dev:
            with step("export.mkfs"):
                bootdisk.make_root(dev, layout, tree, fs_uuid)
            if loader:
                with step("export.loader"):
                    finish_disk(dev, layout, fs_uuid, scratch, log)
        with step("export.partition_sha256"):
            parts = bootdisk.partition_sums(raw, layout)
        with step("export.qcow2"):
            proc.run(
                [qemu_img, "convert", "-f", "raw", "-O", "qcow2", raw, dest_dir / DISK],
                timeout=1800,
            )
    with step("export.boot_files"):
        boot = copy_boot_files(tree, dest_dir)
    return DiskExport([dest_dir / DISK, *boot], disk_manifest(layout, fs_uuid, parts, loader))


def disk_manifest(layout: bootdisk.Layout, fs_uuid: str, parts: list[dict], loader: bool) -> dict:
    return {
        "table": "gpt",
        "bytes": layout.disk_bytes,
        "boot": ["bios", "uefi"] if loader and layout.arch == "amd64" else
                ["uefi"] if loader else [],
        "root_fs_uuid": fs_uuid,
        "partitions": parts,
    }  # fmt: skip


def finish_disk(
    dev: str,
    layout: bootdisk.Layout,
    fs_uuid: str,
    scratch: Path,
    logfile: IO[str],
    seal_root: Callable[[Path], None] | None = None,
) -> None:
    """On the attached disk: mount root (*seal_root* runs on it first: the qemu target's
    sealing), install the boot loader, scan every partition, discard free blocks."""
    from . import scan

    root_dev = bootdisk.part_dev(dev, layout.part("root"))
    with bootdisk.mounted(root_dev, scratch / "root") as root:
        if seal_root is not None:
            seal_root(root)
        esp = bootdisk.install_loader(dev, layout, root, fs_uuid, scratch, logfile)
        found = {"root": scan.scan(root), "esp": scan.scan(esp)}
        if layout.arch == "amd64":
            bios = scratch / "bios-boot"
            bios.mkdir()
            p = layout.part("bios")
            with open(dev, "rb") as f:
                f.seek(p.start)
                (bios / "core.img").write_bytes(f.read(p.bytes))
            found["bios"] = scan.scan(bios)
        bad = [f"{part}: {x}" for part, xs in found.items() for x in xs]
        if bad:
            raise NodeforgeError(
                "the secret scanner found on the disk: "
                + "; ".join(bad)
                + " — nothing was exported; see images/sealed.yaml"
            )
        logfile.write(f"disk: scanned partitions {', '.join(found)}: no finding\n")
        discard_free_blocks(root, logfile)


def discard_free_blocks(root: Path, logfile: IO[str]) -> None:
    """fstrim the mounted filesystem, so nothing deleted can be read back from the disk."""
    # ext4 frees deleted blocks only when the journal commits: commit first, or
    # fstrim sees them still in use and the deleted data stays on the disk.
    proc.run(["sync", "--file-system", root], timeout=600)
    trimmed = proc.run([proc.require_tool("fstrim"), "-v", root], timeout=600).stdout
    logfile.write(
        f"seal: discard free blocks — deleted files must not be recoverable: {trimmed.strip()}\n"
    )


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
