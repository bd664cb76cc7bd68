"""Gang cases run against two Slurm versions (imported as tests.e2e.gang_cases, never
collected here: the file name is not test_*): test_gang_slurm.py runs them on the 22.05 lab
(lab/slurm_netns.py), test_gang_slurm_2411.py on the image's own Slurm (lab/gang_cluster.py).
Each collecting module brings its own `lab` fixture; `clean` and `gov` are in
tests/e2e/conftest.py. Cases that need one version only stay in that version's module."""

from __future__ import annotations

import time

from nodeforge.gang.events import decode_admin
from nodeforge.gang.slurm_view import SlurmCli
from tests.e2e.gang_support import assert_requeued, parse_time, wait_for


def test_happy_path_with_app_probe(lab, gov):
    g = gov(probe={"mode": "command"}).start()
    # the default config path (absent on the lab's nodes: defaults)
    script = f"#!/bin/sh\n{lab.nodeforge_cmd} gang ready --timeout 20 || true\nsleep 2\n"
    j = lab.sbatch("-N2", "-w", "gn1,gn2", script=script)
    wait_for(
        lambda: (
            g.events(j, "note") and any(e["reason"] == "PodsReady" for e in g.events(j, "note"))
        ),
        30,
        "PodsReady",
    )
    wait_for(lambda: lab.job(j)["JobState"] == "COMPLETED", 30, "job COMPLETED")
    info = lab.job(j)
    assert info["Restarts"] == "0"
    assert "nfg-ready=0" in info.get("Comment", "")
    assert not g.events(j, "requeue")
    wait_for(lambda: g.rec(j) and g.rec(j).phase == "done", 10, "record done")
    assert g.rec(j).count == 0


def test_prolog_hangs(lab, gov):
    lab.set_prolog("gn2", "hang")
    g = gov().start()
    j = lab.sbatch("-N2", "-w", "gn1,gn2")
    wait_for(lambda: g.events(j, "requeue"), 25, "requeue of a job whose prolog hangs")
    ev = g.events(j, "requeue")[0]
    assert ev["waited"] >= 4
    assert_requeued(lab, g, j)


def test_probe_never_signals_backoff_steps(lab, gov):
    g = gov(timeout=3, probe={"mode": "command"}).start()
    j = lab.sbatch("-N2", "-w", "gn3,gn4", script="#!/bin/sh\nsleep 60\n")
    wait_for(lambda: len(g.events(j, "requeue")) >= 3, 60, "three requeues")
    reqs = g.events(j, "requeue")[:3]
    steps = [e["backoff_seconds"] for e in reqs]
    assert steps == [2, 4, 8], (steps, reqs)
    assert [e["count"] for e in reqs] == [1, 2, 3]
    g.stop()  # freeze: the job now waits out its 8 s backoff
    wait_for(lambda: lab.job(j)["JobState"] == "PENDING", 10, "pending in backoff")
    info = lab.job(j)
    assert int(info["Restarts"]) == 3
    # Slurm's EligibleTime is the governor's next eligible time (Slurm's own ~120 s requeue
    # hold-off on 22.05 is replaced by the backoff)

    last = g.events(j, "requeue")[-1]
    assert abs(parse_time(info["EligibleTime"]) - last["next_eligible"]) <= 1.5
    assert parse_time(info["EligibleTime"]) > time.time()


def test_retry_limit_requeuehold_then_release_resets(lab, gov):
    g = gov(
        timeout=3,
        probe={"mode": "command"},
        requeuing={"backoff_base_seconds": 1, "backoff_limit_count": 1},
    ).start()
    j = lab.sbatch("-N2", "-w", "gn3,gn4", script="#!/bin/sh\nsleep 60\n")
    wait_for(lambda: g.events(j, "requeuehold"), 40, "deactivation (requeuehold)")
    wait_for(lambda: lab.job(j)["JobState"] == "PENDING", 10, "pending")
    info = lab.job(j)
    # Slurm's state_reason (scontrol's Reason shows the requeue text instead)
    wait_for(lambda: lab.job_json(j).get("state_reason") == "JobHeldAdmin", 10, "admin hold (JSON)")
    info = lab.job(j)
    assert info["Priority"] == "0", info
    assert decode_admin(info["AdminComment"])["phase"] == "deactivated"
    assert len(g.events(j, "requeue")) == 1
    time.sleep(1.5)
    assert g.rec(j).phase == "deactivated" and g.rec(j).count == 2
    lab.run("scontrol", "release", str(j))
    wait_for(lambda: g.rec(j).count == 0 and g.rec(j).phase != "deactivated", 10, "counter reset")
    # (the annotate event is written after its command, so it may trail the AdminComment)
    wait_for(
        lambda: decode_admin(lab.job(j)["AdminComment"])["n"] == "0" and g.events(j, "annotate"),
        10,
        "AdminComment n=0, and its event",
    )
    assert g.events(j, "annotate")[-1]["reason"] == "Released"


