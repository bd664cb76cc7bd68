"""The export's parts that need no root: where the raw disk image goes, its unnamed scratch
file, and the step timings the manifest records."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from nodeforge.images import export
from nodeforge.images.pipeline import Phases

pytestmark = pytest.mark.unit

GiB = 1 << 30


class Clock:
    """An injected clock that moves only when told."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_steps_are_timed_apart_from_phases_and_add_up_when_repeated():
    clock = Clock()
    ph = Phases(lambda *_: None, clock=clock)
    with ph.phase("export"):
        with ph.step("export.mkfs"):
            clock.t += 3.0
        with ph.step("export.mkfs"):  # a second disk (a dropped layer rebuilt) adds to it
            clock.t += 1.5
        with ph.step("export.qcow2"):
            clock.t += 0.25
    assert ph.durations == {"export": 4.75}  # the phases still add up to the build time
    assert ph.steps == {"export.mkfs": 4.5, "export.qcow2": 0.25}


def test_a_failed_step_is_still_timed_and_its_error_passes_through():
    clock = Clock()
    ph = Phases(lambda *_: None, clock=clock)
    with pytest.raises(RuntimeError, match="mkfs failed"), ph.step("export.mkfs"):
        clock.t += 2.0
        raise RuntimeError("mkfs failed")
    assert ph.steps == {"export.mkfs": 2.0}


@pytest.mark.parametrize(
    "content,shm_free,mem,fits",
    [
        (1 * GiB, 12 * GiB, 20 * GiB, True),
        (1 * GiB, 1 * GiB, 20 * GiB, False),  # the tmpfs is smaller than the image
        (1 * GiB, 12 * GiB, 3 * GiB, False),  # it would leave under 2 GiB of memory
        (1 * GiB, 12 * GiB, 1 * GiB + export.RAW_OVERHEAD + export.RAM_SPARE, True),
        (0, 0, 0, False),
    ],
)
def test_raw_image_goes_to_memory_only_with_room_to_spare(content, shm_free, mem, fits):
    assert export.raw_fits_in_memory(content, shm_free, mem) is fits


@pytest.mark.parametrize(
    "text,expected",
    [
        ("MemTotal:  24683664 kB\nMemAvailable:    21248028 kB\n", 21248028 << 10),
        ("MemTotal:  24683664 kB\n", 0),  # no MemAvailable: treated as no room
        ("MemAvailable: -5 kB\n", 0),
        ("MemAvailable: 1e30 kB\n", 0),
        ("MemAvailable: 99999999999999999999 kB\n", 0),  # absurd: not trusted
        ("MemAvailable: 12 kB\nextra\n", 12 << 10),
        ("MemAvailable: 12 MB\n", 0),  # only kB is the kernel's unit
    ],
)
def test_mem_available_reads_only_the_kernel_format(tmp_path, text, expected):
    f = tmp_path / "meminfo"
    f.write_text(text)
    assert export.mem_available_bytes(f) == expected


def test_mem_available_of_an_unreadable_file_is_zero(tmp_path):
    assert export.mem_available_bytes(tmp_path / "missing") == 0


def test_raw_scratch_falls_back_to_the_work_dir(tmp_path, monkeypatch):
    fallback = tmp_path / "work"
    assert export.raw_scratch_dir(GiB, fallback, shm=tmp_path / "no-such-tmpfs") == fallback
    monkeypatch.setattr(export, "mem_available_bytes", lambda: 0)  # no memory to spare
    assert export.raw_scratch_dir(GiB, fallback, shm=tmp_path) == fallback
    monkeypatch.setattr(export, "mem_available_bytes", lambda: 1 << 60)
    assert export.raw_scratch_dir(0, fallback, shm=tmp_path) == tmp_path


def test_unnamed_file_is_sparse_writable_by_path_and_gone_when_closed(tmp_path):
    size = 64 << 20
    with export.unnamed_file(tmp_path, size) as raw:
        assert os.path.getsize(raw) == size
        with open(raw, "r+b") as fh:  # another opener (mkfs, qemu-img) reaches the same file
            fh.seek(size - 5)
            fh.write(b"ext4!")
        assert Path(raw).read_bytes()[-5:] == b"ext4!"
        assert list(tmp_path.iterdir()) == []  # it has no name in the directory
    assert not Path(raw).exists()
    assert list(tmp_path.iterdir()) == []


def test_unnamed_file_leaves_nothing_when_the_export_fails(tmp_path):
    with pytest.raises(RuntimeError), export.unnamed_file(tmp_path, 1 << 20) as raw:
        raise RuntimeError("mkfs failed")
    assert not Path(raw).exists() and list(tmp_path.iterdir()) == []


