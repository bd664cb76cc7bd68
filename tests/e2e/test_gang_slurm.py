"""Gang governor against a real slurmctld + several slurmd (Debian 12: Slurm 22.05.8).

One lab per module (lab/slurm_netns.py: own netns, munge, ports 7817+); each test gets a
fresh governor (in-process thread, its own state/event files) and a clean cluster (the `gov`
and `clean` fixtures, tests/e2e/conftest.py). The cases the image's Slurm runs too are in
tests/e2e/gang_cases.py; the ones here need the 22.05 lab (test_gang_slurm_2411.py says why). Every
wait is bounded; each test ends with the job completed, pending or held and checks the
reason and the recorded history (events, AdminComment, Restarts).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from nodeforge.gang.slurm_view import SlurmCli
from nodeforge.lab.slurm_netns import Lab, check_tools
from tests.e2e.gang_cases import (  # noqa: F401  (the cases both Slurm versions run, collected here)
    test_array_gang_timeout_requeues_only_its_own_task,
    test_array_task_with_the_arrays_id_marks_only_itself_ready,
    test_array_tasks_are_tracked_as_arrayjob_task,
    test_block_admission_not_stalled_by_a_gang_waiting_for_its_dependency,
    test_block_admission_serializes,
    test_deactivation_is_final_until_an_operator_releases,
    test_drain_under_a_ready_job_is_not_lost_readiness,
    test_forged_job_name_is_still_a_two_node_gang,
    test_forged_workdir_and_comment_add_no_phantom_job,
    test_governor_restart_mid_countdown,
    test_happy_path_with_app_probe,
    test_not_requeueable_is_recorded,
    test_own_deadlines_judged_and_shown_to_the_owner,
    test_probe_never_signals_backoff_steps,
    test_prolog_hangs,
    test_real_node_output_is_read_node_by_node_through_the_cache,
    test_retry_limit_requeuehold_then_release_resets,
    test_time_limit_deactivates_after_t_seconds,
)
from tests.e2e.gang_support import REPO, assert_requeued, gang_status_json, parse_time, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lab():
    check_tools()  # a missing tool FAILS here, naming it
    lab = Lab(nodes=4, cloud_nodes=1)
    try:
        lab.start()
        lab.open_to_users()
        yield lab
    finally:
        lab.close()


def test_cli_run_once_and_status(lab, gov, tmp_path):
    """The real CLI (`nodeforge gang run --once`, `gang status --json`) against the lab."""
    import yaml

    cfgfile = tmp_path / "gang.yaml"
    cfgfile.write_text(
        yaml.safe_dump(
            {
                "timeout": 60,
                "state_file": str(tmp_path / "cli-state.json"),
                "event_log": str(tmp_path / "cli-events.jsonl"),
                "metrics_file": str(tmp_path / "cli-metrics.prom"),
            }
        )
    )
    j = lab.sbatch("-N2", "-w", "gn3,gn4", script="#!/bin/sh\nsleep 20\n")
    wait_for(lambda: lab.job(j)["JobState"] == "RUNNING", 15, "running")
    env_py = {"PYTHONPATH": str(REPO)}
    lab.run(
        sys.executable,
        "-m",
        "nodeforge.cli",
        "gang",
        "run",
        "--once",
        "--config",
        str(cfgfile),
        timeout=30,
    )
    out = gang_status_json(cfgfile, env=env_py)
    rows = {r["job_id"]: r for r in out["gangs"]}
    assert rows[str(j)]["phase"] == "ready" and rows[str(j)]["count"] == 0
    prom = (tmp_path / "cli-metrics.prom").read_text()
    assert 'kueue_admitted_active_workloads{cluster_queue="main"} 1' in prom
    lab.run("scancel", str(j))


def test_node_never_comes_up(lab, gov):
    lab.set_never("gc1")
    g = gov().start()
    j = lab.sbatch("-N2", "-w", "gn1,gc1")
    wait_for(
        lambda: (
            "POWERING_UP" in lab.node_states().get("gc1", "")
            or lab.job(j)["JobState"] == "CONFIGURING"
        ),
        20,
        "gc1 powering up",
    )
    wait_for(lambda: g.events(j, "requeue"), 20, "requeue of a job whose node never comes up")
    info = assert_requeued(lab, g, j)
    assert info["Reason"], info  # pending with a reason (BeginTime, ReqNodeNotAvail, ...)
    assert g.rec(j).count == 1


def test_prolog_fails(lab, gov):
    lab.set_prolog("gn2", "fail")
    g = gov().start()
    j = lab.sbatch("-N2", "-w", "gn1,gn2")
    # Slurm itself drains the node and requeues (held) the job; the governor must see and
    # record it, and must not requeue a second time.
    wait_for(lambda: "DRAIN" in lab.node_states()["gn2"], 25, "gn2 drained by prolog failure")
    wait_for(lambda: lab.job(j)["JobState"] == "PENDING", 25, "job back to PENDING")
    time.sleep(2)
    info = lab.job(j)
    assert info["JobState"] == "PENDING"
    assert not [e for e in g.events(j, "requeue") if "error" in e]
    wait_for(
        lambda: [e for e in g.events(j, "note") if e["reason"] == "RequeuedBySlurm"],
        10,
        "governor records Slurm's own requeue",
    )
    assert g.rec(j).count == 0 and g.rec(j).phase in ("pending", "backoff")
    reason = lab.run("sinfo", "-h", "-R", "-n", "gn2", "-o", "%E").stdout
    assert "rolog" in reason, reason


def test_recovery_timeout_node_killed_after_ready(lab, gov):
    g = gov(recovery_timeout=3).start()
    j = lab.sbatch("--no-kill", "-N2", "-w", "gn3,gn4", script="#!/bin/sh\nsleep 120\n")
    wait_for(lambda: g.rec(j) and g.rec(j).phase == "ready", 20, "ready")
    lab.kill_slurmd("gn4")
    wait_for(
        lambda: (
            g.events(j, "note") and any(e["reason"] == "ReadinessLost" for e in g.events(j, "note"))
        ),
        30,
        "readiness lost (gn4 not responding)",
    )
    lost = next(e for e in g.events(j, "note") if e["reason"] == "ReadinessLost")
    wait_for(lambda: g.events(j, "requeue"), 20, "requeue after recovery_timeout")
    req = g.events(j, "requeue")[0]
    assert req["reason"] == "RecoveryTimeout"
    assert req["time"] - lost["time"] >= 3
    wait_for(lambda: lab.job(j)["JobState"] == "PENDING", 30, "job pending after requeue")
    assert int(lab.job(j)["Restarts"]) == 1


def test_slurmctld_restart(lab, gov):
    lab.set_prolog("gn2", "hang")
    g = gov(timeout=8).start()
    j = lab.sbatch("-N2", "-w", "gn1,gn2")
    wait_for(lambda: g.rec(j) and g.rec(j).phase == "admitted", 15, "admitted")
    lab.stop_ctld()
    wait_for(
        lambda: g.events(action="slurmctld_unreachable"), 10, "governor notices slurmctld down"
    )
    time.sleep(1)
    lab.start_ctld()
    wait_for(lambda: g.events(j, "requeue"), 30, "requeue after slurmctld restart")
    time.sleep(2)
    assert len(g.events(j, "requeue")) == 1
    assert g.events(action="slurmctld_reachable")
    lab.release_prologs()
    wait_for(lambda: lab.job(j)["JobState"] == "PENDING", 20, "pending")
    info = lab.job(j)
    assert info["Restarts"] == "1" and info["JobState"] == "PENDING"


def test_never_booting_node_drained_after_two_gang_timeouts(lab, gov, tmp_path):
    """The gap node strikes close: a requeue frees a never-booting node and Slurm gives it to
    the next gang, which times out too. After two such timeouts the node is drained (reason in
    `sinfo -R`), the next gang waits for a good node instead, and a resume clears the strikes."""
    import yaml

    lab.set_never("gc1")
    # gn2..gn4 busy with 1-node jobs (not gangs): gn1 and gc1 are the only free nodes, so
    # Slurm places every 2-node gang on the never-booting gc1.
    fillers = {
        n: lab.sbatch("-N1", "-w", n, script="#!/bin/sh\nsleep 300\n")
        for n in ("gn2", "gn3", "gn4")
    }
    wait_for(
        lambda: all(lab.job(f)["JobState"] == "RUNNING" for f in fillers.values()), 20, "fillers"
    )
    # backoff 120 s: A and B stay out of the queue for the rest of the test
    g = gov(
        node_strike_limit=2,
        node_strike_window_seconds=3600,
        requeuing={"backoff_base_seconds": 120, "backoff_max_seconds": 120},
    ).start()
    a = lab.sbatch("-N2")
    wait_for(lambda: g.events(a, "requeue"), 30, "A requeued (gc1 never comes up)")
    assert "gc1" in g.events(a, "strike")[0]["detail"]
    b = lab.sbatch("-N2")
    wait_for(lambda: g.events(b, "requeue"), 30, "B requeued (given gc1 again)")
    wait_for(lambda: "DRAIN" in lab.node_states().get("gc1", ""), 10, "gc1 drained")

    # one strike per timed-out gang, all on gc1; gn1 was up both times: no strike
    strikes = g.events(action="strike")
    assert [(e["node"], e["job_id"], e["count"]) for e in strikes] == [
        ("gc1", str(a), 1),
        ("gc1", str(b), 2),
    ], strikes
    (drain,) = g.events(action="drain")
    assert (drain["node"], drain["job_id"], drain["count"]) == ("gc1", str(b), 2)
    assert "error" not in drain
    reason = lab.run("sinfo", "-h", "-R", "-n", "gc1", "-o", "%E").stdout.strip()
    assert reason.startswith(
        f"nodeforge-gang: not ready at 2 gang timeouts within 3600s (last job {b}:"
    ), reason
    assert "POWERING_UP" in reason, reason
    assert not lab.run("sinfo", "-h", "-R", "-n", "gn1", "-o", "%E").stdout.strip()
    # what a governor that lost its state file finds again: our Reason, parsed from scontrol
    fresh = SlurmCli(prefix=lab.prefix(), env=lab.env, timeout=10).snapshot()
    assert fresh.node_reasons["gc1"] == drain["detail"]
    # Draining a powering-up node makes slurmctld requeue B itself; the governor's requeue
    # must still apply B's backoff, not fail.
    for j in (a, b):
        (req,) = g.events(j, "requeue")
        assert "error" not in req, req
        wait_for(lambda j=j: lab.job(j)["JobState"] == "PENDING", 20, f"job {j} pending")
        assert abs(parse_time(lab.job(j)["EligibleTime"]) - req["next_eligible"]) <= 1.5
    assert g.events(b, "requeue")[0].get("requeued_by") == "slurmctld"

    # The operator's view: status, metrics.
    cfgfile = tmp_path / "gang.yaml"
    cfgfile.write_text(yaml.safe_dump({"state_file": g.cfg.state_file}))
    # The drain is confirmed ("drained") once a later cycle sees it in Slurm: wait for that
    # cycle (bounded) instead of racing it.
    seen: list[dict] = []

    def confirmed() -> bool:
        seen.append(gang_status_json(cfgfile, env={"PYTHONPATH": str(REPO)}))
        return [n["state"] for n in seen[-1]["nodes"]] == ["drained"]

    wait_for(confirmed, 15, "gc1 drained in `gang status`")
    status = seen[-1]
    assert [(n["node"], n["state"], n["strikes"], n["last_job"]) for n in status["nodes"]] == [
        ("gc1", "drained", 2, str(b))
    ], status["nodes"]
    prom = Path(g.cfg.metrics_file).read_text()
    for line in (
        "nodeforge_gang_nodes_drained_total 1",
        "nodeforge_gang_node_strikes_total 2",
        "nodeforge_gang_nodes_drained 1",
        "nodeforge_gang_action_errors_total 0",
    ):
        assert line in prom.splitlines(), (line, prom)

    # The next gang: gn1 is the only usable free node now, so it waits instead of taking gc1...
    c = lab.sbatch("-N2", script="#!/bin/sh\nsleep 3\n")
    t_end = time.monotonic() + 4
    while time.monotonic() < t_end:
        info = lab.job(c)
        assert info["JobState"] == "PENDING" and "gc1" not in info.get("NodeList", ""), info
        time.sleep(0.5)
    # ...and runs, ready, on good nodes as soon as one frees up.
    lab.run("scancel", str(fillers["gn2"]))
    wait_for(lambda: lab.job(c)["JobState"] == "COMPLETED", 40, "C completed")
    assert lab.job(c)["NodeList"] == "gn[1-2]"
    assert [e["reason"] for e in g.events(c, "note")][:1] == ["PodsReady"]
    assert not g.events(c, "requeue") and len(g.events(action="strike")) == 2

    # The operator resumes gc1: the governor records it and forgets its strikes.
    lab.run("scontrol", "update", "NodeName=gc1", "State=RESUME")
    wait_for(
        lambda: [e for e in g.events(action="note") if e["reason"] == "NodeResumed"],
        10,
        "resume recorded",
    )
    (resumed,) = [e for e in g.events(action="note") if e["reason"] == "NodeResumed"]
    assert resumed["node"] == "gc1" and "2 strike(s) cleared" in resumed["detail"]
    wait_for(lambda: "gc1" not in g.gov.state.nodes, 5, "strikes cleared in the state")
    wait_for(
        lambda: (
            "nodeforge_gang_nodes_drained 0" in Path(g.cfg.metrics_file).read_text().split("\n")
        ),
        5,
        "metrics: no node held drained",
    )