def test_block_admission_serializes(lab, gov):
    lab.set_prolog("gn2", "hang")
    g = gov(
        timeout=4,
        block_admission=True,
        requeuing={"backoff_base_seconds": 30, "backoff_max_seconds": 60},
    ).start()
    # --begin: the governor's admin hold queues the job before the scheduler can start it
    # (a begin time within `timeout` still blocks the queue: a short wait, not a stall)
    a = lab.sbatch("--begin=now+2", "-N2", "-w", "gn1,gn2")
    time.sleep(0.3)
    b = lab.sbatch("--begin=now+2", "-N2", "-w", "gn3,gn4")
    wait_for(lambda: g.events(a, "hold") and g.events(b, "hold"), 10, "both queued (held)")
    assert lab.job(b)["Reason"] == "JobHeldAdmin"
    wait_for(lambda: g.events(a, "release"), 10, "A released first")
    wait_for(lambda: lab.job(a)["JobState"] in ("CONFIGURING", "RUNNING"), 15, "A admitted")
    # B must stay held while A is admitted-but-not-ready, although gn3/gn4 are idle.
    t_end = time.time() + 2.5
    while time.time() < t_end:
        assert lab.job(b)["JobState"] == "PENDING" and not g.events(b, "release")
        time.sleep(0.3)
    wait_for(lambda: g.events(a, "requeue"), 15, "A requeued after timeout")
    wait_for(lambda: g.events(b, "release"), 10, "B released once A gave its allocation back")
    rel_b = g.events(b, "release")[0]["time"]
    assert rel_b >= g.events(a, "requeue")[0]["time"]
    wait_for(
        lambda: lab.job(b)["JobState"] == "COMPLETED" or g.rec(b).phase == "ready", 30, "B ready"
    )
    lab.release_prologs()
    wait_for(lambda: lab.job(a)["JobState"] == "PENDING", 20, "A pending")
    info_a = lab.job(a)
    # requeued with hold: Priority 0 (Reason shows the hold after the next scheduler pass)
    assert info_a["Priority"] == "0", (info_a, g.events(a))
    assert g.rec(a).phase in ("backoff", "waiting_admission")
    assert decode_admin(info_a["AdminComment"])["phase"] in ("backoff", "waiting_admission")


def test_governor_restart_mid_countdown(lab, gov):
    lab.set_prolog("gn2", "hang")
    g1 = gov(timeout=6).start()
    j = lab.sbatch("-N2", "-w", "gn1,gn2")
    wait_for(lambda: g1.rec(j) and g1.rec(j).phase == "admitted", 15, "admitted")
    time.sleep(2)
    g1.stop()
    assert not g1.events(j, "requeue")
    time.sleep(1)
    g2 = gov(timeout=6).start()
    wait_for(lambda: g2.events(j, "requeue"), 15, "requeue by the restarted governor")
    time.sleep(3)  # several more cycles: no second requeue
    assert len(g2.events(j, "requeue")) == 1
    lab.release_prologs()
    wait_for(lambda: lab.job(j)["JobState"] == "PENDING", 20, "pending")
    info = lab.job(j)
    assert info["Restarts"] == "1" and info["JobState"] == "PENDING"
    assert g2.rec(j).count == 1
    # deadline honoured from Slurm's StartTime, not from the restart
    ev = g2.events(j, "requeue")[0]
    assert ev["requeued_at"] - ev["deadline"] < 2.0


def test_not_requeueable_is_recorded(lab, gov):
    lab.set_prolog("gn2", "hang")
    g = gov(timeout=3).start()
    j = lab.sbatch("--no-requeue", "-N2", "-w", "gn1,gn2")
    wait_for(lambda: g.events(j, "record"), 20, "not-requeueable recorded")
    time.sleep(1.5)
    assert len(g.events(j, "record")) == 1  # recorded once, not every cycle
    info = lab.job(j)
    adm = decode_admin(info["AdminComment"])
    assert adm["phase"] == "not_requeueable"
    assert info["Restarts"] == "0"
    assert g.rec(j).phase == "not_requeueable"


