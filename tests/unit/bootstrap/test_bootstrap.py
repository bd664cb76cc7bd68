"""Agent, role steps and readiness gate against a fake machine (no root, no systemd, no Slurm).

`support.FakeMachine` stands in for `nodeforge.proc.run`: it records every command and models
just enough of systemd, MariaDB, slurmdbd/sacctmgr and slurmctld/scontrol to check ORDER,
idempotence, resume after a reboot and the readiness gate; `support.make` builds the agent on it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from nodeforge.bootstrap import readiness as rd
from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.host import Host
from nodeforge.bootstrap.paths import Paths
from nodeforge.bootstrap.state import State
from nodeforge.bootstrap.status import as_json, as_text
from nodeforge.errors import NodeforgeError
from tests.unit.support import COMPUTE, CTL, FakeMachine, make

pytestmark = pytest.mark.unit


# -- controller -------------------------------------------------------------------------------
def test_controller_order_and_secrets(tmp_path, caplog):
    caplog.set_level("DEBUG")
    agent, fm, paths, chowns = make(tmp_path, CTL)
    state = agent.init()
    assert state.status == "ready"
    ev = [e for e in fm.events if not e.startswith("start munge")]
    assert ev == [
        "start mariadb.service",
        "db+password",
        "start slurmdbd.service",
        "slurmdbd answering",
        "cluster demo registered",
        "start slurmctld.service",
    ], ev
    # slurmctld starts only after the cluster exists in slurmdbd
    i_ctld = next(
        i for i, c in enumerate(fm.calls) if c[:3] == ["systemctl", "start", "slurmctld.service"]
    )
    i_reg = next(i for i, c in enumerate(fm.calls) if c[:4] == ["sacctmgr", "-i", "add", "cluster"])
    assert i_reg < i_ctld
    pw = (paths.secrets / "slurmdbd_storage_pass").read_text().strip()
    assert len(pw) >= 40
    assert (paths.secrets / "slurmdbd_storage_pass").stat().st_mode & 0o777 == 0o600
    dbd = paths.slurm_etc / "slurmdbd.conf"
    assert f"StoragePass={pw}" in dbd.read_text() and dbd.stat().st_mode & 0o777 == 0o600
    assert (str(dbd), "slurm", "slurm") in chowns
    assert (str(paths.munge_key), "munge", "munge") in chowns
    assert (
        paths.munge_key.read_bytes() == b"m" * 1024
        and paths.munge_key.stat().st_mode & 0o777 == 0o400
    )
    # the password is passed on stdin, never in argv, never logged
    assert all(pw not in " ".join(c) for c in fm.calls)
    assert any(pw in i for i in fm.inputs)
    assert pw not in caplog.text and pw not in paths.state_file.read_text()
    conf = (paths.slurm_etc / "slurm.conf").read_text()
    assert (
        "SlurmctldHost=ctl(10.9.0.2)" in conf
        and "TreeWidth=65533" in conf
        and "MaxNodeCount=64" in conf
    )
    assert "PrologFlags=Alloc\n" in conf
    # identity: host keys, machine-id, hostname
    assert (
        paths.ssh_etc / "ssh_host_ed25519_key"
    ).exists() and paths.machine_id.read_text().strip()
    assert fm.hostname == "ctl" and paths.hostname_file.read_text() == "ctl\n"
    assert "10.9.0.2 ctl" in paths.hosts_file.read_text()


def test_host_keys_left_to_the_first_boot_unit_when_the_image_has_it(tmp_path):
    """nodeforge-init is not ordered after nodeforge-ssh-keygen.service (readiness does not wait
    for SSH); with that unit in the image the agent never runs a second `ssh-keygen -A`."""
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    paths.systemd_etc.mkdir(parents=True, exist_ok=True)
    (paths.systemd_etc / "nodeforge-ssh-keygen.service").write_text("[Service]\n")
    state = agent.init()
    assert state.status == "ready" and state.steps["identity"].status == "done"
    assert not any(c[0] == "ssh-keygen" for c in fm.calls)
    assert not list(paths.ssh_etc.glob("ssh_host_*_key"))  # the unit's job, not the agent's


def test_controller_rerun_is_idempotent_and_reboot_resumes(tmp_path):
    agent, fm, paths, _ = make(tmp_path, CTL)
    agent.init()
    pw = (paths.secrets / "slurmdbd_storage_pass").read_text()
    n_calls = len(fm.calls)
    # Second run, same boot: every step verified and skipped; nothing restarted.
    state = agent.init()
    assert [state.steps[s].status for s in ("identity", "munge", "role", "hooks")] == [
        "skipped"
    ] * 4
    assert all(state.steps[s].duration < 1 for s in ("identity", "munge", "role", "hooks"))
    first_ttr = state.time_to_ready
    assert not any(c[:2] == ["systemctl", "start"] for c in fm.calls[n_calls:])
    # Reboot: services are down, the role step runs again, password and cluster are reused.
    fm.reboot()
    fm.dbd_polls_before_answer = 1
    state = agent.init()
    assert state.status == "ready" and state.boots == 3
    assert state.time_to_ready == first_ttr  # first readiness; a reboot does not change it
    assert state.steps["role"].runs == 2 and state.steps["identity"].runs == 1
    assert (paths.secrets / "slurmdbd_storage_pass").read_text() == pw
    assert not any(c[:4] == ["sacctmgr", "-i", "add", "cluster"] for c in fm.calls[n_calls:])
    assert fm.events[-1] == "start slurmctld.service"


def test_controller_slurmdbd_wait_is_bounded(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**CTL, "wait_timeout": 5})
    fm.dbd_polls_before_answer = 10**9
    clock = iter(range(10**6))
    agent.host.monotonic = lambda: float(next(clock))
    with pytest.raises(
        StepFailed,
        match=r"slurmdbd answering \(sacctmgr -n show cluster\) did not happen within 5s",
    ):
        agent.init()
    st = State.load(paths.state_file)
    assert st.status == "failed" and st.steps["role"].status == "failed"
    assert "slurmctld.service" not in fm.active


def test_controller_enables_gang_when_installed(tmp_path):
    agent, fm, paths, _ = make(tmp_path, CTL)
    paths.systemd_lib[0].mkdir(parents=True)
    (paths.systemd_lib[0] / "nodeforge-gang.service").write_text("[Unit]\n")
    st = agent.init()
    assert fm.events[-1] == "enable nodeforge-gang.service"
    assert st.steps["role"].detail["gang"] == "enabled"


def test_controller_without_accounting(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**CTL, "accounting": False})
    agent.init()
    assert "start mariadb.service" not in fm.events and "start slurmdbd.service" not in fm.events
    assert "AccountingStorageType" not in (paths.slurm_etc / "slurm.conf").read_text()


# -- compute + readiness gate -----------------------------------------------------------------
def test_compute_gate_order_and_resume(tmp_path):
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    hook_seen = tmp_path / "hook-saw-state"
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "10-check").write_text(
        f"#!/bin/sh\necho $NODEFORGE_NODE $NODEFORGE_CONTROLLER > {hook_seen}\n"
    )
    (paths.on_init_d / "10-check").chmod(0o755)
    state = agent.init()
    assert state.status == "ready"
    ev = _slurm_events_after_docker(fm)
    assert ev == [
        "create c1 FUTURE",
        "drain c1: nodeforge: initializing",
        "start slurmd.service",
        "slurmd registered c1",
        "drain c1: nodeforge: running hooks",
        "resume c1",
        "ping answered c1",  # the agent is ready only once slurmctld sees the node responding
    ], ev
    assert state.steps["ready"].detail["slurm"] == "resumed"
    assert fm.ping_saw_slurmd_c == [True]  # `slurmd -C` ran while the controller was asked
    assert hook_seen.read_text().split() == ["c1", "10.9.0.2"]
    node = fm.nodes["c1"]
    assert node["State"] == "IDLE"
    assert node["NodeAddr"] == "10.9.0.5" and node["CPUs"] == "4" and node["Feature"] == "gpu,nvme"
    assert node["Gres"] == "gpu:1"
    dropin = (paths.systemd_etc / "slurmd.service.d" / "nodeforge.conf").read_text()
    assert "ExecStart=\n" in dropin
    # Debian 12's 22.05 unit: Type=simple, `slurmd -D -s`, no --systemd flag, and a
    # ConditionPathExists on slurm.conf that configless nodes must reset.
    assert "[Unit]\nConditionPathExists=\n" in dropin
    assert (
        "ExecStart=/usr/sbin/slurmd -D -s -Z --conf-server 10.9.0.2:6817 "
        '--conf "Feature=gpu,nvme Gres=gpu:1" -N c1 $SLURMD_OPTIONS\n'
    ) in dropin
    # scontrol talks to the controller through the minimal client config
    client = paths.slurm_client_conf.read_text()
    assert "SlurmctldHost=ctl(10.9.0.2)" in client and "ClusterName=demo" in client
    assert "SlurmUser=slurm" in client  # else slurmctld rejects the munge credential
    assert "10.9.0.2 ctl" in paths.hosts_file.read_text()


@pytest.mark.parametrize(
    "body, reason",
    [
        ("exit 4", "nodeforge: hook 20-bad failed (exit 4)"),
        ("kill -KILL $$", "nodeforge: hook 20-bad killed by signal 9 (SIGKILL)"),
        ("sleep 30", "nodeforge: hook 20-bad timed out after 0.5s"),
    ],
)
def test_failed_hook_leaves_node_drained_with_reason(tmp_path, body, reason):
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_timeout": 0.5, "hook_retries": 0})
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "20-bad").write_text(f"#!/bin/sh\n{body}\n")
    (paths.on_init_d / "20-bad").chmod(0o755)
    with pytest.raises(StepFailed):
        agent.init()
    node = fm.nodes["c1"]
    assert "DRAIN" in node["State"] and node["Reason"] == reason
    assert not any(e.startswith("resume") for e in fm.events)
    st = State.load(paths.state_file)
    assert (
        st.status == "failed"
        and st.steps["hooks"].status == "failed"
        and st.steps["ready"].status == "pending"
    )
    assert reason.removeprefix("nodeforge: ") in st.last_error
    text = as_text(st)
    assert (
        "hooks      failed" in text
        and "20-bad" in text
        and "last error: hooks: hook 20-bad" in text
    )

    # The operator fixes the hook and reruns: hooks run again, the node is resumed.
    (paths.on_init_d / "20-bad").write_text("#!/bin/sh\nexit 0\n")
    st = agent.init()
    assert st.status == "ready" and fm.nodes["c1"]["State"] == "IDLE"
    assert st.steps["hooks"].runs == 2 and st.steps["role"].status == "skipped"


def test_sha_mismatch_drains(tmp_path):
    src = tmp_path / "ext.sh"
    src.write_text("#!/bin/sh\ntrue\n")
    agent, fm, _paths, _ = make(
        tmp_path, {**COMPUTE, "hooks": [{"uri": f"file://{src}", "sha256": "f" * 64}]}
    )
    with pytest.raises(StepFailed, match="sha256 mismatch"):
        agent.init()
    assert fm.nodes["c1"]["Reason"] == "nodeforge: hook ext.sh sha256 mismatch (not run)"


def _slurm_events_after_docker(fm) -> list[str]:
    """Docker comes up before the node is created in Slurm (a compute that cannot run
    containers must never register); returns the Slurm-side events, in order."""
    docker = [e for e in fm.events if "containerd" in e or "docker" in e]
    assert docker == [
        "enable containerd.service",
        "start containerd.service",
        "enable docker.service",
        "start docker.service",
    ], docker
    assert fm.events.index("start docker.service") < fm.events.index(
        next(e for e in fm.events if e.startswith(("create c1", "drain c1")))
    )
    return [e for e in fm.events if not e.startswith("start munge") and e not in docker]


def test_compute_reboot_redrains_before_slurmd(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    fm.reboot()
    fm.events.clear()
    st = agent.init()
    ev = _slurm_events_after_docker(fm)
    assert ev == [
        "drain c1: nodeforge: initializing",
        "start slurmd.service",
        "slurmd registered c1",
        "drain c1: nodeforge: running hooks",
        "resume c1",
        "ping answered c1",
    ], ev
    assert st.steps["hooks"].status == "skipped" and st.steps["hooks"].runs == 1


def test_hosts_block_restored_on_rerun(tmp_path):
    agent, _fm, paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    paths.hosts_file.write_text("127.0.0.1 localhost\n")  # e.g. rewritten by a container manager
    st = agent.init()
    assert st.steps["identity"].runs == 2
    assert paths.hosts_file.read_text().count("10.9.0.2 ctl") == 1


def test_admin_drain_is_not_undone(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    fm.nodes["c1"].update(State="IDLE+DRAIN", Reason="bad dimm (admin)")
    agent.init()
    assert fm.nodes["c1"]["State"] == "IDLE+DRAIN"


def test_compute_waits_for_controller_bounded(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, {**COMPUTE, "wait_timeout": 10})
    fm.ctl_up = False
    clock = iter(range(10**6))
    agent.host.monotonic = lambda: float(next(clock))
    with pytest.raises(
        StepFailed,
        match=r"slurmctld at 10.9.0.2:6817 answering \(scontrol ping\) did not happen within 10s"
        r".* munge key .* clock",
    ):
        agent.init()
    assert "slurmd.service" not in fm.active and fm.nodes == {}


def test_role_change_refused(tmp_path):
    agent, _fm, paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    paths.node_yaml.write_text(json.dumps({**COMPUTE, "role": "login"}))
    with pytest.raises(StepFailed, match="initialised as 'compute' and params now say 'login'"):
        agent.init()


# -- login --------------------------------------------------------------------------------------
def test_login_with_sackd(tmp_path):
    agent, fm, paths, _ = make(
        tmp_path,
        {**COMPUTE, "role": "login", "node_name": "login1"},
        slurm_version="24.11.5",
        sackd=True,
    )
    st = agent.init()
    assert st.status == "ready" and fm.nodes == {}
    assert "start sackd.service" in fm.events and "start slurmd.service" not in fm.events
    d = (paths.systemd_etc / "sackd.service.d" / "nodeforge.conf").read_text()
    assert "ExecStart=/usr/sbin/sackd --systemd --conf-server 10.9.0.2:6817 $SACKD_OPTIONS" in d


def test_login_on_2205_is_a_drained_slurmd(tmp_path):
    agent, fm, _paths, _ = make(
        tmp_path, {**COMPUTE, "role": "login", "node_name": "login1", "features": []}
    )
    st = agent.init()
    assert st.status == "ready"
    n = fm.nodes["login1"]
    assert "DRAIN" in n["State"] and n["Reason"] == "nodeforge: login node (no jobs)"
    assert n["Feature"] == "nodeforge_login"


# -- status ---------------------------------------------------------------------------------------
def test_status_text_and_json(tmp_path, capsys):
    agent, _fm, paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    st = State.load(paths.state_file)
    text = as_text(st)
    assert "role compute" in text and "status    ready" in text and "time-to-ready" in text
    for step in ("params", "identity", "munge", "role", "hooks", "ready"):
        assert f"\n{step:<10} done" in text
    data = json.loads(as_json(st))
    assert data["status"] == "ready" and data["time_to_ready"] is not None
    for step in data["steps"].values():
        assert (
            step["status"] == "done"
            and step["duration"] is not None
            and step["started"] <= step["ended"]
        )
    from nodeforge.cli import main

    assert main(["node", "status", "--json", "--root", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["node"] == "c1"
    assert main(["node", "status", "--root", str(tmp_path)]) == 0
    assert "STEP" in capsys.readouterr().out


def test_state_survives_crash_mid_step(tmp_path):
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    fm.fail_on["systemctl restart slurmd.service"] = 1
    with pytest.raises(StepFailed):
        agent.init()
    st = State.load(paths.state_file)
    assert st.steps["role"].status == "failed" and "slurmd.service" in st.steps["role"].error
    # the node was announced drained, and its reason now names the failed step
    assert fm.nodes["c1"]["Reason"].startswith("nodeforge: role step failed: command failed")
    del fm.fail_on["systemctl restart slurmd.service"]
    st = agent.init()
    assert st.status == "ready" and st.steps["role"].runs == 2 and st.steps["identity"].runs == 1


def test_uptime_is_since_pid1_started(tmp_path):
    import os

    from nodeforge.bootstrap.state import uptime

    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "uptime").write_text("1000.50 1.0\n")
    hz = os.sysconf("SC_CLK_TCK")
    fields = ["S"] + ["0"] * 18 + [str(990 * hz)] + ["0"] * 10
    (proc / "1/stat").write_text("1 (systemd) " + " ".join(fields) + "\n")
    assert uptime(proc) == 10.5
    (proc / "1/stat").unlink()
    assert uptime(proc) == 1000.5
    assert uptime(tmp_path / "nope") is None


def test_address_detection(tmp_path):
    from nodeforge.bootstrap.identity import detect_address

    fm = FakeMachine(tmp_path)
    host = Host(run=fm.run, source_address=lambda t: "10.9.0.5" if t == "10.9.0.2" else None)
    assert detect_address(host, "10.9.0.2") == "10.9.0.5"
    assert detect_address(host, "ctl") == "10.9.0.7"  # a name: fall back to hostname -I
    assert detect_address(Host(run=fm.run), "127.0.0.1") == "10.9.0.7"  # loopback is never it


def test_real_role_templates_render_with_agent_context(tmp_path):
    """The agent's template variables match what roles/slurm and roles/accounting ship."""
    import shutil

    repo = Path(__file__).resolve().parents[3]
    agent, _fm, paths, _ = make(tmp_path, {**CTL, "gres_types": ["gpu"]})
    shutil.copy(repo / "roles/slurm/templates/slurm.conf.j2", paths.templates / "slurm.conf.j2")
    shutil.copy(
        repo / "roles/accounting/templates/slurmdbd.conf.j2", paths.templates / "slurmdbd.conf.j2"
    )
    agent.init()
    conf = (paths.slurm_etc / "slurm.conf").read_text()
    for line in (
        "ClusterName=demo",
        "SlurmctldHost=ctl(10.9.0.2)",
        "MaxNodeCount=64",
        "TreeWidth=65533",
        "SlurmctldParameters=enable_configless",
        "PrologFlags=Alloc",
        "GresTypes=gpu",
        "AccountingStorageHost=ctl",
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ):
        assert line in conf, line
    dbd = (paths.slurm_etc / "slurmdbd.conf").read_text()
    pw = (paths.secrets / "slurmdbd_storage_pass").read_text().strip()
    assert f"StoragePass={pw}" in dbd and "DbdHost=ctl" in dbd and "StorageLoc=slurm_acct_db" in dbd


