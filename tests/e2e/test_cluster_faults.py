"""Faults while nodes join (issue 28 item 3), on a real local cluster from the built image.

Every case ends with every node it started either schedulable (Slurm says ready, the agent
says ready, its hooks done) or drained with a reason (the agent failed, `sinfo -R` says why):
none idle without its hooks, none stuck with its agent still "running", none missing from
Slurm. One module-scoped cluster ("e2efault", with accounting: slurmdbd is one of the faults);
each case joins its own computes (c1NN) and leaves the controller as it found it.

A node's clock skewed beyond munge's TTL is not here but in tests/e2e/test_vm_clock_skew.py:
an nspawn node cannot have its own wall clock (docs/operate.md "Faults while nodes join").
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nodeforge.lab.localcluster import Cluster, LocalCluster, node_exec
from tests.conftest import require_tools, wait_for

pytestmark = pytest.mark.e2e
NAME = "e2efault"
HOOK_LOG = "var/lib/e2e-hook.log"  # in each node, written by the hook below
# FIXTURE hook: records each start and each completion with its pid; sleeps SECS first.
MARK_HOOK = """#!/bin/sh
echo "start $$" >> /{log}
sleep {secs}
echo "done $$" >> /{log}
"""
SETTLE_S = 240.0


def ctl(lc: LocalCluster, *argv: str, check: bool = True, timeout: float = 60):
    c = Cluster.load(lc.name)
    return node_exec(c.controller, list(argv), check=check, timeout=timeout)


def join(
    lc: LocalCluster,
    tmp_path: Path,
    name: str,
    hook: str,
    *,
    first: str | None = None,
    params: dict | None = None,
    **kw,
):
    """Start compute *name* with the extension hook 10-mark (*hook*: the script), after the
    hook 05-first if *first* is given, with *params* added to its params, without waiting."""
    scripts = ([("05-first", first)] if first is not None else []) + [("10-mark", hook)]
    hooks, copies = [], []
    for hname, body in scripts:
        f = tmp_path / f"{name}-{hname}.sh"
        f.write_text(body)
        f.chmod(0o755)
        dest = f"/opt/e2e-hooks/{hname}.sh"
        hooks.append({"uri": f"file://{dest}", "name": hname, "timeout": 120})
        copies.append((f, dest))
    doc = {"hooks": hooks, "hook_retries": 0, **(params or {})}
    return lc.start_node(name, params=doc, copies=copies, **kw)


def hook_lines(lc: LocalCluster, name: str) -> list[str]:
    f = Cluster.load(lc.name).node(name).merged / HOOK_LOG
    return f.read_text().split("\n")[:-1] if f.exists() else []


def agent(lc: LocalCluster, name: str) -> dict:
    return lc.agent_state(Cluster.load(lc.name).node(name))


def settle(lc: LocalCluster, names: list[str], timeout: float = SETTLE_S) -> dict[str, str]:
    """Wait (bounded) until every node in *names* is settled; return {name: "ready"|reason}.

    Settled: schedulable (Slurm ready, agent ready, hooks step done) or drained with a reason
    and its agent failed. Anything else at the bound fails the test with what each node was."""
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    while True:
        c = Cluster.load(lc.name)
        sn = lc.slurm_nodes(c)
        out: dict[str, str] = {}
        for n in names:
            st = lc.agent_state(c.node(n))
            sl = sn.get(n)
            hooks = (st.get("steps") or {}).get("hooks", {}).get("status")
            if sl is None:
                last[n] = f"missing from Slurm, agent {st.get('status')}"
            elif sl.state.ready and st.get("status") == "ready" and hooks in ("done", "skipped"):
                out[n] = "ready"
            elif sl.state.drained and sl.reason and st.get("status") == "failed":
                out[n] = sl.reason
            else:
                last[n] = (
                    f"{sl.shown} reason={sl.reason!r}, agent {st.get('status')}, hooks {hooks}"
                )
        if len(out) == len(names):
            return out
        if time.monotonic() > deadline:
            pytest.fail(f"not settled after {timeout:.0f}s: {last}", pytrace=False)
        time.sleep(1)


@pytest.fixture(scope="module")
def lc(built_image):
    require_tools("systemd-nspawn", "ip", "nsenter")
    lab = LocalCluster(NAME, progress=lambda msg: None)
    lab.down()  # one left by an interrupted run of this module
    lab.up(built_image, 0, timeout=400)  # accounting on: slurmdbd is one of the faults
    yield lab
    lab.down()


def test_controller_unreachable_while_two_nodes_join(lc, tmp_path):
    """slurmctld stopped while two computes boot: their agents wait (bounded by wait_timeout)
    and both end schedulable with their hooks run once, soon after slurmctld is back."""
    ctl(lc, "systemctl", "stop", "slurmctld.service", timeout=120)
    try:
        names = ["c101", "c102"]
        for n in names:
            join(lc, tmp_path, n, MARK_HOOK.format(log=HOOK_LOG, secs=1))
        time.sleep(25)  # the controller stays away while they boot
        c = Cluster.load(lc.name)
        for n in names:
            st = lc.agent_state(c.node(n))
            assert st.get("status") == "running", st  # waiting, not failed, not ready
            assert hook_lines(lc, n) == []  # no hook before the node exists in Slurm
    finally:
        ctl(lc, "systemctl", "start", "slurmctld.service", timeout=120)
    back = time.monotonic()
    assert settle(lc, names, timeout=120) == {n: "ready" for n in names}
    took = time.monotonic() - back
    for n in names:
        lines = hook_lines(lc, n)
        assert [ln.split()[0] for ln in lines] == ["start", "done"], lines
        assert agent(lc, n)["steps"]["role"]["runs"] == 1  # waited in the step, no rerun
    assert took < 120


def rejoin_log(node) -> str:
    cmd = ["journalctl", "-u", "nodeforge-rejoin.service", "--no-pager", "-o", "cat"]
    return node_exec(node, cmd, check=False, timeout=60).stdout


def test_controller_away_past_wait_timeout_node_joins_when_it_is_back(lc, tmp_path):
    """slurmctld stays away longer than the compute's wait_timeout: its role step fails and it
    is outside Slurm (nobody can drain it); once slurmctld is back, nodeforge-rejoin.timer
    starts its agent again and it ends schedulable, its hook run once."""
    n = "c108"
    ctl(lc, "systemctl", "stop", "slurmctld.service", timeout=120)
    try:
        join(lc, tmp_path, n, MARK_HOOK.format(log=HOOK_LOG, secs=1), params={"wait_timeout": 10})
        wait_for(
            f"{n}'s agent to fail its role step",
            lambda: agent(lc, n).get("status") == "failed",
            120,
        )
        st = agent(lc, n)
        assert st["steps"]["role"]["status"] == "failed" and st["retry"] == "controller-away", st
        assert "nodeforge-rejoin.timer" in st["steps"]["role"]["error"]
        assert hook_lines(lc, n) == []
        c = Cluster.load(lc.name)
        # exit 1: the agent failed (`node status` says so by its exit code too)
        cp = node_exec(c.node(n), ["nodeforge", "node", "status"], check=False, timeout=60)
        status = cp.stdout
        assert cp.returncode == 1, status
        assert "outside Slurm: nodeforge-rejoin.timer" in status, status
        timer = node_exec(
            c.node(n), ["systemctl", "is-active", "nodeforge-rejoin.timer"], check=False
        ).stdout.strip()
        assert timer == "active", timer
        # at least one look of the timer (60 s after boot, then every 30 s) while slurmctld
        # is still away: it starts nothing
        wait_for(
            "a look of nodeforge-rejoin while slurmctld is away",
            lambda: "slurmctld still does not answer" in rejoin_log(c.node(n)),
            150,
            every=2,
        )
        assert agent(lc, n).get("status") == "failed"
    finally:
        ctl(lc, "systemctl", "start", "slurmctld.service", timeout=120)
    back = time.monotonic()
    # the timer's next look (every 30 s, up to 10 s late) finds slurmctld, then a first boot
    assert settle(lc, [n], timeout=150) == {n: "ready"}
    took = time.monotonic() - back
    lines = hook_lines(lc, n)
    assert [ln.split()[0] for ln in lines] == ["start", "done"], lines
    st = agent(lc, n)
    assert st["steps"]["role"]["runs"] == 2 and st.get("retry") is None, st
    log = rejoin_log(Cluster.load(lc.name).node(n))
    assert "slurmctld answers: starting nodeforge-init.service again" in log, log
    print(f"{n}: schedulable {took:.1f}s after slurmctld was back")


def test_agent_killed_mid_hook_is_restarted_and_finishes_its_hooks(lc, tmp_path):
    """SIGKILL of `node init` while its hook runs: systemd starts the agent again
    (Restart=on-abort), the hook that was cut off is stopped, the interrupted hooks step runs
    again, and the node ends schedulable with the hook completed exactly once."""
    n = "c103"
    join(lc, tmp_path, n, MARK_HOOK.format(log=HOOK_LOG, secs=15))
    wait_for(f"{n}'s hook to start", lambda: hook_lines(lc, n), timeout=SETTLE_S)
    node = Cluster.load(lc.name).node(n)
    pid = node_exec(
        node, ["systemctl", "show", "-p", "MainPID", "--value", "nodeforge-init.service"]
    ).stdout.strip()
    assert pid.isdigit() and int(pid) > 1, pid
    node_exec(node, ["kill", "-KILL", pid])
    assert settle(lc, [n]) == {n: "ready"}
    lines = hook_lines(lc, n)
    verbs = [ln.split()[0] for ln in lines]
    # the killed run's hook never completed (stopped with the agent), the rerun's did
    assert verbs == ["start", "start", "done"], lines
    assert lines[2].split()[1] == lines[1].split()[1], lines
    st = agent(lc, n)
    assert st["boots"] == 2 and st["steps"]["hooks"]["runs"] == 2, st
    assert st["steps"]["identity"]["runs"] == 1, st  # completed steps are not redone
    restarts = node_exec(
        node, ["systemctl", "show", "-p", "NRestarts", "--value", "nodeforge-init.service"]
    ).stdout.strip()
    assert restarts == "1"
    # no scope of the killed run's hook is left behind
    scopes = node_exec(
        node, ["systemctl", "list-units", "--no-legend", "--plain", "nodeforge-hook-*"]
    ).stdout
    assert scopes.strip() == "", scopes


def test_agent_killed_4_times_in_one_boot_ends_failed_and_drained(lc, tmp_path):
    """SIGKILL of `node init` mid-hook, 4 times: systemd restarts it 3 times, then gives up
    (StartLimitBurst=4). The node does not stay "running": OnFailure= records the hooks step
    failed with "agent restarted too often", the node is drained with that reason, the hook is
    stopped, and the metric and the cluster's summary say so."""
    n = "c107"
    join(lc, tmp_path, n, MARK_HOOK.format(log=HOOK_LOG, secs=60))
    node = Cluster.load(lc.name).node(n)

    def show(prop: str) -> str:
        argv = ["systemctl", "show", "-p", prop, "--value", "nodeforge-init.service"]
        return node_exec(node, argv).stdout.strip()

    for kill in range(1, 5):
        # the kill-th run of the agent has (re)started the hook: kill that agent
        wait_for(
            f"{n}'s agent run {kill} in its hook",
            lambda k=kill: len(hook_lines(lc, n)) >= k and show("MainPID") not in ("", "0"),
            timeout=SETTLE_S,
        )
        node_exec(node, ["kill", "-KILL", show("MainPID")])
    why = (
        "agent restarted too often: killed 4 times in this boot, systemd gave up "
        "(nodeforge-init.service StartLimitBurst=4)"
    )
    assert settle(lc, [n], timeout=120) == {n: f"nodeforge: hooks step failed: {why}"}
    # systemd 257 counts the refused 4th restart (NRestarts=4) and keeps Result=signal; an
    # older one fails the restart (start-limit-hit, NRestarts=3)
    assert (show("Result"), show("NRestarts")) in (("signal", "4"), ("start-limit-hit", "3"))
    st = agent(lc, n)
    assert st["status"] == "failed", st
    assert st["steps"]["hooks"]["status"] == "failed" and st["steps"]["hooks"]["error"] == why
    lines = hook_lines(lc, n)
    assert [ln.split()[0] for ln in lines] == ["start"] * 4, lines  # never completed, not rerun
    scopes = node_exec(
        node, ["systemctl", "list-units", "--no-legend", "--plain", "nodeforge-hook-*"]
    ).stdout
    assert scopes.strip() == "", scopes
    prom = node_exec(node, ["cat", "/var/lib/nodeforge/gang/nodeforge_bootstrap.prom"]).stdout
    assert 'nodeforge_bootstrap_failed{step="hooks"} 1' in prom, prom
    status = node_exec(node, ["nodeforge", "node", "status"], check=False)
    assert status.returncode != 0 and "agent restarted too often" in status.stdout, status.stdout
    summary = lc.status()["bootstrap_failures"]
    assert [(s["step"], s["nodes"]) for s in summary] == [("hooks", [n])], summary
    assert "agent restarted too often" in summary[0]["first_error"], summary
    lc.remove_node(n)  # the disk-fill case counts the cluster's failed nodes: its own only


