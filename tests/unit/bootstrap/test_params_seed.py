"""Params from a seed device (OpenStack config drive, NoCloud) where there is neither cloud-init
nor an IMDSv2: found by label, mounted read-only nosuid,nodev,noexec on a private directory,
read under the document cap, unmounted on every path out. blkid, mount and umount are a
fixture (FakeDevices): "mounting" copies a directory that stands for the device's filesystem.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeforge import strict_yaml
from nodeforge.bootstrap import params_seed
from nodeforge.bootstrap.params import ParamsError
from nodeforge.bootstrap.params_seed import SeedDevices, exposure_of
from nodeforge.bootstrap.params_sources import SourceConfig, load_params
from nodeforge.bootstrap.paths import Paths
from nodeforge.errors import NodeforgeError

pytestmark = pytest.mark.unit

KEY = base64.b64encode(b"k" * 64).decode()
NODE = {"role": "compute", "cluster_name": "demo", "controller": {"address": "10.0.0.2"}}


class FakeDevices:
    """Fixture: block devices as directories. Records every command; `mount` copies the
    device's directory onto the mount point, `umount` empties it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.devices: dict[str, tuple[str, str, Path]] = {}  # dev -> (label, fstype, content)
        self.calls: list[list[str]] = []
        self.mounted: set[str] = set()
        self.mount_rc = 0
        self.umount_rc = {"umount": 0, "--lazy": 0}
        self.blkid_out: str | None = None

    def add(self, dev: str, label: str, files: dict[str, str | bytes], fstype="iso9660") -> Path:
        d = self.tmp / "media" / dev.strip("/").replace("/", "_")
        d.mkdir(parents=True)
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(data, bytes):
                (d / rel).write_bytes(data)
            else:
                (d / rel).write_text(data)
        self.devices[dev] = (label, fstype, d)
        return d

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        self.calls.append(list(argv))
        rc, out = 0, ""
        if argv[0] == "blkid":
            if self.blkid_out is not None:
                out = self.blkid_out
            else:
                out = "\n".join(
                    f"DEVNAME={dev}\nLABEL={lab}\nTYPE={fs}\n"
                    for dev, (lab, fs, _) in self.devices.items()
                )
            rc = 0 if out else 2
        elif argv[0] == "mount":
            dev, target = argv[-2], argv[-1]
            rc = self.mount_rc
            if rc == 0:
                shutil.copytree(self.devices[dev][2], target, symlinks=True, dirs_exist_ok=True)
                self.mounted.add(target)
            else:
                out = "mount: /x: wrong fs type, bad option, bad superblock.\n       dmesg(1) may have more"
        elif argv[0] == "umount":
            target = argv[-1]
            rc = self.umount_rc["--lazy" if "--lazy" in argv else "umount"]
            if rc == 0:
                for child in Path(target).iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child)
                    else:
                        child.unlink()
                self.mounted.discard(target)
            else:
                out = "umount: target is busy"
        return subprocess.CompletedProcess(argv, rc, out, None)


@pytest.fixture
def fake(tmp_path):
    return FakeDevices(tmp_path)


def cfg_for(tmp_path, fake, *, exposure=None, guarded=True, imds_url=None) -> SourceConfig:
    paths = Paths.under(tmp_path / "root")
    devices = SeedDevices(workdir=paths.run_dir, run=fake.run, device_exposure=lambda dev: exposure)
    return SourceConfig(paths, imds_url=imds_url, imds_guarded=lambda: guarded,
                        seed_devices=devices)  # fmt: skip


def ud(params: dict) -> str:
    return "#cloud-config\nnodeforge: " + json.dumps(params) + "\n"


def _cleaned(cfg: SourceConfig, fake: FakeDevices) -> None:
    """Nothing left mounted, no mount point left behind."""
    assert fake.mounted == set()
    assert list(cfg.paths.run_dir.iterdir()) == []