def test_compute_dropin_keeps_systemd_notify_on_24_11(tmp_path):
    from nodeforge.bootstrap.node_roles import compute

    class Ctx:
        pass

    ctx = Ctx()
    ctx.features = type("F", (), {"version_tuple": (24, 11, 5)})()
    ctx.params = type(
        "P",
        (),
        {
            "node_name": "",
            "features": (),
            "gres": (),
            "cpus": None,
            "real_memory": None,
            "controller": type("C", (), {"target": "ctl"})(),
        },
    )()
    argv = compute.slurmd_exec(ctx)
    assert argv[:3] == [compute.SLURMD, "--systemd", "-Z"]


# -- honest readiness -------------------------------------------------------------------------
def test_compute_without_hooks_is_created_in_its_final_state(tmp_path):
    """No hooks: one `scontrol create` (FUTURE), no drain, no RESUME, so no forced ping."""
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    st = agent.init()
    ev = _slurm_events_after_docker(fm)
    assert ev == ["create c1 FUTURE", "start slurmd.service", "slurmd registered c1"], ev
    assert fm.nodes["c1"]["State"] == "IDLE" and "Reason" not in fm.nodes["c1"]
    assert st.steps["role"].detail["slurm_node"] == "created (final state)"
    assert st.steps["ready"].detail["slurm"] == "not drained"
    creates = [c for c in fm.calls if c[:2] == ["scontrol", "create"]]
    assert len(creates) == 1 and creates[0][-1] == "State=FUTURE"
    assert not any(c[:2] == ["scontrol", "update"] for c in fm.calls)
    # first boot: slurmd is inactive, systemd reads the new drop-in without a daemon-reload
    ask = ["systemctl", "show", "-p", "NeedDaemonReload", "--value", "slurmd.service"]
    assert fm.calls.index(ask) < fm.calls.index(["systemctl", "restart", "slurmd.service"])
    restart = fm.calls.index(["systemctl", "restart", "slurmd.service"])
    assert not any(
        c[:2] == ["systemctl", "is-active"] and c[-1] == "slurmd.service"
        for c in fm.calls[:restart]
    )  # restart starts a stopped unit: one call
    # (after it, `node health` in the ready step asks whether slurmd is active)
    assert ["systemctl", "daemon-reload"] not in fm.calls