# ---- issue 10 ------------------------------------------------------------------------------
def test_forged_job_name_is_still_a_two_node_gang(lab, gov):
    """A job named `train NumNodes=1` on 2 nodes, never ready: tracked and requeued."""
    lab.set_prolog("gn4", "hang")
    g = gov(timeout=3).start()
    j = lab.sbatch("-J", "train NumNodes=1", "-N2", "-w", "gn3,gn4")
    wait_for(lambda: g.events(j, "requeue"), 20, "requeue of the forged-name job")
    assert g.rec(j).count == 1


def test_forged_workdir_and_comment_add_no_phantom_job(lab, gov, tmp_path):
    """A WorkDir (and Comment) holding a newline and `JobId=999 JobState=RUNNING NumNodes=2`
    with a StartTime long past: no job 999 is tracked, nobody else's job is touched."""
    forged = (
        "x\nJobId=999 JobState=RUNNING NumNodes=2 StartTime=2020-01-01T00:00:00 NodeList=gn[1-2]"
    )
    wd = lab.make_dir(forged)
    other = lab.sbatch("-N1", "-w", "gn1", script="#!/bin/sh\nsleep 20\n")  # a 1-node job
    g = gov(timeout=3).start()
    j = lab.run(
        "sbatch",
        "--parsable",
        "-N1",
        "-w",
        "gn2",
        f"--chdir={wd}",
        f"--comment={forged}",
        f"--output={lab.base}/log/forged-%j.out",
        "--wrap",
        "sleep 20",
    ).stdout.strip()
    wait_for(lambda: lab.job(j)["JobState"] == "RUNNING", 15, "forged job running")
    time.sleep(5)  # past the timeout of the forged "StartTime"
    assert "999" not in g.gov.state.jobs
    assert str(j) not in g.gov.state.jobs and str(other) not in g.gov.state.jobs  # 1-node jobs
    assert not [e for e in g.events() if e.get("action") in ("requeue", "requeuehold", "hold")]
    assert lab.job(other)["Restarts"] == "0"


def test_deactivation_is_final_until_an_operator_releases(lab, gov):
    """A never-ready gang of a non-root owner: requeued at the deadline twice, with backoff,
    then requeuehold at its third timeout. Its epilog is slow, so Slurm shows it COMPLETING
    after the requeuehold: that is no release. Then the admin hold, which the owner cannot
    release; the operator's release resets the count."""
    lab.set_epilog_sleep("gn3", 4)
    g = gov(
        timeout=3,
        probe={"mode": "command"},  # the job never runs `gang ready`: never ready
        requeuing={"backoff_base_seconds": 1, "backoff_limit_count": 2},
    ).start()
    j = lab.as_user(
        "sbatch",
        "--parsable",
        "-N2",
        "-w",
        "gn3,gn4",
        f"--output={lab.base}/log/u-%j.out",
        "--wrap",
        "sleep 60",
    ).stdout.strip()
    assert j.isdigit(), j
    seen = set()

    def shown_state() -> dict:
        info = lab.job_json(j)
        seen.add(str(info.get("job_state")))
        return info

    def deactivated() -> bool:
        shown_state()
        return bool(g.events(j, "requeuehold"))

    wait_for(deactivated, 60, "deactivated at the third timeout", lambda: (lab.job(j), g.events(j)))
    reqs = g.events(j, "requeue")
    assert [(e["count"], e["backoff_seconds"]) for e in reqs] == [(1, 1), (2, 2)], reqs
    assert all(e["requeued_at"] >= e["deadline"] and e["waited"] >= 3 for e in reqs), reqs
    (hold,) = g.events(j, "requeuehold")
    assert hold["count"] == 3 and hold["requeued_at"] >= hold["deadline"], hold

    def held_admin():
        info = shown_state()
        return info.get("job_state") == "PENDING" and info.get("state_reason") == "JobHeldAdmin"

    wait_for(held_admin, 30, "admin hold after requeuehold")
    assert "COMPLETING" in seen, seen  # the slow epilog was seen (and survived)
    rec = g.rec(j)
    assert rec.phase == "deactivated" and rec.count == 3, rec
    assert not g.events(j, "annotate")  # COMPLETING (slow epilog) was no release
    cp = lab.as_user("scontrol", "release", j)  # the owner
    assert cp.returncode != 0 and "denied" in (cp.stdout or "").lower(), cp.stdout
    time.sleep(1.5)
    assert lab.job_json(j)["state_reason"] == "JobHeldAdmin" and g.rec(j).count == 3
    assert g.rec(j).hold_confirmed
    assert lab.job(j)["Restarts"] == "3"
    lab.run("scontrol", "release", j)  # the operator
    # The governor writes its state before it runs the cycle's commands, and each command's
    # event after the command: the reset shows in the state file before its annotate event.
    wait_for(
        lambda: g.rec(j).count == 0 and g.events(j, "annotate"),
        10,
        "counter reset by the operator's release, and its event",
        lambda: (g.rec(j), g.events(j)),
    )
    assert g.events(j, "annotate")[-1]["reason"] == "Released"
    assert len(g.events(j, "requeuehold")) == 1


