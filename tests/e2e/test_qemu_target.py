"""`nodeforge build --target qemu`: Packer's qemu builder, the host-side disk seal, the box.

The build runs under TCG here, where the full product playbook takes far longer than the CI
budget allows (its figures are in bench/README.md and the issue notes). These tests drive
the same target with the FIXTURE playbook tests/fixtures/qemu-smoke.yml (one marker file,
then the real seal role), so everything that is the qemu target's own runs for real: the
base disk made from the cached mmdebstrap base, the KVM probe / TCG fallback, Packer booting
it and reaching SSH on 127.0.0.1, the ansible provisioner, shutdown, images/disk_seal.py as
a shell-local post-processor, and the vagrant post-processor's libvirt box, whose own disk
then boots from SeaBIOS on vagrant-libvirt's default machine (no kernel of its own).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeforge.images import manifest as manifest_mod
from nodeforge.images.versions import sha256_file
from nodeforge.lab.vm import VM, VMConfig
from tests.conftest import require_tools
from tests.helpers import (
    E2E_ROOT,
    GIB,
    REPO,
    build_turn,
    ctrl_c_enabled,
    debugfs_read,
    drop_outputs,
    need_room,
    nodeforge,
)

pytestmark = pytest.mark.e2e

SMOKE = REPO / "tests/fixtures/qemu-smoke.yml"
BOX_BOOT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_BOOT_TIMEOUT", "480"))  # to SSH login
QEMU_TOOLS = (
    "packer",
    "qemu-system-x86_64",
    "qemu-img",
    "mkfs.ext4",
    "debugfs",
    "fstrim",
    "sfdisk",
    "mmdebstrap",
    "ssh-keygen",
)


def _no_build_leftovers(out: Path, log: str) -> None:
    """Nothing of this build is left: VM, loop mount, work dir, partial output."""
    works = set(re.findall(r"/nodeforge-qemu-[a-z0-9_]+", log))
    assert works, "the build log names its work directory"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    mounts = Path("/proc/mounts").read_text()
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    for w in works:
        assert w not in ps, f"a process of the build is still running ({w})"
        assert w not in mounts and w not in loops, f"a mount of the build is left ({w})"
        assert not list(Path("/var/cache/nodeforge").glob(w.lstrip("/"))), f"{w} was not removed"
    assert not out.with_name(out.name + ".partial").exists()
    assert not (REPO / "packer_cache").exists() and not (REPO / "packer-manifest.json").exists()


@pytest.fixture(scope="module")
def qemu_build(root_required, fixture_mirror, pinned_versions) -> Iterator[Path]:
    require_tools(*QEMU_TOOLS)
    out = E2E_ROOT / "qemu-smoke"
    reuse = os.environ.get("NODEFORGE_E2E_QEMU_IMAGE")  # developer speed-up; CI builds
    if reuse:
        yield Path(reuse)  # the developer's own output: never removed
        return
    # The build VM's disk, its export and the box (about 4 GiB at the peak).
    need_room(E2E_ROOT, 4 * GIB, "the qemu target's build")
    with build_turn("the qemu target's build"):
        cp = nodeforge(
            "build", "--target", "qemu", "--playbook", str(SMOKE),
            "--artifact-mirror", str(fixture_mirror), "--versions-file", str(pinned_versions),
            "--output", str(out), "--json", timeout=3600,
        )  # fmt: skip
    assert json.loads(cp.stdout)["output"] == str(out)
    yield out
    drop_outputs(out)  # 0.9 GiB no later module reads


def test_outputs_and_manifest(qemu_build):
    out = qemu_build
    m = json.loads((out / "manifest.json").read_text())
    assert manifest_mod.check(m) == [], manifest_mod.check(m)
    assert m["target"] == "qemu" and m["base"]["suite"] == "trixie"
    for name in ("disk.qcow2", "vmlinuz", "initrd.img", "nodeforge-libvirt.box"):
        assert (out / name).is_file(), name
        assert m["artifacts"][name]["sha256"] == sha256_file(out / name), name
    assert {"preflight", "base", "provision", "seal", "export"} <= set(m["phases"])
    log = (out / "build.log").read_text()
    assert "accelerator: " in log  # the KVM probe's decision is recorded
    # Written by the build VM after the in-guest seal role ran: only the host-side seal
    # can remove them.
    assert "seal: remove /var/log/journal/" in log and "seal: truncate /var/log/wtmp" in log
    assert "seal: discard free blocks" in log
    _no_build_leftovers(out, log)


def test_disk_is_provisioned_and_sealed(qemu_build, tmp_path):
    out = qemu_build
    disk = out / "disk.qcow2"
    assert "provisioned for" in debugfs_read(disk, tmp_path, "cat /etc/nodeforge-qemu-smoke")
    assert "ssh_host_" not in debugfs_read(disk, tmp_path, "ls /etc/ssh")
    assert "authorized_keys" not in debugfs_read(disk, tmp_path, "ls /root/.ssh")
    assert debugfs_read(disk, tmp_path, "cat /etc/machine-id") == ""
    assert "system.journal" not in debugfs_read(disk, tmp_path, "ls -r /var/log/journal")
    inside = json.loads(debugfs_read(disk, tmp_path, "cat /etc/nodeforge/image.json"))
    m = json.loads((out / "manifest.json").read_text())
    assert inside["packages"] == m["packages"] and inside["target"] == "qemu"
    assert "openssh-server" in inside["packages"]
    # The filesystem fills the disk_size the build asked for (8G by default).
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "--output=json", str(disk)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert info["virtual-size"] >= 8 << 30 and info["format"] == "qcow2"


def _box_files(box: Path, dest: Path) -> list[str]:
    """The box's member names, extracted into *dest*. GNU tar, as Vagrant's bsdtar reads it
    (Python's tarfile misreads Packer's GNU headers)."""
    names = subprocess.run(
        ["tar", "-tzf", str(box)], capture_output=True, text=True, check=True, timeout=300
    ).stdout.split()
    subprocess.run(["tar", "-xzf", str(box), "-C", str(dest)], check=True, timeout=600)
    return sorted(names)


@pytest.fixture
def box(tmp_path) -> Iterator[Path]:
    """Where the box is unpacked; its 1 GiB disk is dropped after the test, pass or fail."""
    d = tmp_path / "box"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_box_holds_the_sealed_disk_and_it_boots_from_firmware(qemu_build, box, tmp_path):
    """The box as vagrant-libvirt boots it: its own box.img (a copy-on-write overlay), the
    i440fx machine with SeaBIOS (libvirt's default), no kernel from outside the disk; the
    SSH key comes in as an SMBIOS credential, as the lab's Vagrantfile passes it."""
    require_tools("qemu-system-x86_64", "qemu-img", "ssh", "ssh-keygen")
    out = qemu_build
    assert _box_files(out / "nodeforge-libvirt.box", box) == [
        "Vagrantfile",
        "box.img",
        "metadata.json",
    ]
    meta = json.loads((box / "metadata.json").read_text())
    assert meta["provider"] == "libvirt" and meta["format"] == "qcow2"
    # The box is made after the host-side seal: the very same bytes as the published disk.
    disk_sum = sha256_file(box / "box.img")
    assert disk_sum == sha256_file(out / "disk.qcow2")
    vf = (box / "Vagrantfile").read_text()
    settings = [ln.split("#", 1)[0].strip() for ln in vf.splitlines()]
    assert [ln for ln in settings if ln.startswith("lv.")] == ['lv.disk_bus = "virtio"'], vf
    # The VM harness boots IMAGE_DIR/disk.qcow2: here that is the box's own box.img.
    image = tmp_path / "image"
    image.mkdir()
    (image / "disk.qcow2").symlink_to(box / "box.img")
    cfg = VMConfig(
        image_dir=image,
        workdir=tmp_path / "vm",
        name="box",
        boot="bios",
        machine="pc",
        accel="tcg",
        boot_timeout=BOX_BOOT_TIMEOUT,
        # The smoke image has no first-boot host-key unit (the product's ssh role adds one).
        compat_keygen=True,
        keep=True,
    )
    with VM(cfg) as vm:
        # What runs: qemu's own command line, and the overlay it boots.
        argv = Path(f"/proc/{vm.pid}/cmdline").read_bytes().decode().split("\0")
        assert "-kernel" not in argv and "-initrd" not in argv and "-append" not in argv
        assert argv[argv.index("-machine") + 1] == "pc,accel=tcg" and "pflash" not in str(argv)
        overlay = json.loads(
            subprocess.run(
                ["qemu-img", "info", "-U", "--output=json", str(vm.overlay)],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout
        )
        assert overlay["full-backing-filename"] == str((box / "box.img").resolve())
        took = vm.wait_ssh()
        print(f"\nbox.img from SeaBIOS (i440fx, tcg): SSH login after {took:.1f}s")
        got = vm.ssh(
            "cat /proc/cmdline; test -d /sys/firmware/efi && echo firmware=efi "
            "|| echo firmware=bios; cat /sys/class/dmi/id/product_name; "
            "cat /etc/nodeforge-qemu-smoke",
            timeout=120,
        ).stdout
    print(got)
    cmdline, firmware, machine, marker = got.splitlines()[:4]
    # grub (from the disk's BIOS boot partition) booted the kernel, root by filesystem UUID
    assert cmdline.startswith("BOOT_IMAGE=") and " root=UUID=" in cmdline, cmdline
    assert firmware == "firmware=bios" and "i440FX" in machine, got
    assert marker.startswith("provisioned for "), got  # the smoke playbook's marker
    assert sha256_file(box / "box.img") == disk_sum, "the VM wrote into the box's disk"


def test_box_adds_and_the_lab_validates_with_it(qemu_build, tmp_path):
    require_tools("vagrant")
    out = qemu_build
    env = {"VAGRANT_CHECKPOINT_DISABLE": "1", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run(
        ["vagrant", "box", "add", "--name", "nodeforge/slurm", str(out / "nodeforge-libvirt.box")],
        env=env,
        check=True,
        timeout=600,
        capture_output=True,
    )
    listed = subprocess.run(
        ["vagrant", "box", "list"], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "nodeforge/slurm" in listed and "libvirt" in listed
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab/Vagrantfile").write_text((REPO / "Vagrantfile").read_text())
    cp = subprocess.run(
        ["vagrant", "validate", "--ignore-provider"],
        cwd=tmp_path / "lab",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "validated successfully" in cp.stdout, cp.stdout + cp.stderr


def test_failed_provisioning_leaves_nothing_and_shows_the_console(
    root_required, fixture_mirror, pinned_versions, tmp_path
):
    require_tools(*QEMU_TOOLS)
    with build_turn("the failing qemu build"):
        _failed_provisioning(fixture_mirror, pinned_versions, tmp_path)


def _failed_provisioning(fixture_mirror: Path, pinned_versions: Path, tmp_path: Path) -> None:
    out = E2E_ROOT / "qemu-fail"
    vf = tmp_path / "fail.pkrvars.hcl"
    vf.write_text('ansible_vars = { nodeforge_smoke_fail = "true" }\n')
    cp = nodeforge(
        "build",
        "--target",
        "qemu",
        "--playbook",
        str(SMOKE),
        "--var-file",
        str(vf),
        "--artifact-mirror",
        str(fixture_mirror),
        "--versions-file",
        str(pinned_versions),
        "--output",
        str(out),
        check=False,
        timeout=3600,
    )
    assert cp.returncode != 0
    assert "build VM console (accelerator" in cp.stderr, cp.stderr[-3000:]
    assert "no console output" not in cp.stderr and "console log is empty" not in cp.stderr
    assert not out.exists(), "a failed build must leave nothing under the final name"
    failed_log = out.with_name(out.name + ".failed-build.log").read_text()
    assert "FIXTURE: failing on purpose" in failed_log
    _no_build_leftovers(out, failed_log)


def test_interrupt_during_provisioning_stops_the_vm_and_leaves_nothing(
    root_required, fixture_mirror, pinned_versions
):
    require_tools(*QEMU_TOOLS)
    with build_turn("the interrupted qemu build"):
        _interrupted_qemu_build(fixture_mirror, pinned_versions)


def _interrupted_qemu_build(fixture_mirror: Path, pinned_versions: Path) -> None:
    out = E2E_ROOT / "qemu-interrupted"
    log = out.with_name(out.name + ".partial") / "build.log"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nodeforge",
            "build",
            "--target",
            "qemu",
            "--playbook",
            str(SMOKE),
            "--artifact-mirror",
            str(fixture_mirror),
            "--versions-file",
            str(pinned_versions),
            "--output",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=ctrl_c_enabled,
    )  # noqa: PLW1509 (no threads here)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and p.poll() is None:
            if log.exists() and "Waiting for SSH" in log.read_text(errors="replace"):
                break
            time.sleep(1)
        assert p.poll() is None, f"the build ended before the VM started: {p.stderr.read()}"
        assert "Waiting for SSH" in log.read_text(), "the build VM did not start in 15 min"
        time.sleep(5)  # the VM is booting
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C at the terminal
        p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    assert not out.exists()
    failed_log = out.with_name(out.name + ".failed-build.log").read_text()
    _no_build_leftovers(out, failed_log)
