"""The qemu target's host-side disk seal on a real disk (loop mount: needs root).

The built image's tree (or, where no boot loader is needed, a small tree) stands in for
the build VM's disk; what is checked is what an operator would check of a published qcow2:
no host key, no build access key, an image.json, the boot loader on the disk, and nothing
deleted that can be read back out of the disk's free blocks.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from nodeforge.images import disk_seal, export
from tests.conftest import make_keypair, require_tools
from tests.helpers import debugfs_read, qemu_image_manifest

pytestmark = pytest.mark.e2e


def _tree(tmp_path, marker: bytes):
    t = tmp_path / "tree"
    (t / "var/lib/dpkg").mkdir(parents=True)
    (t / "var/lib/dpkg/status").write_text(
        "Package: slurmd\nStatus: install ok installed\nVersion: 24.11.5-1\nArchitecture: amd64\n\n"
    )
    (t / "boot").mkdir()
    (t / "boot/vmlinuz-6.12.1-amd64").write_bytes(b"kernel")
    (t / "boot/initrd.img-6.12.1-amd64").write_bytes(b"initrd")
    (t / "etc/ssh").mkdir(parents=True)
    # A build-time host key: its blocks must not survive in the published disk.
    (t / "etc/ssh/ssh_host_ed25519_key").write_bytes(marker * (16384 // len(marker)))
    (t / "root/.ssh").mkdir(parents=True)
    (t / "root/.ssh/authorized_keys").write_text(make_keypair(tmp_path, "build")[0] + "\n")
    return t


def _disk(tmp_path, marker: bytes, tree: Path | None = None):
    """The qemu target's disk as Packer hands it over: nodeforge's GPT layout, no boot
    loader on the disk yet (the tree may carry the loader's packages)."""
    t = tree or _tree(tmp_path, marker)
    out = tmp_path / "disk"
    out.mkdir()
    export.export_disk(t, out, size_mib=None if tree else 256, loader=False)
    return out / export.DISK


@pytest.fixture
def provisioned_tree(image_tree, tmp_path):
    """The built image's tree (it has its boot loader's packages) with what a build VM
    leaves behind: a host key that must not survive, the build's access key."""
    t = tmp_path / "tree"
    subprocess.run(["cp", "-a", f"{image_tree}/.", str(t)], check=True, timeout=600)
    return t


EFI_MARK = b"NODEFORGE-EFI-PARTITION-UNTOUCHED"


def _partitioned_disk(tmp_path, marker: bytes):
    """A GPT disk like a cloud image's: a small ESP, then the root filesystem."""
    t = _tree(tmp_path, marker)
    out = tmp_path / "disk"
    out.mkdir()
    raw = out / "disk.raw"
    subprocess.run(["truncate", "-s", "300M", str(raw)], check=True)
    subprocess.run(
        ["sfdisk", "--quiet", str(raw)],
        input="label: gpt\n,16MiB,U\n,,L\n",
        text=True,
        check=True,
        timeout=60,
    )
    parts = json.loads(
        subprocess.run(
            ["sfdisk", "--json", str(raw)], capture_output=True, text=True, check=True
        ).stdout
    )["partitiontable"]["partitions"]
    esp, root = parts
    fs = out / "root.img"
    subprocess.run(["truncate", "-s", str(root["size"] * 512), str(fs)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(t), str(fs)], check=True, timeout=120)
    subprocess.run(
        [
            "dd",
            f"if={fs}",
            f"of={raw}",
            "bs=512",
            f"seek={root['start']}",
            "conv=notrunc,sparse",
            "status=none",
        ],
        check=True,
        timeout=120,
    )
    with open(raw, "r+b") as f:
        f.seek(esp["start"] * 512)
        f.write(EFI_MARK)
    fs.unlink()
    disk = out / export.DISK
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(disk)], check=True)
    raw.unlink()
    return disk


def _raw_bytes(qcow2, tmp_path) -> bytes:
    raw = tmp_path / f"{qcow2.name}.raw"
    subprocess.run(
        ["qemu-img", "convert", "-O", "raw", str(qcow2), str(raw)], check=True, timeout=120
    )
    data = raw.read_bytes()
    raw.unlink()
    return data


