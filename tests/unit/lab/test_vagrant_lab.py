"""nodeforge.lab.vagrant_lab: the driver choice, the box, libvirtd's config, the firewall undo
(no root, no libvirtd; write_box uses the real qemu-img and tar)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.bootstrap.params import parse_params
from nodeforge.bootstrap.params_sources import params_from_user_data
from nodeforge.errors import NodeforgeError
from nodeforge.images.qemu_host import AccelDecision
from nodeforge.lab import vagrant_lab as vl
from tests.helpers import carries_secret
from tests.unit.support import REPO

pytestmark = pytest.mark.unit


def _never():
    raise AssertionError("the KVM probe ran although the environment chose")


@pytest.mark.parametrize("value", ["kvm", "qemu"])
def test_driver_from_env_skips_the_probe(value):
    assert vl.vagrant_driver({vl.DRIVER_ENV: value}, _never) == value


@pytest.mark.parametrize("accel,want", [("kvm", "kvm"), ("tcg", "qemu")])
def test_driver_follows_the_probe_when_unset(accel, want):
    assert vl.vagrant_driver({}, lambda: AccelDecision(accel, "probe")) == want
    assert vl.vagrant_driver({vl.DRIVER_ENV: ""}, lambda: AccelDecision(accel, "probe")) == want


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=20).filter(lambda s: s not in ("kvm", "qemu")))
def test_driver_rejects_anything_else(value):
    with pytest.raises(NodeforgeError) as e:
        vl.vagrant_driver({vl.DRIVER_ENV: value}, _never)
    assert vl.DRIVER_ENV in str(e.value) and "kvm" in str(e.value) and "qemu" in str(e.value)


@pytest.mark.parametrize("value", ["KVM", " qemu", "qemu\n", "tcg", "kvm,qemu"])
def test_driver_rejects_near_misses(value):
    with pytest.raises(NodeforgeError, match=vl.DRIVER_ENV):
        vl.vagrant_driver({vl.DRIVER_ENV: value}, _never)


@pytest.mark.parametrize("size,gib", [(1, 1), (2**30, 1), (2**30 + 1, 2), (3003121664, 3)])
def test_box_metadata_rounds_up_to_whole_gib(size, gib):
    assert vl.box_metadata(size) == {"provider": "libvirt", "format": "qcow2", "virtual_size": gib}


def test_box_metadata_refuses_an_empty_disk():
    with pytest.raises(NodeforgeError, match="not positive"):
        vl.box_metadata(0)


@pytest.fixture
def qemu_img():
    if shutil.which("qemu-img") is None:
        pytest.fail("qemu-img missing (apt install qemu-utils)", pytrace=False)
    return "qemu-img"


def test_write_box_holds_the_disk_metadata_and_firmware_vagrantfile(tmp_path, qemu_img):
    image = tmp_path / "image"
    image.mkdir()
    subprocess.run(
        [qemu_img, "create", "-q", "-f", "qcow2", str(image / "disk.qcow2"), "1536M"], check=True
    )
    (tmp_path / "out").mkdir()
    box = vl.write_box(image, tmp_path / "out" / "nodeforge.box")
    with tarfile.open(box) as t:
        assert sorted(t.getnames()) == ["Vagrantfile", "box.img", "metadata.json"]
        assert json.loads(t.extractfile("metadata.json").read())["virtual_size"] == 2
        assert t.extractfile("box.img").read() == (image / "disk.qcow2").read_bytes()
        vf = t.extractfile("Vagrantfile").read().decode()
    assert "lv.kernel" not in vf  # the disk boots from firmware
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["nodeforge.box"]


def test_write_box_refuses_a_missing_or_raw_disk(tmp_path, qemu_img):
    with pytest.raises(NodeforgeError, match="disk.qcow2 is missing"):
        vl.write_box(tmp_path, tmp_path / "x.box")
    subprocess.run(
        [qemu_img, "create", "-q", "-f", "raw", str(tmp_path / "disk.qcow2"), "1M"], check=True
    )
    with pytest.raises(NodeforgeError, match="not a qcow2 image"):
        vl.write_box(tmp_path, tmp_path / "x.box")
    assert not (tmp_path / "x.box").exists()


def test_libvirtd_conf_keeps_sockets_private(tmp_path):
    conf = vl.libvirtd_conf(tmp_path / "run", tmp_path / "l.log")
    assert f'unix_sock_dir = "{tmp_path}/run"' in conf
    assert 'unix_sock_rw_perms = "0700"' in conf and 'unix_sock_ro_perms = "0700"' in conf
    lv = vl.Libvirtd(tmp_path)
    assert lv.uri == f"qemu:///system?socket={tmp_path}/run/libvirt-sock"


def test_firewall_undo_removes_only_new_libvirt_rules_then_chains():
    before = {"-P INPUT ACCEPT", "-N DOCKER", "-A FORWARD -j DOCKER"}
    after = [
        "-P INPUT ACCEPT",
        "-N DOCKER",
        "-N LIBVIRT_INP",
        "-N MINE",
        "-A FORWARD -j DOCKER",
        "-A INPUT -j LIBVIRT_INP",
        "-A LIBVIRT_INP -i virbr1 -p udp -m udp --dport 53 -j ACCEPT",
        "-A INPUT -j MINE",
    ]
    assert vl.firewall_undo(before, after) == [
        ["-D", "INPUT", "-j", "LIBVIRT_INP"],
        [
            "-D",
            "LIBVIRT_INP",
            "-i",
            "virbr1",
            "-p",
            "udp",
            "-m",
            "udp",
            "--dport",
            "53",
            "-j",
            "ACCEPT",
        ],
        ["-F", "LIBVIRT_INP"],
        ["-X", "LIBVIRT_INP"],
    ]
    assert vl.firewall_undo(set(after), after) == []


def test_remove_refuses_a_name_that_is_not_a_libvirt_name(tmp_path):
    with pytest.raises(NodeforgeError, match="not \\[A-Za-z0-9_.-\\]"):
        vl.Libvirtd(tmp_path).remove(domains=["a b; rm"])


def test_start_refuses_beside_a_running_libvirtd(tmp_path, monkeypatch):
    monkeypatch.setattr(vl, "running", lambda: [(4242, "libvirtd")])
    with pytest.raises(NodeforgeError, match="libvirtd pid 4242"):
        vl.Libvirtd(tmp_path).start()
    assert not (tmp_path / "libvirtd.conf").exists()


def test_start_refuses_autostarted_objects(tmp_path, monkeypatch):
    auto = tmp_path / "networks-autostart"
    auto.mkdir()
    (auto / "default.xml").write_text("<network/>\n")
    monkeypatch.setattr(vl, "running", lambda: [])
    monkeypatch.setattr(vl, "AUTOSTART_DIRS", (tmp_path / "absent", auto))
    with pytest.raises(NodeforgeError, match="default.xml.*net-autostart --disable"):
        vl.Libvirtd(tmp_path / "w").start()
    assert not (tmp_path / "w").exists()


# -- the repository's Vagrantfile, evaluated by Ruby with a recording stand-in for Vagrant ------

# FIXTURE: a stand-in for Vagrant's config objects. Every call on them is recorded with its
# receiver's path (e.g. `config.vm.define(c1).vm.provider(libvirt).sysinfo=`); blocks run with
# fresh recorders, except trigger bodies (`ruby`): those of `before` triggers run as `vagrant
# up` would run them, for each machine named in STANDIN_UP with provider STANDIN_PROVIDER.
VAGRANT_STANDIN = r"""
require "json"
class Rec
  LOG = []
  TRIGGERS = []
  def initialize(path) = @path = path
  def respond_to_missing?(*) = true
  def to_s = @path
  def method_missing(name, *args, **kw, &blk)
    path = "#{@path}.#{name}"
    LOG << { "path" => path, "args" => args, "kw" => kw }
    if blk && name == :ruby
      TRIGGERS << [path, blk]
    elsif blk
      here = args.empty? ? path : "#{path}(#{args.first})"
      blk.call(*Array.new([blk.arity, 1].max) { Rec.new(here) })
    end
    Rec.new(path)
  end
