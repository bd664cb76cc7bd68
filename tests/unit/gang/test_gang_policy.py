"""gang.policy: the pure decision function, exact timings."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from nodeforge.gang.events import decode_admin, encode_admin
from nodeforge.gang.policy import backoff_delay, decide, is_gang
from nodeforge.gang.slurm_view import JobObs, Snapshot
from nodeforge.gang.state import GovState
from tests.unit.gang.gang_support import gang_cfg as cfg

pytestmark = pytest.mark.unit

T0 = 1_000_000.0
OK = frozenset({"ALLOCATED"})


def job(jid="1", state="RUNNING", nodes=("a", "b"), start=T0, restarts=0, held=False, **kw):
    return JobObs(
        job_id=jid,
        state=state,
        reason=kw.pop("reason", "None"),
        nodes=tuple(nodes),
        num_nodes=kw.pop("num_nodes", len(nodes) or 2),
        start_time=start,
        submit_time=kw.pop("submit", T0 - 100),
        restarts=restarts,
        held=held,
        partition="main",
        **kw,
    )


def snap(*jobs, nodes=None):
    return Snapshot(
        jobs=list(jobs), nodes=nodes if nodes is not None else {"a": OK, "b": OK, "c": OK, "d": OK}
    )


def run(c, st, s, now):
    return decide(c, st, s, now)


def test_is_gang_rules():
    c = cfg(gangs={"min_nodes": 2, "partitions": ["gpu"], "qos": ["gang"], "comment_flag": "gang"})
    assert is_gang(c, job(nodes=("a", "b")))
    assert not is_gang(c, job(nodes=("a",)))
    assert is_gang(c, job(nodes=("a",), comment="x gang"))
    assert is_gang(c, JobObs("2", "PENDING", "None", (), 1, partition="gpu"))
    assert is_gang(c, JobObs("2", "PENDING", "None", (), 1, qos="gang"))
    assert not is_gang(cfg(gangs={"min_nodes": 0}), job(nodes=("a", "b")))


def test_backoff_is_exponential_capped_and_jitter_deterministic():
    c = cfg()
    assert [backoff_delay(c, "1", n) for n in range(1, 6)] == [5, 10, 20, 40, 40]
    cj = cfg(requeuing={"jitter": 0.5}, seed=7)
    d1 = backoff_delay(cj, "1", 1)
    assert 5 <= d1 < 7.5 and d1 == backoff_delay(cj, "1", 1)
    assert backoff_delay(cj, "1", 1) != backoff_delay(cj, "2", 1)


def test_ready_before_timeout_no_action():
    c = cfg()
    st, acts = run(c, GovState(), snap(job()), T0 + 1)
    assert st.jobs["1"].phase == "ready"
    assert [a.reason for a in acts] == ["PodsReady"]
    st, acts = run(c, st, snap(job()), T0 + 100)
    assert acts == [] and st.jobs["1"].phase == "ready"


@pytest.mark.parametrize(
    "obs,nodes",
    [
        ({"state": "CONFIGURING"}, None),
        ({"reason": "Prolog"}, None),
        ({}, {"a": OK, "b": frozenset({"ALLOCATED", "NOT_RESPONDING"})}),
        ({}, {"a": OK, "b": frozenset({"ALLOCATED", "CLOUD", "POWERING_UP"})}),
        ({}, {"a": OK}),  # node unknown (hidden cloud node)
    ],
)
def test_not_ready_times_out_exactly_at_deadline(obs, nodes):
    c = cfg()
    j = job(**obs)
    st, acts = run(c, GovState(), snap(j, nodes=nodes), T0 + 9.9)
    assert acts == [] and st.jobs["1"].phase == "admitted"
    st, acts = run(c, st, snap(j, nodes=nodes), T0 + 10)
    assert [(a.kind, a.count, a.start_at, a.reason) for a in acts] == [
        ("requeue", 1, T0 + 15, "PodsReadyTimeout")
    ]
    assert st.jobs["1"].phase == "backoff" and st.jobs["1"].next_eligible == T0 + 15


def test_probe_mode_requires_marker_bound_to_restarts():
    c = cfg(probe={"mode": "command"})
    st, _ = run(c, GovState(), snap(job(comment="nfg-ready=0")), T0 + 1)
    assert st.jobs["1"].phase == "ready"
    st, _ = run(c, GovState(), snap(job(comment="nfg-ready=0", restarts=1)), T0 + 1)
    assert st.jobs["1"].phase == "admitted"  # stale marker from the previous run


def _cycle_to_requeue(c, st, n, t, restarts):
    j = job(start=t, restarts=restarts, reason="Prolog")
    st, acts = run(c, st, snap(j), t + c.timeout)
    assert acts and acts[0].kind in ("requeue", "requeuehold"), acts
    return st, acts[0]


def test_backoff_steps_and_limit_then_release_resets():
    c = cfg(requeuing={"backoff_limit_count": 2})
    st = GovState()
    t = T0
    st, a = _cycle_to_requeue(c, st, 1, t, 0)
    assert (a.kind, a.count, a.start_at - (t + 10)) == ("requeue", 1, 5)
    # pending in backoff: nothing to do; Slurm shows our StartTime
    pend = job(state="PENDING", nodes=(), start=a.start_at, restarts=1, eligible_time=a.start_at)
    st, acts = run(c, st, snap(pend), t + 12)
    assert acts == [] and st.jobs["1"].phase == "backoff"
    t2 = a.start_at + 1
    st, a = _cycle_to_requeue(c, st, 2, t2, 1)
    assert (a.kind, a.count, a.start_at - (t2 + 10)) == ("requeue", 2, 10)
    t3 = a.start_at + 1
    st, a = _cycle_to_requeue(c, st, 3, t3, 2)
    assert (a.kind, a.count) == ("requeuehold", 3)
    assert st.jobs["1"].phase == "deactivated"
    # Slurm shows the requeue-hold (the owner could release it): the admin hold closes it
    held = job(
        state="PENDING", nodes=(), restarts=3, held=True, reason="job_requeued_in_held_state"
    )
    st, acts = run(c, st, snap(held), t3 + 20)
    assert [(x.kind, x.count) for x in acts] == [("hold", 3)] and st.jobs["1"].count == 3
    admin = job(
        state="PENDING", nodes=(), restarts=3, held=True, admin_held=True, reason="JobHeldAdmin"
    )
    st, acts = run(c, st, snap(admin), t3 + 21)
    assert acts == [] and st.jobs["1"].hold_confirmed
    released = job(state="PENDING", nodes=(), restarts=3)
    st, acts = run(c, st, snap(released), t3 + 30)
    assert [(x.kind, x.reason, x.count) for x in acts] == [("annotate", "Released", 0)]
    assert st.jobs["1"].count == 0 and st.jobs["1"].phase == "pending"


def test_recovery_timeout():
    c = cfg(recovery_timeout=6)
    st, _ = run(c, GovState(), snap(job()), T0 + 1)
    bad = {"a": OK, "b": frozenset({"ALLOCATED", "NOT_RESPONDING"})}
    st, acts = run(c, st, snap(job(), nodes=bad), T0 + 50)
    assert st.jobs["1"].phase == "recovering" and acts[0].reason == "ReadinessLost"
    st, acts = run(c, st, snap(job(), nodes=bad), T0 + 55.9)
    assert acts == []
    st, acts = run(c, st, snap(job(), nodes=bad), T0 + 56)
    assert acts[0].kind == "requeue" and acts[0].reason == "RecoveryTimeout"


def test_recovery_disabled_and_recovered():
    bad = {"a": OK, "b": frozenset({"DOWN"})}
    c0 = cfg()
    st, _ = run(c0, GovState(), snap(job()), T0 + 1)
    st, acts = run(c0, st, snap(job(), nodes=bad), T0 + 5000)
    assert acts == [] and st.jobs["1"].phase == "ready"
    c = cfg(recovery_timeout=6)
    st, _ = run(c, GovState(), snap(job()), T0 + 1)
    st, _ = run(c, st, snap(job(), nodes=bad), T0 + 2)
    st, acts = run(c, st, snap(job()), T0 + 3)
    assert st.jobs["1"].phase == "ready" and acts[0].reason == "Recovered"


def test_not_requeueable_recorded_once_or_cancelled():
    j = job(reason="Prolog", requeue=False)
    st, acts = run(cfg(), GovState(), snap(j), T0 + 10)
    assert [a.kind for a in acts] == ["record"]
    st, acts = run(cfg(), st, snap(j), T0 + 11)
    assert acts == []
    st, acts = run(cfg(not_requeueable="cancel"), GovState(), snap(j), T0 + 10)
    assert [a.kind for a in acts] == ["cancel"]


def test_restart_mid_countdown_derives_deadline_from_slurm():
    c = cfg()
    run(c, GovState(), snap(job(reason="Prolog")), T0 + 3)
    # state lost entirely: a fresh governor still requeues at StartTime + timeout, once
    st2, acts = run(c, GovState(), snap(job(reason="Prolog")), T0 + 9)
    assert acts == []
    st2, acts = run(c, st2, snap(job(reason="Prolog")), T0 + 10)
    assert [a.kind for a in acts] == ["requeue"]


def test_interrupted_requeue_is_reissued_not_double_counted():
    c = cfg()
    j = job(reason="Prolog")
    st, acts = run(c, GovState(), snap(j), T0 + 10)
    assert acts[0].count == 1
    # the daemon died before scontrol requeue: Slurm still shows the same run
    st, acts = run(c, st, snap(j), T0 + 11)
    assert [(a.kind, a.count) for a in acts] == [("requeue", 1)]
    # it died after the requeue but before StartTime: repair StartTime only
    pend = job(state="PENDING", nodes=(), restarts=1, eligible_time=T0 + 130)
    st, acts = run(c, st, snap(pend), T0 + 12)
    assert [(a.kind, a.start_at) for a in acts] == [("set_start", T0 + 15)]
    assert st.jobs["1"].count == 1


def test_slurm_requeue_hold_off_after_a_slow_epilog_is_repaired():
    """The old allocation stays COMPLETING (slow epilog) past the backoff; when it ends, Slurm
    moves the begin time that has passed to now + 121 s (batch_requeue_fini). The governor
    puts it back to now, once, and then leaves the pending job alone."""
    c = cfg()  # backoff 5 s
    st, acts = run(c, GovState(), snap(job(reason="Prolog")), T0 + 10)
    assert [(a.kind, a.start_at) for a in acts] == [("requeue", T0 + 15)]
    # COMPLETING through the backoff: nothing to decide
    for t in (T0 + 12, T0 + 16, T0 + 19):
        st, acts = run(c, st, snap(job(state="COMPLETING", restarts=1)), t)
        assert acts == [] and st.jobs["1"].phase == "backoff"
    # the epilog ended at T0 + 20: Slurm's hold-off
    pend = job(state="PENDING", nodes=(), restarts=1, eligible_time=T0 + 141)
    st, acts = run(c, st, snap(pend), T0 + 20.5)
    assert [(a.kind, a.start_at, a.count) for a in acts] == [("set_start", T0 + 20.5, 1)]
    # Slurm took it: eligible now; pending as usual, no second update
    pend = job(state="PENDING", nodes=(), restarts=1, eligible_time=T0 + 21)
    st, acts = run(c, st, snap(pend), T0 + 21.5)
    assert acts == [] and st.jobs["1"].phase == "pending" and st.jobs["1"].count == 1
    st, acts = run(c, st, snap(pend), T0 + 22.5)
    assert acts == []


def test_owner_hold_after_the_backoff_is_not_overridden():
    """A held job (owner's hold) past the backoff: its begin time is not ours to move."""
    c = cfg()
    st, _ = run(c, GovState(), snap(job(reason="Prolog")), T0 + 10)
    pend = job(state="PENDING", nodes=(), restarts=1, eligible_time=T0 + 141, held=True)
    st, acts = run(c, st, snap(pend), T0 + 20)
    assert acts == []


def test_state_rebuilt_from_admin_comment():
    ac = encode_admin(
        "ops-note", count=3, phase="backoff", next_eligible=T0 + 50, restarts=2, why="x"
    )
    assert ac.startswith("ops-note ") and decode_admin(ac)["n"] == "3"
    pend = job(state="PENDING", nodes=(), restarts=3, admin_comment=ac, eligible_time=T0 + 50)
    st, acts = run(cfg(), GovState(), snap(pend), T0 + 10)
    assert acts == [] and st.jobs["1"].count == 3 and st.jobs["1"].phase == "backoff"
    # next timeout continues the count
    st, _ = run(cfg(), st, snap(job(state="PENDING", nodes=(), restarts=3)), T0 + 51)
    st, acts = run(cfg(), st, snap(job(start=T0 + 52, restarts=3, reason="Prolog")), T0 + 62)
    assert acts[0].count == 4 and acts[0].start_at == T0 + 62 + 40


def test_slurm_own_requeue_is_noted():
    c = cfg()
    st, _ = run(c, GovState(), snap(job(state="CONFIGURING")), T0 + 1)
    st, acts = run(
        c,
        st,
        snap(
            job(
                state="PENDING",
                nodes=(),
                restarts=1,
                held=True,
                reason="launch_failed_requeued_held",
            )
        ),
        T0 + 2,
    )
    assert [a.reason for a in acts] == ["RequeuedBySlurm"]
    assert st.jobs["1"].count == 0


def _queued(c, *jobs, now=T0):
    """block_admission: the governor admin-holds the pending gangs; Slurm then shows them
    held (JobHeldAdmin). A gang admitted-but-not-ready (99) keeps them queued in this cycle;
    it is gone in the next."""
    busy = job("99", state="CONFIGURING", nodes=("c", "d"))
    st, acts = run(c, GovState(), snap(busy, *jobs), now)
    assert not [x for x in acts if x.kind == "release"]
    assert sorted(x.job_id for x in acts if x.kind == "hold") == sorted(
        j.job_id for j in jobs if j.state == "PENDING"
    )
    return st


def held_admin(j):
    return replace(j, held=True, admin_held=True, reason="JobHeldAdmin", priority=0)


def test_block_admission_releases_one_at_a_time_in_order():
    c = cfg(block_admission=True)
    a = job("10", state="PENDING", nodes=(), submit=T0 - 50)
    b = job("11", state="PENDING", nodes=(), submit=T0 - 40)
    st = _queued(c, a, b, now=T0 - 1)
    st, acts = run(c, st, snap(held_admin(a), held_admin(b)), T0)
    assert [(x.kind, x.job_id) for x in acts] == [("release", "10")]
    a2 = a
    b = held_admin(b)
    st, acts = run(c, st, snap(a2, b), T0 + 1)
    assert acts == []  # released but not yet started: still blocks
    a3 = job("10", state="CONFIGURING", start=T0 + 2, submit=T0 - 50)
    st, acts = run(c, st, snap(a3, b), T0 + 3)
    assert acts == []  # admitted but not ready
    a4 = job("10", start=T0 + 2, submit=T0 - 50)
    st, acts = run(c, st, snap(a4, b), T0 + 4)
    assert [(x.kind, x.job_id) for x in acts] == [("note", "10"), ("release", "11")]


@pytest.mark.parametrize(
    "reason",
    ["BeginTime", "Dependency", "AssocGrpNodeLimit", "QOSMaxNodePerJobLimit", "PartitionNodeLimit"],
)
def test_released_gang_that_waits_for_itself_does_not_stall_the_queue(reason):
    c = cfg(block_admission=True)
    a = job("10", state="PENDING", nodes=(), submit=T0 - 50)
    b = job("11", state="PENDING", nodes=(), submit=T0 - 40)
    st = _queued(c, a, b, now=T0 - 1)
    st, acts = run(c, st, snap(held_admin(a), held_admin(b)), T0)
    assert [(x.kind, x.job_id) for x in acts] == [("release", "10")]
    stuck = replace(a, reason=reason)
    st, acts = run(c, st, snap(stuck, held_admin(b)), T0 + 1)
    assert [(x.kind, x.job_id) for x in acts] == [("release", "11")]


@pytest.mark.parametrize("reason", ["JobHeldUser", "JobHeldAdmin"])
def test_block_admission_never_releases_a_hold_it_did_not_place(reason):
    """sbatch -H, an operator's hold, Slurm's launch-failure hold: not ours to release."""
    c = cfg(block_admission=True)
    theirs = job(
        "10",
        state="PENDING",
        nodes=(),
        held=True,
        reason=reason,
        admin_held=reason == "JobHeldAdmin",
    )
    st, acts = run(c, GovState(), snap(theirs), T0)
    assert acts == [] and st.jobs["10"].phase == "pending"
    st, acts = run(c, st, snap(theirs), T0 + 100)
    assert acts == []


def test_block_admission_orders_by_slurm_priority_first():
    c = cfg(block_admission=True)
    lo = job("10", state="PENDING", nodes=(), submit=T0 - 50, priority=100)
    hi = job("11", state="PENDING", nodes=(), submit=T0 - 40, priority=900)
    st = _queued(c, lo, hi, now=T0 - 1)
    # held: Slurm shows Priority=0 now; the governor remembers the priority from before
    st, acts = run(c, st, snap(held_admin(lo), held_admin(hi)), T0)
    assert [(x.kind, x.job_id) for x in acts] == [("release", "11")]


def test_block_admission_holds_unheld_new_jobs_and_requeues_with_hold():
    c = cfg(block_admission=True)
    busy = job("1", state="CONFIGURING")
    new = job("2", state="PENDING", nodes=())
    st, acts = run(c, GovState(), snap(busy, new), T0 + 1)
    assert ("hold", "2") in [(x.kind, x.job_id) for x in acts]
    st, acts = run(c, st, snap(busy, held_admin(job("2", state="PENDING", nodes=()))), T0 + 10)
    rq = [x for x in acts if x.kind == "requeue"]
    assert rq and rq[0].hold and rq[0].job_id == "1"
    assert ("release", "2") in [(x.kind, x.job_id) for x in acts]


def test_eviction_vs_creation_ordering():
    for ts, first in (("creation", "5"), ("eviction", "6")):
        c = cfg(block_admission=True, requeuing={"timestamp": ts})
        x = job("5", state="PENDING", nodes=(), submit=T0 - 90)
        y = job("6", state="PENDING", nodes=(), submit=T0 - 10)
        st = _queued(c, job("7", state="CONFIGURING"), x, y, now=T0 - 1)
        st.jobs["5"].last_evicted_at = T0 - 1  # evicted recently
        st, acts = run(c, st, snap(held_admin(x), held_admin(y)), T0 + 1)
        assert [a.job_id for a in acts if a.kind == "release"] == [first]


def test_completing_job_with_fewer_nodes_stays_a_gang():
    c = cfg(block_admission=True)
    st, acts = run(c, GovState(), snap(job(reason="Prolog")), T0 + 10)
    assert acts[0].kind == "requeue" and acts[0].hold
    # Slurm 22.05: during COMPLETING after a requeue NumNodes counts only completing nodes
    comp = job(state="COMPLETING", nodes=("b",), num_nodes=1, restarts=1, held=True)
    st, acts = run(c, st, snap(comp), T0 + 11)
    assert acts == [] and st.jobs["1"].phase == "backoff"
    pend = job(state="PENDING", nodes=(), restarts=1, held=True, eligible_time=T0 + 15)
    st, acts = run(c, st, snap(pend), T0 + 12)
    assert acts == [] and st.jobs["1"].phase == "backoff"  # not released before its backoff
    st, acts = run(c, st, snap(pend), T0 + 15)
    assert [(a.kind, a.job_id) for a in acts] == [("release", "1")]


def test_first_sight_of_a_job_slurm_already_requeued_is_noted():
    pend = job(
        state="PENDING", nodes=(), restarts=1, held=True, reason="launch_failed_requeued_held"
    )
    st, acts = run(cfg(), GovState(), snap(pend), T0)
    assert [a.reason for a in acts] == ["RequeuedBySlurm"] and st.jobs["1"].count == 0
    st, acts = run(cfg(), st, snap(pend), T0 + 1)
    assert acts == []


# ---- node strikes -------------------------------------------------------------------------

BOOTING = frozenset({"ALLOCATED", "CLOUD", "NOT_RESPONDING", "POWERING_UP"})
OURS = "nodeforge-gang: not ready at 2 gang timeouts within 3600s (last job 2: POWERING_UP)"


def scfg(**kw):
    return cfg(**{"node_strike_limit": 2, "node_strike_window_seconds": 3600, **kw})


def node_snap(*jobs, b=BOOTING, reasons=None, **more):
    return Snapshot(jobs=list(jobs), nodes={"a": OK, "b": b, **more}, node_reasons=reasons or {})


def kinds(acts):
    return [(a.kind, a.node or a.job_id, a.count) for a in acts]


def timeout_on(c, st, jid, t, **snapkw):
    """Job *jid* admitted at *t* on nodes a, b; the governor cycle at its deadline."""
    return run(c, st, node_snap(job(jid, start=t), **snapkw), t + c.timeout)


def test_strike_for_unready_node_only_then_drain_before_requeue_at_limit():
    c = scfg()
    st, acts = timeout_on(c, GovState(), "1", T0)
    assert kinds(acts) == [("strike", "b", 1), ("requeue", "1", 1)]
    assert acts[0].reason == "PodsReadyTimeout" and "POWERING_UP" in acts[0].detail
    assert set(st.nodes) == {"b"}  # a was up: no strike
    assert (st.nodes["b"].strikes[0].job_id, st.nodes["b"].drain) == ("1", "")
    # Slurm hands the still-booting b to the next gang, which times out too
    st, acts = timeout_on(c, st, "2", T0 + 100)
    assert kinds(acts) == [("strike", "b", 2), ("drain", "b", 2), ("requeue", "2", 1)]
    drain = acts[1]
    assert drain.job_id == "2" and drain.reason == "NodeStrikes"
    assert drain.detail == (
        "nodeforge-gang: not ready at 2 gang timeouts within 3600s "
        "(last job 2: NOT_RESPONDING+POWERING_UP)"
    )
    assert (st.nodes["b"].drain, st.nodes["b"].drain_reason) == ("draining", drain.detail)


@pytest.mark.parametrize(
    "obs,b",
    [
        ({"reason": "Prolog"}, OK),  # hung prolog: no node to blame
        ({"state": "CONFIGURING"}, OK),
        ({"comment": ""}, OK),  # app probe never signalled (probe mode below)
        ({}, frozenset({"ALLOCATED", "DRAIN"})),  # someone drained it: their call, not a strike
    ],
)
def test_no_strike_without_a_node_that_is_not_up(obs, b):
    c = scfg(probe={"mode": "command"})
    st, acts = run(c, GovState(), node_snap(job(**obs), b=b), T0 + 10)
    assert [a.kind for a in acts] == ["requeue"] and st.nodes == {}


def test_node_unknown_to_slurmctld_is_struck():
    _, acts = run(scfg(), GovState(), Snapshot([job()], nodes={"a": OK}), T0 + 10)
    assert kinds(acts)[0] == ("strike", "b", 1) and "unknown to slurmctld" in acts[0].detail


def test_strike_limit_zero_is_off():
    st, acts = timeout_on(cfg(), GovState(), "1", T0)
    st, acts = timeout_on(cfg(), st, "2", T0 + 100)
    assert [a.kind for a in acts] == ["requeue"] and st.nodes == {}


def test_strikes_expire_after_the_window():
    c = scfg()
    st, _ = timeout_on(c, GovState(), "1", T0)
    # one second too late: the first strike has left the window, no drain
    st, acts = timeout_on(c, st, "2", T0 + 3600 + 1)
    assert kinds(acts) == [("strike", "b", 1), ("requeue", "2", 1)]
    # and a struck node whose strikes all expire is forgotten
    st, acts = run(c, st, node_snap(), T0 + 10 + 2 * 3600 + 2)
    assert acts == [] and st.nodes == {}
    # just inside the window: drained
    st, _ = timeout_on(c, GovState(), "1", T0)
    st, acts = timeout_on(c, st, "2", T0 + 3600 - 11)
    assert ("drain", "b", 2) in kinds(acts)


def test_gang_that_becomes_ready_clears_its_nodes_strikes():
    c = scfg()
    st, _ = timeout_on(c, GovState(), "1", T0)
    st, acts = run(c, st, node_snap(job("2", start=T0 + 50), b=OK), T0 + 51)
    assert [a.reason for a in acts] == ["PodsReady"] and st.nodes == {}
    st, acts = timeout_on(c, st, "3", T0 + 100)
    assert kinds(acts)[0] == ("strike", "b", 1)


def test_one_strike_per_node_per_cycle_for_gangs_sharing_it():
    c = scfg()
    _, acts = run(c, GovState(), node_snap(job("1"), job("2")), T0 + 10)
    assert [k for k in kinds(acts) if k[0] == "strike"] == [("strike", "b", 1)]
    assert [a.job_id for a in acts if a.kind == "requeue"] == ["1", "2"]


def test_recovery_timeout_strikes_the_node_that_went_away():
    c = scfg(recovery_timeout=6)
    st, _ = run(c, GovState(), node_snap(job(), b=OK), T0 + 1)
    dead = frozenset({"ALLOCATED", "NOT_RESPONDING"})
    st, _ = run(c, st, node_snap(job(), b=dead), T0 + 2)
    st, acts = run(c, st, node_snap(job(), b=dead), T0 + 8)
    assert kinds(acts) == [("strike", "b", 1), ("requeue", "1", 1)]
    assert acts[0].reason == "RecoveryTimeout"


@pytest.mark.parametrize(
    "b,reason",
    [
        (frozenset({"IDLE", "DRAIN", "POWERING_UP"}), "ops: reseat the NIC"),
        (frozenset({"DOWN", "NOT_RESPONDING"}), "Not responding"),
        (frozenset({"DOWN", "CLOUD", "POWERED_DOWN"}), "ResumeTimeout reached"),
    ],
)
def test_someone_elses_drain_or_down_is_never_overridden(b, reason):
    c = scfg()
    st, _ = timeout_on(c, GovState(), "1", T0)
    st, acts = timeout_on(c, st, "2", T0 + 100, b=b, reasons={"b": reason})
    assert kinds(acts) == [("strike", "b", 2), ("drain_skipped", "b", 2), ("requeue", "2", 1)]
    assert acts[1].reason == "AlreadyOut" and reason in acts[1].detail
    assert st.nodes["b"].drain == ""


def test_drain_confirmed_then_operator_resume_clears_strikes():
    c = scfg()
    st, _ = timeout_on(c, GovState(), "1", T0)
    st, _ = timeout_on(c, st, "2", T0 + 100)
    drained = frozenset({"IDLE", "DRAIN", "POWERING_UP"})
    st, acts = run(c, st, node_snap(b=drained, reasons={"b": OURS}), T0 + 111)
    assert acts == [] and st.nodes["b"].drain == "drained"
    # drained nodes keep their evidence past the window
    st, acts = run(c, st, node_snap(b=drained, reasons={"b": OURS}), T0 + 5 * 3600)
    assert acts == [] and len(st.nodes["b"].strikes) == 2
    # `scontrol update NodeName=b State=RESUME`
    st, acts = run(c, st, node_snap(b=frozenset({"IDLE"})), T0 + 5 * 3600 + 1)
    assert kinds(acts) == [("note", "b", 0)] and acts[0].reason == "NodeResumed"
    assert "2 strike(s) cleared" in acts[0].detail and st.nodes == {}
    st, acts = timeout_on(c, st, "3", T0 + 6 * 3600)
    assert kinds(acts)[0] == ("strike", "b", 1)


def test_drain_taken_over_by_someone_else_is_theirs():
    c = scfg()
    st, _ = timeout_on(c, GovState(), "1", T0)
    st, _ = timeout_on(c, st, "2", T0 + 100)
    drained = frozenset({"IDLE", "DRAIN"})
    st, _ = run(c, st, node_snap(b=drained, reasons={"b": OURS}), T0 + 111)
    st, acts = run(c, st, node_snap(b=drained, reasons={"b": "RMA ticket 42"}), T0 + 112)
    assert [a.reason for a in acts] == ["DrainTakenOver"] and st.nodes == {}


def test_drain_that_did_not_reach_slurm_is_reissued_once_per_cycle():
    c = scfg()
    st, _ = timeout_on(c, GovState(), "1", T0)
    st, acts = timeout_on(c, st, "2", T0 + 100)
    reason = next(a.detail for a in acts if a.kind == "drain")
    # the daemon died before scontrol: the next cycle (or the next daemon) re-issues it
    st, acts = run(c, st, node_snap(), T0 + 111)
    assert kinds(acts) == [("drain", "b", 2)]
    assert (acts[0].reason, acts[0].detail, acts[0].job_id) == ("ReissueDrain", reason, "2")
    assert len(st.nodes["b"].strikes) == 2  # no extra strike
    # ...unless someone took the node out meanwhile
    gone = frozenset({"DOWN", "NOT_RESPONDING"})
    st, acts = run(c, st, node_snap(b=gone, reasons={"b": "Not responding"}), T0 + 112)
    assert [(a.kind, a.reason) for a in acts] == [("drain_skipped", "AlreadyOut")]
    assert st.nodes["b"].drain == ""


def test_pending_drain_is_dropped_when_strikes_are_turned_off():
    st, _ = timeout_on(scfg(), GovState(), "1", T0)
    st, _ = timeout_on(scfg(), st, "2", T0 + 100)
    st, acts = run(cfg(), st, node_snap(), T0 + 111)  # restarted with node_strike_limit: 0
    assert [(a.kind, a.reason) for a in acts] == [("drain_skipped", "Disabled")]
    assert st.nodes["b"].drain == ""


def test_lost_state_finds_our_drains_by_reason():
    drained = frozenset({"IDLE", "DRAIN", "POWERING_UP"})
    st, acts = run(scfg(), GovState(), node_snap(b=drained, reasons={"b": OURS}), T0)
    assert acts == [] and st.nodes["b"].drain == "drained"
    st, acts = run(scfg(), st, node_snap(b=frozenset({"IDLE"})), T0 + 1)
    assert [a.reason for a in acts] == ["NodeResumed"] and st.nodes == {}
    # a foreign drain is not adopted
    st, _ = run(scfg(), GovState(), node_snap(b=drained, reasons={"b": "maint"}), T0)
    assert st.nodes == {}


def test_max_drained_caps_how_many_nodes_the_governor_holds():
    c = scfg(node_strike_max_drained=1)
    two = job("1", nodes=("b", "c"))
    boot = {"b": BOOTING, "c": BOOTING}
    st, _ = run(c, GovState(), Snapshot([two], nodes=boot), T0 + 10)
    st, acts = run(
        c, st, Snapshot([job("2", nodes=("b", "c"), start=T0 + 100)], nodes=boot), T0 + 110
    )
    assert kinds(acts) == [
        ("strike", "b", 2),
        ("drain", "b", 2),
        ("strike", "c", 2),
        ("drain_skipped", "c", 2),
        ("requeue", "2", 1),
    ]
    assert acts[3].reason == "MaxDrained" and "node_strike_max_drained 1" in acts[3].detail
    assert (st.nodes["b"].drain, st.nodes["c"].drain) == ("draining", "")


def test_limit_one_and_not_requeueable_jobs_strike_too():
    c = scfg(node_strike_limit=1)
    _, acts = run(c, GovState(), node_snap(job(requeue=False)), T0 + 10)
    assert kinds(acts) == [("strike", "b", 1), ("drain", "b", 1), ("record", "1", 0)]
    assert "at 1 gang timeout within" in acts[1].detail


def test_decide_does_not_mutate_the_input_node_state():
    c = scfg()
    st, _ = timeout_on(c, GovState(), "1", T0)
    before = [s.job_id for s in st.nodes["b"].strikes]
    timeout_on(c, st, "2", T0 + 100)
    assert [s.job_id for s in st.nodes["b"].strikes] == before and st.nodes["b"].drain == ""


# ---- issue 10: deactivation is final until an operator acts ---------------------------------
def _deactivate(c):
    st, a = _cycle_to_requeue(c, GovState(), 1, T0, 0)
    assert (a.kind, a.count) == ("requeuehold", 1)
    return st


def test_completing_after_requeuehold_is_not_a_release():
    c = cfg(requeuing={"backoff_limit_count": 0})
    st = _deactivate(c)
    # the epilog runs: Slurm shows COMPLETING (Restarts already counted up)
    for state in ("COMPLETING", "SUSPENDED"):
        st, acts = run(c, st, snap(job(state=state, restarts=1)), T0 + 11)
        assert acts == [] and st.jobs["1"].phase == "deactivated" and st.jobs["1"].count == 1


def test_failed_requeuehold_is_reissued_with_the_same_count():
    c = cfg(requeuing={"backoff_limit_count": 0})
    st = _deactivate(c)
    # scontrol failed: the job still runs, Restarts unchanged
    st, acts = run(c, st, snap(job(reason="Prolog")), T0 + 12)
    assert [(x.kind, x.count, x.reissue) for x in acts] == [("requeuehold", 1, False)]
    assert st.jobs["1"].count == 1 and st.jobs["1"].phase == "deactivated"


def test_owner_release_before_admin_hold_is_closed_not_a_reset():
    c = cfg(requeuing={"backoff_limit_count": 0})
    st = _deactivate(c)
    # requeue-held (the owner may release that), then released by the owner: not an operator
    st, acts = run(c, st, snap(job(state="PENDING", nodes=(), restarts=1)), T0 + 12)
    assert [(x.kind, x.reason, x.count) for x in acts] == [("hold", "Deactivated", 1)]
    # it even started again before the hold landed: requeuehold again, not counted twice
    st, acts = run(c, st, snap(job(restarts=1, start=T0 + 13)), T0 + 14)
    assert [(x.kind, x.count, x.reissue) for x in acts] == [("requeuehold", 1, True)]
    assert st.jobs["1"].count == 1


def test_release_of_the_confirmed_admin_hold_resets_the_counter():
    c = cfg(requeuing={"backoff_limit_count": 0})
    st = _deactivate(c)
    admin = job(
        state="PENDING", nodes=(), restarts=1, held=True, admin_held=True, reason="JobHeldAdmin"
    )
    st, acts = run(c, st, snap(admin), T0 + 12)
    assert acts == [] and st.jobs["1"].hold_confirmed
    st, acts = run(c, st, snap(job(state="PENDING", nodes=(), restarts=1)), T0 + 13)
    assert [(x.kind, x.reason, x.count) for x in acts] == [("annotate", "Released", 0)]


# ---- issue 10: Kueue semantics -------------------------------------------------------------
def test_clock_runs_from_first_admission_not_a_moved_start_time():
    """Slurm resets StartTime when cloud nodes finish powering up: no second window."""
    c = cfg()
    booting = {"a": OK, "b": frozenset({"IDLE", "CLOUD", "POWERING_UP"})}
    st, _ = run(c, GovState(), snap(job(start=T0), nodes=booting), T0 + 1)
    moved = job(start=T0 + 8)  # StartTime moved after power-up; node b still not ready
    st, acts = run(c, st, snap(moved, nodes=booting), T0 + 10)
    assert [(a.kind, a.deadline) for a in acts] == [("requeue", T0 + 10)]


@pytest.mark.parametrize("flags", [{"ALLOCATED", "DRAIN"}, {"MIXED", "REBOOT_REQUESTED"}])
def test_drain_or_reboot_request_is_not_lost_readiness(flags):
    c = cfg(recovery_timeout=5)
    st, _ = run(c, GovState(), snap(job()), T0 + 1)
    assert st.jobs["1"].phase == "ready"
    st, acts = run(c, st, snap(job(), nodes={"a": OK, "b": frozenset(flags)}), T0 + 2)
    assert acts == [] and st.jobs["1"].phase == "ready"


def test_drain_does_not_block_first_readiness():
    st, _ = run(
        cfg(), GovState(), snap(job(), nodes={"a": OK, "b": frozenset({"MIXED", "DRAIN"})}), T0 + 1
    )
    assert st.jobs["1"].phase == "ready"


@pytest.mark.parametrize("flag", ["DOWN", "NOT_RESPONDING", "FAIL"])
def test_node_failure_is_lost_readiness(flag):
    c = cfg(recovery_timeout=5)
    st, _ = run(c, GovState(), snap(job()), T0 + 1)
    st, acts = run(c, st, snap(job(), nodes={"a": OK, "b": frozenset({"ALLOCATED", flag})}), T0 + 2)
    assert [(a.kind, a.reason) for a in acts] == [("note", "ReadinessLost")]


def test_no_kill_job_on_fewer_nodes_does_not_recover():
    c = cfg(recovery_timeout=5)
    st, _ = run(c, GovState(), snap(job()), T0 + 1)
    lost = job(nodes=("a",), num_nodes=1)  # --no-kill: b failed and left the allocation
    st, acts = run(c, st, snap(lost), T0 + 2)
    assert [(a.kind, a.reason) for a in acts] == [("note", "ReadinessLost")]
    st, acts = run(c, st, snap(lost), T0 + 7)
    assert [(a.kind, a.reason, a.cause) for a in acts] == [
        ("requeue", "RecoveryTimeout", "WaitForRecovery")
    ]


# ---- issue 10: identity --------------------------------------------------------------------
def test_reused_job_id_starts_fresh():
    c = cfg()
    st, _ = _cycle_to_requeue(c, GovState(), 1, T0, 0)
    assert st.jobs["1"].count == 1
    # slurmctld state cleared: id 1 is a new job (new SubmitTime, Restarts 0)
    fresh = job(state="PENDING", nodes=(), submit=T0 + 500)
    st, _ = run(c, st, snap(fresh), T0 + 501)
    assert st.jobs["1"].count == 0 and st.jobs["1"].phase == "pending"


def test_our_requeue_is_not_a_reused_id():
    c = cfg()
    st, _ = _cycle_to_requeue(c, GovState(), 1, T0, 0)
    # Slurm resets SubmitTime on requeue, and Restarts goes up: the same job
    back = job(state="PENDING", nodes=(), restarts=1, submit=T0 + 10)
    st, _ = run(c, st, snap(back), T0 + 11)
    assert st.jobs["1"].count == 1 and st.jobs["1"].phase == "backoff"


def test_released_gang_with_a_begin_time_soon_still_blocks():
    """`--begin=now+2` is a short wait (within timeout), not a stall: the queue waits."""
    c = cfg(block_admission=True)
    a = job("10", state="PENDING", nodes=(), submit=T0 - 50)
    b = job("11", state="PENDING", nodes=(), submit=T0 - 40)
    st = _queued(c, a, b, now=T0 - 1)
    st, acts = run(c, st, snap(held_admin(a), held_admin(b)), T0)
    soon = replace(a, reason="BeginTime", eligible_time=T0 + 2)
    st, acts = run(c, st, snap(soon, held_admin(b)), T0 + 1)
    assert acts == []
    later = replace(a, reason="BeginTime", eligible_time=T0 + 3600)
    st, acts = run(c, st, snap(later, held_admin(b)), T0 + 2)
    assert [(x.kind, x.job_id) for x in acts] == [("release", "11")]


def test_block_admission_hold_and_release_in_one_cycle_when_nothing_blocks():
    """A new gang with nothing ahead of it is held and released in the same cycle: queueing
    costs no extra interval per admission."""
    c = cfg(block_admission=True)
    _, acts = run(c, GovState(), snap(job("10", state="PENDING", nodes=())), T0)
    assert [(x.kind, x.job_id) for x in acts] == [("hold", "10"), ("release", "10")]


def test_unchanged_observation_is_skipped_but_clocks_still_run():
    """The reader hands out the same JobObs object for an unchanged job: a quiet record is
    kept as is, but an admitted job's deadline still fires without any change in Slurm."""
    c = cfg()
    nodes = {"a": OK, "b": frozenset({"ALLOCATED", "CLOUD", "POWERING_UP"})}
    admitted, pending = job("1"), job("2", state="PENDING", nodes=())
    s = snap(admitted, pending, nodes=nodes)
    st, _ = run(c, GovState(), s, T0 + 1)
    rec2 = st.jobs["2"]
    st2, acts = run(c, st, s, T0 + 10)
    assert st2.jobs["2"] is rec2  # quiet: not copied
    assert [(a.kind, a.job_id) for a in acts] == [("requeue", "1")]  # the clock ran


def test_done_record_of_a_gone_job_expires_while_the_rest_stays_in_place():
    """A gang's job leaves slurmctld while the other jobs stay listed in the same places
    (decide() then moves its last view on, policy._in_place): its record is DONE, kept an
    hour (DONE_KEEP_SECONDS), then dropped, exactly as a decide() with no last view does."""
    from dataclasses import replace as dc_replace

    from nodeforge.gang import policy

    c = cfg()
    a, b = job("1"), job("2", state="PENDING", nodes=())
    st, _ = decide(c, GovState(), snap(a, b), T0)
    st, _ = decide(c, st, snap(b), T0 + 1)  # job 1 left slurmctld
    assert st.jobs["1"].phase == "done" and st.jobs["1"].done_at == T0 + 1
    b2 = dc_replace(b, priority=b.priority + 1)  # (a new observation in the same place)
    for t, kept in ((T0 + 2, True), (T0 + 1800, True), (T0 + 3602, False), (T0 + 3603, False)):
        s = snap(b2 if t == T0 + 1800 else b)
        assert policy._in_place(st, s.jobs) is not None  # the same jobs, the same places
        blind, _ = decide(c, dc_replace(st, seen_jobs={}, seen_view=None, watch=None), s, t)
        st, _ = decide(c, st, s, t)
        assert ("1" in st.jobs) is kept and st.jobs.keys() == blind.jobs.keys()


def test_release_of_a_quiet_waiting_record_does_not_mutate_the_input_state():
    c = cfg(block_admission=True)
    w = held_admin(job("10", state="PENDING", nodes=(), submit=T0 - 50))
    busy = job("99", state="CONFIGURING", nodes=("c", "d"))
    st, _ = run(c, GovState(), snap(busy, w), T0)
    st.jobs["10"].hold_ours = True  # as if held by us earlier
    st.jobs["10"].phase = "waiting_admission"
    s = snap(w)  # busy gone; w unchanged (same object)
    st.seen_jobs["10"] = w
    before = dict(st.jobs["10"].__dict__)
    st2, acts = run(c, st, s, T0 + 1)
    assert [(a.kind, a.job_id) for a in acts] == [("release", "10")]
    assert st.jobs["10"].__dict__ == before and st2.jobs["10"].released_by_us


def test_admin_hold_that_does_not_take_is_retried_slowly_not_every_cycle():
    c = cfg(requeuing={"backoff_limit_count": 0})
    st = _deactivate(c)
    user_held = job(state="PENDING", nodes=(), restarts=1, held=True, reason="JobHeldUser")
    kinds = []
    for t in range(12, 12 + 61):
        st, acts = run(c, st, snap(user_held), T0 + t)
        kinds += [a.kind for a in acts]
    assert kinds.count("hold") == 3  # at +12, +42, +72: every 30 s, not 61 times
    # not held at all (the owner released it): the admin hold is asked for at once
    st, acts = run(c, st, snap(job(state="PENDING", nodes=(), restarts=1)), T0 + 73)
    assert [a.kind for a in acts] == ["hold"]


# -- the quiet shortcut decides exactly what the full path decides ---------------------------


def _walk_job(rng, jid: str, prev: JobObs | None, t: float) -> JobObs:
    """The next observation of one job: often the very same object (as the reader's cache
    hands it out), else a new one with a random change a real slurmctld could show."""
    if prev is not None and rng.random() < 0.6:
        return prev
    state = rng.choice(
        ["PENDING"] * 3 + ["RUNNING"] * 3 + ["CONFIGURING", "COMPLETING", "COMPLETED"]
    )
    restarts = (prev.restarts if prev else 0) + (rng.random() < 0.1)
    held = state == "PENDING" and rng.random() < 0.4
    admin = held and rng.random() < 0.5
    reason = (
        ("JobHeldAdmin" if admin else "JobHeldUser")
        if held
        else rng.choice(["None", "Priority", "BeginTime", "Prolog"])
    )
    size = rng.choice([1, 2, 3])  # 1 node: not a gang (min_nodes 2), unless it was one
    nodes = () if state == "PENDING" else tuple(rng.sample(["a", "b", "c", "d"], size))
    return JobObs(
        job_id=jid,
        state=state,
        reason=reason,
        nodes=nodes,
        num_nodes=len(nodes) or size,
        partition="main",
        start_time=t - rng.choice([0, 3, 12]) if state != "PENDING" else None,
        submit_time=T0 - 100,
        eligible_time=rng.choice([None, t, t + 7]),
        restarts=restarts,
        held=held,
        admin_held=admin,
        priority=0 if held else rng.randint(1, 5),
        # a job's own timeout request (deadlines.field: comment), in or out of bounds
        comment=rng.choice(["", "", "nfg-timeout=5s", "nfg-timeout=1:00", "nfg-timeout=x"]),
    )


@settings(max_examples=120, deadline=None)
@given(
    seed=hst.integers(0, 2**32 - 1),
    block=hst.booleans(),
    recovery=hst.sampled_from([0, 4]),
    limit=hst.sampled_from([None, 1]),
    node_churn=hst.sampled_from([0.05, 0.3]),
    own=hst.sampled_from(["none", "refuse", "clamp"]),
    tlimit=hst.sampled_from([None, 20]),
)
def test_quiet_shortcut_decides_what_the_full_path_decides(
    seed, block, recovery, limit, node_churn, own, tlimit
):
    """decide() skips a job whose observation is the same object as last cycle's while its
    phase would not change, and with the same node map and config it looks only at the jobs
    that changed, loud records and records whose clock is due (policy._Watch); over random
    cycles (clocks running, nodes failing, holds, requeues by Slurm, jobs purged and coming
    back) the result must equal a decide() that sees no previous observation at all. The
    reads the governor asks for next (full_reads, settled_reads), carried forward from the
    last state's by the keys decide() looked at, must equal a walk of the records."""
    import random

    from nodeforge.gang import policy

    rng = random.Random(seed)
    c = cfg(
        block_admission=block,
        recovery_timeout=recovery,
        requeuing={"backoff_limit_count": limit, "backoff_limit_seconds": tlimit},
        deadlines={
            "field": "none" if own == "none" else "comment",
            "out_of_bounds": "clamp" if own == "clamp" else "refuse",
            "min_seconds": 3,
            "max_seconds": 30,
        },
    )
    flag_sets = [
        OK,
        frozenset({"ALLOCATED", "CLOUD", "POWERING_UP"}),
        frozenset({"DOWN"}),
        # an operator's drain or reboot request: moves no node for the watch (policy
        # _moved_nodes), so these maps test that nothing it skips would have been decided
        frozenset({"ALLOCATED", "DRAIN"}),
        frozenset({"MIXED", "REBOOT_REQUESTED", "DRAIN"}),
        frozenset({"ALLOCATED", "DRAIN", "NOT_RESPONDING"}),
    ]
    nodes = {n: OK for n in "abcd"}
    jobs: dict[str, JobObs | None] = {str(i): None for i in range(1, 7)}
    st, t = GovState(), T0
    fast = carried = in_place = 0
    for _ in range(40):
        t += rng.choice([0, 0.5, 1, 3, 6, 1800])  # (1800: done records of gone jobs expire)
        if rng.random() < node_churn:
            nodes = {n: rng.choice(flag_sets) for n in "abcd"}  # a new map object
            if rng.random() < 0.3:  # only drains come and go
                nodes = {n: f ^ {"DRAIN"} for n, f in nodes.items()}
            if rng.random() < 0.2:
                nodes.pop(rng.choice("abcd"))  # a node no longer listed
        elif rng.random() < 0.1:
            nodes = dict(nodes)  # a new map object, the same flags
        for jid in jobs:
            if jobs[jid] is not None and rng.random() < 0.08:
                jobs[jid] = None  # purged by slurmctld (it may come back, as a new job)
            else:
                jobs[jid] = _walk_job(rng, jid, jobs[jid], t)
        s = snap(*[j for j in jobs.values() if j is not None], nodes=nodes)
        before = {k: dict(v.__dict__) for k, v in st.jobs.items()}
        blind = replace(st, seen_jobs={}, seen_nodes=None, watch=None)  # nothing to skip
        full, full_acts = decide(c, blind, s, t)
        fast += isinstance(st.watch, policy._Watch)
        # the same jobs in the same places, some observations new: seen_jobs moved on
        in_place += isinstance(st.watch, policy._Watch) and bool(policy._in_place(st, s.jobs))
        # what the governor asks before each snapshot (made by a walk, or carried forward)
        need, settled = policy.full_reads(c, st), policy.settled_reads(st)
        quick, quick_acts = decide(c, st, s, t)
        carried += isinstance(quick.reads, policy._Reads)
        assert quick_acts == full_acts
        assert quick.jobs.keys() == full.jobs.keys()
        for k, r in quick.jobs.items():
            diff = {f: (v, full.jobs[k].__dict__[f]) for f, v in r.__dict__.items()}
            assert {f: v for f, v in diff.items() if v[0] != v[1]} == {}, (k, st.jobs.get(k))
        assert {k: v.__dict__ for k, v in st.jobs.items()} == before  # input not mutated
        # the next cycle's map of what this one saw: this snapshot's very observations
        assert {k: id(v) for k, v in quick.seen_jobs.items()} == {j.job_id: id(j) for j in s.jobs}
        walked = replace(st, reads=None)  # the reads of the input state, by a walk
        assert (need, settled) == (policy.full_reads(c, walked), policy.settled_reads(walked))
        walked = replace(quick, reads=None)  # and of the new one (carried forward, or made)
        assert policy.full_reads(c, quick) == policy.full_reads(c, walked)
        assert policy.settled_reads(quick) == policy.settled_reads(walked)
        # the wake-up read from the watch is the walk's
        for later in (t, t + 0.5, t + 3, t + 7):
            assert policy.next_deadline(c, quick, later) == policy.next_deadline(
                c, replace(quick, watch=None), later
            )
        st = quick
    assert block or fast > 0  # the look-only-at-changes path was taken
    assert block or carried > 0  # and the reads carried forward from the last state's
    assert block or in_place > 0  # and a snapshot of the same jobs in the same places


@settings(max_examples=200, deadline=None)
@given(
    flags=hst.lists(
        hst.frozensets(
            hst.sampled_from(
                ["ALLOCATED", "IDLE", "MIXED", "DRAIN", "REBOOT_REQUESTED", "COMPLETING"]
                + ["CLOUD", "DOWN", "NOT_RESPONDING", "FAIL", "POWERING_UP", "UNKNOWN"]
                + ["POWERED_DOWN", "MAINTENANCE", "RESERVED", "PLANNED"]
            ),
            max_size=5,
        ),
        min_size=2,
        max_size=2,
    ),
    state=hst.sampled_from(["RUNNING", "CONFIGURING"]),
)
def test_readiness_reads_no_flag_outside_read_flags(flags, state):
    """The watch (policy._moved_nodes) looks again only at jobs on nodes whose flags moved in
    readiness.READ_FLAGS: any flag outside them must not change what readiness says."""
    from nodeforge.gang import readiness

    j = job(state=state, nodes=("a", "b"), num_nodes=2)
    nodes = {"a": flags[0], "b": flags[1]}
    seen = {"a": flags[0] & readiness.READ_FLAGS, "b": flags[1] & readiness.READ_FLAGS}
    assert readiness.check(j, nodes) == readiness.check(j, seen)
    assert readiness.still_ready(j, nodes, 2) == readiness.still_ready(j, seen, 2)
    assert readiness.unready_nodes(j, nodes) == readiness.unready_nodes(j, seen)


def test_full_reads_follow_a_reloaded_config():
    """The reads a state made for one config are not another's: a pending gang is read in
    full every cycle once block_admission is turned on (its hold decides the queue), and
    no longer once it is turned off again."""
    from nodeforge.gang import policy

    plain, block = cfg(), cfg(block_admission=True)
    st, _ = run(plain, GovState(), snap(job(state="PENDING", nodes=())), T0)
    assert st.jobs["1"].phase == "pending"
    assert policy.full_reads(plain, st) == frozenset()
    assert policy.full_reads(block, st) == {"1"}
    assert policy.full_reads(plain, st) == frozenset()


def test_in_place_snapshots_keep_one_map_of_places():
    """The key -> place map of a queue is made once and handed from view to view while the
    snapshots list the same jobs in the same places (a 50k queue: ~4 ms to make)."""
    from dataclasses import replace as dc_replace

    c = cfg()
    jobs = [job(str(i), state="PENDING", nodes=()) for i in range(1, 6)]
    st, _ = decide(c, GovState(), snap(*jobs), T0)
    views = []
    for k in range(3):  # one new observation a cycle, in its place
        jobs[k] = dc_replace(jobs[k], priority=jobs[k].priority + 1)
        st, _ = decide(c, st, snap(*jobs), T0 + 1 + k)
        views.append(st.seen_view)
    assert views[0].pos is not None
    assert views[0].pos is views[1].pos is views[2].pos
    assert views[0].pos == {str(i): i - 1 for i in range(1, 6)}
