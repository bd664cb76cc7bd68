"""amazon-ebs: encrypted by default for EC2; `encrypt_boot = false` gives the AMI SageMaker
HyperPod accepts (unencrypted, the root snapshot alone). Checked on the rendered HCL of both
template shapes (Packer 1.6 and >= 1.7), with `packer validate`, and the post-build check
that refuses an AMI which came out encrypted anyway."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import hcl2
import pytest

from nodeforge.errors import NodeforgeError
from nodeforge.images import packer, template, varfile
from nodeforge.images.packer import PackerVersion
from tests.helpers import fake_command

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[3]
HYPERPOD_VARS = REPO / "docs/hyperpod/hyperpod.pkrvars.hcl"
SHAPES = {"packer-1.6": PackerVersion(1, 6, 6), "packer-1.11": PackerVersion(1, 11, 2)}
ROOT = "${local.source_amis[var.source_os].root_device}"


def _rendered(pv: PackerVersion, monkeypatch) -> dict:
    if pv.has_required_plugins:  # Debian's Packer 1.6 cannot fmt a >= 1.7 template's plugins
        monkeypatch.setattr(packer, "fmt", lambda text: text)
    return hcl2.loads(packer.render("amazon-ebs", pv))


def _source(d: dict) -> dict:
    return d["source"][0]['"amazon-ebs"']['"node"']


def _resolve(value: object, var: dict[str, object]) -> object:
    """What Packer sees for an attribute that is a literal or a plain `var.NAME` reference."""
    if isinstance(value, str) and value.startswith("${var.") and value.endswith("}"):
        return var[value[len("${var.") : -1]]
    return value


def _vars(*files: Path) -> dict[str, object]:
    out: dict[str, object] = {v.name: v.default for v in template.variables_for("amazon-ebs")}
    for f in files:
        out.update(varfile.load(f, "amazon-ebs"))
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("files", "encrypted"), [((), True), ((HYPERPOD_VARS,), False)])
def test_root_snapshot_encryption_follows_encrypt_boot(shape, files, encrypted, monkeypatch):
    d = _rendered(SHAPES[shape], monkeypatch)
    src = _source(d)
    var = _vars(*files)
    assert _resolve(src["encrypt_boot"], var) is encrypted
    # the root volume is the only block device: no second launch mapping, no AMI-only mapping
    # (HyperPod uses the root snapshot alone)
    maps = src["launch_block_device_mappings"]
    assert len(maps) == 1 and maps[0]["device_name"] == ROOT
    assert _resolve(maps[0]["encrypted"], var) is encrypted
    assert "ami_block_device_mappings" not in src
    assert not any(
        k.endswith("block_device_mappings") for k in src if k != "launch_block_device_mappings"
    )
    # IMDSv2 stays required either way
    text = json.dumps(d)
    assert ("imds_support" in src) == SHAPES[shape].has_required_plugins
    assert "--imds-support v2.0" in text or "metadata_options" in src


def test_encrypted_stays_the_default_for_plain_ec2():
    default = {v.name: v for v in template.variables_for("amazon-ebs")}
    assert default["encrypt_boot"].default is True and default["encrypt_boot"].type == "bool"


def test_hyperpod_var_file_sets_only_encryption():
    assert varfile.load(HYPERPOD_VARS, "amazon-ebs") == {"encrypt_boot": False}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('encrypt_boot = "false"\n', r"'encrypt_boot' must be of type bool"),
        ("encrypt_boot = 0\n", r"'encrypt_boot' must be of type bool"),
        (
            'encrypt_boot = false\nkms_key_id = "alias/x"\n',
            r"kms_key_id is set but encrypt_boot = false",
        ),
    ],
)
def test_bad_encryption_vars_are_refused_before_packer(tmp_path, text, match):
    f = tmp_path / "bad.pkrvars.hcl"
    f.write_text(text)
    from nodeforge.images.validate import validate_targets

    with pytest.raises(NodeforgeError, match=match):
        validate_targets(["amazon-ebs"], [f])


def test_packer_validate_passes_with_the_hyperpod_var_file():
    from nodeforge.images.validate import validate_targets

    assert set(validate_targets(["amazon-ebs"], [HYPERPOD_VARS])) == {"amazon-ebs"}


# -- the post-build check: an account's EBS encryption by default would encrypt the AMI anyway --
def _check_script(monkeypatch, encrypt_boot: bool) -> str:
    d = _rendered(SHAPES["packer-1.6"], monkeypatch)
    inline = None
    for pp in d["build"][0]["post-processor"]:
        lines = pp.get('"shell-local"', {}).get("inline", [])
        if any("describe-images" in x for x in lines):
            inline = [json.loads(x) for x in lines]  # HCL string literals: JSON escapes
    assert inline, "no post-processor checks the AMI's encryption"
    script = "\n".join(inline)
    return script.replace("${var.encrypt_boot}", str(encrypt_boot).lower()).replace(
        "${var.region}", "eu-west-1"
    )


@pytest.mark.parametrize(
    ("encrypt_boot", "aws_says", "ok"),
    [
        (False, "False", True),
        (False, "True", False),  # EBS encryption by default turned the snapshot encrypted
        (False, "False\tFalse", False),  # a second snapshot: HyperPod uses only the root one
        (True, "True", True),  # an encrypted build is not checked (aws is not even called)
    ],
)
def test_post_build_check_refuses_an_ami_hyperpod_cannot_use(
    tmp_path, monkeypatch, encrypt_boot, aws_says, ok
):
    bindir = tmp_path / "bin"
    calls = fake_command(bindir, "aws", stdout=aws_says + "\n")
    (tmp_path / "packer-manifest.json").write_text(
        json.dumps({"builds": [{"artifact_id": "eu-west-1:ami-0123456789abcdef0"}]})
    )
    script = tmp_path / "check.sh"
    script.write_text(_check_script(monkeypatch, encrypt_boot))
    cp = subprocess.run(
        ["sh", "-e", str(script)],
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (cp.returncode == 0) is ok, cp.stderr
    if not ok:
        assert "ami-0123456789abcdef0" in cp.stderr and "HyperPod" in cp.stderr
    if encrypt_boot:
        assert not calls.exists()
    else:
        assert "--image-ids ami-0123456789abcdef0" in calls.read_text()


def test_a_var_file_with_comments_loads(tmp_path):
    """python-hcl2 8 returns a file's comments as `__comments__`/`__inline_comments__` keys;
    they were refused as unknown variables, so no commented var file could be used."""
    f = tmp_path / "c.pkrvars.hcl"
    f.write_text('# why\n// also\nregion = "eu-west-1" # inline\nami_tags = {\n  a = "b" # x\n}\n')
    assert varfile.load(f, "amazon-ebs") == {"region": "eu-west-1", "ami_tags": {"a": "b"}}
