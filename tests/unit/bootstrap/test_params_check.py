"""`nodeforge params check`: offline lint of node params through the real CLI entry point."""

from __future__ import annotations

import json

import pytest

from nodeforge.cli import main
from tests.unit.support import MUNGE_KEY as KEY

pytestmark = pytest.mark.unit

NODE = (
    "role: compute\ncluster_name: demo\ncontroller: {host: ctl, address: 10.9.0.2}\n"
    f"munge_key: {KEY}\nfeatures: [gpu]\n"
)


def run(capsys, *argv):
    rc = main(["params", "check", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_node_yaml_valid_prints_redacted(tmp_path, capsys):
    f = tmp_path / "node.yaml"
    f.write_text(NODE)
    f.chmod(0o600)
    rc, out, _ = run(capsys, "--node-yaml", str(f))
    assert rc == 0 and out.startswith("valid node params (file:")
    assert "munge_key: <redacted>" in out and KEY not in out and "- gpu" in out
    rc, out, _ = run(capsys, "--node-yaml", str(f), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["params"]["munge_key"] == "<redacted>"
    assert doc["params"]["controller"] == {"host": "ctl", "address": "10.9.0.2"}


@pytest.mark.parametrize(
    "text, mode, expect",
    [
        (
            NODE.replace("[gpu]", '["gpu\\nNodeName=x"]'),
            0o600,
            "features[0]: 'gpu\\nNodeName=x' contains a control character",
        ),
        (NODE + "role: login\n", 0o600, "line 6: duplicate key 'role' (first on line 1); keep one"),
        (NODE, 0o644, "munge_key: refused, the file is mode 0644"),
        (NODE + "wait_timeout: .nan\n", 0o600, "wait_timeout: nan is not a finite number"),
    ],
)
def test_node_yaml_errors_exit_2_naming_file_and_field(tmp_path, capsys, text, mode, expect):
    f = tmp_path / "node.yaml"
    f.write_text(text)
    f.chmod(mode)
    rc, out, err = run(capsys, "--node-yaml", str(f))
    assert rc == 2 and out == ""
    assert err.startswith(f"nodeforge: error: {f}: ") and expect in err, err


def test_cmdline_string_and_file(tmp_path, capsys):
    line = 'BOOT_IMAGE=/vmlinuz ro nodeforge.role=compute nodeforge.cluster=demo nodeforge.controller=fd00::2 nodeforge.features="gpu,ib"'
    rc, out, _ = run(capsys, "--cmdline", line, "--json")
    p = json.loads(out)["params"]
    assert rc == 0 and p["features"] == ["gpu", "ib"] and p["controller"]["address"] == "fd00::2"
    f = tmp_path / "cmdline"
    f.write_text(line + f" nodeforge.munge_key={KEY}\n")
    rc, out, err = run(capsys, "--cmdline-file", str(f))
    assert (
        rc == 2 and "munge_key: refused, the kernel command line is readable by every user" in err
    )
    assert "munge_key_file" in err


def test_cmdline_params_url_is_reported_not_fetched(capsys):
    """docs/agent.md's own example (issue 27: it exited 2): the URL is checked as a URL and
    reported; the rest of the command line is checked; nothing is fetched."""
    example = (
        "nodeforge.role=compute nodeforge.cluster=demo nodeforge.controller=ctl(10.0.0.2) "
        "nodeforge.features=gpu nodeforge.params=https://cfg.internal/demo.yaml"
    )
    rc, out, err = run(capsys, "--cmdline", example)
    assert rc == 0, err
    assert (
        "not fetched (params check is offline): nodeforge.params=https://cfg.internal/demo.yaml"
        in out
    )
    rc, out, _ = run(capsys, "--cmdline", example, "--json")
    assert rc == 0 and json.loads(out)["not_fetched"] == ["https://cfg.internal/demo.yaml"]
    rc, _, err = run(capsys, "--cmdline", example.replace("https://cfg.internal", "https://"))
    assert rc == 2 and "no host" in err
    rc, out, err = run(capsys, "--cmdline", example.replace("https://", "https://u:pw@"))
    assert rc == 2 and "credentials (user:password@) in the URL" in err and "pw" not in err


def test_user_data(tmp_path, capsys):
    ud = tmp_path / "user-data"
    ud.write_text(
        "#cloud-config\nnodeforge:\n" + "".join("  " + ln + "\n" for ln in NODE.splitlines())
    )
    rc, _, err = run(capsys, "--user-data", str(ud))
    assert rc == 2 and "munge_key: refused, EC2 user-data can be read by every local user" in err
    rc, out, _ = run(capsys, "--user-data", str(ud), "--imds-guarded")
    assert rc == 0 and "<redacted>" in out
    ud.write_text("#!/bin/bash\necho hi\n")
    rc, _, err = run(capsys, "--user-data", str(ud))
    assert rc == 2 and "no node params in this user-data" in err


def test_hyperpod_dir(tmp_path, capsys):
    rc_doc = {
        "InstanceGroups": [
            {"Name": "ctl", "Instances": [{"InstanceName": "a", "CustomerIpAddress": "10.0.0.1"}]},
            {
                "Name": "workers",
                "Instances": [{"InstanceName": "b", "CustomerIpAddress": "10.0.0.2"}],
            },
        ]
    }
    pp = {
        "controller_group": "ctl",
        "worker_groups": [{"instance_group_name": "workers", "partition_name": "dev"}],
        "nodeforge": {"munge_key_file": "/opt/ml/config/munge.key", "features": "ib,nvme"},
    }
    (tmp_path / "resource_config.json").write_text(json.dumps(rc_doc))
    (tmp_path / "provisioning_parameters.json").write_text(json.dumps(pp))
    rc, out, _ = run(capsys, "--hyperpod", str(tmp_path), "--address", "10.0.0.2", "--json")
    p = json.loads(out)["params"]
    assert rc == 0 and p["role"] == "compute" and p["features"] == ["dev", "ib", "nvme"]
    rc, _, err = run(capsys, "--hyperpod", str(tmp_path), "--address", "10.0.0.9")
    assert rc == 2 and "resource_config.json: this node" in err and "is in no instance group" in err
    rc, _, err = run(capsys, "--hyperpod", str(tmp_path))
    assert rc == 2 and "give this node's --address" in err
    (tmp_path / "provisioning_parameters.json").unlink()
    rc, _, err = run(capsys, "--hyperpod", str(tmp_path), "--address", "10.0.0.2")
    assert rc == 2 and "provisioning_parameters.json: missing" in err


def test_one_source_required(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["params", "check"])
    assert ei.value.code == 2


@pytest.mark.parametrize(
    ("hooks", "says"),
    [
        ([{"uri": "http://10.0.0.9/a.sh"}], "is plain http without a sha256"),
        ([{"uri": "https://h/a.sh"}, {"uri": "https://g/a.sh"}], "two hooks are named 'a.sh'"),
        ([{"uri": "https://h/.a.sh"}], "as a hook name"),
    ],
)
def test_params_check_applies_the_agents_hook_trust_rules(tmp_path, capsys, hooks, says):
    """Issue 27: `params check` passed a plain-http hook without a sha256, which the agent then
    refused at boot; both apply the same rules now."""
    f = tmp_path / "node.yaml"
    f.write_text(NODE + "hooks: " + json.dumps(hooks) + "\n")
    f.chmod(0o600)
    rc, out, err = run(capsys, "--node-yaml", str(f))
    assert rc == 2 and out == "" and says in err and str(f) in err, err