def test_drain_under_a_ready_job_is_not_lost_readiness(lab, gov):
    g = gov(recovery_timeout=2).start()
    j = lab.sbatch("-N2", "-w", "gn3,gn4", script="#!/bin/sh\nsleep 8\n")
    wait_for(lambda: g.rec(j) and g.rec(j).phase == "ready", 20, "ready")
    lab.run("scontrol", "update", "NodeName=gn4", "State=DRAIN", "Reason=maintenance")
    wait_for(lambda: lab.job(j)["JobState"] == "COMPLETED", 30, "job completed")
    notes = [e["reason"] for e in g.events(j, "note")]
    assert "ReadinessLost" not in notes and not g.events(j, "requeue"), g.events(j)


def test_real_node_output_is_read_node_by_node_through_the_cache(lab, clean):
    """slurmctld's own node JSON (22.05 `sinfo --json`, 24.11 `scontrol show node --json`) is
    laid out as the cached read expects: a second read of the same output takes every node
    from the cache (the same record objects, no fallback to the full parse), a drain with a
    hostile reason reads back exactly, and every read equals the full parse."""
    from nodeforge import slurm_records as sr

    cli = SlurmCli(prefix=lab.prefix(), env=lab.env, timeout=10)
    _, argv = cli.commands()

    def read() -> str:
        return cli._run(*argv).stdout

    cache = sr.BlockCache()
    text = read()
    first = sr.parse_nodes(text, "t", cache)
    assert first == sr.parse_nodes(text) and len(first) >= 2
    again = sr.parse_nodes(text, "t", cache)
    assert all(again[n] is first[n] for n in first)
    reason = 'ops: fan "x" Reason=y'
    lab.run("scontrol", "update", "NodeName=gn4", "State=DRAIN", f"Reason={reason}")
    try:
        text = read()
        drained = sr.parse_nodes(text, "t", cache)
        assert drained == sr.parse_nodes(text)
        assert "DRAIN" in drained["gn4"].flags and drained["gn4"].reason == reason
    finally:
        lab.run("scontrol", "update", "NodeName=gn4", "State=RESUME")


def test_block_admission_not_stalled_by_a_gang_waiting_for_its_dependency(lab, gov):
    g = gov(timeout=30, block_admission=True).start()
    blocker = lab.sbatch("-N1", "-w", "gn1", script="#!/bin/sh\nsleep 60\n")  # not a gang
    c = lab.sbatch("--begin=now+2", f"--dependency=afterok:{blocker}", "-N2", "-w", "gn3,gn4")
    time.sleep(0.3)
    d = lab.sbatch("--begin=now+2", "-N2", "-w", "gn3,gn4", script="#!/bin/sh\nsleep 3\n")
    wait_for(lambda: g.events(c, "release"), 15, "C (with the dependency) released first")
    wait_for(lambda: g.events(d, "release"), 15, "D released although C cannot start")
    wait_for(lambda: lab.job(d)["JobState"] in ("RUNNING", "COMPLETED"), 20, "D runs")
    assert lab.job(c)["Reason"] == "Dependency"


def test_array_tasks_are_tracked_as_arrayjob_task(lab, gov):
    lab.set_prolog("gn4", "hang")
    g = gov(timeout=3).start()
    a = lab.sbatch("--array=1-2%1", "-N2", "-w", "gn3,gn4")
    wait_for(lambda: g.events(f"{a}_1", "requeue"), 25, "task 1 requeued under its key")
    assert f"{a}_1" in g.gov.state.jobs


