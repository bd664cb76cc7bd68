"""The built disk boots from firmware, as a cloud or bare metal boots it (no `-kernel`).

Each test boots one VM from a copy-on-write overlay of the artifact under TCG unless KVM
really works: SeaBIOS (legacy BIOS: grub-pc's core.img in the BIOS boot partition) and OVMF
with Secure Boot (Debian's signed shim -> grub -> kernel, verified against Microsoft's keys
from Debian's ovmf). The UEFI boot without Secure Boot is the VM tier's default
(tests/e2e/test_vm.py). Params and the SSH key arrive as SMBIOS credentials. The overlay
is larger than the image's disk: root must have grown to it at first boot.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeforge.lab.vm import VM, VMConfig
from tests.conftest import require_tools

pytestmark = pytest.mark.e2e
IMAGE_ENV = os.environ.get("NODEFORGE_VM_IMAGE")
BOOT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_BOOT_TIMEOUT", "480"))
GROWN_MIB = 6144


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
