"""Var files, the secret scanner, post-stop sealing, the manifest schema and CLI errors."""

import json
import os
from pathlib import Path

import pytest

from nodeforge.errors import NodeforgeError
from nodeforge.images import build, manifest, scan, seal, varfile
from tests.conftest import make_keypair
from tests.helpers import dpkg_ship
from tests.unit.support import run_cli

pytestmark = pytest.mark.unit


def test_var_file_parse_error_has_line(tmp_path):
    f = tmp_path / "bad.pkrvars.hcl"
    f.write_text('region = "eu-west-1"\ninstance_type = \n')
    with pytest.raises(NodeforgeError, match=rf"{f}:2:\d+: not valid HCL2"):
        varfile.load(f, "amazon-ebs")


def test_var_file_unknown_and_internal_and_type(tmp_path):
    f = tmp_path / "v.pkrvars.hcl"
    f.write_text('regoin = "x"\n')
    with pytest.raises(NodeforgeError, match="unknown variable 'regoin'.*region"):
        varfile.load(f, "amazon-ebs")
    f.write_text("ssh_port = 22\n")
    with pytest.raises(NodeforgeError, match="'ssh_port' is set by nodeforge"):
        varfile.load(f, "local")
    f.write_text('root_volume_size = "big"\n')
    with pytest.raises(NodeforgeError, match="'root_volume_size' must be of type number"):
        varfile.load(f, "amazon-ebs")
    f.write_text('ansible_vars = { docker_source = "upstream" }\nroot_volume_size = 50\n')
    assert varfile.load(f, "amazon-ebs") == {
        "ansible_vars": {"docker_source": "upstream"},
        "root_volume_size": 50,
    }


def test_unreadable_var_file(tmp_path):
    with pytest.raises(NodeforgeError, match="cannot read var file"):
        varfile.load(tmp_path / "nope.hcl", "local")


def _tree(tmp_path) -> Path:
    t = tmp_path / "tree"
    for d in (
        "etc/ssh",
        "etc/munge",
        "var/lib/dpkg/info",
        "root/.ssh",
        "tmp",
        "var/tmp",
        "usr/share/doc/x",
        "etc/slurm",
        "usr/share/nodeforge/templates",
    ):
        (t / d).mkdir(parents=True)
    (t / "etc/machine-id").write_text("")
    # A package-owned example key is public (it is in the Debian archive): not a finding.
    (t / "usr/share/doc/x/example.key").write_text(make_keypair(tmp_path, "example")[1])
    dpkg_ship(t, "x", "usr/share/doc/x/example.key")
    (t / "usr/share/nodeforge/templates/slurmdbd.conf.j2").write_text(
        "StoragePass={{ storage_pass }}\n"
    )
    return t


def test_scan_clean_tree_has_no_findings(tmp_path):
    assert scan.scan(_tree(tmp_path)) == []


