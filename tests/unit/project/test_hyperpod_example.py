"""The HyperPod example (docs/hyperpod/): the CreateCluster request is valid for the SageMaker
model botocore ships (botocore's own parameter validation, offline: AWS is never called), its
lifecycle prefix holds what the request names, and the OnCreate script puts HyperPod's files
where the agent reads them and hands over to nodeforge-init.service."""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import fake_command
from tests.unit.support import run_cli

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "docs/hyperpod"
REQUEST = EXAMPLE / "create-cluster.json"
LIFECYCLE = EXAMPLE / "lifecycle"


def _validate(params: dict) -> None:
    """Raise botocore's ParamValidationError if *params* is not a valid CreateCluster input."""
    import botocore.session
    from botocore.validate import validate_parameters

    model = botocore.session.get_session().get_service_model("sagemaker")
    validate_parameters(params, model.operation_model("CreateCluster").input_shape)


def _request() -> dict:
    return json.loads(REQUEST.read_text())


def test_create_cluster_request_is_valid_for_botocores_sagemaker_model():
    _validate(_request())


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


# Each mutation makes the request invalid in a way the model catches; the test proves the
# check above can fail (a validator that accepts anything would pass it).
MUTATIONS = {
    "misspelt group field": lambda r: _rename(
        r["InstanceGroups"][0], "LifeCycleConfig", "LifecycleConfig"
    ),
    "misspelt top-level field": lambda r: _rename(r, "NodeProvisioningMode", "ProvisioningMode"),
    "unknown lifecycle field": lambda r: r["InstanceGroups"][2]["LifeCycleConfig"].update(
        OnStart="x.sh"
    ),
    "missing ExecutionRole": lambda r: r["InstanceGroups"][1].pop("ExecutionRole"),
    "missing ClusterName": lambda r: r.pop("ClusterName"),
    "count as a string": lambda r: r["InstanceGroups"][2].update(InstanceCount="4"),
    "empty OnCreate": lambda r: r["InstanceGroups"][0]["LifeCycleConfig"].update(OnCreate=""),
    "subnets not a list": lambda r: r["VpcConfig"].update(Subnets="subnet-0123456789abcdef0"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_an_invalid_request_fails_the_check(name):
    from botocore.exceptions import ParamValidationError

    bad = copy.deepcopy(_request())
    MUTATIONS[name](bad)
    with pytest.raises(ParamValidationError):
        _validate(bad)


def test_request_is_a_continuous_cluster_of_the_unencrypted_ami_with_nodeforges_lifecycle():
    r = _request()
    assert r["NodeProvisioningMode"] == "Continuous"
    groups = {g["InstanceGroupName"]: g for g in r["InstanceGroups"]}
    amis = {g["ImageId"] for g in groups.values()}
    assert len(amis) == 1 and next(iter(amis)).startswith("ami-")  # one image, every role
    for g in groups.values():
        lc = g["LifeCycleConfig"]
        # HyperPod's instance role may read only sagemaker-* buckets
        assert lc["SourceS3Uri"].startswith("s3://sagemaker-") and lc["SourceS3Uri"].endswith("/")
        script = LIFECYCLE / lc["OnCreate"]
        assert script.is_file() and os.access(script, os.X_OK), script
    # provisioning_parameters.json (in the same prefix) names these groups
    pp = json.loads((LIFECYCLE / "provisioning_parameters.json").read_text())
    named = {pp["controller_group"], pp["login_group"]}
    named |= {w["instance_group_name"] for w in pp["worker_groups"]}
    assert named == set(groups)


def _params_check(directory: Path, address: str) -> dict:
    cp = run_cli("params", "check", "--hyperpod", str(directory), "--address", address, "--json")
    assert cp.returncode == 0, cp.stderr
    doc = json.loads(cp.stdout)
    assert doc["source"] == "hyperpod"
    return doc["params"]


def _on_create(tmp_path: Path, rc_path: Path, systemctl_rc: int = 0, munge: bool = True):
    prefix = tmp_path / "prefix"  # what HyperPod copied from SourceS3Uri
    prefix.mkdir()
    for f in LIFECYCLE.iterdir():
        (prefix / f.name).write_bytes(f.read_bytes())
        (prefix / f.name).chmod(f.stat().st_mode)
    if munge:
        (prefix / "munge.key").write_bytes(os.urandom(128))
    bindir = tmp_path / "bin"
    log = fake_command(bindir, "systemctl", rc=systemctl_rc)
    root = tmp_path / "root"
    root.mkdir()
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "NODEFORGE_ROOT": str(root),
           "SAGEMAKER_RESOURCE_CONFIG_PATH": str(rc_path)}  # fmt: skip
    cp = subprocess.run(["bash", str(prefix / "on_create.sh")], cwd="/", env=env,
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    return cp, root, log


def test_on_create_installs_hyperpods_files_root_only_and_runs_the_agent(tmp_path):
    rc_path = tmp_path / "hp" / "resource_config.json"  # HyperPod's own place for it
    rc_path.parent.mkdir()
    rc_path.write_text((EXAMPLE / "resource_config.example.json").read_text())
    cp, root, log = _on_create(tmp_path, rc_path)
    assert cp.returncode == 0, cp.stderr
    conf = root / "opt/ml/config"
    for name in ("resource_config.json", "provisioning_parameters.json"):
        st = (conf / name).stat()
        assert stat.S_IMODE(st.st_mode) == 0o600, name
    assert stat.S_IMODE((root / "etc/nodeforge/secrets/munge.key").stat().st_mode) == 0o400
    assert stat.S_IMODE((root / "etc/nodeforge/secrets").stat().st_mode) == 0o700
    assert not list(conf.glob("*.new"))
    assert log.read_text().split() == ["restart", "nodeforge-init.service"]
    # what the agent will read there: each role resolves, with the example's extension hook
    for address, role in (("10.1.0.10", "controller"), ("10.1.0.20", "login"),
                          ("10.1.0.32", "compute")):  # fmt: skip
        params = _params_check(conf, address)
        assert params["role"] == role, params
        assert params["controller"]["address"] == "10.1.0.10"
        hooks = params["hooks"]
        assert hooks[0]["uri"] == "s3://sagemaker-nodeforge-demo/site/"
        assert hooks[0]["script"] == "on_init_complete.sh"
        assert params["munge_key_file"] == "/etc/nodeforge/secrets/munge.key"
        assert params["features"] == (["cpu"] if role == "compute" else [])


def test_on_create_without_hyperpods_resource_config_fails_and_writes_nothing(tmp_path):
    cp, root, log = _on_create(tmp_path, tmp_path / "absent.json")
    assert cp.returncode != 0
    assert "resource config" in cp.stderr and "SAGEMAKER_RESOURCE_CONFIG_PATH" in cp.stderr
    assert not (root / "opt").exists() and not log.exists()


def test_a_failing_agent_fails_on_create(tmp_path):
    rc_path = tmp_path / "rc.json"
    rc_path.write_text((EXAMPLE / "resource_config.example.json").read_text())
    cp, _, log = _on_create(tmp_path, rc_path, systemctl_rc=1)
    assert cp.returncode == 1 and log.exists()
