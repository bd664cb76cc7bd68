"""The built disk boots from firmware, as a cloud or bare metal boots it (no `-kernel`).

Each test boots one VM from a copy-on-write overlay of the artifact under TCG unless KVM
really works: SeaBIOS (legacy BIOS: grub-pc's core.img in the BIOS boot partition) and OVMF
with Secure Boot (Debian's signed shim -> grub -> kernel, verified against Microsoft's keys
from Debian's ovmf). The UEFI boot without Secure Boot is the VM tier's default
(tests/e2e/test_vm.py). The SSH key arrives as an SMBIOS credential. The overlay is larger
than the image's disk: root must have grown to it at first boot.

Params arrive as a platform without a metadata service hands them over, on a seed device the
VM's own kernel mounts (bootstrap/params_seed.py; the host's kernel here cannot mount vfat or
ISO 9660): the BIOS VM gets a NoCloud seed (vfat `cidata`, as Proxmox and libvirt attach), the
Secure Boot VM an OpenStack config drive (ISO 9660 `config-2`). Each is a compute whose
controller does not exist (its address is dropped by qemu's restricted user network), with a
short wait_timeout: the agent must read the seed, run identity and munge, then fail in the
role step waiting for slurmctld, the reason in `node status`; the seed is unmounted and its
private mount point gone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nodeforge.lab.vm import VM, CloudNet, VMConfig
from tests.conftest import require_tools

pytestmark = pytest.mark.e2e
IMAGE_ENV = os.environ.get("NODEFORGE_VM_IMAGE")
BOOT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_BOOT_TIMEOUT", "480"))
GROWN_MIB = 6144
INIT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_INIT_TIMEOUT", "420"))
MUNGE_B64 = "bm9kZWZvcmdlLXZtLXNlZWQtbXVuZ2Uta2V5LTMyLWJ5dGVzLW9rISE="  # test only
MUNGE_FILE = "/etc/nodeforge/munge.key"
CONTROLLER = "192.0.2.10"  # TEST-NET-1; restrict=on drops every packet to it inside qemu
WAIT_S = 30
# boot mode -> (seed kind for lab/vm.py, the agent's params source name, filesystem label)
SEEDS = {
    "bios": ("nocloud", "nocloud", "cidata"),
    "uefi-secureboot": ("configdrive", "config-drive", "config-2"),
}


def _user_data(boot: str) -> str:
    section = {
        "role": "compute",
        "cluster_name": f"seed-{SEEDS[boot][0]}",
        "node_name": f"sd-{SEEDS[boot][0]}",
        "controller": {"host": "ctl", "address": CONTROLLER},
        "wait_timeout": WAIT_S,
    }
    if boot == "bios":
        # A NoCloud device is root:disk 0660: a secret may ride on it.
        section["munge_key"] = MUNGE_B64
    else:
        # A config drive's user-data is also served by OpenStack's metadata service to every
        # local user (this image has no IMDS guard), so the agent refuses secrets from it:
        # the key is a root-only file the platform put in place (here an SMBIOS credential).
        section["munge_key_file"] = MUNGE_FILE
    return "#cloud-config\n" + json.dumps({"nodeforge": section}, indent=1) + "\n"


@pytest.fixture(scope="module")
def vm_image(request) -> Path:
    return Path(IMAGE_ENV) if IMAGE_ENV else request.getfixturevalue("built_image")


@pytest.mark.parametrize("boot", ["bios", "uefi-secureboot"])
def test_disk_boots_from_firmware_and_grows_root(vm_image, tmp_path, boot):
    require_tools("qemu-system-x86_64", "qemu-img", "ssh", "ssh-keygen")
    cfg = VMConfig(
        image_dir=vm_image,
        workdir=tmp_path / boot,
        name=boot,
        boot=boot,
        boot_timeout=BOOT_TIMEOUT,
        disk_size_mib=GROWN_MIB,
        keep=True,
        seed=(SEEDS[boot][0], _user_data(boot)),
        extra_files={MUNGE_FILE: MUNGE_B64.encode()} if boot != "bios" else {},
        # qemu's user network with restrict=on: the guest reaches nothing outside qemu (the
        # absent controller's address included); SSH still comes in by hostfwd.
        metadata=CloudNet({}, net="10.0.2.0/24"),
    )
    with VM(cfg) as vm:
        took = vm.wait_ssh()
        print(f"\nVM {boot}: SSH login after {took:.1f}s ({vm.accel.accel})")
        out = vm.ssh(
            "cat /proc/cmdline; echo; test -d /sys/firmware/efi && echo firmware=efi "
            "|| echo firmware=bios; mokutil --sb-state 2>&1 || true; "
            'findmnt -n -o SOURCE /; blockdev --getsize64 "$(findmnt -n -o SOURCE /)"; '
            "df -B1 --output=size / | tail -1; systemctl is-active systemd-repart.service",
            timeout=120,
        ).stdout
        print(out)
        lines = out.split()
        assert (
            "root=UUID=" in out
            and "console=ttyS0,115200" in out
            and "/dev/vda" not in (out.split("\n", 1)[0])
        )
        if boot == "bios":
            assert "firmware=bios" in lines
        else:
            assert "firmware=efi" in lines and "SecureBoot enabled" in out, out
        part_bytes, fs_bytes = (int(x) for x in lines[-3:-1])
        assert part_bytes > (GROWN_MIB - 128) << 20, f"root partition not grown: {part_bytes}"
        assert fs_bytes > (GROWN_MIB - 512) << 20, f"root filesystem not grown: {fs_bytes}"
        check_seed_params(vm, boot)


def check_seed_params(vm: VM, boot: str) -> None:
    """What a user checks on a node that took its params from a seed device."""
    _, source, label = SEEDS[boot]
    state = vm.wait_unit("nodeforge-init.service", timeout=INIT_TIMEOUT)
    out = vm.ssh(
        "nodeforge node status; echo ==; cat /var/lib/nodeforge/state.json; echo ==; "
        "blkid -c /dev/null -o export /dev/vdb; echo ==; findmnt -rn -S /dev/vdb; "
        "findmnt -rn -o TARGET | grep -c '^/run/nodeforge/seed' ; "
        "ls -A /run/nodeforge | grep -c '^seed-'; test -e /etc/nodeforge/node.yaml || "
        "echo no-node-yaml",
        timeout=120,
        check=False,
    ).stdout
    print(f"nodeforge-init.service: {state}\n{out}")
    status, st_json, blk, mounts = out.split("\n==\n")
    st = json.loads(st_json)
    kind = SEEDS[boot][0]
    # params came from the seed, and they are what the seed held
    assert f"params from {source}" in status
    assert (st["source"], st["role"], st["node"], st["cluster"]) == (
        source,
        "compute",
        f"sd-{kind}",
        f"seed-{kind}",
    ), st
    assert f"LABEL={label}" in blk.split() and "no-node-yaml" in mounts
    # the seed is not left mounted and its private mount point is gone
    assert mounts.split()[:2] == ["0", "0"], mounts
    # past params: identity and munge (the key from the seed / the file it names) ran; the
    # role step waited for the controller, bounded by the seed's wait_timeout
    steps = st["steps"]
    assert [steps[s]["status"] for s in ("params", "identity", "munge")] == ["done"] * 3
    assert state == "failed" and steps["role"]["status"] == "failed", steps["role"]
    assert "slurmctld at" in steps["role"]["error"]
    assert f"did not happen within {WAIT_S}s" in steps["role"]["error"]
