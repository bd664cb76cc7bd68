"""Packer templates: every target renders, is `packer fmt` clean and passes `packer validate`."""

import subprocess

import hcl2
import pytest

from nodeforge.images import packer, template
from nodeforge.images.packer import PackerVersion

pytestmark = pytest.mark.unit
OLD = PackerVersion(1, 6, 6)
NEW = PackerVersion(1, 11, 2)


@pytest.mark.parametrize("target", template.TARGETS)
def test_render_roundtrips_through_hcl2(target):
    text = template.render(target)
    data = hcl2.loads(text)
    assert "build" in data and "source" in data
    declared = {next(iter(v)).strip('"') for v in data["variable"]}
    assert {v.name for v in template.variables_for(target)} == declared


@pytest.mark.parametrize("target", template.TARGETS)
def test_rendered_template_is_packer_fmt_clean(tmp_path, target):
    f = tmp_path / f"{target}.pkr.hcl"
    f.write_text(packer.render(target, OLD))
    cp = subprocess.run(["packer", "fmt", "-check", str(f)], capture_output=True, text=True)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_required_plugins_only_for_packer_17_and_later(monkeypatch):
    monkeypatch.setattr(packer, "fmt", lambda text: text)
    assert "required_plugins" not in packer.render("local", OLD)
    assert "required_plugins" in packer.render("local", NEW)


def test_local_target_uses_null_builder_and_direct_ansible():
    d = template.render_dict("local")
    src = d["source"][0]['"null"']['"sandbox"']
    assert src["ssh_host"] == '"127.0.0.1"'
    prov = d["build"][0]["provisioner"][0]['"ansible"']
    assert prov["use_proxy"] is False
    assert '"@${var.extra_vars_file}"' in prov["extra_arguments"]


def test_amazon_ebs_is_encrypted_gp3_with_official_owners_and_unique_name():
    text = template.render("amazon-ebs")
    assert "136693071363" in text and "099720109477" in text
    assert 'volume_type           = "gp3"' in text or 'volume_type = "gp3"' in text.replace(
        "  ", " "
    )
    assert "encrypted" in text and "encrypt_boot" in text
    assert "local.build_stamp" in text and "timestamp()" in text


def test_amazon_ebs_imdsv2_on_old_and_new_packer():
    old = template.render("amazon-ebs", modern=False)
    new = template.render("amazon-ebs", modern=True)
    # Packer 1.6 cannot express IMDS options: the AMI is switched to IMDSv2 after the build.
    assert "metadata_options" not in old and "--imds-support v2.0" in old
    assert 'http_tokens                 = "required"' in new or 'http_tokens = "required"' in new
    assert "imds_support" in new


def test_qemu_builds_qcow2_and_libvirt_box():
    text = template.render("qemu")
    assert '"qcow2"' in text and 'post-processor "vagrant"' in text and '"libvirt"' in text


def test_unknown_target_is_named():
    from nodeforge.errors import NodeforgeError

    with pytest.raises(NodeforgeError, match="unknown target 'gce'.*local, qemu, amazon-ebs"):
        template.render_dict("gce")


def test_packer_validate_passes_for_every_target():
    from nodeforge.images.validate import validate_targets

    res = validate_targets(list(template.TARGETS), [])
    assert set(res) == set(template.TARGETS)