def _array_of_two_gangs(lab, unready: str) -> tuple[int, int, int]:
    """An array of two 2-node gangs (tasks 0 and 1, both running at once); one task never
    signals ready: the one that carries the array's own JobId (*unready* "own": Slurm keeps
    that id for one task, and as a bare id it names the whole array) or the other ("other").
    -> (array id, the unready task, its ready sibling), once both run."""
    own = '[ "$SLURM_JOB_ID" = "$SLURM_ARRAY_JOB_ID" ]'
    cond = own if unready == "own" else f"! {own}"
    script = (
        f"#!/bin/sh\nif {cond}; then sleep 120; exit 0; fi\n"
        f"{lab.nodeforge_cmd} gang ready --timeout 20 || true\nsleep 120\n"
    )
    extra = ["-x", ",".join(lab.cloud_names)] if lab.cloud_names else []
    a = lab.sbatch("--array=0-1", "-N2", *extra, script=script)

    def both_run() -> bool:
        return all(lab.job(f"{a}_{t}").get("JobState") == "RUNNING" for t in (0, 1))

    wait_for(
        both_run, 30, "both array tasks RUNNING", lambda: [lab.job(f"{a}_{t}") for t in (0, 1)]
    )
    carrier = [t for t in (0, 1) if lab.job(f"{a}_{t}")["JobId"] == str(a)]
    assert len(carrier) == 1, [lab.job(f"{a}_{t}") for t in (0, 1)]
    bad = carrier[0] if unready == "own" else 1 - carrier[0]
    return a, bad, 1 - bad


def test_array_gang_timeout_requeues_only_its_own_task(lab, gov):
    """Issue 24: the task carrying the array's id never signals ready; at each of its
    timeouts only that task is requeued (`scontrol requeue <ArrayJobId>` requeued the whole
    array, the ready sibling included). Then an operator requeues the sibling (a requeue
    that is Slurm's, not the governor's): the governor records it for the sibling only, and
    its next requeue of the unready task still leaves the sibling alone. Checked in Slurm's
    own view: Restarts, JobState, JobId and StartTime of each task."""
    g = gov(timeout=4, probe={"mode": "command"}, requeuing={"backoff_base_seconds": 2}).start()
    a, bad, sib = _array_of_two_gangs(lab, "own")
    bad_key, sib_key = f"{a}_{bad}", f"{a}_{sib}"
    before = lab.job(sib_key)
    wait_for(
        lambda: len(g.events(bad_key, "requeue")) >= 2,
        60,
        "two requeues of the unready task",
        lambda: (g.events(), lab.job(bad_key), lab.job(sib_key)),
    )
    after = lab.job(sib_key)
    assert after["Restarts"] == "0" and after["JobState"] == "RUNNING", after
    assert (after["JobId"], after["StartTime"]) == (before["JobId"], before["StartTime"])
    assert int(lab.job(bad_key)["Restarts"]) >= 2
    assert any(e["reason"] == "PodsReady" for e in g.events(sib_key, "note"))
    acted = [e for e in g.events(sib_key) if e["action"] != "note"]
    assert acted == [], acted
    # every command went to the unready task by its ArrayJobId_TaskId
    cmds = [e for e in g.events(bad_key) if e["action"] not in ("note", "strike")]
    assert cmds and {e.get("address") for e in cmds} == {bad_key}, cmds

    # Slurm's own requeue of the sibling (an operator's): recorded, not acted on
    lab.run("scontrol", "requeue", sib_key)
    wait_for(
        lambda: any(e["reason"] == "RequeuedBySlurm" for e in g.events(sib_key, "note")),
        15,
        "the governor notes Slurm's requeue of the sibling",
    )
    n = len(g.events(bad_key, "requeue"))
    wait_for(lambda: len(g.events(bad_key, "requeue")) > n, 40, "the next requeue of bad")
    assert lab.job(sib_key)["Restarts"] == "1", lab.job(sib_key)
    assert [e for e in g.events(sib_key) if e["action"] != "note"] == []