def test_slurmdbd_down_when_a_node_joins(lc, tmp_path):
    """slurmdbd stopped: a compute still joins and runs a job (joining needs slurmctld only);
    once slurmdbd is back, the job is in `sacct` (slurmctld kept the record)."""
    n = "c104"
    ctl(lc, "systemctl", "stop", "slurmdbd.service", timeout=120)
    try:
        join(lc, tmp_path, n, MARK_HOOK.format(log=HOOK_LOG, secs=1))
        assert settle(lc, [n]) == {n: "ready"}
        job = ctl(lc, "sbatch", "--parsable", "-w", n, "--wrap", "hostname").stdout.strip()
        job = job.split(";")[0]
        wait_for(
            f"job {job} to complete",
            lambda: (
                "COMPLETED"
                in ctl(lc, "squeue", "-h", "-t", "all", "-j", job, "-o", "%T", check=False).stdout
            ),
            timeout=120,
        )
    finally:
        ctl(lc, "systemctl", "start", "slurmdbd.service", timeout=120)
    wait_for(
        f"job {job} in sacct after slurmdbd is back",
        lambda: (
            "COMPLETED"
            in ctl(lc, "sacct", "-n", "-X", "-j", job, "-o", "State", check=False).stdout
        ),
        timeout=180,
    )
    assert settle(lc, [n]) == {n: "ready"}


