"""The governor's planned read on Slurm >= 24.05 (gang/read_plan.py): a state listing of every
job, then in full only what the cycle needs. Checked against a FIXTURE squeue (a small
script below, run as a real child process like Slurm's clients): it prints the listing or
the full records of a job table the test edits, with squeue's --jobs filter (a job id
selects that job and, as in squeue, every task of the array of that id).

What a user would check: each planned snapshot has exactly the observations a full read
has (for every job that a decision reads), far fewer bytes are read with a queue of pending
jobs, a pending job's change that no decision reads is seen within STALE_SECONDS, and
hostile or broken output is an error (no decision on a partial view), never a guess."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.errors import NodeforgeError
from nodeforge.gang.slurm_view import SlurmCli, parse_jobs
from nodeforge.slurm_records import SlurmDataError, parse_job_states
from tests.unit.gang.gang_support import n24

pytestmark = pytest.mark.unit

# FIXTURE: squeue's two JSON forms over a job table (TABLE: a JSON list of 24.11 job dicts).
FAKE_SQUEUE = textwrap.dedent(
    """
    import json, sys
    table = json.load(open(sys.argv[1]))
    mode = sys.argv[2]
    GONE = {"777"}
    def num(v):
        return v["number"] if v.get("set", True) else None
    def tasks(spec):  # "2-9" / "1,3" (the fixture's forms)
        out = []
        for part in spec.split(","):
            a, _, b = part.partition("-")
            out += range(int(a), int(b or a) + 1)
        return out
    if mode == "state":  # 24.11's --only-job-state: squeue's job names, "state"
        jobs = []
        for j in table:
            arr, task, het = num(j["array_job_id"]), num(j["array_task_id"]), num(j["het_job_id"])
            if arr and task is None:
                keys = [f"{arr}_{t}" for t in tasks(j["array_task_string"])]
            elif arr:  # a task split out of the array's record: by its own id
                keys = [f"{j['job_id']}_{task}"]
            elif het:
                keys = [f"{j['job_id']}+{num(j['het_job_offset'])}"]
            else:
                keys = [str(j["job_id"])]
            jobs += [{"job_id": k, "state": j["job_state"]} for k in keys]
    elif mode == "one":  # scontrol show job --json N: that job (24.11: [] when unknown)
        jobs = [j for j in table if str(j["job_id"]) == sys.argv[-1]]
        if sys.argv[-1] in GONE:  # (the older client form of an unknown job)
            open(sys.argv[1] + ".log", "a").write(json.dumps([mode, []]) + "\\n")
            sys.stdout.write("slurm_load_jobs error: Invalid job id specified\\n")
            sys.exit(1)
    else:  # --jobs as squeue filters: N = that job, every task of array N, every het comp.
        want = None
        for a in sys.argv[3:]:
            if a.startswith("--jobs="):
                want = a[len("--jobs="):].split(",")
        jobs = []
        for j in table:
            arr, task, het = num(j["array_job_id"]), num(j["array_task_id"]), num(j["het_job_id"])
            if want is None or any(
                w == str(j["job_id"]) or w == str(arr) or w == str(het)
                or (arr and task is not None and w == f"{arr}_{task}")
                for w in want
            ):
                jobs.append(j)
    log = open(sys.argv[1] + ".log", "a")
    log.write(json.dumps([mode, [j["job_id"] for j in jobs]]) + "\\n")
    doc = {"jobs": jobs, "last_update": {"set": True, "infinite": False, "number": 5},
           "meta": {}, "errors": [], "warnings": []}
    sys.stdout.write(json.dumps(doc, indent=2).replace("/", "\\\\/"))
    """
)


def job(jid: int, state: str = "PENDING", **kw) -> dict:
    """A 24.11 job record (FIXTURE) with the members the reader reads."""
    d = {
        "job_id": jid,
        "name": kw.pop("name", f"j{jid}"),
        "comment": kw.pop("comment", ""),
        "job_state": [state] if isinstance(state, str) else state,
        "state_reason": kw.pop("reason", "Priority" if state == "PENDING" else "None"),
        "node_count": n24(kw.pop("nodes_n", 2)),
        "nodes": kw.pop("nodes", "" if state == "PENDING" else "gn[1-2]"),
        "partition": "batch",
        "priority": n24(kw.pop("priority", 7)),
        "restart_cnt": kw.pop("restarts", 0),
        "submit_time": n24(1796290183),
        "last_sched_evaluation": n24(kw.pop("sched", 1796290190)),
        "array_job_id": n24(kw.pop("array_job_id", 0)),
        "array_task_id": {"set": False, "infinite": False, "number": 0},
        "het_job_id": n24(kw.pop("het_job_id", 0)),
        "het_job_offset": n24(kw.pop("het_job_offset", 0)),
    }
    if "array_task_id" in kw:
        d["array_task_id"] = n24(kw.pop("array_task_id"))
    if "array_task_string" in kw:
        d["array_task_string"] = kw.pop("array_task_string")
    assert not kw, kw
    return d


class Lab:
    """A job table, a clock, and two readers of it: planned (the governor's) and full."""

    def __init__(self, tmp_path, jobs: list[dict], nodes: list[dict] | None = None):
        self.table = tmp_path / "table.json"
        self.jobs = jobs
        self.nodes = [] if nodes is None else nodes  # 24.11 node dicts (FIXTURE)
        self.now = 1000.0
        script = tmp_path / "squeue.py"
        script.write_text(FAKE_SQUEUE)
        self.node_table = nodes = tmp_path / "nodes.json"
        # (a staleness bound of 20 s: read_plan.STALE_SECONDS's 300 cycles would be slow here)
        self.cli = SlurmCli(timeout=10, clock=lambda: self.now, stale_seconds=20.0)
        fake = [sys.executable, str(script), str(self.table)]
        self.cli._commands = ([*fake, "full", "--states=all"], ["cat", str(nodes)])
        self.cli._state_argv = [*fake, "state"]
        self.cli._full_argv = [*fake, "full", "--states=all"]
        self.cli._one_argv = [*fake, "one"]
        self.write()

    def write(self) -> None:
        self.table.write_text(json.dumps(self.jobs))
        self.node_table.write_text(json.dumps({"nodes": self.nodes, "errors": []}, indent=2))

    def full(self):
        return parse_jobs(json.dumps({"jobs": self.jobs, "errors": []}))

    def planned(self, need=frozenset(), dt: float = 1.0, settled=frozenset()):
        """One planned snapshot and the ids its full reads returned (squeue's or one by
        one); *self.modes*: the full reads' forms ("full": squeue, "one": per id)."""
        self.now += dt
        self.write()
        log = self.table.with_name("table.json.log")
        log.unlink(missing_ok=True)
        snap = self.cli.snapshot(need=need, settled=settled)
        calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        self.modes = [mode for mode, _ in calls if mode != "state"]
        assert self.modes.count("full") <= 1  # (one squeue read at most)
        return snap, {i for mode, ids in calls if mode != "state" for i in ids}


def _same_decisions(cfg, full_st, snap_f, plan_st, snap_p, now, step):
    """One cycle decided on the full read and on the planned read: the same actions and the
    same phase for every job. Returns both new states and the actions."""
    from nodeforge.gang import policy

    full_st, acts_f = policy.decide(cfg, full_st, snap_f, now)
    plan_st, acts_p = policy.decide(cfg, plan_st, snap_p, now)
    assert acts_p == acts_f, step
    assert {k: r.phase for k, r in plan_st.jobs.items()} == {
        k: r.phase for k, r in full_st.jobs.items()
    }, step
    return full_st, plan_st, acts_f


def test_planned_snapshot_equals_a_full_read_and_reads_only_what_changed(tmp_path):
    jobs = [job(i) for i in range(1, 201)] + [job(500, "RUNNING")]
    lab = Lab(tmp_path, jobs)
    snap, read = lab.planned()
    assert snap.jobs == lab.full() and len(read) == 201  # the first cycle reads every job
    for _ in range(3):  # steady: the running job, by its id, or with a refresh batch
        snap, read = lab.planned()  # (every 2 s here: the share of 2 s of 20 s)
        assert snap.jobs == lab.full()
        assert (read == {500} and lab.modes == ["one"]) or (500 in read and len(read) == 1 + 20)
    # a pending job starts, one is cancelled, one is new, one leaves the queue
    jobs[0].update(job(1, "RUNNING"))
    jobs[1]["job_state"] = ["CANCELLED"]
    jobs.append(job(900))
    del jobs[5]
    snap, read = lab.planned()
    assert snap.jobs == lab.full()
    assert {1, 2, 900, 500} <= read and 6 not in read
    assert [j.job_id for j in snap.jobs] == [str(j["job_id"]) for j in jobs]  # slurmctld's order


def test_needed_gangs_are_read_every_cycle_and_their_hold_release_seen_at_once(tmp_path):
    jobs = [job(i) for i in range(1, 101)]
    jobs[9].update(priority=0, reason="JobHeldAdmin")  # a deactivated gang under our hold
    lab = Lab(tmp_path, jobs)
    lab.planned()
    lab.planned(need={"10"})
    jobs[9].update(priority=n24(7), state_reason="Priority")  # an operator releases it
    snap, read = lab.planned(need={"10"})
    got = next(j for j in snap.jobs if j.job_id == "10")
    assert 10 in read and not got.held and got.priority == 7


def test_a_change_no_decision_reads_is_seen_within_the_staleness_bound(tmp_path):
    jobs = [job(i) for i in range(1, 301)]
    lab = Lab(tmp_path, jobs)
    lab.planned()
    jobs[150]["comment"] = "gang"  # an owner's scontrol update of a pending job
    stale = lab.cli.stale_seconds
    seen_after = None
    for k in range(1, int(stale) + 3):
        snap, _ = lab.planned()
        if next(j for j in snap.jobs if j.job_id == "151").comment == "gang":
            seen_after = k
            break
    assert seen_after is not None and seen_after <= stale + 1
    assert seen_after > 1  # (not read in full every cycle: the point of the plan)


def test_array_and_het_records_stay_exact(tmp_path):
    jobs = [
        job(20, array_job_id=20, array_task_string="2-9"),  # the array's pending tasks
        job(21, "RUNNING", array_job_id=20, array_task_id=0),
        job(22, "RUNNING", array_job_id=20, array_task_id=1),
        job(30, het_job_id=30, het_job_offset=0),
        job(31, het_job_id=30, het_job_offset=1),
    ] + [job(i) for i in range(100, 140)]
    lab = Lab(tmp_path, jobs)
    lab.planned()
    pending_record_reads = 0
    for _ in range(4):  # running tasks every cycle; the record of pending tasks: refresh only
        snap, read = lab.planned()
        assert snap.jobs == lab.full() and {21, 22} <= read
        pending_record_reads += 20 in read
    assert pending_record_reads <= 1
    assert {j.address for j in snap.jobs if j.job_id.startswith("20")} == {
        "20_[2-9]",
        "20_0",
        "20_1",
    }
    # a task starts: the array's record of pending tasks loses it without a state change
    jobs[0]["array_task_string"] = "3-9"
    jobs.append(job(23, "RUNNING", array_job_id=20, array_task_id=2))
    snap, _ = lab.planned()
    assert snap.jobs == lab.full()
    assert next(j for j in snap.jobs if j.job_id == "20").address == "20_[3-9]"
    # one het component changes: the whole het job is read (one gang, one merged record)
    jobs[4]["job_state"] = ["RUNNING"]
    snap, read = lab.planned()
    assert {30, 31} <= read and snap.jobs == lab.full()


def test_a_job_that_writes_another_state_into_its_text_is_what_slurm_says(tmp_path):
    forged = '"job_state": ["RUNNING"], "job_id": 7}, {"job_id": 8, "job_state": ["RUNNING"]'
    jobs = [job(1, name=forged, comment="\n    }\n  ]\n}"), job(2)]
    lab = Lab(tmp_path, jobs)
    for _ in range(3):
        snap, _ = lab.planned()
        assert [(j.job_id, j.state) for j in snap.jobs] == [("1", "PENDING"), ("2", "PENDING")]
        assert snap.jobs[0].name == forged


def test_listing_and_full_record_disagree_the_full_record_wins(tmp_path):
    """The job moved between the two calls: the listing said PENDING, the full read (later)
    RUNNING. Next cycle the listing agrees."""
    jobs = [job(1), job(2)]
    lab = Lab(tmp_path, jobs)
    lab.planned()
    jobs[0].update(job(1, "RUNNING"))
    snap, _ = lab.planned()
    assert snap.jobs == lab.full() and snap.jobs[0].state == "RUNNING"


def _listing(items) -> str:
    return json.dumps({"jobs": items, "errors": []}, indent=2)


def _st(key="1", state=("PENDING",)) -> dict:
    return {"job_id": key, "state": list(state)}


@pytest.mark.parametrize(
    "text, match",
    [
        (_listing([_st()])[:-7], "not JSON"),  # truncated
        (_listing([_st(), _st()]), "listed twice"),
        (_listing([_st(state=["RUNNING\nJobState=X"])]), "state"),
        (_listing([{"job_id": 1, "state": ["PENDING"]}]), "job_id"),  # not squeue's name
        (_listing([_st("1_2_3")]), "job_id"),
        (_listing([_st("0")]), "job_id"),
        (_listing([_st("1 ")]), "job_id"),
        (_listing([_st(state=[])]), "state"),
        (_listing([{"job_id": "1", "job_state": ["PENDING"]}]), "state"),
        ('{"jobs": [], "errors": [{"error": "down"}]}', "reported errors"),
    ],
)
def test_hostile_or_broken_listing_is_an_error(text, match):
    with pytest.raises(SlurmDataError, match=match):
        parse_job_states(text, "squeue --json --only-job-state")


def test_a_truncated_listing_fails_the_read_and_the_next_cycle_reads_again(tmp_path):
    jobs = [job(i) for i in range(1, 50)]
    lab = Lab(tmp_path, jobs)
    lab.planned()
    good = lab.cli._state_argv
    cut = tmp_path / "cut.json"
    cut.write_text(_listing([_st()])[:40])
    lab.cli._state_argv = ["cat", str(cut)]
    with pytest.raises(NodeforgeError, match="truncated"):
        lab.planned()
    lab.cli._state_argv = good
    snap, _ = lab.planned()
    assert snap.jobs == lab.full()


def test_listing_cache_returns_the_same_object_for_unchanged_text():
    from nodeforge.slurm_records import BlockCache

    items = [_st(str(i)) for i in range(1, 5)]
    cache = BlockCache()
    a = parse_job_states(_listing(items), "s", cache)
    items[2]["state"] = ["RUNNING"]
    b = parse_job_states(_listing(items), "s", cache)
    assert a[0] is b[0] and a[3] is b[3] and b[2].base_state == "RUNNING"
    assert b == parse_job_states(_listing(items), "s")  # the same as without a cache


def _apply(jobs: list[dict], actions) -> None:
    """FIXTURE Slurm's reaction to the governor's commands, on the job table."""
    by_id = {str(j["job_id"]): j for j in jobs}
    for a in actions:
        j = by_id.get(a.job_id)
        if j is None:
            continue
        if a.kind in ("requeue", "requeuehold"):
            j.update(job_state=["PENDING"], nodes="", state_reason="BeginTime")
            j["restart_cnt"] += 1
        if a.kind in ("requeuehold", "hold"):
            j.update(priority=n24(0), state_reason="JobHeldAdmin")
        if a.kind == "release":
            j.update(priority=n24(7), state_reason="Priority")


@pytest.mark.parametrize("block_admission", [False, True])
def test_decisions_on_the_planned_read_are_those_on_a_full_read(tmp_path, block_admission):
    """Two governors' decisions (policy.decide) over one scripted queue, cycle by cycle: one
    reads every job in full, the other through the plan with what policy.full_reads names.
    Timeouts, requeues, backoff, a deactivation and its operator release, Slurm's own
    requeue, block_admission's holds and releases: the same actions in every cycle."""
    from nodeforge.gang import config as gcfg
    from nodeforge.gang import policy
    from nodeforge.gang.slurm_view import Snapshot
    from nodeforge.gang.state import GovState

    cfg = gcfg.from_dict(
        {
            "timeout": 3,
            "recovery_timeout": 0,
            "block_admission": block_admission,
            "requeuing": {"backoff_base_seconds": 2, "backoff_max_seconds": 2, "jitter": 0,
                          "backoff_limit_count": 1},
        },
        "test",
    )  # fmt: skip
    jobs = [job(i) for i in range(1, 31)] + [job(31, nodes_n=1)]
    lab = Lab(tmp_path, jobs)
    full_st, plan_st = GovState(), GovState()
    script = {
        2: lambda: [jobs[k].update(job(k + 1, "RUNNING")) for k in (0, 1, 2)],
        4: lambda: jobs[19].update(comment="an owner's edit"),
        9: lambda: jobs[0].update(job(1, "RUNNING", restarts=jobs[0]["restart_cnt"])),
        11: lambda: jobs[2].update(job(3, "RUNNING", restarts=jobs[2]["restart_cnt"])),
        12: lambda: jobs[2].update(job(3, "PENDING", restarts=jobs[2]["restart_cnt"] + 1)),
        16: lambda: jobs[0].update(priority=n24(7), state_reason="Priority"),  # an operator
        18: lambda: jobs.append(job(40, "RUNNING")),
    }
    kinds: set[str] = set()
    for step in range(24):
        if step in script:
            script[step]()
        lab.write()
        snap_p, _ = lab.planned(need=policy.full_reads(cfg, plan_st))
        snap_f = Snapshot(jobs=lab.full(), nodes={}, taken_at=lab.now)
        snap_p = Snapshot(jobs=snap_p.jobs, nodes={}, taken_at=lab.now)
        full_st, plan_st, acts_f = _same_decisions(
            cfg, full_st, snap_f, plan_st, snap_p, lab.now, step
        )
        kinds |= {a.kind for a in acts_f}
        _apply(jobs, acts_f)
    # the scenario reached what it is about (a test that cannot fail proves nothing)
    assert {"requeue", "requeuehold"} <= kinds
    if block_admission:
        assert {"hold", "release"} <= kinds


def test_a_requeue_by_slurm_between_two_cycles_is_noted_within_the_staleness_bound(tmp_path):
    """The documented difference (read_plan.py): a pending job that ran and was requeued by
    Slurm between two cycles (a fast prolog failure) keeps its listed state, PENDING; the
    full read notes RequeuedBySlurm at once, the planned one at the refresh (or at the next
    start). No other decision differs."""
    from nodeforge.gang import config as gcfg
    from nodeforge.gang import policy
    from nodeforge.gang.slurm_view import Snapshot
    from nodeforge.gang.state import GovState

    cfg = gcfg.from_dict({"timeout": 3}, "test")
    jobs = [job(i) for i in range(1, 41)]
    lab = Lab(tmp_path, jobs)
    st = GovState()
    noted_at = None
    for step in range(int(lab.cli.stale_seconds) + 3):
        if step == 2:
            jobs[7]["restart_cnt"] = 1  # ran and was requeued, unseen
        snap, _ = lab.planned(need=policy.full_reads(cfg, st))
        st, acts = policy.decide(cfg, st, Snapshot(jobs=snap.jobs, taken_at=lab.now), lab.now)
        assert all(a.kind == "note" for a in acts)
        if any(a.reason == "RequeuedBySlurm" and a.job_id == "8" for a in acts):
            noted_at = step
            break
    assert noted_at is not None and 2 <= noted_at <= 2 + lab.cli.stale_seconds + 1


def test_a_slow_cycle_asks_for_no_larger_refresh_than_refresh_max():
    """A cycle that took long (elapsed >> interval) must not turn the refresh into a read of
    every job (the next cycle would be slower still: seen live at 50k queued)."""
    from nodeforge.gang import read_plan as rp
    from nodeforge.slurm_records import JobRecord, JobState

    n = 3 * rp.REFRESH_MAX
    known = rp.Known()
    for i in range(1, n + 1):
        known.store(JobRecord(i, "PENDING", "PENDING", frozenset(), "Priority", 2, ()), now=0.0)
    listing = [JobState(str(i), "PENDING", frozenset(), i) for i in range(1, n + 1)]
    p = rp.plan(listing, frozenset(), known, now=10_000.0, elapsed=10_000.0, stale=300.0)
    assert p.requests is not None and len(p.requests) == rp.REFRESH_MAX
    # the oldest first: what was read at 0 before what was read later
    assert p.requests == {str(i) for i in range(1, rp.REFRESH_MAX + 1)}


def node(name: str, *state: str) -> dict:
    """A 24.11 node record (FIXTURE)."""
    return {"name": name, "state": list(state or ["ALLOCATED"]), "reason": ""}


def _apply_running(jobs: list[dict], actions) -> None:
    """FIXTURE Slurm's reaction to the governor's commands, running jobs included."""
    _apply(jobs, actions)
    for a in actions:
        for j in jobs:
            if str(j["job_id"]) == a.job_id and a.kind in ("requeue", "requeuehold"):
                j["node_count"] = n24(2)


@pytest.mark.parametrize("block_admission", [False, True])
def test_ready_running_gangs_kept_from_their_last_read_decide_as_a_full_read(
    tmp_path, block_admission
):
    """Running gangs found ready are kept from their last full record (policy.settled_reads)
    while their listed state is the same and their nodes are up and allocated. Over one
    scripted queue, cycle by cycle, against a governor that reads every job in full: an
    owner's and an operator's edits of ready jobs, a --no-kill node failure (the job shrinks)
    evicted after recovery_timeout, a node that stops responding and comes back, Slurm's own
    requeue of a ready job, an operator's shrink, a het job: the same actions and phases in
    every cycle, and the ready jobs are not read in full on quiet cycles."""
    from nodeforge.gang import config as gcfg
    from nodeforge.gang import policy
    from nodeforge.gang.slurm_view import Snapshot
    from nodeforge.gang.state import GovState

    cfg = gcfg.from_dict(
        {
            "timeout": 3,
            "recovery_timeout": 3,
            "block_admission": block_admission,
            "requeuing": {"backoff_base_seconds": 2, "backoff_max_seconds": 2, "jitter": 0},
        },
        "test",
    )
    jobs = [job(i) for i in range(1, 31)]
    jobs += [job(i, nodes_n=1) for i in range(100, 180)]  # (not gangs: the plan's share)
    jobs += [job(40 + k, "RUNNING", nodes=f"gn[{2 * k + 1}-{2 * k + 2}]") for k in range(5)]
    jobs += [
        job(60, "RUNNING", het_job_id=60, het_job_offset=0, nodes_n=1, nodes="gn11"),
        job(61, "RUNNING", het_job_id=60, het_job_offset=1, nodes_n=1, nodes="gn12"),
    ]
    nodes = [node(f"gn{i}") for i in range(1, 13)]
    lab = Lab(tmp_path, jobs, nodes)
    by_id = {j["job_id"]: j for j in jobs}
    ready_ids = {40, 41, 42, 43, 44}

    def shrink(jid: int, keep: str) -> None:
        by_id[jid].update(nodes=keep, node_count=n24(1))

    script = {
        # an owner's edit (Comment) and an operator's (Priority) of ready jobs
        4: lambda: (by_id[40].update(comment="epoch 3"), by_id[41].update(priority=n24(99))),
        # --no-kill: gn3 fails, Slurm takes it out of job 41 in the same step
        6: lambda: (nodes[2].update(state=["DOWN"]), shrink(41, "gn4")),
        # gn5 stops responding (job 42 keeps it) and comes back
        7: lambda: nodes[4].update(state=["ALLOCATED", "NOT_RESPONDING"]),
        8: lambda: nodes[4].update(state=["ALLOCATED"]),
        # Slurm requeues ready job 43 on its own
        12: lambda: by_id[43].update(
            job_state=["PENDING"], nodes="", state_reason="BeginTime", restart_cnt=1
        ),
        # an operator shrinks ready job 44; the freed node is idle
        14: lambda: (shrink(44, "gn9"), nodes[9].update(state=["IDLE"])),
        # the het job's second component finishes
        17: lambda: by_id[61].update(job_state=["COMPLETED"]),
    }
    full_st, plan_st = GovState(), GovState()
    notes: set[str] = set()
    seen: set[tuple[str, str]] = set()
    kinds: set[str] = set()
    quiet_reads: list[int] = []
    for step in range(24):
        if step in script:
            script[step]()
        snap_p, read = lab.planned(
            need=policy.full_reads(cfg, plan_st), settled=policy.settled_reads(plan_st)
        )
        snap_f = Snapshot(jobs=lab.full(), nodes=snap_p.nodes, taken_at=lab.now)
        full_st, plan_st, acts_f = _same_decisions(
            cfg, full_st, snap_f, plan_st, snap_p, lab.now, step
        )
        if step in (3, 5, 10, 11):  # quiet for the ready jobs (found ready at step 0)
            quiet_reads.append(len(read & ready_ids))
        kinds |= {a.kind for a in acts_f}
        notes |= {a.reason for a in acts_f}
        seen |= {(a.reason, a.job_id) for a in acts_f}
        _apply_running(jobs, acts_f)
    # the scenario reached what it is about (a test that cannot fail proves nothing)
    assert {"PodsReady", "ReadinessLost", "Recovered", "RequeuedBySlurm"} <= notes
    assert "requeue" in kinds and policy.REASON_RECOVERY in notes
    assert {("ReadinessLost", "41"), ("ReadinessLost", "44"), ("Recovered", "42")} <= seen
    assert ("RequeuedBySlurm", "43") in seen and (policy.REASON_RECOVERY, "41") in seen
    assert quiet_reads and max(quiet_reads) <= 1  # (at most the refresh's share)


def test_a_settled_job_is_read_when_a_node_of_it_is_not_up_or_not_allocated():
    from nodeforge.gang import read_plan as rp
    from nodeforge.gang import readiness
    from nodeforge.slurm_records import JobRecord, JobState

    assert readiness.READ_FLAGS <= rp.UNSETTLED_FLAGS  # (spelled out in read_plan)
    run = JobRecord(7, "RUNNING", "RUNNING", frozenset(), "None", 2, ("a1", "a2"))
    listing = [JobState("7", "RUNNING", frozenset(), 7)] + [
        JobState(str(i), "PENDING", frozenset(), i) for i in range(100, 110)
    ]

    def reads(nodes, settled=frozenset({"7"}), state=run) -> bool:
        known = rp.Known()
        for i in range(100, 110):
            known.store(JobRecord(i, "PENDING", "PENDING", frozenset(), "Priority", 2, ()), 0.0)
        known.store(state, now=0.5)  # (the newest: not the refresh's)
        p = rp.plan(listing, frozenset(), known, 1.0, 1.0, 300.0, settled, nodes)
        assert p.requests is not None
        return "7" in p.requests

    up = {"a1": frozenset({"ALLOCATED"}), "a2": frozenset({"MIXED", "DRAIN"})}
    assert not reads(up)  # ready, nodes up and held (a drain is no loss of readiness)
    assert reads(up, settled=frozenset())  # not found ready: read every cycle
    assert reads({"a1": up["a1"]})  # a node slurmctld no longer lists
    for bad in [*readiness.READ_FLAGS, "IDLE"]:
        assert reads(
            {**up, "a2": frozenset({"MIXED", bad})}
            if bad != "IDLE"
            else {**up, "a2": frozenset({"IDLE"})}
        ), bad
    done = JobRecord(7, "COMPLETING", "RUNNING", frozenset({"COMPLETING"}), "None", 2, ("a1",))
    assert reads(up, state=done)  # the listing shows another state than the record


def test_a_quiet_queue_is_refreshed_in_batches_within_the_staleness_bound(tmp_path):
    """squeue filters --jobs in the client: a full read costs about the same for a few ids
    as for hundreds, so a quiet cycle makes none; the refresh comes in batches (here every
    stale/10 s) and still no kept record is older than the bound."""
    jobs = [job(i) for i in range(1, 301)]
    lab = Lab(tmp_path, jobs)
    lab.planned()  # every job in full
    stale = lab.cli.stale_seconds
    last = dict.fromkeys(range(1, 301), lab.now)
    no_read = 0
    cycles = int(3 * stale)
    for _ in range(cycles):
        snap, read = lab.planned()
        assert snap.jobs == lab.full()
        no_read += not read
        for jid in read:
            last[jid] = lab.now
        assert lab.now - min(last.values()) <= stale, lab.now
    assert no_read >= cycles // 3  # (every 2 s here: about every other cycle reads nothing)


def test_the_plans_need_check_by_listed_name_is_the_records_own():
    """plan() checks *need* by the listing's name of a job (read_plan._needed_listed, inline)
    instead of building each record's key: the same answer for plain jobs, array tasks (the
    task that carries the array's own id, and one split out under its own id) and het
    components; for a key that names no job of the queue (`23_3`, job 23 being task 3 of
    array 20) at most an extra read."""
    from nodeforge.gang import read_plan as rp
    from nodeforge.slurm_records import JobRecord

    def rec(jid, **kw):
        return JobRecord(jid, "PENDING", "PENDING", frozenset(), "Priority", 2, (), **kw)

    records = [
        rec(5),
        rec(20, array_job_id=20, array_task_id=0),  # the task with the array's own id
        rec(23, array_job_id=20, array_task_id=3),  # split out as job 23
        rec(30, het_job_id=30, het_job_offset=0),
        rec(31, het_job_id=30, het_job_offset=1),
    ]
    keys = ["5", "20", "23", "30", "31", "20_0", "20_3", "23_3", "30+1", "99"]
    for r in records:
        k = rp.listing_key(r)
        job, _, rest = k.partition("_")
        jid, _, off = job.partition("+")
        s = rp.JobState(
            k,
            "PENDING",
            frozenset(),
            r.array_job_id if rest else int(jid),
            int(rest) if rest else None,
            int(off) if off else None,
        )
        for n in range(len(keys)):
            need = frozenset(keys[n : n + 3])
            fast, full = rp._needed_listed(s, r, need), rp._needed(r, need)
            # never a missed read; an extra one only for `J_T` naming no job of this queue
            assert fast >= full and (fast == full or (k == "23_3" and "23_3" in need))


# ---- a few plain ids: one `scontrol show job --json ID` each (read_plan.few_ids) -----------


def test_a_few_new_or_changed_plain_jobs_are_read_one_by_one_without_a_refresh(tmp_path):
    """squeue loads every job in the client (~210 ms at 50k queued for 2 ids); slurmctld's
    single-job read costs ~7 ms: a cycle that needs a few plain jobs reads each by its id
    and takes no refresh batch along (that would make it a squeue read again)."""
    from nodeforge.gang import read_plan as rp

    jobs = [job(i) for i in range(1, 301)] + [job(500, "RUNNING")]
    lab = Lab(tmp_path, jobs)
    lab.cli.stale_seconds = 300.0  # (a refresh every 3 s: none due in the cycles below)
    lab.planned()
    few = rp.few_ids(len(jobs) + 30)  # (the most this test lists before its last cycle)
    assert few == rp.FEW_IDS_MIN
    for k in range(1, few):  # k new jobs (and the running one) each cycle
        new = [job(1000 + 10 * k + i) for i in range(k)]
        jobs.extend(new)
        snap, read = lab.planned(dt=0.5)
        assert snap.jobs == lab.full()
        assert read == {500} | {j["job_id"] for j in new}
        assert lab.modes == ["one"] * (k + 1)
    jobs.extend(job(2000 + i) for i in range(few))  # more than few_ids(): squeue
    snap, read = lab.planned(dt=0.5)  # (a squeue read takes a refresh batch along)
    assert snap.jobs == lab.full() and lab.modes == ["full"]
    assert read >= {500} | set(range(2000, 2000 + few))


def test_how_many_ids_are_read_one_by_one_grows_with_the_queue():
    """squeue's --jobs read loads every job in the client, so its cost grows with the queue
    while a single-job read does not: the break-even measured live on 24.11.5 is ~7 ids at
    10k queued and ~25 at 50k (bench/README-gang.md, `calls`)."""
    from nodeforge.gang import read_plan as rp

    sizes = [0, 1, 999, 8_000, 10_000, 20_000, 50_000, 10**6]
    few = [rp.few_ids(n) for n in sizes]
    assert few == sorted(few) and few[0] == rp.FEW_IDS_MIN and few[-1] == rp.FEW_IDS_MAX
    assert rp.few_ids(10_000) in range(4, 8) and rp.few_ids(50_000) in range(20, 26)


def test_every_job_is_read_by_the_jobs_command_and_a_filter_by_squeue(tmp_path):
    """A read of every job (the first cycle, more than FULL_SHARE asked for) is this Slurm's
    jobs command, `scontrol show job --json` on 24.11, as the full path's (16.9 s at 50k
    queued, squeue's --json 17.5-18.1 s for the same 380 MB, measured live,
    bench/README-gang.md); a read of some jobs stays squeue's --jobs filter (scontrol takes
    one id)."""
    jobs = [job(i) for i in range(1, 301)] + [job(500, "RUNNING")]
    lab = Lab(tmp_path, jobs)
    lab.cli._commands = ([*lab.cli._commands[0][:3], "all"], lab.cli._commands[1])
    lab.cli.stale_seconds = 300.0
    snap, read = lab.planned()  # the first cycle: every job
    assert lab.modes == ["all"] and read == {j["job_id"] for j in jobs}
    jobs.extend(job(2000 + i) for i in range(10))  # more than a few: squeue's filter
    snap, read = lab.planned(dt=0.5)
    assert lab.modes == ["full"] and set(range(2000, 2010)) | {500} <= read
    assert snap.jobs == lab.full()
    for j in jobs[:200]:  # most jobs start: more than FULL_SHARE to read, so every job
        j["job_state"] = ["RUNNING"]
    snap, read = lab.planned(dt=0.5)
    assert lab.modes == ["all"] and snap.jobs == lab.full()


@pytest.mark.parametrize("gone_id", [901, 777], ids=["empty-list", "invalid-job-id-exit"])
def test_a_job_read_by_id_that_left_since_the_listing_is_dropped(tmp_path, gone_id):
    """The job leaves between the listing and its read: 24.11's scontrol prints an empty
    list (the older form: "Invalid job id specified", exit 1). Its kept record is dropped
    and the cycle does not fall back to reading every job (16-20 s at 50k queued)."""
    jobs = [job(i) for i in range(1, 101)] + [job(gone_id)]
    lab = Lab(tmp_path, jobs)
    lab.planned()
    script = tmp_path / "squeue.py"
    # the listing still shows it RUNNING (it started), the full read no longer has it
    script.write_text(
        FAKE_SQUEUE.replace(
            "mode = sys.argv[2]\n",
            f'mode = sys.argv[2]\nif mode == "state": table[-1]["job_state"] = ["RUNNING"]\n'
            f'else: table = [j for j in table if j["job_id"] != {gone_id}]\n',
        )
    )
    snap, read = lab.planned()
    assert lab.modes == ["one"] and gone_id not in read
    assert str(gone_id) not in {j.job_id for j in snap.jobs}
    assert snap.jobs == lab.full()[:-1]
    assert gone_id not in lab.cli._known.records


def test_a_failed_read_by_id_is_an_error_not_a_guess(tmp_path):
    """Any other failure of a one-job read (slurmctld away) fails the cycle's read, naming
    the command: no decision on a partial view."""
    jobs = [job(i) for i in range(1, 101)]
    lab = Lab(tmp_path, jobs)
    lab.planned()
    jobs.append(job(900))
    lab.cli._one_argv = ["sh", "-c", 'echo "slurm_load_jobs error: Unable to contact'
                         ' slurm controller (connect failure)"; exit 1', "scontrol"]  # fmt: skip
    with pytest.raises(NodeforgeError, match="exit 1.*connect failure"):
        lab.planned()


def _rec(jid: int, kind: str, state: str = "PENDING"):
    from nodeforge.slurm_records import JobRecord

    kw: dict = {
        "plain": {},
        "task": {"array_job_id": jid - 1, "array_task_id": 3},  # split out as its own job
        "meta": {"array_job_id": jid, "array_tasks": "1-2"},  # an array's pending tasks
        "het": {"het_job_id": jid, "het_job_offset": 0},
    }[kind]
    return JobRecord(jid, state, state, frozenset(), "Priority", 2, (), **kw)


@settings(max_examples=200, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["plain", "task", "meta", "het"]), min_size=1, max_size=24),
    started=st.sets(st.integers(0, 23)),
    new=st.lists(st.sampled_from(["plain", "task", "het"]), max_size=12),
    queue=st.sampled_from([100, 20_000]),
)
def test_the_plan_reads_by_id_exactly_the_few_plain_batches(kinds, started, new, queue):
    """Over any batch: the plan reads one by one only when every job it names is a plain
    job (no array task or record, no het component: those keep squeue's --jobs form, which
    names the array or the het job) and there are at most few_ids() of the listing's size;
    squeue otherwise."""
    from nodeforge.gang import read_plan as rp
    from nodeforge.slurm_records import JobState

    known = rp.Known()
    listing: list[JobState] = []
    plain_ids: set[str] = set()
    for i, kind in enumerate(kinds):
        jid = 10 * (i + 1)
        r = known.store(_rec(jid, kind), now=0.0)
        state = "RUNNING" if i in started else "PENDING"
        if kind == "meta":  # listed as its tasks: a started task names the array
            listing += [JobState(f"{jid}_{t}", state, frozenset(), jid, t) for t in (1, 2)]
            continue
        k = rp.listing_key(r)
        task = r.array_task_id
        het = r.het_job_offset
        listing.append(JobState(k, state, frozenset(), jid, task, het))
        if kind == "plain":
            plain_ids.add(str(jid))
    for i, kind in enumerate(new):  # jobs without a full record yet
        jid = 1000 + 10 * i
        task = 5 if kind == "task" else None
        het = 0 if kind == "het" else None
        key = f"{jid}_5" if task is not None else f"{jid}+0" if het is not None else str(jid)
        listing.append(JobState(key, "PENDING", frozenset(), jid, task, het))
        if kind == "plain":
            plain_ids.add(str(jid))
    listing += [JobState(str(i), "PENDING", frozenset(), i) for i in range(5000, 5000 + queue)]
    p = rp.plan(listing, frozenset(), known, now=1.0, elapsed=1.0, stale=300.0)
    if p.requests is None:
        assert not p.by_id
        return
    few = rp.few_ids(len(listing))
    assert p.by_id == (0 < len(p.requests) <= few and p.requests <= plain_ids)


