"""The agent's seed-device lookup on real block devices (root): a NoCloud seed and an OpenStack
config drive, each a vfat filesystem made with mkfs.vfat + mcopy in a file and attached as a
loop device, found by the real blkid with the output format the reader parses; a loop device
re-used for another seed is seen as it is now (blkid's cache is not read).

Mounting a seed needs vfat or iso9660 in the kernel; the CI host's kernel has neither (only
ext2/3/4, xfs, btrfs, squashfs, erofs), so the mount, read and unmount are proven in the unit
tier (tests/unit/bootstrap/test_params_seed.py, with blkid/mount/umount as a fixture), not here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nodeforge.bootstrap.params_seed import Seed, SeedDevices
from tests.conftest import require_tools

pytestmark = pytest.mark.e2e


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


@pytest.fixture
def seed_device(tmp_path):
    """Fixture: make_seed(label, {path: text}) -> /dev/loopN holding a vfat filesystem with
    those files; every loop device made is detached at the end."""
    require_tools("mkfs.vfat", "mcopy", "mmd", "losetup", "blkid")
    loops: list[str] = []

    def make(label: str, files: dict[str, str]) -> str:
        img = tmp_path / f"{label}-{len(loops)}.img"
        _run("mkfs.vfat", "-n", label, "-C", str(img), "2048")
        for rel, text in files.items():
            parts = Path(rel).parts
            for i in range(1, len(parts)):
                subprocess.run(["mmd", "-D", "s", "-i", str(img), "::" + "/".join(parts[:i])],
                               capture_output=True, timeout=60)  # fmt: skip
            src = tmp_path / "src" / rel
            src.parent.mkdir(parents=True, exist_ok=True)
            src.write_text(text)
            _run("mcopy", "-i", str(img), str(src), f"::{rel}")
        dev = _run("losetup", "--find", "--show", "--read-only", str(img)).strip()
        loops.append(dev)
        return dev

    def detach(dev: str) -> None:
        loops.remove(dev)
        _run("losetup", "-d", dev)

    make.detach = detach  # type: ignore[attr-defined]
    yield make
    for dev in loops:
        subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=60)


def test_real_blkid_finds_both_seed_kinds(tmp_path, seed_device):
    nocloud = seed_device("CIDATA", {"user-data": "#cloud-config\n", "meta-data": "x\n"})
    drive = seed_device("CONFIG-2", {"openstack/latest/user_data": "#cloud-config\n"})
    found = SeedDevices(workdir=tmp_path / "run").find()
    assert Seed("nocloud", nocloud, "vfat", "user-data") in found, found
    assert Seed("config-drive", drive, "vfat", "openstack/latest/user_data") in found, found


def test_a_re_used_loop_device_is_seen_as_it_is_now(tmp_path, seed_device):
    dev = seed_device("CIDATA", {"user-data": "x\n"})
    assert [s.kind for s in SeedDevices(workdir=tmp_path).find() if s.device == dev] == ["nocloud"]
    seed_device.detach(dev)
    again = seed_device("CONFIG-2", {"openstack/latest/user_data": "x\n"})
    kinds = [s.kind for s in SeedDevices(workdir=tmp_path).find() if s.device == again]
    assert kinds == ["config-drive"]