def test_nocloud_seed_gives_the_params(tmp_path, fake):
    fake.add("/dev/sr0", "cidata", {"user-data": ud(NODE), "meta-data": "instance-id: x\n"})
    cfg = cfg_for(tmp_path, fake)
    got = load_params(cfg)
    assert got.source == "nocloud" and got.params.role == "compute"
    assert got.params.controller.address == "10.0.0.2"
    blkid, mount, umount = fake.calls
    assert blkid == ["blkid", "-c", "/dev/null", "-o", "export"]
    assert mount[:5] == ["mount", "-t", "iso9660", "-o", "ro,nosuid,nodev,noexec"]
    assert mount[5] == "/dev/sr0" and Path(mount[6]).parent == cfg.paths.run_dir
    assert Path(mount[6]).name.startswith("seed-")
    assert umount == ["umount", mount[6]]
    _cleaned(cfg, fake)


def test_config_drive_gives_the_params(tmp_path, fake):
    fake.add("/dev/vdb", "config-2", {"openstack/latest/user_data": ud(NODE),
                                      "openstack/latest/meta_data.json": "{}"}, "vfat")  # fmt: skip
    cfg = cfg_for(tmp_path, fake)
    got = load_params(cfg)
    assert got.source == "config-drive" and got.params.cluster_name == "demo"
    assert fake.calls[1][:3] == ["mount", "-t", "vfat"]
    _cleaned(cfg, fake)


def test_upper_case_vfat_labels_count(tmp_path, fake):
    fake.add("/dev/sdb1", "CIDATA", {"user-data": ud(NODE)}, "vfat")
    assert load_params(cfg_for(tmp_path, fake)).source == "nocloud"


def test_an_error_in_the_params_names_the_seed_and_still_unmounts(tmp_path, fake):
    fake.add("/dev/sr0", "cidata", {"user-data": ud({**NODE, "cpus": 0})})
    cfg = cfg_for(tmp_path, fake)
    with pytest.raises(ParamsError) as e:
        load_params(cfg)
    assert str(e.value).startswith("/dev/sr0 (NoCloud seed) user-data nodeforge: cpus: ")
    _cleaned(cfg, fake)


def test_a_symlink_on_the_medium_is_refused(tmp_path, fake):
    d = fake.add("/dev/sr0", "config-2", {"x": "y"})
    (d / "openstack").symlink_to("/etc")
    cfg = cfg_for(tmp_path, fake)
    with pytest.raises(ParamsError, match=r"\(OpenStack config drive\) openstack/latest/user_data: "
                       r"openstack is a symlink; refused"):  # fmt: skip
        load_params(cfg)
    _cleaned(cfg, fake)
    d = fake.add("/dev/sr1", "cidata", {})
    (d / "user-data").symlink_to("/etc/passwd")
    del fake.devices["/dev/sr0"]
    with pytest.raises(ParamsError, match=r"user-data is a symlink; refused"):
        load_params(cfg)
    _cleaned(cfg, fake)


def test_a_seed_without_our_user_data_falls_through(tmp_path, fake):
    fake.add("/dev/sr0", "cidata", {"user-data": "#!/bin/sh\necho hi\n"})
    cfg = cfg_for(tmp_path, fake)
    with pytest.raises(NodeforgeError, match="no node params found"):
        load_params(cfg)
    _cleaned(cfg, fake)
    fake.devices.clear()
    fake.add("/dev/sr1", "config-2", {"openstack/latest/meta_data.json": "{}"})  # no user_data
    with pytest.raises(NodeforgeError, match="no node params found"):
        load_params(cfg)
    _cleaned(cfg, fake)


def test_an_oversized_user_data_is_refused_after_a_bounded_read(tmp_path, fake, monkeypatch):
    big = "#cloud-config\nnodeforge:\n  role: compute\n  extra: {pad: '" + "x" * (2 << 20) + "'}\n"
    fake.add("/dev/sr0", "cidata", {"user-data": big})
    seen = []
    real = params_seed.read_in

    def spy(root, rel, label):
        text = real(root, rel, label)
        seen.append(len(text))
        return text

    monkeypatch.setattr(params_seed, "read_in", spy)
    cfg = cfg_for(tmp_path, fake)
    with pytest.raises(ParamsError, match=r"/dev/sr0 \(NoCloud seed\) user-data: "):
        load_params(cfg)
    assert seen == [strict_yaml.MAX_BYTES + 1]
    _cleaned(cfg, fake)