# ---- plan()'s memo (read_plan._Base): kept between cycles, updated by the changed records --


def _memo_record(jid: int, kind: str, state: str, flag: bool):
    from nodeforge.slurm_records import JobRecord

    flags = frozenset({"REQUEUED"}) if flag else frozenset()
    nodes = ("n1", "n2") if state == "RUNNING" else ()
    kw: dict = {}
    if kind == "task":  # split out of array 100 as job *jid*
        kw = {"array_job_id": 100, "array_task_id": jid % 4}
    elif kind == "meta":  # array 100's record of its pending tasks
        jid, kw = 100, {"array_job_id": 100, "array_tasks": "1-2"}
    elif kind == "het":
        kw = {"het_job_id": 40, "het_job_offset": jid % 3}
    return JobRecord(jid, state, state, flags, "Priority", 2, nodes, **kw)


def _memo_state(key: str, state: str, flag: bool):
    import re

    from nodeforge.gang import read_plan as rp

    m = re.fullmatch(r"(\d+)(?:_(\d+)|\+(\d+))?", key)
    assert m is not None
    job, task, off = m.groups()
    flags = frozenset({"REQUEUED"}) if flag else frozenset()
    return rp.JobState(
        key, state, flags, int(job), None if task is None else int(task), off and int(off)
    )


