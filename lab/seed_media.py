"""Seed media for the VM tier: the disks a cloud or hypervisor attaches to hand a machine its
user-data without a metadata service, built as those platforms build them.

* ``nocloud``: cloud-init's NoCloud seed (Proxmox, libvirt, cloud-localds): a vfat filesystem
  labelled ``cidata`` holding ``user-data`` and ``meta-data``; made with mkfs.vfat and filled
  with mtools (no mount on the host).
* ``configdrive``: OpenStack's config drive: ISO 9660 (Rock Ridge + Joliet) labelled
  ``config-2`` holding ``openstack/latest/user_data`` and ``meta_data.json``; made with xorriso.

The image file is attached read-only as a second virtio disk (lab/vm.py). The agent reads
it with bootstrap/params_seed.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.images.qemu_host import Runner

KINDS = ("nocloud", "configdrive")
TOOLS = {"nocloud": ("mkfs.vfat", "mcopy"), "configdrive": ("xorriso",)}
# The seed's user-data: bounded so a runaway test value fails here. Twice the agent's own cap
# (strict_yaml.MAX_BYTES, 1 MiB), so a test can hand the agent an oversized document.
USER_DATA_MAX = 2 << 20
VFAT_KIB = 4096  # room for USER_DATA_MAX and the FAT itself


def check(seed: object) -> tuple[str, str]:
    """*seed* as (kind, user-data text), or an error that says what a seed is."""
    if not (
        isinstance(seed, tuple)
        and len(seed) == 2
        and isinstance(seed[0], str)
        and isinstance(seed[1], str)
    ):
        raise NodeforgeError(
            f"VM seed {seed!r:.80}: give (kind, user-data text), kind one of {', '.join(KINDS)}"
        )
    kind, text = seed
    if kind not in KINDS:
        raise NodeforgeError(f"VM seed kind {kind!r:.40} is not one of {', '.join(KINDS)}")
    if len(text.encode()) > USER_DATA_MAX:
        raise NodeforgeError(
            f"VM seed user-data is {len(text.encode())} bytes, over {USER_DATA_MAX}: shorten it"
        )
    for tool in TOOLS[kind]:
        proc.require_tool(tool)
    return kind, text


def build(seed: tuple[str, str], workdir: Path, instance_id: str, run: Runner) -> Path:
    """Write the seed image for *seed* under *workdir* (a fresh ``seed/`` tree) and return it."""
    kind, text = check(seed)
    if "," in str(workdir):
        # qemu's -drive option list has no escape we use: a comma would split the file name
        raise NodeforgeError(f"VM seed: work dir {workdir} has a comma; use another directory")
    tree = workdir / "seed"
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    if kind == "nocloud":
        ud, md = tree / "user-data", tree / "meta-data"
        ud.write_text(text)
        md.write_text(f"instance-id: {instance_id}\nlocal-hostname: {instance_id}\n")
        img = workdir / "seed-cidata.img"
        img.unlink(missing_ok=True)
        run(["mkfs.vfat", "-n", "cidata", "-C", str(img), str(VFAT_KIB)], timeout=60)
        run(["mcopy", "-o", "-i", str(img), str(ud), str(md), "::"], timeout=60)
        return img
    latest = tree / "openstack" / "latest"
    latest.mkdir(parents=True)
    (latest / "user_data").write_text(text)
    meta = {"uuid": instance_id, "name": instance_id, "hostname": instance_id}
    (latest / "meta_data.json").write_text(json.dumps(meta) + "\n")
    img = workdir / "seed-config-2.iso"
    img.unlink(missing_ok=True)
    run(["xorriso", "-as", "mkisofs", "-quiet", "-R", "-J", "-V", "config-2",
         "-o", str(img), str(tree)], timeout=60)  # fmt: skip
    return img