@pytest.mark.parametrize(
    ("label", "exposure", "guarded", "refused_because"),
    [
        ("cidata", None, False, None),
        ("cidata", "the device (mode 0660) can be read by its group's members (alice)", True,
         "the device (mode 0660) can be read by its group's members (alice)"),
        ("config-2", None, True, None),
        ("config-2", None, False, "OpenStack's metadata service serves the same user-data"),
    ],
)  # fmt: skip
def test_secrets_only_from_a_seed_no_other_user_can_read(
    tmp_path, fake, label, exposure, guarded, refused_because
):
    path = "user-data" if label == "cidata" else "openstack/latest/user_data"
    fake.add("/dev/sr0", label, {path: ud({**NODE, "munge_key": KEY})})
    cfg = cfg_for(tmp_path, fake, exposure=exposure, guarded=guarded)
    if refused_because is None:
        assert load_params(cfg).params.munge_key == KEY
    else:
        with pytest.raises(ParamsError) as e:
            load_params(cfg)
        assert "munge_key: refused, " + refused_because in str(e.value)
        assert KEY not in str(e.value)
    _cleaned(cfg, fake)


def test_two_seeds_are_an_error(tmp_path, fake):
    fake.add("/dev/sr0", "cidata", {"user-data": ud(NODE)})
    fake.add("/dev/vdb", "config-2", {"openstack/latest/user_data": ud(NODE)})
    with pytest.raises(ParamsError, match=r"more than one \(/dev/sr0 nocloud, /dev/vdb "
                       r"config-drive\); attach one"):  # fmt: skip
        load_params(cfg_for(tmp_path, fake))
    assert [c[0] for c in fake.calls] == ["blkid"]  # nothing mounted


def test_a_seed_label_on_another_filesystem_is_refused_unmounted(tmp_path, fake):
    fake.add("/dev/sdb1", "cidata", {"user-data": ud(NODE)}, "ext4")
    with pytest.raises(ParamsError, match=r"/dev/sdb1: labelled 'cidata' .* its filesystem is "
                       r"'ext4'; a seed is iso9660 or vfat"):  # fmt: skip
        load_params(cfg_for(tmp_path, fake))
    assert [c[0] for c in fake.calls] == ["blkid"]


def test_a_failed_mount_says_so_and_leaves_no_mount_point(tmp_path, fake):
    fake.add("/dev/sr0", "cidata", {"user-data": ud(NODE)})
    fake.mount_rc = 32
    cfg = cfg_for(tmp_path, fake)
    with pytest.raises(
        ParamsError, match=r"cannot mount it read-only \(mount: /x: wrong fs type"
    ) as e:
        load_params(cfg)
    assert "\n" not in str(e.value) and "superblock. dmesg(1) may have more)" in str(e.value)
    assert "umount" not in [c[0] for c in fake.calls]
    _cleaned(cfg, fake)


def test_a_busy_mount_is_detached_lazily_or_named(tmp_path, fake):
    fake.add("/dev/sr0", "cidata", {"user-data": ud(NODE)})
    fake.umount_rc["umount"] = 32
    cfg = cfg_for(tmp_path, fake)
    assert load_params(cfg).source == "nocloud"
    assert [c[:2] for c in fake.calls[-2:]] == [["umount", fake.calls[1][-1]], ["umount", "--lazy"]]
    _cleaned(cfg, fake)
    fake.umount_rc["--lazy"] = 32
    with pytest.raises(ParamsError, match=r"cannot unmount .*seed-.* unmount it by hand"):
        load_params(cfg)


