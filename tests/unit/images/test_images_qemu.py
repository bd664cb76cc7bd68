"""The qemu target's host-side pieces: disk sizing, the Packer chain, the disk seal (no root)."""

import json
import re

import pytest

from nodeforge.errors import NodeforgeError
from nodeforge.images import disk_seal, export, manifest, template
from nodeforge.images import packer_build as remote
from tests.conftest import make_keypair
from tests.helpers import qemu_image_manifest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "value,mib",
    [
        ("8G", 8192),
        ("8192M", 8192),
        ("10240", 10240),
        ("1.5G", 1536),
        ("1T", 1048576),
        ("4g", 4096),
    ],
)
def test_disk_size_follows_packer_syntax(value, mib):
    assert remote.disk_size_mib(value) == mib


@pytest.mark.parametrize(
    "value,msg", [("eight", "not a size"), ("512M", "under 1 GiB"), ("", "not a size")]
)
def test_bad_disk_size_names_the_variable(value, msg):
    with pytest.raises(NodeforgeError, match=f"disk_size.*{msg}"):
        remote.disk_size_mib(value)


def test_fixed_disk_size_smaller_than_the_tree_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(export, "tree_size_bytes", lambda tree: 3 << 30)  # 3 GiB of content
    with pytest.raises(NodeforgeError, match="disk size 2048 MiB is smaller than the image needs"):
        export.export_disk(tmp_path, tmp_path, size_mib=2048)


def test_qemu_template_forwards_ssh_on_loopback_and_logs_the_console():
    text = template.render("qemu")
    assert "hostfwd=tcp:127.0.0.1:{{ .SSHHostPort }}-:22" in text
    assert '"file:${var.console_log}"' in text


def test_qemu_template_seals_before_the_box_is_made():
    d = template.render_dict("qemu")
    build = d["build"][0]
    # One post-processors chain: shell-local (seal) first, then vagrant on its output.
    chain = build["post-processors"][0]["post-processor"]
    kinds = [next(iter(pp)).strip('"') for pp in chain]
    assert kinds == ["shell-local", "vagrant"]
    vagrant = chain[1]['"vagrant"']
    assert vagrant["provider_override"] == '"libvirt"'
    assert vagrant["vagrantfile_template"] == "${var.box_vagrantfile}"

    assert "post-processor" not in build, "a separate post-processor would box the unsealed disk"


def test_box_carries_only_the_disk_metadata_and_vagrantfile():
    """Nothing is added to the vagrant post-processor's box.img + metadata.json +
    Vagrantfile: no kernel or initrd (no `include`), and no variable left to name one."""
    d = template.render_dict("qemu")
    chain = d["build"][0]["post-processors"][0]["post-processor"]
    vagrant = chain[1]['"vagrant"']
    assert "include" not in vagrant
    names = {v.name for v in template.variables_for("qemu")}
    assert not {"kernel_out", "initrd_out"} & names
    # One Vagrantfile for every box (the qemu target's and vagrant_lab.write_box's).
    assert sorted(p.name for p in remote.BOX_VAGRANTFILE.parent.iterdir()) == ["Vagrantfile"]


def test_box_vagrantfile_boots_the_disk_from_firmware():
    text = remote.BOX_VAGRANTFILE.read_text()
    code = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    settings = [ln for ln in code if ln.startswith("lv.")]
    # disk_bus only: no lv.kernel, lv.initrd or lv.cmd_line (direct kernel boot).
    assert settings == ['lv.disk_bus = "virtio"']
    assert not re.search(r"\b(kernel|initrd|cmd_line)\b", "\n".join(code))
    # Packer renders the file as a Go template: a stray '{{' would break the box.
    assert "{{" not in text