def test_changed_dropin_of_a_running_slurmd_is_reloaded_before_restart(tmp_path):
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    paths.state_file.unlink()  # start over on purpose, with other features
    paths.node_yaml.write_text(json.dumps({**COMPUTE, "features": ["gpu"]}))
    fm.calls.clear()
    agent.init()
    calls = [" ".join(c) for c in fm.calls]
    assert calls.index("systemctl daemon-reload") < calls.index("systemctl restart slurmd.service")
    dropin = (paths.systemd_etc / "slurmd.service.d" / "nodeforge.conf").read_text()
    assert '--conf "Feature=gpu Gres=gpu:1"' in dropin


def test_failed_daemon_reload_keeps_slurmd_stopped(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    fm.force_reload = True
    fm.fail_on["systemctl daemon-reload"] = 1
    with pytest.raises(StepFailed, match="daemon-reload"):
        agent.init()
    assert "slurmd.service" not in fm.active


def test_ready_waits_for_slurmctld_to_see_the_node_responding(tmp_path):
    """After RESUME the node is IDLE+NOT_RESPONDING (idle*) until slurmctld's ping answers:
    `srun -w` is refused meanwhile, so the agent is not ready before that."""
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    fm.ping_after_shows = 4
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "10-ok").write_text("#!/bin/sh\nexit 0\n")
    (paths.on_init_d / "10-ok").chmod(0o755)
    states: list[str] = []
    real_save = agent._save

    def save(**kw):
        states.append(fm.nodes.get("c1", {}).get("State", ""))
        real_save(**kw)

    agent._save = save
    st = agent.init()
    assert st.status == "ready" and fm.nodes["c1"]["State"] == "IDLE"
    assert fm.events[-1] == "ping answered c1"
    # the save that says "ready" saw the node responding (without the wait: IDLE+NOT_RESPONDING)
    assert states[-1] == "IDLE"
    assert st.steps["ready"].detail["slurm"] == "resumed"