def test_unnamed_file_without_o_tmpfile_uses_a_named_file_it_removes(tmp_path, monkeypatch):
    real_open = os.open

    def no_tmpfile(path, flags, mode=0o777):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(95, "Operation not supported")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", no_tmpfile)
    with pytest.raises(RuntimeError), export.unnamed_file(tmp_path, 1 << 20) as raw:
        assert raw.parent == tmp_path and raw.stat().st_size == 1 << 20
        assert oct(raw.stat().st_mode & 0o777) == "0o600"
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_export_disk_makes_the_raw_image_unnamed_and_converts_it(tmp_path, monkeypatch):
    """The commands the disk export runs (stand-ins record them): the raw image is an
    unnamed file that sfdisk, losetup and qemu-img all see, root is made on its loop
    partition, the loop device is released, and nothing but the artifacts is left."""
    tree = tmp_path / "tree"
    (tree / "boot").mkdir(parents=True)
    (tree / "boot/vmlinuz-6.12.0").write_bytes(b"kernel")
    (tree / "boot/initrd.img-6.12.0").write_bytes(b"initrd")
    dest = tmp_path / "out"
    dest.mkdir()
    calls: list[list[str]] = []

    def run(argv, **kw):
        argv = [str(a) for a in argv]
        calls.append(argv)
        if argv[0].endswith("losetup") and "--show" in argv:
            return subprocess.CompletedProcess(argv, 0, "/dev/loop7\n")
        if argv[0].endswith("qemu-img"):
            with open(argv[argv.index("qcow2") + 1], "rb") as src:
                src.seek(65 << 20)  # root: after 1 MiB lead, BIOS boot and the ESP
                Path(argv[-1]).write_bytes(src.read(10))
        return subprocess.CompletedProcess(argv, 0, "")

    def mkfs(dev, layout, tree_, fs_uuid):
        calls.append(["mkfs", dev, str(tree_)])
        with open(raw_seen[0], "r+b") as fh:
            fh.seek(layout.part("root").start)
            fh.write(b"SUPERBLOCK")

    raw_seen: list[str] = []
    monkeypatch.setattr(export, "tree_size_bytes", lambda t: 10 << 20)
    monkeypatch.setattr(export.proc, "run", run)
    monkeypatch.setattr(export.bootdisk.proc, "run", run)
    monkeypatch.setattr(export.bootdisk, "make_root", mkfs)
    monkeypatch.setattr(export.proc, "require_tool", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(export, "raw_scratch_dir", lambda content, fallback: tmp_path)
    real_table = export.bootdisk.write_table
    monkeypatch.setattr(
        export.bootdisk,
        "write_table",
        lambda raw, layout: (raw_seen.append(str(raw)), real_table(raw, layout))[1],
    )
    steps: list[str] = []

    def step(name):
        steps.append(name)
        return export.no_step(name)

    made = export.export_disk(tree, dest, step=step, loader=False)
    assert [f.name for f in made.files] == ["disk.qcow2", "vmlinuz", "initrd.img"]
    assert (dest / "disk.qcow2").read_bytes() == b"SUPERBLOCK"
    raw = raw_seen[0]
    assert raw.startswith(f"/proc/{os.getpid()}/fd/")
    tools = [Path(c[0]).name for c in calls]
    assert tools == ["sfdisk", "losetup", "partx", "mkfs", "partx", "losetup", "qemu-img"]
    assert calls[1][-1] == raw and calls[3][1] == "/dev/loop7"
    assert calls[4][1:] == ["--delete", "/dev/loop7"] and calls[5][1:] == ["--detach", "/dev/loop7"]
    assert calls[-1][1:5] == ["convert", "-f", "raw", "-O"] and calls[-1][-2] == raw
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tree"]
    assert steps == [
        "export.disk_size",
        "export.partition",
        "export.mkfs",
        "export.partition_sha256",
        "export.qcow2",
        "export.boot_files",
    ]
    roles = [p["role"] for p in made.disk["partitions"]]
    assert roles == ["bios", "esp", "root"] and made.disk["boot"] == []
    assert made.disk["bytes"] == sum(p["bytes"] for p in made.disk["partitions"]) + (2 << 20)


def test_rootfs_archive_is_zstd_and_extracts_to_the_same_tree(tmp_path):
    """What lab/ and the e2e tests do with rootfs.tar.zst (`tar -I zstd -x`) gives back
    the files, links, modes and xattrs of the tree, whatever the zstd level."""
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc/node.conf").write_text("rotate 9\n" * 1000)
    (tree / "etc/node.conf").chmod(0o640)
    (tree / "usr/bin").mkdir(parents=True)
    (tree / "usr/bin/tool").write_bytes(os.urandom(200_000))
    (tree / "usr/bin/tool").chmod(0o755)
    (tree / "usr/bin/alias").symlink_to("tool")
    try:
        os.setxattr(tree / "usr/bin/tool", "user.nodeforge", b"cap")
        xattr = True
    except OSError:
        xattr = False  # the test's filesystem has no user xattrs
    dest = tmp_path / export.ROOTFS
    export.export_rootfs(tree, dest)
    assert dest.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"  # a zstd frame
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(
        ["tar", "-C", out, "--xattrs", "--xattrs-include=*", "-I", "zstd", "-xf", dest],
        check=True,
        timeout=60,
    )
    for rel in ("etc/node.conf", "usr/bin/tool"):
        assert (out / rel).read_bytes() == (tree / rel).read_bytes()
        assert (out / rel).stat().st_mode == (tree / rel).stat().st_mode
    assert os.readlink(out / "usr/bin/alias") == "tool"
    if xattr:
        assert os.getxattr(out / "usr/bin/tool", "user.nodeforge") == b"cap"