def test_earlier_sources_win_and_the_seed_is_not_looked_for(tmp_path, fake):
    fake.add("/dev/sr0", "cidata", {"user-data": ud({**NODE, "cluster_name": "seed"})})
    cfg = cfg_for(tmp_path, fake)
    cfg.paths.node_yaml.parent.mkdir(parents=True)
    cfg.paths.node_yaml.write_text(json.dumps(NODE))
    cfg.paths.node_yaml.chmod(0o600)
    assert load_params(cfg).params.cluster_name == "demo" and fake.calls == []
    cfg.paths.node_yaml.unlink()
    cfg.paths.cloud_init_user_data.parent.mkdir(parents=True)
    cfg.paths.cloud_init_user_data.write_text(ud({**NODE, "cluster_name": "ci"}))
    assert load_params(cfg).source == "cloud-init" and fake.calls == []
    cfg.paths.cloud_init_user_data.unlink()
    assert load_params(cfg).params.cluster_name == "seed"


def test_a_re_rooted_tree_never_looks_at_the_machines_devices(tmp_path, monkeypatch):
    def boom(argv, timeout):
        raise AssertionError(f"ran {argv}")

    monkeypatch.setattr(params_seed, "_run", boom)
    with pytest.raises(NodeforgeError, match="no node params found"):
        load_params(SourceConfig(Paths.under(tmp_path), imds_url=None))


def test_blkid_finding_nothing_is_no_seed(tmp_path, fake):
    with pytest.raises(NodeforgeError, match="no node params found"):
        load_params(cfg_for(tmp_path, fake))
    assert fake.calls == [["blkid", "-c", "/dev/null", "-o", "export"]]


def test_device_exposure_rules():
    def st_(mode, uid=0, gid=24):
        return os.stat_result((0o60000 | mode, 0, 0, 0, uid, gid, 0, 0, 0, 0))

    def members(gid):
        return ["alice"] if gid == 24 else []

    assert exposure_of(st_(0o600), members) is None
    assert exposure_of(st_(0o660, gid=6), members) is None  # a group nobody is in
    assert exposure_of(st_(0o660), members) == (
        "the device (mode 0660) can be read by its group's members (alice)"
    )
    assert exposure_of(st_(0o644), members) == (
        "the device (mode 0644) can be read by every local user"
    )
    assert exposure_of(st_(0o600, uid=1000), members) == (
        "the device is owned by uid 1000, not root"
    )


SEED_WORDS = ["DEVNAME=", "LABEL=", "TYPE=", "/dev/sr0", "cidata", "config-2", "iso9660", "vfat",
              "\n", "\n\n", "=", " ", "\x00", "../", "é", "\\ ", "/dev/../etc/x"]  # fmt: skip


@settings(max_examples=200, deadline=2000, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(st.lists(st.sampled_from(SEED_WORDS) | st.text(max_size=8), max_size=30))
def test_any_blkid_output_is_read_safely(tmp_path, words):
    """Hostile blkid output (labels are whatever a disk says): a ParamsError or seeds whose
    device is a /dev path and filesystem one we mount; never another exception."""
    out = "".join(words)

    def run(argv, timeout):
        return subprocess.CompletedProcess(argv, 0, out, None)

    try:
        seeds = SeedDevices(workdir=tmp_path, run=run).find()
    except ParamsError as exc:
        assert "\n" not in str(exc)
        return
    for s in seeds:
        assert params_seed._DEVNAME.fullmatch(s.device) and ".." not in s.device.split("/")
        assert s.fstype in ("iso9660", "vfat")


def test_a_directory_where_the_file_should_be_is_refused(tmp_path, fake):
    """A directory where user-data belongs, or a file where a directory belongs, is not the
    format (and is never opened: a FIFO there would block a read). Each is refused by name,
    and the seed unmounted."""
    d = fake.add("/dev/vdb", "cidata", {})
    (d / "user-data").mkdir()
    cfg = cfg_for(tmp_path, fake)
    with pytest.raises(ParamsError, match=r"/dev/vdb \(NoCloud seed\) user-data: user-data is "
                       r"not a regular file"):  # fmt: skip
        load_params(cfg)
    _cleaned(cfg, fake)
    fake.devices.clear()
    fake.add("/dev/sr0", "config-2", {"openstack/latest": "a file, not a directory"})
    with pytest.raises(ParamsError, match=r"openstack/latest is not a directory"):
        load_params(cfg)
    _cleaned(cfg, fake)
