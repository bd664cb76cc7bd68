"""Compute: configless slurmd registered as a dynamic node, pyxis in srun, docker, log rotation."""

from __future__ import annotations

import json
import time

import pytest

from nodeforge.bootstrap.node_roles.compute import DOCKER_DISABLED

pytestmark = pytest.mark.role("compute")


def test_slurmd_configless(node):
    cmd = node.sh("systemctl show -P ExecStart slurmd.service")
    assert "--conf-server" in cmd and "-Z" in cmd.split(), (
        f"slurmd is not a configless dynamic node: {cmd}"
    )
    assert "--systemd" in cmd, f"slurmd ExecStart lost --systemd (the unit is Type=notify): {cmd}"
    node.sh(
        "test -f /run/slurm/conf/slurm.conf", what="no configless cache /run/slurm/conf/slurm.conf"
    )
    node.sh(
        "test ! -e /etc/slurm/slurm.conf", what="a local /etc/slurm/slurm.conf shadows configless"
    )


def test_node_registered(node):
    name = node.state.get("node") or node.sh("hostname").strip()
    out = node.sh(f"scontrol show node {name}")
    assert "State=" in out and "DYNAMIC" in out.upper(), (
        f"node {name} not registered as dynamic:\n{out}"
    )
    st = out.split("State=")[1].split()[0]
    assert not any(s in st for s in ("DOWN", "DRAIN", "NOT_RESPONDING")), (
        f"node {name} state {st}:\n{out}"
    )


def test_srun_shows_pyxis(node):
    out = node.sh("srun --help")
    assert "--container-image" in out, (
        "srun --help does not list --container-image (pyxis not loaded)"
    )


def test_docker_active_with_log_rotation(node):
    if node.role_detail("docker") == DOCKER_DISABLED:
        # The node's params turned dockerd off (the local nspawn cluster does: dockerd cannot
        # run there): what it is meant to run is no dockerd at all.
        r = node.run("systemctl is-active docker.service containerd.service")
        assert r.stdout.split() == ["inactive", "inactive"], (
            f"params say docker: false, but: {r.stdout.strip()}"
        )
        return
    node.sh("systemctl is-active docker.service", what="docker must run on a compute node")
    cfg = json.loads(node.sh("cat /etc/docker/daemon.json"))
    opts = cfg.get("log-opts") or {}
    assert cfg.get("log-driver") == "json-file" and opts.get("max-size") and opts.get("max-file"), (
        f"/etc/docker/daemon.json has no log rotation: {cfg}"
    )
    info = node.sh("docker info --format '{{.LoggingDriver}}'").strip()
    assert info == "json-file", f"dockerd runs with log driver {info!r}"


def test_slurmd_survives_forced_rotation(node):
    node.sh("logrotate -f /etc/logrotate.d/nodeforge-slurm", what="forced rotation failed")
    deadline = time.monotonic() + 20
    while True:
        fds = node.open_files("slurmd.service")
        if "/var/log/slurm/slurmd.log" in fds and not any(
            f.startswith("/var/log/slurm/slurmd.log.") for f in fds
        ):
            break
        assert time.monotonic() < deadline, (
            f"slurmd still writes the rotated file after 20s:\n{fds}"
        )
        time.sleep(2)
    node.sh("systemctl is-active slurmd.service")
