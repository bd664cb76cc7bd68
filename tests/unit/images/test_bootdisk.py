"""images/bootdisk.py: the GPT layout of the firmware-bootable disk (sfdisk on a sparse file,
no root, no loop device)."""

from __future__ import annotations

import hashlib
import itertools
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.images import bootdisk

pytestmark = pytest.mark.unit
MIB = 1 << 20


@settings(max_examples=300, deadline=None)
@given(
    arch=st.sampled_from(["amd64", "arm64"]),
    disk=st.integers(min_value=0, max_value=1 << 22),
    need=st.integers(min_value=1, max_value=1 << 22),
)
def test_plan_fits_the_disk_or_refuses(arch, disk, need):
    """Any size: partitions aligned to 1 MiB, in order, inside the disk with room for the
    backup GPT, root at least what the tree needs; or a refusal naming both sizes."""
    try:
        layout = bootdisk.plan(arch, disk, need)
    except NodeforgeError as e:
        assert f"disk size {disk} MiB is smaller than the image needs" in str(e)
        assert disk - bootdisk.overhead_mib(arch) < need
        return
    parts = layout.partitions
    assert [p.role for p in parts] == (["bios"] if arch == "amd64" else []) + ["esp", "root"]
    assert parts[0].start == MIB and all(p.start % MIB == 0 and p.bytes % MIB == 0 for p in parts)
    assert all(a.start + a.bytes == b.start for a, b in itertools.pairwise(parts))
    assert parts[-1].start + parts[-1].bytes == layout.disk_bytes - MIB
    assert layout.part("root").bytes >= need * MIB
    assert layout.part("root").type == bootdisk.ROOT_TYPE[arch]
    assert len({p.partuuid for p in parts}) == len(parts)


def test_table_written_by_sfdisk_reads_back(tmp_path):
    if shutil.which("sfdisk") is None:
        pytest.fail("sfdisk is missing: apt-get install fdisk", pytrace=False)
    raw = tmp_path / "disk.raw"
    layout = bootdisk.plan("amd64", 200, 100)
    with open(raw, "wb") as f:
        f.truncate(layout.disk_bytes)
    bootdisk.write_table(raw, layout)
    assert bootdisk.read_table(raw, "amd64") == layout
    assert bootdisk.read_table(raw, "arm64") is None  # root's type is amd64's
    # partition sums are the sha256 of each partition's bytes
    with open(raw, "r+b") as f:
        f.seek(layout.part("esp").start)
        f.write(b"FAT")
    sums = {p["role"]: p for p in bootdisk.partition_sums(raw, layout)}
    data = raw.read_bytes()
    for p in layout.partitions:
        want = hashlib.sha256(data[p.start : p.start + p.bytes]).hexdigest()
        assert sums[p.role]["sha256"] == want and sums[p.role]["partuuid"] == p.partuuid
    assert sums["root"]["name"] == "nodeforge-root" and sums["esp"]["bytes"] == 63 * MIB


@pytest.mark.parametrize(
    "script",
    [
        None,  # a bare filesystem: no table
        "label: dos\n,10M,L\n,,L\n",
        'label: gpt\nsize=10M, name="esp"\nname="data"\n',
        'label: gpt\nsize=1M, name="bios-boot"\nsize=10M, name="esp"\nname="nodeforge-root"\n',
    ],
)
def test_other_disks_are_not_taken_for_ours(tmp_path, script):
    """A cloud image's own layout, or names without our types: left as they are."""
    raw = tmp_path / "disk.raw"
    with open(raw, "wb") as f:
        f.truncate(64 * MIB)
    if script:
        proc.run(["sfdisk", "--quiet", raw], input=script, timeout=60)
    assert bootdisk.read_table(raw, "amd64") is None


def test_esp_grub_cfg_finds_root_by_uuid_only():
    cfg = bootdisk.esp_grub_cfg("523b0e79-3be9-455b-915b-0173108c0918")
    assert cfg.splitlines()[0] == "search.fs_uuid 523b0e79-3be9-455b-915b-0173108c0918 root"
    assert "/dev/" not in cfg and "configfile $prefix/grub.cfg" in cfg


def test_an_image_without_its_loader_is_refused_naming_the_files(tmp_path):
    (tmp_path / "usr/lib/shim").mkdir(parents=True)
    (tmp_path / "usr/lib/shim/shimx64.efi.signed").write_bytes(b"shim")
    with pytest.raises(NodeforgeError, match="no boot loader.*grubx64.efi.signed.*base role"):
        bootdisk.require_loader(tmp_path, "amd64")