def test_node_power_cut_during_first_boot(lc, tmp_path):
    """The node loses power while its first boot runs a hook, and boots again on the same
    disk: it ends schedulable, the hook completed once (the cut-off run never finished),
    completed steps are not run again (identity)."""
    n = "c105"
    first = f"#!/bin/sh\necho first $$ >> /{HOOK_LOG}\n"
    join(lc, tmp_path, n, MARK_HOOK.format(log=HOOK_LOG, secs=15), first=first)
    wait_for(
        f"{n}'s second hook to start",
        lambda: any(ln.startswith("start") for ln in hook_lines(lc, n)),
        timeout=SETTLE_S,
    )
    lc.power_cycle(n)
    assert settle(lc, [n]) == {n: "ready"}
    lines = hook_lines(lc, n)
    # 05-first completed before the cut: not run again; 10-mark cut off, run again, completed
    assert [ln.split()[0] for ln in lines] == ["first", "start", "start", "done"], lines
    st = agent(lc, n)
    assert st["boots"] == 2 and st["steps"]["hooks"]["runs"] == 2, st
    assert st["steps"]["identity"]["runs"] == 1, st
    res = st["steps"]["hooks"]["detail"]["results"]
    assert [(r["name"], r.get("resumed", False)) for r in res] == [
        ("05-first", True),
        ("10-mark", False),
    ], res


