"""Packer templates: every target renders, is `packer fmt` clean and passes `packer validate`."""

import re
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
    # Debian's official AMIs only: the playbook bakes Debian 12/13 (no Ubuntu on offer).
    assert "136693071363" in text and "debian-13-%s-*" in text and "debian-12-%s-*" in text
    assert "ubuntu" not in text.lower() and "099720109477" not in text
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


# -- Packer >= 1.7: pinned plugins, installed by `packer init` before validate/build ------------
@pytest.mark.parametrize("target", template.TARGETS)
def test_modern_template_pins_exactly_the_plugins_its_target_uses(monkeypatch, target):
    monkeypatch.setattr(packer, "fmt", lambda text: text)
    text = packer.render(target, NEW)
    raw = hcl2.loads(text)["packer"][0]["required_plugins"][0]
    unq = lambda v: v.strip('"') if isinstance(v, str) else v  # noqa: E731
    block = {k: {a: unq(b) for a, b in v.items() if a != "__is_block__"}
             for k, v in raw.items() if k != "__is_block__"}  # fmt: skip
    names = set(block)
    assert names == set(template.TARGET_PLUGINS[target])
    for name, spec in block.items():
        source, version = template.PLUGINS[name]
        assert spec["source"] == source
        # an exact pin ("= X.Y.Z"), never a range that drifts with new releases
        assert re.fullmatch(r"= \d+\.\d+\.\d+", spec["version"]), spec["version"]
        assert spec["version"] == f"= {version}"
    # every builder and post-processor the template uses comes from a pinned plugin or Packer
    builtin = {"null", "shell-local", "manifest"}
    used = set(re.findall(r'(?:source|provisioner|post-processor) "([\w-]+)"', text))
    plugin_of = {"qemu": "qemu", "ansible": "ansible", "vagrant": "vagrant", "amazon-ebs": "amazon"}
    assert {plugin_of[u] for u in used - builtin} == names


def test_packer_init_runs_before_validate_and_build_only_with_pinned_plugins(tmp_path, monkeypatch):
    calls: list[list[str]] = []

    def fake_run(argv, **kw):
        calls.append([str(a) for a in argv])
        return subprocess.CompletedProcess(argv, 0, "")

    monkeypatch.setattr(packer.proc, "run", fake_run)
    monkeypatch.setattr(packer.build_proc, "stream", lambda argv, **kw: fake_run(argv))
    monkeypatch.setattr(packer.proc, "require_tool", lambda t: t)
    modern = tmp_path / "modern.pkr.hcl"
    modern.write_text(
        template.required_plugins_block("local") + template.render("local", modern=True)
    )
    old = tmp_path / "old.pkr.hcl"
    old.write_text(template.render("local"))
    log = open(tmp_path / "build.log", "w")
    packer.build(modern, {}, [], logfile=log)
    packer.validate(modern, {}, [])
    packer.build(old, {}, [], logfile=log)
    verbs = [c[1] for c in calls]
    assert verbs == ["init", "build", "init", "validate", "build"]
    assert calls[0][2] == str(modern)


def test_packer_init_failure_says_how_to_install_plugins_offline(tmp_path, monkeypatch):
    from nodeforge.errors import CommandError

    def failing(argv, **kw):
        raise CommandError([str(a) for a in argv], 1, "Failed getting the plugin", hint=kw["hint"])

    monkeypatch.setattr(packer.proc, "run", failing)
    monkeypatch.setattr(packer.proc, "require_tool", lambda t: t)
    f = tmp_path / "t.pkr.hcl"
    f.write_text(template.required_plugins_block("qemu"))
    with pytest.raises(CommandError, match="packer plugins install"):
        packer.init(f)


# -- amazon-ebs: Debian 13 by default, the base actually used, unsupported choices up front --------
def test_amazon_source_follows_the_base_and_defaults_to_debian_13():
    assert template.amazon_source({}, "debian13", "amd64") == {
        "source_os": "debian-13",
        "arch": "amd64",
    }
    assert template.amazon_source({}, "debian12", "amd64")["source_os"] == "debian-12"
    default = {v.name: v.default for v in template.variables_for("amazon-ebs")}
    assert default["source_os"] == "debian-13"


@pytest.mark.parametrize(
    ("user", "base", "match"),
    [
        (
            {"source_os": "ubuntu-22.04"},
            "debian13",
            r"'ubuntu-22.04' is not built: the playbook bakes Debian 12/13 only",
        ),
        ({"source_os": "debian-12"}, "debian13", r"differs from --base debian13"),
        ({"arch": "arm64"}, "debian13", r"arch = 'arm64', but this build host is amd64"),
    ],
)
def test_amazon_source_refuses_before_anything_is_launched(user, base, match):
    from nodeforge.errors import NodeforgeError

    with pytest.raises(NodeforgeError, match=match):
        template.amazon_source(user, base, "amd64")