def test_ready_wait_is_bounded_and_names_the_last_state(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "wait_timeout": 10})
    fm.ping_after_shows = 10**6  # the node never answers slurmctld's ping
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "10-ok").write_text("#!/bin/sh\nexit 0\n")
    (paths.on_init_d / "10-ok").chmod(0o755)
    clock = iter(range(10**6))
    agent.host.monotonic = lambda: float(next(clock))
    with pytest.raises(StepFailed, match=r"ready in slurmctld .* did not happen within 10s") as ei:
        agent.init()
    assert "Last state seen: IDLE+NOT_RESPONDING" in str(ei.value)
    st = State.load(paths.state_file)
    assert st.status == "failed" and st.steps["ready"].status == "failed"
    n = fm.nodes["c1"]
    assert "DRAIN" in n["State"] and n["Reason"].startswith("nodeforge: ready step failed")


def test_existing_node_is_never_created_again(tmp_path):
    """Slurm 24.11.5 deletes an existing node when `scontrol create` of it fails: the gate
    looks first, on every boot."""
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    fm.reboot()
    agent.init()
    assert not any(e.startswith("create of existing") for e in fm.events)
    assert sum(c[:2] == ["scontrol", "create"] for c in fm.calls) == 1
    assert fm.nodes["c1"]["State"] == "IDLE"


