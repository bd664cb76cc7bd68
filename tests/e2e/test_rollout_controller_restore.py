"""`nodeforge cluster rollout`: a failed controller step is restored on the old image (issue 28
item 2), on a real local cluster (1 controller, 1 compute).

Two real failures of the new controller, one after the other. First `--params` gives it a
`wait_timeout` its agent refuses (FIXTURE: -5), so its params step fails at first boot,
slurmctld never starts, and the step's bound runs out. Then it gets another munge key than
the cluster's: it comes up and answers, but the step's round trip (one job on each idle
compute through it) cannot run, so it is restored again. The restore boots the old image with the cluster's own
params; the controller's state (its queue,
sacct's history) lives on the controller-state volume and survives both replacements. The new
image is the built image's files hard-linked into another directory (tests.helpers.linked_copy).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil

import pytest
import yaml

from nodeforge.lab.localcluster import Cluster
from tests.conftest import require_tools, wait_for
from tests.helpers import E2E_ROOT, linked_copy, nodeforge

pytestmark = pytest.mark.e2e
CLUSTER = "e2ectlr"


def cx(node: str, *cmd: str, check: bool = True) -> str:
    cp = nodeforge("cluster", "exec", "--name", CLUSTER, node, "--", *cmd, check=check, timeout=120)
    return cp.stdout


def test_failed_controller_step_is_restored_with_its_state(built_image, tmp_path):
    require_tools("systemd-nspawn", "ip", "nsenter")
    new_image = linked_copy(built_image, E2E_ROOT / f"{CLUSTER}-image-new")
    params = tmp_path / "bad.yaml"
    params.write_text(yaml.safe_dump({"wait_timeout": -5}))
    nodeforge("cluster", "down", "--name", CLUSTER, check=False)
    nodeforge(
        "cluster", "up", "--name", CLUSTER, "--image", str(built_image), "--computes", "1",
        "--timeout", "400",
    )  # fmt: skip
    try:
        key = (Cluster.load(CLUSTER).dir / "munge.key").read_bytes()
        held = cx("ctl", "sbatch", "--parsable", "--hold", "--wrap", "hostname").strip()
        assert held.isdigit(), held
        ctl_id = cx("ctl", "cat", "/etc/machine-id").strip()
        cp = nodeforge(
            "cluster", "rollout", "--name", CLUSTER, "--image", str(new_image), "--nodes", "ctl",
            "--timeout", "90", "--params", str(params), check=False, timeout=1200,
        )  # fmt: skip
        assert cp.returncode == 1, (cp.stdout, cp.stderr)
        err = cp.stderr
        assert "Traceback" not in err
        assert "rollout stopped at step 1/1 (controller: ctl): nodes not ready after 90s" in err
        assert "ctl (slurmctld starting, agent failed)" in err, err
        assert f"ctl restored on the old image {built_image}" in err, err
        # the restored controller: another machine, the cluster's key and params, the compute back
        assert cx("ctl", "cat", "/etc/machine-id").strip() != ctl_id
        on_ctl = cx("ctl", "sha256sum", "/etc/munge/munge.key").split()[0]
        assert on_ctl == hashlib.sha256(key).hexdigest()
        assert Cluster.load(CLUSTER).image == str(built_image)
        sinfo = cx("ctl", "sinfo", "-h", "-N", "-o", "%N|%T").split()
        assert sinfo == ["c001|idle"], sinfo
        # the queue survived both replacements: the held job runs once released
        cx("ctl", "scontrol", "release", held)
        wait_for(
            f"job {held} COMPLETED in sacct",
            lambda: (
                cx("ctl", "sacct", "-n", "-X", "-P", "-j", held, "-o", "State", check=False).strip()
                == "COMPLETED"
            ),
            timeout=120,
        )

        # A new controller with ANOTHER munge key: its agent is ready and its slurmctld
        # answers its own ping, and it starts from the saved node states, which look
        # schedulable (until SlurmdTimeout); only a job through it shows that it cannot reach
        # c001. The step's round trip fails it, and the old image is restored again.
        other = tmp_path / "other-key.yaml"
        other.write_text(yaml.safe_dump({"munge_key": base64.b64encode(os.urandom(32)).decode()}))
        other.chmod(0o600)  # it carries a key
        cp = nodeforge(
            "cluster", "rollout", "--name", CLUSTER, "--image", str(new_image), "--nodes", "ctl",
            "--timeout", "240", "--params", str(other), check=False, timeout=1200,
        )  # fmt: skip
        assert cp.returncode == 1, (cp.stdout, cp.stderr)
        err = cp.stderr
        assert "Traceback" not in err
        assert "rollout stopped at step 1/1 (controller: ctl)" in err, err
        assert "the new controller cannot run a job on c001" in err, err
        assert f"ctl restored on the old image {built_image}" in err, err
        on_ctl = cx("ctl", "sha256sum", "/etc/munge/munge.key").split()[0]
        assert on_ctl == hashlib.sha256(key).hexdigest()
        # the restored controller runs a job on c001 again
        out = cx("ctl", "srun", "-N", "1", "-w", "c001", "--immediate=120", "-t", "1", "hostname")
        assert out.strip() == "c001", out
    finally:
        nodeforge("cluster", "down", "--name", CLUSTER, check=False)
        shutil.rmtree(new_image, ignore_errors=True)