MEMO_OP = st.tuples(
    st.sampled_from(["store", "store", "drop", "listing", "need", "same", "settle"]),
    st.integers(1, 12),  # a job id
    st.sampled_from(["plain", "plain", "task", "meta", "het"]),
    st.sampled_from(["PENDING", "PENDING", "RUNNING"]),
    st.booleans(),  # a state flag
    st.lists(st.integers(0, 30), max_size=12),  # which keys a listing / need holds
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(MEMO_OP, min_size=1, max_size=25))
def test_the_plans_memo_plans_as_a_fresh_classification_over_random_cycles(ops):
    """Records stored, changed and dropped, listings kept (the same object) or new (with the
    reader's delta: the entries it added and dropped), needs and settled jobs moving: plan()
    through its memo plans exactly what it plans with none (every entry classified anew), so
    a changed record or listing entry is never planned by its old classification and no key
    takes another's."""
    from nodeforge.gang import read_plan as rp

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rp, "FULL_SHARE", 1e9)  # (else most small plans read all: nothing to compare)
        _memo_cycles(ops)


def _memo_cycles(ops) -> None:
    from nodeforge.gang import read_plan as rp

    known = rp.Known()
    listing: list = []
    need: frozenset[str] = frozenset()
    settled: frozenset[str] = frozenset()
    nodes = {"n1": frozenset({"ALLOCATED"}), "n2": frozenset({"MIXED"})}
    pool = [str(i) for i in range(1, 13)] + ["100_1", "100_2", "5_1", "40+1", "7+2", "100"]
    now = 1000.0
    delta = None  # the reader's, for the last listing (stale after: plan() must see that)
    for op, jid, kind, state, flag, picks in ops:
        now += 1.0
        if op == "store":
            known.store(_memo_record(jid, kind, state, flag), now)
        elif op == "drop":
            known.drop(100 if kind == "meta" else jid)
        elif op == "listing":
            keys = {rp.listing_key(r) for r in known.records.values() if not rp._is_meta(r)}
            keys |= {pool[p % len(pool)] for p in picks}
            tasks = {"100_1", "100_2"} if kind == "meta" else set()  # (array 100's pending)
            made = [
                _memo_state(k, state if p % 2 else "PENDING", flag and p % 3 == 0)
                for p, k in enumerate(sorted(keys - tasks))
            ] + [_memo_state(k, "PENDING", flag and jid % 2 == 0) for k in sorted(tasks)]
            # as the reader hands it out: an unchanged entry is last listing's object, and
            # its delta names the entries added and dropped (every other kept in order)
            last = {s.key: s for s in listing}
            new = [last[s.key] if last.get(s.key) == s else s for s in made]
            kept = {id(s) for s in new} & {id(s) for s in listing}
            delta = (
                listing,
                new,
                [s for s in new if id(s) not in kept],
                [s for s in listing if id(s) not in kept],
            )
            listing = new
        elif op == "need":
            need = frozenset(pool[p % len(pool)] for p in picks) | ({"100_1"} if flag else set())
        elif op == "settle":
            settled = frozenset(r.key for r in known.records.values() if r.base_state == "RUNNING")
            nodes = {**nodes, "n2": frozenset({"DOWN"} if flag else {"MIXED"})}
        was, touched = known.memo, known.touched
        memo = rp.plan(listing, need, known, now, 5.0, 300.0, settled, nodes, delta)
        if (
            op == "listing"
            and known.records
            and was is not None
            and touched is not None
            and was.need == need
        ):
            assert known.memo is was  # a new listing moved the memo on, not made it anew
        kept = known.memo, known.touched
        known.memo = known.touched = None
        fresh = rp.plan(listing, need, known, now, 5.0, 300.0, settled, nodes)
        known.memo, known.touched = kept
        assert memo == fresh