def test_a_replaced_machine_replaces_the_names_registration(tmp_path):
    """Issue 28: a fresh disk booted under a name another machine held (HyperPod's node
    replacement keeps the name). Its old registration (old address, old hardware) is taken
    DOWN, deleted once Slurm lets go of it, and created anew: replaced, never reused."""
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    fm.nodes["c1"] = {"NodeAddr": "10.9.9.9", "State": "IDLE+NOT_RESPONDING"}
    fm.delete_refusals = 2
    agent.init()
    ev = [e for e in fm.events if e.split()[0] in ("down", "delete", "create")]
    assert ev == [
        "down c1: nodeforge: replaced by a new machine",
        "delete c1",
        "create c1 FUTURE",
    ], fm.events
    assert fm.nodes["c1"]["NodeAddr"] != "10.9.9.9" and fm.nodes["c1"]["State"] == "IDLE"
    st = State.load(paths.state_file)
    assert st.steps["role"].detail["slurm_node"] == "replaced another machine's registration"
    assert paths.slurm_registered.read_text() == "c1\n"
    # Its own registration on the next boot is kept, never deleted again.
    fm.reboot()
    agent.init()
    assert sum(e.startswith("delete") for e in fm.events) == 1


def test_a_registration_that_never_lets_go_fails_bounded_with_the_reason(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "wait_timeout": 2})
    fm.nodes["c1"] = {"NodeAddr": "10.9.9.9", "State": "ALLOCATED"}
    fm.delete_refusals = 10**6
    with pytest.raises(NodeforgeError) as ei:
        agent.init()
    msg = str(ei.value)
    assert "delete node c1's previous registration did not happen within 2s" in msg
    assert "Node has active jobs" in msg and "squeue -w c1" in msg
    assert not any(e.startswith("create") for e in fm.events)
    assert not paths.slurm_registered.exists()