def test_scan_finds_every_kind_of_secret(tmp_path):
    t = _tree(tmp_path)
    (t / "etc/ssh/ssh_host_ed25519_key").write_text("k")
    (t / "etc/munge/munge.key").write_bytes(os.urandom(32))
    (t / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    (t / "root/.ssh/authorized_keys").write_text("ssh-ed25519 AAAA build")
    (t / "root/.bash_history").write_text("mysql -p secret")
    (t / "etc/ssl-private.pem").write_text(make_keypair(tmp_path, "stray")[1])
    (t / "etc/slurm/slurmdbd.conf").write_text("StorageUser=slurm\nStoragePass=hunter2\n")
    (t / "tmp/leftover").write_text("x")
    kinds = {f.kind for f in scan.scan(t)}
    assert kinds == {
        "ssh-host-key",
        "munge-key",
        "machine-id",
        "authorized-keys",
        "shell-history",
        "private-key",
        "db-credential",
        "temp-files",
    }


def test_seal_finalize_removes_build_identity(tmp_path):
    t = _tree(tmp_path)
    (t / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    (t / "etc/ssh/ssh_host_rsa_key").write_text("k")
    (t / "etc/ssh/sshd_config.d").mkdir()
    (t / "etc/ssh/sshd_config.d/00-nodeforge-build.conf").write_text("Port 1")
    (t / "root/.ssh/authorized_keys").write_text("ssh-ed25519 AAAA build")
    (t / "var/log").mkdir()
    (t / "var/log/x.log").write_text("old log line\n")
    (t / "etc/resolv.conf").write_text("nameserver 10.0.0.1\n")
    log = open(tmp_path / "log", "w")
    done = seal.finalize(t, log)
    log.close()
    assert "/etc/ssh/ssh_host_rsa_key" in done
    assert (t / "etc/machine-id").read_text() == ""
    assert (t / "var/log/x.log").exists() and (t / "var/log/x.log").read_text() == ""
    assert (t / "etc/resolv.conf").read_text() == ""
    assert scan.scan(t) == []
    # Every sealing action is logged with its reason.
    assert "SSH host keys are generated per node" in (tmp_path / "log").read_text()


def test_manifest_schema_rejects_incomplete():
    assert "missing 'packages'" in manifest.check({"schema": 1}, outer=False)
    good = {
        "schema": 1,
        "name": "n",
        "target": "local",
        "created": "x",
        "arch": "amd64",
        "base": {"name": "debian13", "suite": "trixie", "mirror": "m", "key": "k"},
        "components": {"slurmctld": "24.11"},
        "packages": {"slurmctld": "24.11"},
        "inputs": {"pyxis_src": {"sha256": "a" * 64, "pinned": False}},
        "tools": {"nodeforge": "0.1", "packer": "1.6.6", "ansible-core": "2.19"},
        "phases": {p: 1.0 for p in manifest.REQUIRED_PHASES_IMAGE["local"]},
    }
    assert manifest.check(good, outer=False) == []
    errs = manifest.check(good, outer=True)
    assert "missing 'artifacts'" in errs and "'phases.export' is missing" in errs


def test_cli_unknown_target():
    cp = run_cli("build", "--target", "gce")
    assert cp.returncode == 2 and "invalid choice: 'gce'" in cp.stderr


def test_cli_missing_tool_names_apt_package(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # nothing on PATH
    cp = run_cli("build", env=env)
    assert cp.returncode == 2
    assert "required tool 'packer' not found" in cp.stderr and "apt-get install packer" in cp.stderr


def test_build_refuses_non_root(monkeypatch):
    monkeypatch.setattr(build.proc, "require_tool", lambda t: f"/usr/bin/{t}")
    monkeypatch.setattr(build.os, "geteuid", lambda: 1000)
    with pytest.raises(NodeforgeError, match="needs root.*sudo"):
        build.preflight(build.BuildOptions())


def test_cli_bad_var_file_reported(tmp_path):
    f = tmp_path / "x.pkrvars.hcl"
    f.write_text("image_name = \n")
    cp = run_cli("validate", "--target", "local", "--var-file", str(f))
    assert cp.returncode == 2 and f"{f}:1:" in cp.stderr


def test_cli_render_prints_template():
    cp = run_cli("render", "--target", "local")
    assert cp.returncode == 0 and 'source "null" "sandbox"' in cp.stdout


def test_cli_versions_show_json():
    cp = run_cli("versions", "show", "--json")
    rows = json.loads(cp.stdout)
    assert {r["artifact"] for r in rows} == {
        "enroot_deb",
        "enroot_caps_deb",
        "pyxis_src",
        # gpu variant only (versions.yaml `variant: gpu`)
        "libnvidia_container1_deb",
        "libnvidia_container_tools_deb",
        "nvidia_container_toolkit_base_deb",
        "nvidia_container_toolkit_deb",
        "nvidia_fabricmanager_deb",
    }


def test_aws_credentials_detection(tmp_path):
    from nodeforge.images.packer_build import aws_credentials_present

    assert not aws_credentials_present({"HOME": str(tmp_path)})
    assert aws_credentials_present({"HOME": str(tmp_path), "AWS_PROFILE": "ci"})
    assert aws_credentials_present(
        {"HOME": str(tmp_path), "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
    )
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws/credentials").write_text("[default]\n")
    assert aws_credentials_present({"HOME": str(tmp_path)})


def test_amazon_build_without_credentials_names_the_fix(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["HOME"] = str(tmp_path)
    cp = run_cli("build", "--target", "amazon-ebs", env=env)
    assert cp.returncode == 2 and "needs AWS credentials" in cp.stderr


def test_ami_tags_map_literal():
    from nodeforge.images.packer_build import _hcl_map

    assert _hcl_map({"nodeforge:enroot": "4.1.2"}) == '{"nodeforge:enroot" = "4.1.2"}'