def _tree(tmp_path):
    """A minimal node tree: dpkg status, kernel, initrd and build leftovers to seal."""
    t = tmp_path / "tree"
    (t / "var/lib/dpkg").mkdir(parents=True)
    (t / "var/lib/dpkg/status").write_text(
        "Package: slurmctld\nStatus: install ok installed\nVersion: 24.11.5-1\n"
        "Architecture: amd64\n\n"
        "Package: gone\nStatus: deinstall ok config-files\nVersion: 1\nArchitecture: amd64\n\n"
    )
    (t / "boot").mkdir()
    (t / "boot/vmlinuz-6.12.1-amd64").write_bytes(b"kernel")
    (t / "boot/initrd.img-6.12.1-amd64").write_bytes(b"initrd")
    (t / "etc/ssh").mkdir(parents=True)
    _, priv = make_keypair(tmp_path, "hostkey")
    (t / "etc/ssh/ssh_host_ed25519_key").write_text(priv)
    (t / "root/.ssh").mkdir(parents=True)
    (t / "root/.ssh/authorized_keys").write_text(make_keypair(tmp_path, "build")[0] + "\n")
    (t / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    (t / "var/log/journal/abc").mkdir(parents=True)
    (t / "var/log/journal/abc/system.journal").write_bytes(b"x" * 100)
    return t


def test_seal_tree_removes_identity_writes_image_json_and_copies_boot(tmp_path):
    t = _tree(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "seal.log"
    with open(log, "w") as f:
        image = disk_seal.seal_tree(t, qemu_image_manifest(), out, f, started=0.0)
    assert not list((t / "etc/ssh").glob("ssh_host_*"))
    assert not (t / "root/.ssh/authorized_keys").exists()
    assert (t / "etc/machine-id").read_text() == ""
    assert not list((t / "var/log/journal").iterdir())
    written = json.loads((t / "etc/nodeforge/image.json").read_text())
    assert written == image
    assert written["packages"] == {"slurmctld": "24.11.5-1"}
    assert written["components"]["slurmctld"] == "24.11.5-1"
    assert manifest.check(written, outer=False) == []
    assert (out / "vmlinuz").read_bytes() == b"kernel"
    assert (out / "initrd.img").read_bytes() == b"initrd"
    # Every removal is logged with its reason.
    assert "remove /etc/ssh/ssh_host_ed25519_key — SSH host keys" in log.read_text()


def test_seal_tree_refuses_a_secret_it_cannot_remove(tmp_path):
    t = _tree(tmp_path)
    _, priv = make_keypair(tmp_path, "stray")
    (t / "opt").mkdir()
    (t / "opt/deploy_key").write_text(priv)
    out = tmp_path / "out"
    out.mkdir()
    with (
        open(tmp_path / "log", "w") as f,
        pytest.raises(
            NodeforgeError, match="(?s)refusing to publish.*/opt/deploy_key: private-key"
        ),
    ):
        disk_seal.seal_tree(t, qemu_image_manifest(), out, f, started=0.0)
    assert not (t / "etc/nodeforge/image.json").exists()


def test_seal_tree_without_kernel_names_the_fix(tmp_path):
    t = _tree(tmp_path)
    for p in (t / "boot").iterdir():
        p.unlink()
    with open(tmp_path / "log", "w") as f, pytest.raises(NodeforgeError, match="linux-image"):
        disk_seal.seal_tree(t, qemu_image_manifest(), tmp_path, f, started=0.0)


def test_manifest_phases_depend_on_the_target():
    m = {**qemu_image_manifest(), "components": {}, "packages": {"a": "1"}}
    m["phases"] = {"preflight": 1, "base": 1, "provision": 1, "seal": 1}
    assert manifest.check(m, outer=False) == []
    assert "'phases.sandbox'" in " ".join(manifest.check({**m, "target": "local"}, outer=False))


def test_cloud_image_needs_its_checksum():
    with pytest.raises(NodeforgeError, match="base_disk_checksum is required.*sha256:<hex>"):
        remote.check_qemu_vars({"base_disk": "https://example.invalid/debian-13.qcow2"})
    remote.check_qemu_vars(
        {
            "base_disk": "https://example.invalid/debian-13.qcow2",
            "base_disk_checksum": "sha512:" + "0" * 128,
        }
    )
    with pytest.raises(NodeforgeError, match="kernel/initrd are set by nodeforge"):
        remote.check_qemu_vars(
            {"base_disk": "x.qcow2", "base_disk_checksum": "sha256:00", "kernel": "/boot/vmlinuz"}
        )
    with pytest.raises(NodeforgeError, match="disk_size"):
        remote.check_qemu_vars({"disk_size": "huge"})


def test_nocloud_seed_authorizes_only_the_build_key(tmp_path):
    import yaml

    pub, _ = make_keypair(tmp_path, "build")
    seed = remote.write_nocloud_seed(tmp_path / "seed", pub + "\n", "img")
    ud = (seed / "user-data").read_text()
    assert ud.startswith("#cloud-config\n")
    cfg = yaml.safe_load(ud)
    assert cfg["ssh_authorized_keys"] == [pub] and cfg["ssh_pwauth"] is False
    assert yaml.safe_load((seed / "meta-data").read_text())["instance-id"] == "img-build"


def test_qemu_template_validates_with_direct_kernel_boot(tmp_path):
    """`nodeforge validate` covers the cloud-image branch; this covers the direct-boot one."""
    from nodeforge.images import packer
    from nodeforge.images.build import repo_paths

    playbook, cfg, _ = repo_paths()
    make_keypair(tmp_path, "k")
    f = tmp_path / "qemu.pkr.hcl"
    f.write_text(template.render("qemu"))
    (tmp_path / "ev.json").write_text("{}")
    for n in ("base.qcow2", "vmlinuz", "initrd.img"):
        (tmp_path / n).write_bytes(b"")
    from nodeforge import proc

    values = {
        "ansible_playbook": proc.require_tool("ansible-playbook"),
        "playbook_file": playbook,
        "ansible_config": cfg,
        "extra_vars_file": tmp_path / "ev.json",
        "base_disk": tmp_path / "base.qcow2",
        "kernel": tmp_path / "vmlinuz",
        "initrd": tmp_path / "initrd.img",
        "ssh_private_key_file": tmp_path / "k",
        "seal_command": "exit 1",
        "box_vagrantfile": remote.BOX_VAGRANTFILE,
    }
    assert "valid" in packer.validate(f, values, [])