# -- the one definition of "ready" (readiness.NodeState) ----------------------------------------


@pytest.mark.parametrize(
    "text, ready",
    [
        ("idle", True),
        ("mix", True),
        ("mixed", True),
        ("IDLE", True),
        ("idle*", False),  # NOT_RESPONDING: the case the old bench counted as ready
        ("idle~", False),
        ("idle#", False),
        ("idle!", False),
        ("idle%", False),
        ("idle$", False),
        ("idle@", False),
        ("mix-", False),
        ("alloc", False),
        ("drain", False),
        ("drained", False),
        ("drng", False),
        ("down*", False),
        ("futr", False),
        ("", False),
        ("*", False),
    ],
)
def test_sinfo_state_ready(text, ready):
    assert rd.from_sinfo(text).ready is ready


@pytest.mark.parametrize(
    "state, ready",
    [
        ("IDLE+DYNAMIC_NORM", True),
        ("MIXED", True),
        ("IDLE+CLOUD", True),
        ("IDLE+DYNAMIC_NORM+NOT_RESPONDING", False),
        ("IDLE+DRAIN+DYNAMIC_NORM", False),
        ("IDLE+CLOUD+POWERING_UP", False),
        ("IDLE+CLOUD+POWERED_DOWN", False),
        ("FUTURE+DYNAMIC_NORM", False),
        ("DOWN+NOT_RESPONDING", False),
        ("ALLOCATED", False),
        ("IDLE+SOMETHING_NEW", False),  # an unknown flag is not assumed harmless
        ("", False),
    ],
)
def test_scontrol_state_ready(state, ready):
    assert rd.from_scontrol(state).ready is ready


def test_json_state_list_as_slurm_24_11_prints_it():
    body = json.dumps(
        {
            "nodes": [
                {"name": "c001", "state": ["IDLE", "DYNAMIC_NORM"]},
                {"name": "c002", "state": ["IDLE", "DYNAMIC_NORM", "NOT_RESPONDING"]},
                {"name": "c003", "state": ["IDLE", "DRAIN", "DYNAMIC_NORM"]},
            ],
            "meta": {},
        }
    )
    got = rd.from_json(body)
    assert {k: v.ready for k, v in got.items()} == {"c001": True, "c002": False, "c003": False}
    assert got["c002"].why_not() == "flags NOT_RESPONDING"
    assert str(got["c003"]) == "IDLE+DRAIN+DYNAMIC_NORM"


@pytest.mark.parametrize(
    "body",
    [
        '{"nodes": [{"name": "c1", "state": ["IDLE"]}',  # truncated
        '{"nodes": {"c1": {}}}',
        '{"nodes": [{"name": "c1", "state": ["IDLE", 3]}]}',
        '{"nodes": [{"state": ["IDLE"]}]}',
        '{"nodes": [{"name": "c1", "state": ["IDLE"]}, {"name": "c1", "state": ["DOWN"]}]}',
        "[]",
        "NaN",
    ],
)
def test_json_state_rejects_bad_bodies(body):
    with pytest.raises(ValueError):
        rd.from_json(body)