def test_sealed_disk_has_no_identity_and_nothing_recoverable(
    tmp_path, root_required, provisioned_tree
):
    require_tools("qemu-img", "mkfs.ext4", "fstrim", "debugfs", "mount", "mcopy", "mkfs.vfat")
    marker = f"NODEFORGE-HOSTKEY-{uuid.uuid4()}".encode()
    t = provisioned_tree
    (t / "etc/ssh/ssh_host_ed25519_key").write_bytes(marker * (16384 // len(marker)))
    (t / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
    (t / "root/.ssh/authorized_keys").write_text(make_keypair(tmp_path, "build")[0] + "\n")
    disk = _disk(tmp_path, marker, tree=t)
    assert marker in _raw_bytes(disk, tmp_path), "control: the key is on the disk before sealing"
    boot = tmp_path / "boot-out"
    boot.mkdir()
    with open(tmp_path / "seal.log", "w") as log:
        image = disk_seal.seal_disk(disk, qemu_image_manifest(), boot, log)

    data = _raw_bytes(disk, tmp_path)
    assert marker not in data, "the deleted host key can still be read from the disk's free blocks"
    listing = debugfs_read(disk, tmp_path, "ls -l /etc/ssh")
    assert "ssh_host_" not in listing
    assert "authorized_keys" not in debugfs_read(disk, tmp_path, "ls -l /root/.ssh")
    inside = json.loads(debugfs_read(disk, tmp_path, "cat /etc/nodeforge/image.json"))
    disk_layout = image.pop("disk")
    assert inside == image and "slurmd" in inside["packages"]
    assert (boot / "vmlinuz").read_bytes() == sorted((t / "boot").glob("vmlinuz-*"))[
        -1
    ].read_bytes()
    log = (tmp_path / "seal.log").read_text()
    assert "discard free blocks" in log and "scanned partitions root, esp, bios" in log
    # The seal put the image's boot loader on the disk: grub finds root by UUID.
    cfg = debugfs_read(disk, tmp_path, "cat /boot/grub/grub.cfg")
    assert f"root=UUID={disk_layout['root_fs_uuid']}" in cfg and "/dev/vda" not in cfg
    assert [p["role"] for p in disk_layout["partitions"]] == ["bios", "esp", "root"]
    # No loop device or mount is left behind.
    mounts = Path("/proc/mounts").read_text()
    assert str(disk.parent) not in mounts
    assert (
        str(disk.parent)
        not in subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    )


def test_deleting_without_discard_would_leave_the_key_readable(tmp_path, root_required):
    """Why the seal discards free blocks: a plain delete on ext4 leaves the data in place
    (here on the root partition of nodeforge's layout)."""
    require_tools("qemu-img", "mkfs.ext4", "mount")
    marker = f"NODEFORGE-HOSTKEY-{uuid.uuid4()}".encode()
    disk = _disk(tmp_path, marker)
    raw = tmp_path / "plain.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(disk), str(raw)], check=True)
    with disk_seal.loop_mounted(raw, tmp_path / "mnt") as tree:
        (tree / "etc/ssh/ssh_host_ed25519_key").unlink()
    assert marker in raw.read_bytes()


def test_a_secret_left_on_the_disk_fails_the_seal(tmp_path, root_required):
    require_tools("qemu-img", "mkfs.ext4", "fstrim", "mount")
    disk = _disk(tmp_path, b"x")
    raw = tmp_path / "d.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(disk), str(raw)], check=True)
    with disk_seal.loop_mounted(raw, tmp_path / "mnt") as tree:
        (tree / "opt").mkdir()
        # A private key left behind by a provisioning step (generated here, never in git).
        (tree / "opt/token").write_text(make_keypair(tmp_path, "stray")[1])
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(disk)], check=True)
    before = disk.read_bytes()
    from nodeforge.errors import NodeforgeError

    with (
        open(tmp_path / "seal.log", "w") as log,
        pytest.raises(NodeforgeError, match="(?s)refusing to publish.*/opt/token"),
    ):
        disk_seal.seal_disk(disk, qemu_image_manifest(), tmp_path, log)
    assert disk.read_bytes() == before, "a refused disk must not be rewritten"
    assert not (disk.parent / "seal-work").exists()


def test_cloud_image_disk_seals_its_root_partition_only(tmp_path, root_required):
    """A cloud image (base_disk) is partitioned: the seal finds the root partition, and
    leaves the partition table and the other partitions as they were."""
    require_tools("qemu-img", "mkfs.ext4", "fstrim", "sfdisk", "mount")
    marker = f"NODEFORGE-HOSTKEY-{uuid.uuid4()}".encode()
    disk = _partitioned_disk(tmp_path, marker)
    assert marker in _raw_bytes(disk, tmp_path)
    boot = tmp_path / "boot-out"
    boot.mkdir()
    with open(tmp_path / "seal.log", "w") as log:
        image = disk_seal.seal_disk(disk, qemu_image_manifest(), boot, log)
    assert image["packages"] == {"slurmd": "24.11.5-1"}
    data = _raw_bytes(disk, tmp_path)
    assert marker not in data
    assert EFI_MARK in data, "the ESP was changed"
    raw = tmp_path / "check.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(disk), str(raw)], check=True)
    table = json.loads(
        subprocess.run(
            ["sfdisk", "--json", str(raw)], capture_output=True, text=True, check=True
        ).stdout
    )["partitiontable"]
    assert [p["type"].upper() for p in table["partitions"]] == [
        "C12A7328-F81F-11D2-BA4B-00A0C93EC93B",
        "0FC63DAF-8483-4772-8E79-3D69D8477DE4",
    ]
    assert (boot / "vmlinuz").read_bytes() == b"kernel"
