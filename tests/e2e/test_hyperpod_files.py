"""A node that boots with HyperPod's files, and no node.yaml, joins with the role and group
those files give (nspawn nodes from `nodeforge cluster`, lab/localcluster.py).

HyperPod puts `/opt/ml/config/resource_config.json` (instance groups and their instances'
addresses) and `provisioning_parameters.json` (controller/login/worker groups, partitions) on
every instance; the munge key comes from the operator's lifecycle script as a root-only file,
named by the `nodeforge` section (munge_key_file). Here the controller is a plain lab node; the
compute `hp1` gets only those files (written into its overlay before it boots, as HyperPod's
agent would have), and must come up IDLE in Slurm with its group's partition as a feature.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from nodeforge.lab.localcluster import STATE_ROOT, LocalCluster, Node, node_exec

pytestmark = pytest.mark.e2e
NAME = "e2ehp"
WORKER_GROUP = "worker-group-1"
PARTITION = "dev"


@pytest.fixture(scope="module")
def hp_cluster(built_image):
    lc = LocalCluster(NAME, progress=lambda m: print(m, flush=True))
    if (STATE_ROOT / NAME / "cluster.json").exists():  # a killed earlier run
        lc.down()
    cluster = lc.up(built_image, 0, timeout=300)
    try:
        yield lc, cluster
    finally:
        lc.down()


def _hyperpod_files(cluster, munge_key: bytes):
    ctl = cluster.controller

    def prepare(node: Node) -> None:
        root = node.merged
        (root / "etc/nodeforge/node.yaml").unlink()  # only HyperPod's files
        key = root / "etc/nodeforge/secrets/munge.key"
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key.write_bytes(munge_key)
        os.chmod(key, 0o400)
        cfg = root / "opt/ml/config"
        cfg.mkdir(parents=True, exist_ok=True)
        rc = {
            "InstanceGroups": [
                {"Name": "controller-machine", "Instances": [
                    {"InstanceName": ctl.name, "CustomerIpAddress": ctl.address,
                     "InstanceId": "i-0aaaaaaaaaaaaaaa1", "InstanceType": "ml.m5.xlarge"}]},
                {"Name": WORKER_GROUP, "Instances": [
                    {"InstanceName": node.name, "CustomerIpAddress": node.address,
                     "InstanceId": "i-0bbbbbbbbbbbbbbb2", "InstanceType": "ml.g5.xlarge"}]},
            ]
        }  # fmt: skip
        pp = {
            "version": "1.0.0",
            "workload_manager": "slurm",
            "controller_group": "controller-machine",
            "worker_groups": [{"instance_group_name": WORKER_GROUP, "partition_name": PARTITION}],
            "cluster_name": NAME,
            "nodeforge": {"munge_key_file": "/etc/nodeforge/secrets/munge.key", "docker": False},
        }
        (cfg / "resource_config.json").write_text(json.dumps(rc, indent=1))
        (cfg / "provisioning_parameters.json").write_text(json.dumps(pp, indent=1))

    return prepare


def test_node_with_hyperpod_files_joins_with_their_role_and_group(hp_cluster):
    lc, cluster = hp_cluster
    key = (cluster.dir / "munge.key").read_bytes()
    t0 = time.monotonic()
    node = lc.start_node("hp1", "compute", prepare=_hyperpod_files(cluster, key))
    fresh = type(cluster).load(NAME)
    lc.wait_ready(fresh, ["hp1"], timeout=240)
    print(f"\nhp1 ready (HyperPod files) after {time.monotonic() - t0:.1f}s")
    st = lc.agent_state(node)
    assert st["source"] == "hyperpod" and st["role"] == "compute" and st["node"] == "hp1"
    assert not (node.merged / "etc/nodeforge/node.yaml").exists()
    out = node_exec(
        fresh.controller, ["sinfo", "-h", "-N", "-n", "hp1", "-o", "%T|%f"], timeout=30
    ).stdout.strip()
    state, _, features = out.partition("|")
    assert state == "idle", out
    assert PARTITION in features.split(","), out
    params = json.loads((node.merged / "var/lib/nodeforge/params.json").read_text())
    assert params["extra"]["hyperpod"]["instance_group"] == WORKER_GROUP