def test_json_state_reads_22_05_sinfo_shape_too():
    # 22.05's sinfo --json: the base state as one word, the flags beside it
    body = '{"nodes": [{"name": "c1", "state": "idle", "state_flags": ["NOT_RESPONDING"]}]}'
    assert rd.from_json(body)["c1"].short() == "idle*"


def test_sinfo_table_keeps_names_and_flags():
    got = rd.from_sinfo_table("c001|idle|none\nc002|idle*|none\n\ngarbage\nc003|drain|x y\n")
    assert {k: (v.ready, str(v)) for k, v in got.items()} == {
        "c001": (True, "IDLE"),
        "c002": (False, "IDLE+NOT_RESPONDING"),
        "c003": (False, "DRAIN"),
    }


def test_any_state_suffix_means_not_ready():
    # every base with every suffix combination up to length 2 (exhaustive, 6 * 90 cases)
    for base in ("idle", "mix", "mixed", "alloc", "down", "drain"):
        for n in (1, 2):
            for suf in itertools.product("*~#!%$@^-", repeat=n):
                st = rd.from_sinfo(base + "".join(suf))
                assert not st.ready and st.flags, (base, suf)


def test_only_known_harmless_flags_keep_a_node_ready():
    odd = ["NOT_RESPONDING", "DRAIN", "POWERING_UP", "x=y", "IDLE\nDRAIN", " ", "RESERVED"]
    for flags in itertools.chain.from_iterable(
        itertools.combinations([*rd.HARMLESS_FLAGS, *odd], k) for k in range(3)
    ):
        st = rd.from_flags(["IDLE", *flags])
        assert st.ready == (st.flags <= rd.HARMLESS_FLAGS), flags


# -- cluster up/add observe nodes with the same definition (lab/localcluster.py) ----------------
def test_cluster_reads_node_states_from_json_and_sinfo():
    from nodeforge.lab.localcluster import parse_nodes_json, parse_nodes_sinfo

    body = json.dumps(
        {
            "nodes": [
                {"name": "c001", "state": ["IDLE", "DYNAMIC_NORM"], "reason": ""},
                {"name": "c002", "state": ["IDLE", "DYNAMIC_NORM", "NOT_RESPONDING"], "reason": ""},
                {"name": "c003", "state": ["IDLE", "DRAIN"], "reason": "nodeforge: hook x failed"},
            ]
        }
    )
    got = parse_nodes_json(body)
    assert [(n, v.state.ready, v.shown) for n, v in got.items()] == [
        ("c001", True, "idle"),
        ("c002", False, "idle*"),
        ("c003", False, "idle+drain"),
    ]
    assert got["c003"].state.drained and got["c003"].reason == "nodeforge: hook x failed"
    got = parse_nodes_sinfo("c001|idle|none\nc002|idle*|none\nc003|drain|nodeforge: x|y\n")
    assert {n: v.state.ready for n, v in got.items()} == {
        "c001": True,
        "c002": False,
        "c003": False,
    }
    assert got["c003"].reason == "nodeforge: x|y" and got["c001"].reason == ""
    with pytest.raises(ValueError):
        parse_nodes_json('{"nodes": [{"name": "c001", "state": ["IDLE"]}')  # truncated


def test_cluster_hosts_refresh_writes_overlays_and_refuses_symlinked_etc(tmp_path, monkeypatch):
    from nodeforge.lab import localcluster as lcm

    monkeypatch.setattr(lcm, "_alive", lambda pid: True)
    nodes = []
    for i, name in enumerate(("ctl", "c001", "c002")):
        d = tmp_path / name
        (d / "merged/etc").mkdir(parents=True)
        nodes.append(lcm.Node(name, "compute", i + 2, f"10.213.0.{i + 2}", f"ns{i}", str(d), 1))
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "c002/merged/etc").rmdir()
    (tmp_path / "c002/merged/etc").symlink_to(outside)  # a node pointing its /etc elsewhere
    cluster = lcm.Cluster("t", "img", "lower", "nfc-t", 0.0, nodes)
    lcm.LocalCluster("t")._refresh_hosts(cluster, skip="ctl")
    hosts = (tmp_path / "c001/merged/etc/hosts").read_text()
    assert "10.213.0.2\tctl" in hosts and "10.213.0.4\tc002" in hosts
    assert not (tmp_path / "ctl/merged/etc/hosts").exists()  # the newcomer writes its own
    assert list(outside.iterdir()) == []


