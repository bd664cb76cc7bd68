"""Controller: accounting (MariaDB, slurmdbd), slurmctld configless + dynamic nodes, a 2-node job."""

from __future__ import annotations

import re
import time

import pytest

pytestmark = pytest.mark.role("controller")


def test_slurmdbd_conf_secret(node):
    out = node.sh("stat -c '%a %U' /etc/slurm/slurmdbd.conf")
    assert out.split() == ["600", "slurm"], (
        f"/etc/slurm/slurmdbd.conf: {out.strip()} (want 600 slurm)"
    )


def test_db_password_root_only(node):
    out = node.run("stat -c '%n %a %U' /etc/nodeforge/secrets/* 2>/dev/null")
    for line in out.stdout.splitlines():
        name, mode, owner = line.split()
        assert owner == "root" and mode in ("600", "400"), (
            f"{name}: mode {mode} owner {owner} (want root-only)"
        )


def test_configless_and_dynamic(node):
    cfg = node.sh("scontrol show config")
    assert re.search(r"SlurmctldParameters\s*=.*enable_configless", cfg), (
        "configless is off:\n"
        + "\n".join(ln for ln in cfg.splitlines() if "SlurmctldParameters" in ln)
    )
    m = re.search(r"MaxNodeCount\s*=\s*(\d+)", cfg)
    assert m and int(m.group(1)) > 0, "MaxNodeCount (dynamic nodes) is not set"
    assert re.search(r"SlurmUser\s*=\s*slurm\b", cfg), "SlurmUser is not slurm"


def test_cluster_registered_in_accounting(node):
    name = node.state.get("cluster") or ""
    out = node.sh("sacctmgr -n -P list cluster format=Cluster")
    assert name in out.split(), (
        f"cluster {name!r} not registered in slurmdbd; sacctmgr lists: {out.split()}"
    )


def test_dynamic_nodes_registered(node):
    out = node.sh("sinfo -h -N -o '%N %T %f'")
    rows = [ln.split() for ln in out.splitlines() if ln.strip()]
    assert rows, "no node has registered with slurmctld"


def test_slurmctld_survives_forced_rotation(node):
    node.sh("logrotate -f /etc/logrotate.d/nodeforge-slurm", what="forced rotation failed")
    node.sh("scontrol setdebug info && scontrol ping")
    deadline = time.monotonic() + 20
    while True:
        r = node.run(
            "test -s /var/log/slurm/slurmctld.log && systemctl is-active slurmctld.service"
        )
        if r.rc == 0:
            break
        assert time.monotonic() < deadline, (
            "slurmctld stopped logging to /var/log/slurm/slurmctld.log after rotation"
        )
        time.sleep(2)
    fds = node.open_files("slurmctld.service")
    assert "/var/log/slurm/slurmctld.log" in fds, f"slurmctld has no log open: {fds}"
    assert not any(f.startswith("/var/log/slurm/slurmctld.log.") for f in fds), (
        f"slurmctld still writes to the rotated file (no reopen on SIGUSR2): {fds}"
    )


def test_two_node_job_in_sacct(node):
    out = node.sh("sinfo -h -N -t idle,mixed -o '%N'")
    idle = sorted(set(out.split()))
    if len(idle) < 2:
        pytest.skip(
            f"needs 2 idle compute nodes; this cluster has {idle or 'none'} (single-node topology)"
        )
    job = (
        node.sh("sbatch --parsable -N2 -t 2 --wrap 'srun hostname' -o /tmp/nf-verify-%j.out")
        .strip()
        .split(";")[0]
    )
    deadline = time.monotonic() + 120
    state = ""
    while time.monotonic() < deadline:
        state = node.run(f"sacct -n -X -P -j {job} -o State").stdout.strip()
        if state and state.split()[0] in (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
        ):
            break
        time.sleep(3)
    assert state.startswith("COMPLETED"), (
        f"job {job}: sacct state {state!r}\n"
        + node.run(f"scontrol show job {job}; cat /tmp/nf-verify-{job}.out").stdout
    )
    nodes = node.sh(f"sacct -n -X -P -j {job} -o NNodes").strip()
    assert nodes == "2", f"job {job} ran on {nodes} nodes"