# dd, not a real `enroot import`: the image under test has the FIXTURE enroot of
# tests/fixtures/mirror.py (a shell stand-in, 2 KiB .deb); the real enroot .deb is on GitHub
# (images/versions.yaml), which the test machines cannot resolve, and Debian packages no enroot
# (`apt-cache search enroot`: nothing). Importing with the stand-in would test the stand-in.
FILL_HOOK = """#!/bin/sh
# FIXTURE: stands for a container import (enroot import writes the image under
# /var/lib/enroot); 64 MiB into a 16 MiB disk.
df -k /var/lib/enroot
exec dd if=/dev/zero of=/var/lib/enroot/import.sqsh bs=1M count=64
"""


def test_disk_fills_during_an_import_in_a_hook(lc, tmp_path):
    """A node whose data disk (/var/lib/enroot, 16 MiB here) fills during a hook's import:
    drained, the reason naming the hook, its log saying the disk is full."""
    n = "c106"
    # a later --tmpfs for the same path wins over the lab's default (checked below: 16 MiB)
    join(lc, tmp_path, n, FILL_HOOK, nspawn_args=["--tmpfs=/var/lib/enroot:mode=1777,size=16M"])
    got = settle(lc, [n])
    assert got[n].startswith("nodeforge: hook 10-mark failed (exit 1)"), got
    node = Cluster.load(lc.name).node(n)
    size = node_exec(node, ["df", "-k", "--output=size", "/var/lib/enroot"]).stdout.split()[-1]
    assert int(size) == 16 * 1024, size
    log = node_exec(node, ["cat", "/var/log/nodeforge/hooks/10-mark.log"]).stdout
    assert "No space left on device" in log, log[-2000:]
    st = agent(lc, n)
    assert st["steps"]["hooks"]["status"] == "failed", st
    # the cluster says it once: the failing step, how many nodes, the first error
    summary = lc.status()["bootstrap_failures"]
    assert [(s["step"], s["nodes"]) for s in summary] == [("hooks", [n])], summary
    assert "10-mark failed (exit 1)" in summary[0]["first_error"], summary


def test_every_node_settled_at_the_end(lc):
    """Whatever ran before: no node of the cluster is left idle without its hooks, stuck, or
    missing from Slurm."""
    c = Cluster.load(lc.name)
    computes = [x.name for x in c.nodes if x.role == "compute"]
    assert computes, "no compute joined"
    got = settle(lc, computes, timeout=60)
    ready = {n for n, v in got.items() if v == "ready"}
    assert ready >= {"c101", "c102", "c103", "c104", "c105", "c108"} - {"c106"}, json.dumps(got)