end
module Vagrant
  def self.configure(_version) = yield(Rec.new("config"))
end
Machine = Struct.new(:name, :provider_name, :ssh_info)
load File.join(Dir.pwd, "Vagrantfile")
ENV.fetch("STANDIN_UP", "").split(",").each do |m|
  Rec::TRIGGERS.each do |path, blk|
    next unless path.include?(".trigger.before(") && path.include?(":up")
    blk.call(nil, Machine.new(m.to_sym, ENV.fetch("STANDIN_PROVIDER", "libvirt").to_sym, nil))
  end
end
puts JSON.generate(Rec::LOG)
"""

LIBVIRT = "config.vm.define({}).vm.provider(libvirt)"


@pytest.fixture
def vagrantfile_tools():
    missing = [t for t in ("ruby", "xorriso", "ssh-keygen", "blkid") if shutil.which(t) is None]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} missing (apt install ruby xorriso openssh-client util-linux)",
            pytrace=False,
        )


def _evaluate(lab: Path, path: str | None = None, **env: str) -> subprocess.CompletedProcess:
    lab.mkdir(exist_ok=True)
    shutil.copy(REPO / "Vagrantfile", lab / "Vagrantfile")
    (lab / "standin.rb").write_text(VAGRANT_STANDIN)
    return subprocess.run(
        [shutil.which("ruby") or "ruby", "standin.rb"],
        cwd=lab,
        env={"PATH": path or os.environ["PATH"], "HOME": str(lab), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _calls(lab: Path, **env: str) -> list[dict]:
    cp = _evaluate(lab, **env)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def _credentials(calls: list[dict], node: str) -> dict[str, bytes]:
    (sysinfo,) = [c for c in calls if c["path"] == LIBVIRT.format(node) + ".sysinfo="]
    creds = {}
    for s in sysinfo["args"][0]["oem strings"]:
        name, _, b64 = s.removeprefix("io.systemd.credential.binary:").partition("=")
        creds[name] = base64.b64decode(b64, validate=True)
    return creds


def _seed_file(iso: Path, name: str, tmp: Path) -> str:
    out = tmp / f"{iso.stem}-{name}"
    subprocess.run(
        ["xorriso", "-osirrox", "on", "-indev", str(iso), "-extract", f"/{name}", str(out)],
        capture_output=True,
        check=True,
        timeout=60,
    )
    return out.read_text()


def test_vagrantfile_oem_strings_carry_no_params_and_no_munge_key(tmp_path, vagrantfile_tools):
    """vagrant-libvirt prints every OEM string and qemu arg on `vagrant up`: only the public
    credentials go there; nothing the libvirt provider is given carries the munge key."""
    lab = tmp_path / "lab"
    calls = _calls(lab)
    munge = (lab / ".vagrant" / "nodeforge_munge.key").read_bytes()
    assert len(munge) == 32
    for node in ("ctl", "c1", "c2"):
        creds = _credentials(calls, node)
        assert sorted(creds) == [
            "network.network.40-nodeforge-lab",
            "network.network.50-nodeforge-mgmt",
            "ssh.authorized_keys.root",
            "systemd.unit-dropin.multi-user.target",
        ]
        for name, value in creds.items():
            assert b"munge" not in value and b"node.yaml" not in value, name
        given = [c for c in calls if c["path"].startswith(LIBVIRT.format(node))]
        assert not [c for c in given if c["path"].endswith(".qemu_args=")]
        assert carries_secret(json.dumps(given), munge) is None
    # the check itself finds the key where the old Vagrantfile put it (an OEM string holding a
    # tmpfiles line holding node.yaml's base64)
    node_yaml = f"role: compute\nmunge_key: {base64.b64encode(munge).decode()}\n"
    line = f"f~ /etc/nodeforge/node.yaml 0600 root root - {base64.b64encode(node_yaml.encode()).decode()}\n"
    old = f"io.systemd.credential.binary:tmpfiles.extra={base64.b64encode(line.encode()).decode()}"
    assert carries_secret(json.dumps([old]), munge) is not None


def test_vagrantfile_params_go_on_a_nocloud_seed_cdrom(tmp_path, vagrantfile_tools):
    lab = tmp_path / "lab"
    calls = _calls(lab, NODEFORGE_COMPUTES="1", NODEFORGE_CLUSTER="seedlab", STANDIN_UP="ctl,c1")
    munge = (lab / ".vagrant" / "nodeforge_munge.key").read_bytes()
    for node, role, address in (
        ("ctl", "controller", "10.77.0.10"),
        ("c1", "compute", "10.77.0.11"),
    ):
        (storage,) = [c for c in calls if c["path"] == LIBVIRT.format(node) + ".storage"]
        iso = lab / ".vagrant" / f"{node}-seed.iso"
        # an absolute path (vagrant-libvirt takes a relative one as a pool volume name)
        assert storage["args"] == ["file"]
        assert storage["kw"] == {"device": "cdrom", "path": str(iso)}
        assert stat.S_IMODE(iso.stat().st_mode) == 0o600
        blk = subprocess.run(["blkid", "-p", "-o", "export", str(iso)], capture_output=True,
                             text=True, check=True, timeout=30).stdout.split()  # fmt: skip
        assert "LABEL=cidata" in blk and "TYPE=iso9660" in blk, blk
        # what the agent makes of the seed's user-data: the node's params, the lab's key
        text = _seed_file(iso, "user-data", tmp_path)
        section = params_from_user_data(text, f"{iso} user-data")
        p = parse_params(section, f"{iso} nodeforge")
        assert (p.role, p.cluster_name, p.node_name, p.node_address) == (
            role,
            "seedlab",
            node,
            address,
        )
        assert base64.b64decode(p.munge_key) == munge
        assert _seed_file(iso, "meta-data", tmp_path) == f"instance-id: nodeforge-seedlab-{node}\n"
    # no scratch tree or half-made image beside the seeds
    assert sorted(p.name for p in (lab / ".vagrant").iterdir() if "seed" in p.name) == [
        "c1-seed.iso",
        "c1-seed.iso.sha256",
        "ctl-seed.iso",
        "ctl-seed.iso.sha256",
    ]


def test_vagrantfile_remakes_a_seed_only_when_its_params_change(tmp_path, vagrantfile_tools):
    lab = tmp_path / "lab"
    _calls(lab, NODEFORGE_COMPUTES="1", STANDIN_UP="c1")
    iso = lab / ".vagrant" / "c1-seed.iso"
    first = iso.stat().st_ino, iso.read_bytes()
    _calls(lab, NODEFORGE_COMPUTES="1", STANDIN_UP="c1")
    assert (iso.stat().st_ino, iso.read_bytes()) == first  # same params: left alone
    _calls(lab, NODEFORGE_COMPUTES="1", NODEFORGE_CLUSTER="other", STANDIN_UP="c1")
    assert iso.stat().st_ino != first[0]
    assert "cluster_name: other" in _seed_file(iso, "user-data", tmp_path)
    assert stat.S_IMODE(iso.stat().st_mode) == 0o600


def test_vagrantfile_seeds_only_a_libvirt_up_and_without_xorriso_stops_naming_it(
    tmp_path, vagrantfile_tools
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh-keygen").symlink_to(shutil.which("ssh-keygen"))
    lab = tmp_path / "lab"
    # reading the Vagrantfile (validate, status, ssh-config) or a VirtualBox up needs no seed
    for env in ({}, {"STANDIN_UP": "ctl", "STANDIN_PROVIDER": "virtualbox"}):
        cp = _evaluate(lab, path=str(bin_dir), **env)
        assert cp.returncode == 0, cp.stderr
        assert not [p for p in (lab / ".vagrant").iterdir() if "seed" in p.name]
    cp = _evaluate(lab, path=str(bin_dir), STANDIN_UP="ctl")
    assert cp.returncode != 0
    assert "xorriso not found: install xorriso" in cp.stderr, cp.stderr
    assert not [p for p in (lab / ".vagrant").iterdir() if "seed" in p.name]