def test_manifest_checks_the_disk_layout(tmp_path):
    from nodeforge.images import export
    from nodeforge.images import manifest as manifest_mod

    layout = bootdisk.plan("amd64", 200, 100)
    raw = tmp_path / "d.raw"
    with open(raw, "wb") as f:
        f.truncate(layout.disk_bytes)
    disk = export.disk_manifest(layout, "u", bootdisk.partition_sums(raw, layout), True)
    assert manifest_mod._disk_problems(disk) == []
    assert disk["boot"] == ["bios", "uefi"]
    disk["partitions"][1]["sha256"] = "x"
    disk["partitions"][2]["partuuid"] = "/dev/vda3"
    assert manifest_mod._disk_problems(disk) == [
        "'disk.partitions[1].sha256' must be a sha256",
        "'disk.partitions[2].partuuid' must be an upper-case GUID",
    ]
    assert manifest_mod._disk_problems({"table": "dos"}) == ["'disk.table' must be 'gpt'"]


class _Loops:
    """A fixture standing in for losetup/partx and /sys/block (no root, no loop device): the
    kernel's loop devices as a dict, partitions as /sys/block/loopN/loopNpK directories, and
    *held* partitions (mounted in another namespace) that `partx --delete` cannot remove."""

    def __init__(self, sys_block, held: dict[str, list[str]]):
        self.sys_block, self.held, self.attached, self.calls = sys_block, held, {}, []
        for dev, parts in held.items():
            for part in parts:
                (sys_block / dev / part).mkdir(parents=True)

    def run(self, argv, **kw):
        import subprocess

        tool, *args = [str(a) for a in argv]
        self.calls.append((tool.rsplit("/", 1)[-1], *args))
        out, rc = "", 0
        if tool.endswith("losetup") and args[0] == "--find":
            name = next(f"loop{i}" for i in range(64) if f"loop{i}" not in self.attached)
            self.attached[name] = args[-1]
            out = f"/dev/{name}\n"
        elif tool.endswith("losetup") and args[0] == "--detach":
            self.attached.pop(args[1].rsplit("/", 1)[-1])
        elif tool.endswith("partx"):
            name = args[1].rsplit("/", 1)[-1]
            d = self.sys_block / name
            if args[0] == "--add":
                if any(d.glob(f"{name}p*")):
                    rc = 1  # partx: error adding partition 3
                for k in (1, 2, 3):
                    (d / f"{name}p{k}").mkdir(parents=True, exist_ok=True)
            else:
                for part in list(d.glob(f"{name}p*")):
                    if part.name in self.held.get(name, []):
                        rc = 1
                    else:
                        part.rmdir()
        if rc and kw.get("check", True):
            raise NodeforgeError(f"{tool} {' '.join(args)} failed")
        return subprocess.CompletedProcess(argv, rc, out, "")


def test_attached_skips_a_loop_device_with_stale_partitions(monkeypatch, tmp_path):
    """loop0 still has loop0p3 (mounted in a container started during an earlier export): it is
    kept attached while loop1 is used, then both are detached; loop1's partitions are gone."""
    loops = _Loops(tmp_path, {"loop0": ["loop0p3"]})
    monkeypatch.setattr(proc, "run", loops.run)
    monkeypatch.setattr(proc, "require_tool", lambda name: name)
    with bootdisk.attached("disk.raw", sys_block=tmp_path) as dev:
        assert dev == "/dev/loop1"
        assert sorted(p.name for p in (tmp_path / "loop1").iterdir()) == [
            "loop1p1", "loop1p2", "loop1p3",
        ]  # fmt: skip
        assert set(loops.attached) == {"loop0", "loop1"}
    assert loops.attached == {}
    assert bootdisk.stale_partitions("/dev/loop1", tmp_path) == []


def test_attached_cleans_stale_partitions_it_can_remove(monkeypatch, tmp_path):
    """Stale partitions nothing holds any more are removed and the device is used."""
    loops = _Loops(tmp_path, {})
    (tmp_path / "loop0" / "loop0p2").mkdir(parents=True)
    monkeypatch.setattr(proc, "run", loops.run)
    monkeypatch.setattr(proc, "require_tool", lambda name: name)
    with bootdisk.attached("disk.raw", sys_block=tmp_path) as dev:
        assert dev == "/dev/loop0"
    assert loops.attached == {}


def test_attached_refuses_when_every_loop_device_is_stale(monkeypatch, tmp_path):
    held = {f"loop{i}": [f"loop{i}p3"] for i in range(bootdisk.LOOP_TRIES)}
    loops = _Loops(tmp_path, held)
    monkeypatch.setattr(proc, "run", loops.run)
    monkeypatch.setattr(proc, "require_tool", lambda name: name)
    with pytest.raises(NodeforgeError) as exc, bootdisk.attached("disk.raw", sys_block=tmp_path):
        pytest.fail("attached yielded a device with stale partitions")
    msg = str(exc.value)
    assert msg.startswith("disk.raw: no usable loop device")
    assert "/proc/*/mountinfo" in msg and "partx --delete" in msg
    assert loops.attached == {}  # every device it took was given back
