"""Seal the disk that Packer's qemu builder produced, before the Vagrant box is made from it.

Packer runs this as a `shell-local` post-processor, between the qemu builder and the
`vagrant` post-processor, so the box and the qcow2 both hold the sealed disk. The in-guest
`seal` role cannot finish the job: the build VM's own SSH session, journald and shutdown
write login records, the journal and a random seed after it ran, and deleted files (the
build's host keys among them) stay readable in the filesystem's free blocks. Here, on the
powered-off disk (loop-mounted on the host):

1. the same post-stop items as the local target (images/seal.py), each logged with its reason;
2. the secret scanner (images/scan.py); any finding fails the build;
3. /etc/nodeforge/image.json written from the build's manifest and the disk's dpkg database;
4. the kernel and initrd copied out for direct boot;
5. on nodeforge's own GPT layout (images/bootdisk.py), the image's boot loader installed for
   BIOS and UEFI (a cloud image given as base_disk keeps its own), and the scanner run on
   every partition;
6. free blocks discarded (fstrim), so nothing deleted can be recovered from the image, then
   the disk is rewritten as a compact qcow2 in place.

Usage (internal): python -m nodeforge.images.disk_seal --disk D --manifest-stub F --boot-out DIR --result F
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import IO

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import atomic_output

from . import bootdisk, export, seal
from . import manifest as manifest_mod


def root_partition(raw: Path) -> tuple[int, int] | None:
    """(offset, size) in bytes of the root filesystem of a partitioned disk (a cloud image:
    the largest partition), or None for a bare filesystem (the locally made base disk)."""
    cp = proc.run([proc.require_tool("sfdisk"), "--json", raw], check=False, timeout=60)
    if cp.returncode != 0 or not cp.stdout.strip():
        return None
    table = json.loads(cp.stdout)["partitiontable"]
    sector = int(table.get("sectorsize", 512))
    parts = table.get("partitions", [])
    if not parts:
        return None
    best = max(parts, key=lambda p: int(p["size"]))
    return int(best["start"]) * sector, int(best["size"]) * sector


def loop_mounted(raw: Path, mountpoint: Path):
    """The root filesystem of *raw* (the disk, or its largest partition) loop-mounted."""
    opts = "loop"
    part = root_partition(raw)
    if part is not None:
        opts += f",offset={part[0]},sizelimit={part[1]}"
    return bootdisk.mounted(raw, mountpoint, opts)


def seal_tree(tree: Path, stub: dict, boot_out: Path, logfile: IO[str], started: float) -> dict:
    """Steps 1-4 on a mounted tree; returns the image manifest written into it."""
    seal.seal_and_scan(tree, logfile)
    image = manifest_mod.with_packages(stub, export.dpkg_versions(tree))
    image["phases"] = {**stub["phases"], "seal": round(time.monotonic() - started, 1)}
    export.write_image_json(tree, image)
    export.copy_boot_files(tree, boot_out)
    return image


def seal_disk(disk: Path, stub: dict, boot_out: Path, logfile: IO[str]) -> dict:
    started = time.monotonic()
    work = disk.parent / "seal-work"
    raw = work / "disk.raw"
    work.mkdir(parents=True, exist_ok=True)
    try:
        proc.run([proc.require_tool("qemu-img"), "convert", "-O", "raw", disk, raw], timeout=1800)
        layout = bootdisk.read_table(raw, str(stub.get("arch", "amd64")))
        if layout is not None:
            image = seal_own_layout(raw, layout, stub, boot_out, logfile, started, work)
        else:
            with loop_mounted(raw, work / "mnt") as tree:
                image = seal_tree(tree, stub, boot_out, logfile, started)
                export.discard_free_blocks(tree, logfile)
        with atomic_output(disk, tmp_name=disk.name + ".sealed") as tmp:
            qemu_img = proc.require_tool("qemu-img")
            proc.run([qemu_img, "convert", "-O", "qcow2", raw, tmp], timeout=1800)
        return image
    finally:
        shutil.rmtree(work, ignore_errors=True)


def seal_own_layout(
    raw: Path,
    layout: bootdisk.Layout,
    stub: dict,
    boot_out: Path,
    logfile: IO[str],
    started: float,
    work: Path,
) -> dict:
    """Seal the root partition, then the boot loader, the scan of every partition and the
    discard (export.finish_disk); the result carries the disk's partitions."""
    found: dict = {}
    with bootdisk.attached(raw) as dev:
        fs_uuid = bootdisk.fs_uuid(bootdisk.part_dev(dev, layout.part("root")))

        def seal_root(tree: Path) -> None:
            found["image"] = seal_tree(tree, stub, boot_out, logfile, started)

        export.finish_disk(dev, layout, fs_uuid, work, logfile, seal_root=seal_root)
    parts = bootdisk.partition_sums(raw, layout)
    return {**found["image"], "disk": export.disk_manifest(layout, fs_uuid, parts, True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nodeforge.images.disk_seal")
    ap.add_argument("--disk", type=Path, required=True)
    ap.add_argument("--manifest-stub", type=Path, required=True)
    ap.add_argument("--boot-out", type=Path, required=True)
    ap.add_argument("--result", type=Path, required=True)
    args = ap.parse_args(argv)
    stub = json.loads(args.manifest_stub.read_text())
    # The provision phase ends when Packer hands over the powered-off disk.
    phases = dict(stub.get("phases", {}))
    started = phases.pop("provision_started", None)
    if started is not None:
        phases["provision"] = round(time.time() - started, 1)
    try:
        image = seal_disk(args.disk, {**stub, "phases": phases}, args.boot_out, sys.stdout)
    except NodeforgeError as e:
        print(f"nodeforge: error: {e}", file=sys.stderr)
        return 1
    export.write_json_atomic(args.result, image)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