def test_array_task_with_the_arrays_id_marks_only_itself_ready(lab, gov):
    """The other way round: the task carrying the array's id signals ready (`nodeforge gang
    ready`, SLURM_JOB_ID = the array's id), the sibling never does. The mark lands on that
    task only (Comment by ArrayJobId_TaskId; JobId=<array id> marked every task, so the
    sibling looked ready and was never requeued), and the sibling is requeued alone."""
    g = gov(timeout=4, probe={"mode": "command"}).start()
    a, bad, good = _array_of_two_gangs(lab, "other")
    bad_key, good_key = f"{a}_{bad}", f"{a}_{good}"
    wait_for(
        lambda: g.events(bad_key, "requeue"),
        30,
        "the unready sibling requeued",
        lambda: (g.events(), lab.job(bad_key), lab.job(good_key)),
    )
    assert "nfg-ready=0" in lab.job(good_key).get("Comment", "")
    assert "nfg-ready" not in lab.job(bad_key).get("Comment", "")
    assert lab.job(good_key)["Restarts"] == "0" and lab.job(good_key)["JobState"] == "RUNNING"


def test_own_deadlines_judged_and_shown_to_the_owner(lab, gov):
    """Per-job deadlines (deadlines.field: comment, 2..8 s, default timeout 4 s), three jobs
    of an unprivileged owner that never become ready: one asks for 8 s (set), one for NaN
    (refused: governed with the default), one in its name only (refused: not the allowed
    field). The owner reads each verdict in `scontrol show job`; the deadlines Slurm's
    StartTime and the requeues show are 8, 4 and 4 s."""
    g = gov(
        timeout=4,
        probe={"mode": "command"},  # the jobs never run `gang ready`: never ready
        deadlines={"field": "comment", "min_seconds": 2, "max_seconds": 8},
        requeuing={"backoff_base_seconds": 30, "backoff_max_seconds": 30},
    ).start()

    def submit(node_pair: str, *extra: str) -> str:
        out = lab.as_user(
            "sbatch", "--parsable", "-N2", "-w", node_pair,
            f"--output={lab.base}/log/u-%j.out", *extra, "--wrap", "sleep 60",
        ).stdout.strip()  # fmt: skip
        assert out.isdigit(), out
        return out

    own = submit("gn1,gn2", "--comment=nfg-timeout=8s")
    nan = submit("gn3,gn4", "--comment=nfg-timeout=nan")
    wait_for(lambda: g.events(nan, "requeue"), 20, "the NaN job requeued at the default")
    named = submit("gn3,gn4", "--job-name=nfg-timeout=8s")
    for j in (own, named):
        wait_for(lambda j=j: g.events(j, "requeue"), 20, f"job {j} requeued")

    def shown(j: str) -> str:
        out = lab.as_user("scontrol", "show", "job", j).stdout
        return next((w for w in out.split() if w.startswith("AdminComment=")), "")

    assert "nfg-deadline:set,t=8,why=ok" in shown(own), shown(own)
    assert "nfg-deadline:refused,t=4,why=malformed" in shown(nan), shown(nan)
    assert "nfg-deadline:refused,t=4,why=field_not_allowed" in shown(named), shown(named)
    for j, secs in ((own, 8), (nan, 4), (named, 4)):
        (ev,) = g.events(j, "deadline")
        req = g.events(j, "requeue")[0]
        assert ev["timeout_seconds"] == secs, ev
        # requeued once the job had waited its own timeout (from admission), not another
        assert secs <= req["waited"] < secs + 2, req


def test_time_limit_deactivates_after_t_seconds(lab, gov):
    """backoff_limit_seconds: 5 and no count limit: requeued at its first timeout (3 s after
    the first admission), deactivated at the next one (>= 5 s after it)."""
    g = gov(
        timeout=3,
        probe={"mode": "command"},
        requeuing={"backoff_base_seconds": 1, "backoff_limit_seconds": 5},
    ).start()
    j = lab.sbatch("-N2", "-w", "gn3,gn4", script="#!/bin/sh\nsleep 60\n")
    wait_for(lambda: g.events(j, "requeuehold"), 40, "deactivation by time")
    (rq,) = g.events(j, "requeue")
    (rh,) = g.events(j, "requeuehold")
    assert "since first admission >= backoff_limit_seconds 5" in rh["detail"], rh
    assert rq["count"] == 1 and rh["count"] == 2
    wait_for(lambda: lab.job_json(j).get("state_reason") == "JobHeldAdmin", 15, "admin hold (JSON)")
    assert decode_admin(lab.job(j)["AdminComment"])["phase"] == "deactivated"
