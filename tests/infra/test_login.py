"""Login: configless client (sackd where Slurm has it), no daemons that schedule, srun shows pyxis."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.role("login")


def test_configless_client(node):
    feats = json.loads(node.sh("cat /etc/nodeforge/slurm-features.json"))
    unit = "sackd" if feats.get("sackd") else "slurmd"
    node.sh(f"systemctl is-active {unit}.service")
    cmd = node.sh(f"systemctl show -P ExecStart {unit}.service")
    assert "--conf-server" in cmd, f"{unit} is not configless: {cmd}"
    node.sh(
        "test -f /run/slurm/conf/slurm.conf", what="no configless cache /run/slurm/conf/slurm.conf"
    )


def test_client_commands_reach_controller(node):
    node.sh("sinfo -h", what="sinfo cannot reach slurmctld from the login node")


def test_srun_shows_pyxis(node):
    out = node.sh("srun --help")
    assert "--container-image" in out, (
        "srun --help does not list --container-image (pyxis not loaded)"
    )
