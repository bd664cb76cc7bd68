"""lab/seed_media.py and VMConfig.seed: the NoCloud seed and the OpenStack config drive the VM
tier attaches, built with the real tools (mkfs.vfat + mtools, xorriso; .ci/apt-packages.txt)
and read back without mounting (blkid -p, mtype, xorriso -extract)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.lab import seed_media
from nodeforge.lab import vm as vmmod

pytestmark = pytest.mark.unit

USER_DATA = "#cloud-config\nnodeforge:\n  role: compute\n  node_name: sd1\n"


def _blkid(img: Path) -> dict[str, str]:
    out = proc.run(["blkid", "-p", "-o", "export", str(img)], timeout=30).stdout
    return dict(ln.split("=", 1) for ln in out.splitlines() if "=" in ln)


def test_nocloud_seed_is_vfat_labelled_cidata_with_the_user_data(tmp_path):
    img = seed_media.build(("nocloud", USER_DATA), tmp_path, "vm1", proc.run)
    tags = _blkid(img)
    assert (tags["TYPE"], tags["LABEL"]) == ("vfat", "cidata")
    got = proc.run(["mtype", "-i", str(img), "::user-data"], timeout=30).stdout
    assert got == USER_DATA
    meta = proc.run(["mtype", "-i", str(img), "::meta-data"], timeout=30).stdout
    assert "instance-id: vm1" in meta


def test_config_drive_is_iso9660_labelled_config_2_with_the_user_data(tmp_path):
    img = seed_media.build(("configdrive", USER_DATA), tmp_path, "vm1", proc.run)
    tags = _blkid(img)
    assert (tags["TYPE"], tags["LABEL"]) == ("iso9660", "config-2")
    out = tmp_path / "extracted"
    proc.run(["xorriso", "-osirrox", "on", "-indev", str(img),
              "-extract", "/openstack/latest/user_data", str(out)], timeout=60)  # fmt: skip
    assert out.read_text() == USER_DATA


def test_a_rebuilt_seed_holds_only_the_new_user_data(tmp_path):
    seed_media.build(("nocloud", "role: login\n" * 100), tmp_path, "vm1", proc.run)
    img = seed_media.build(("nocloud", USER_DATA), tmp_path, "vm1", proc.run)
    assert proc.run(["mtype", "-i", str(img), "::user-data"], timeout=30).stdout == USER_DATA


@pytest.mark.parametrize(
    ("seed", "why"),
    [
        (("cdrom", "x"), "kind 'cdrom' is not one of nocloud, configdrive"),
        (("nocloud",), "give \\(kind, user-data text\\)"),
        (["nocloud", "x"], "give \\(kind, user-data text\\)"),
        (("nocloud", b"role: compute"), "give \\(kind, user-data text\\)"),
        (("nocloud", "x" * (seed_media.USER_DATA_MAX + 1)), "over 2097152: shorten it"),
    ],
)
def test_a_bad_seed_is_refused_by_name(tmp_path, seed, why):
    with pytest.raises(NodeforgeError, match=why):
        seed_media.check(seed)
    img = tmp_path / "img"
    img.mkdir()
    (img / "disk.qcow2").write_bytes(b"")
    cfg = vmmod.VMConfig(image_dir=img, workdir=tmp_path / "w", boot="bios", seed=seed)
    with pytest.raises(NodeforgeError, match=why):
        vmmod.VM(cfg).check_inputs()


def test_a_missing_tool_is_named_with_its_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NodeforgeError, match="xorriso"):
        seed_media.check(("configdrive", USER_DATA))


def test_a_work_dir_with_a_comma_is_refused(tmp_path):
    with pytest.raises(NodeforgeError, match="has a comma"):
        seed_media.build(("nocloud", USER_DATA), tmp_path / "a,b", "vm1", proc.run)


def test_the_seed_is_a_read_only_second_virtio_disk(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    cfg = vmmod.VMConfig(image_dir=img, workdir=tmp_path / "w", boot="bios")
    v = vmmod.VM(cfg)
    v.accel, v.port = vmmod.AccelDecision("tcg", "test"), 2222
    drives = [argv for argv in _drives(v.qemu_argv("k"))]
    assert len(drives) == 1  # no seed: the overlay only
    v.seed_image = tmp_path / "w" / "seed-cidata.img"
    drives = _drives(v.qemu_argv("k"))
    assert drives[0].startswith(f"file={v.overlay},if=virtio")
    assert drives[1] == f"file={v.seed_image},if=virtio,format=raw,readonly=on"


def _drives(argv: list[str]) -> list[str]:
    return [
        argv[i + 1] for i, a in enumerate(argv) if a == "-drive" and "pflash" not in argv[i + 1]
    ]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.tuples(st.text(max_size=20), st.text(max_size=50)), st.none(),
                 st.integers(), st.lists(st.text(max_size=5), max_size=3)))  # fmt: skip
def test_any_seed_value_is_accepted_whole_or_refused_by_name(seed):
    try:
        kind, text = seed_media.check(seed)
    except NodeforgeError as exc:
        assert str(exc).startswith("VM seed")
        return
    assert (kind, text) == seed and kind in seed_media.KINDS