def test_status_exit_says_ready_not_ready_failed_or_not_a_node(tmp_path, capsys):
    """0 ready, 3 not ready yet, 1 failed or not a node (issue 27: a machine that is not a
    node printed an empty 'new' status and exited 0)."""
    from nodeforge.cli import EXIT_FAILURE, EXIT_NOT_READY, EXIT_OK, main

    paths = Paths.under(tmp_path)
    assert main(["node", "status", "--root", str(tmp_path)]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "this machine is not a nodeforge node" in err and str(paths.image_json) in err
    paths.image_json.parent.mkdir(parents=True)
    paths.image_json.write_text("{}")  # a nodeforge image whose agent has not run yet
    assert main(["node", "status", "--root", str(tmp_path)]) == EXIT_NOT_READY
    assert "status    new" in capsys.readouterr().out
    st = State(status="running")
    st.save(paths.state_file, durable=False)
    assert main(["node", "status", "--json", "--root", str(tmp_path)]) == EXIT_NOT_READY
    st.status = "failed"
    st.save(paths.state_file, durable=False)
    assert main(["node", "status", "--root", str(tmp_path)]) == EXIT_FAILURE
    st.status = "ready"
    st.save(paths.state_file, durable=False)
    assert main(["node", "status", "--root", str(tmp_path)]) == EXIT_OK


def test_agent_outcome_metric_names_the_failed_step_then_clears(tmp_path):
    """The agent writes nodeforge_bootstrap_failed{step} for node_exporter at each outcome:
    1 for the step it failed in, then all 0 once a rerun made the node ready."""
    agent, _fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "20-bad").write_text("#!/bin/sh\nexit 4\n")
    (paths.on_init_d / "20-bad").chmod(0o755)
    prom = paths.textfile_dir / "nodeforge_bootstrap.prom"
    with pytest.raises(StepFailed):
        agent.init()
    text = prom.read_text()
    assert 'nodeforge_bootstrap_failed{step="hooks"} 1' in text
    assert 'nodeforge_bootstrap_failed{step="role"} 0' in text
    (paths.on_init_d / "20-bad").write_text("#!/bin/sh\nexit 0\n")
    agent.init()
    assert 'nodeforge_bootstrap_failed{step="hooks"} 0' in prom.read_text()
    assert " 1\n" not in prom.read_text()


def test_rerun_after_a_killed_hooks_step_stops_the_old_hook_and_resumes(tmp_path):
    """An agent killed mid-hook (SIGKILL) leaves its hook running in its own scope, and
    systemd's restart of the unit does not stop it (seen in e2e test_cluster_faults). The
    rerun stops every leftover hook scope first, does not run again the hooks that succeeded
    in the interrupted run, and runs the one cut off. A run that was not interrupted (first
    boot, a rerun after a failed hook) stops nothing."""
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    paths.on_init_d.mkdir(parents=True)
    ran = tmp_path / "ran"
    for name in ("10-a", "20-b"):
        (paths.on_init_d / name).write_text(f"#!/bin/sh\necho {name} >> {ran}\n")
        (paths.on_init_d / name).chmod(0o755)
    stop = ["systemctl", "stop", "nodeforge-hook-*.scope"]
    agent.init()
    assert stop not in fm.calls and ran.read_text().split() == ["10-a", "20-b"]
    # the record a SIGKILL during 20-b leaves: 10-a ok, the step and the agent "running"
    st = State.load(paths.state_file)
    st.status, st.steps["hooks"].status, st.steps["ready"].status = "running", "running", "pending"
    first = st.steps["hooks"].detail["results"][0]
    st.steps["hooks"].detail = {"results": [first]}
    st.save(paths.state_file)
    n_calls = len(fm.calls)
    st = agent.init()
    assert st.status == "ready" and st.steps["hooks"].runs == 2
    assert fm.calls[n_calls:].count(stop) == 1
    assert ran.read_text().split() == ["10-a", "20-b", "20-b"]  # 10-a once, 20-b again
    res = st.steps["hooks"].detail["results"]
    assert [(r["name"], r["status"], r.get("resumed", False)) for r in res] == [
        ("10-a", "ok", True),
        ("20-b", "ok", False),
    ]
    n_calls = len(fm.calls)
    agent.init()  # a plain rerun: hooks done before, nothing interrupted
    assert stop not in fm.calls[n_calls:] and len(ran.read_text().split()) == 3


def test_resume_without_systemd_scopes_warns_and_runs_the_hooks(tmp_path, caplog):
    """Without systemd as PID 1 (hooks ran in the agent's cgroup or as its children, dead with
    it) `systemctl stop` of the leftover scopes is refused: a warning, and the hooks run."""
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "10-a").write_text("#!/bin/sh\nexit 0\n")
    (paths.on_init_d / "10-a").chmod(0o755)
    st = State(status="running")
    st.steps["params"].status = "done"
    st.steps["hooks"].status = "running"
    st.save(paths.state_file)
    fm.fail_on["systemctl stop nodeforge-hook-*.scope"] = 1
    with caplog.at_level("WARNING"):
        st = agent.init()
    assert st.status == "ready" and st.steps["hooks"].detail["results"][0]["name"] == "10-a"
    assert "leftover hook scopes not stopped (exit 1)" in caplog.text
