"""Export a sealed tree: root filesystem archive, bootable ext4 disk (+ kernel/initrd), manifest."""

from __future__ import annotations

import shutil
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
            "zstd -T0 -3",
            "-cf",
            dest,
            ".",
        ],
        timeout=1800,
    )


def export_disk(tree: Path, dest_dir: Path, size_mib: int | None = None) -> list[Path]:
    """ext4 disk made with `mkfs.ext4 -d` (no loop devices or mounts needed), converted to
    qcow2, and the kernel + initrd beside it for direct boot.

    *size_mib* fixes the filesystem size (the qemu build's base disk must hold everything
    the playbook installs: the disk has no partition table, so growing the qcow2 alone
    would not grow the filesystem); by default it is the content plus headroom."""
    fits = (int(tree_size_bytes(tree) * DISK_HEADROOM) >> 20) + 1
    if size_mib is not None and size_mib < fits:
        raise NodeforgeError(
            f"disk_size {size_mib} MiB is smaller than the base tree needs ({fits} MiB): "
            "raise disk_size in the var file"
        )
    size_mib = size_mib or fits + DISK_EXTRA_MIB
    raw = dest_dir / "disk.raw"
    proc.run(["truncate", "-s", f"{size_mib}M", raw])
    try:
        proc.run(
            [proc.require_tool("mkfs.ext4"), "-q", "-F", "-L", FS_LABEL, "-d", tree, raw],
            timeout=1800,
        )
        proc.run(
            [proc.require_tool("qemu-img"), "convert", "-O", "qcow2", raw, dest_dir / DISK],
            timeout=1800,
        )
    finally:
        raw.unlink(missing_ok=True)
    return [dest_dir / DISK, *copy_boot_files(tree, dest_dir)]


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
