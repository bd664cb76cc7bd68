"""The governor's decisions as one pure function: (config, state, observations, now) -> (new
state, actions). No I/O, no clock, no randomness beyond a seeded per-(job, attempt) jitter, so
the unit tests and bench/gang_sim.py exercise exactly the code the daemon runs.

Kueue's waitForPodsReady mapped onto Slurm:
- admitted = the job left PENDING (RUNNING/CONFIGURING); `timeout` runs from its StartTime;
- ready = readiness.check(); a ready job that loses readiness gets `recovery_timeout`;
- eviction = `scontrol requeue` (+ StartTime pushed by the backoff), or `requeuehold` over
  `backoff_limit_count` (deactivated); a job that cannot be requeued is recorded (or
  cancelled when configured), never silently skipped;
- block_admission = gang jobs wait held; one is released only when no released gang job is
  admitted-but-not-ready (or released-but-not-yet-started);
- node strikes (gang/strikes.py, no Kueue equivalent) = each node that was not up at an
  eviction gets a strike; `node_strike_limit` strikes within the window drain it.
"""

from __future__ import annotations

import random
from dataclasses import replace

from . import readiness, strikes
from .actions import Action
from .config import GangConfig
from .events import decode_admin
from .slurm import JobObs, Snapshot
from .state import (
    ADMITTED,
    BACKOFF,
    DEACTIVATED,
    DONE,
    NOT_REQUEUEABLE,
    PENDING,
    PHASES,
    READY,
    RECOVERING,
    WAITING,
    GangRecord,
    GovState,
)

DONE_KEEP_SECONDS = 3600.0
REASON_TIMEOUT = "PodsReadyTimeout"
REASON_RECOVERY = "RecoveryTimeout"


def is_gang(cfg: GangConfig, job: JobObs) -> bool:
    g = cfg.gangs
    if g.min_nodes and job.num_nodes >= g.min_nodes:
        return True
    if job.partition and any(p in g.partitions for p in job.partition.split(",")):
        return True
    if job.qos and job.qos in g.qos:
        return True
    return bool(g.comment_flag and g.comment_flag in job.comment.replace(",", " ").split())


def backoff_delay(cfg: GangConfig, job_id: str, n: int) -> float:
    """min(base * 2^(n-1), max) * (1 + jitter * u), u seeded by (seed, job, n)."""
    r = cfg.requeuing
    base = min(r.backoff_base_seconds * (2 ** max(n - 1, 0)), r.backoff_max_seconds)
    if r.jitter:
        u = random.Random(f"{cfg.seed}:{job_id}:{n}").random()
        base *= 1.0 + r.jitter * u
    return base


_new_rec = object.__new__


def _bootstrap(job: JobObs) -> GangRecord:
    """A record for a job the state file does not know: from our AdminComment token if any."""
    rec = GangRecord(job_id=job.job_id, submit_time=job.submit_time, partition=job.partition)
    # Without our AdminComment token every Restart so far was Slurm's (or an operator's):
    # seen=0 makes the first cycle record them (a fast prolog failure requeues before we look).
    rec.restarts_seen = 0
    d = decode_admin(job.admin_comment)
    if d:
        try:
            rec.count = int(d.get("n", "0"))
            ph = d.get("phase", PENDING)
            rec.phase = ph if ph in PHASES else PENDING
            rec.next_eligible = float(d["next"]) if "next" in d else None
            rec.restarts_at_action = int(d["r"]) if "r" in d else None
        except ValueError:
            pass
        if rec.restarts_at_action is not None:
            # restarts explained by our own last action; anything beyond is Slurm's doing
            rec.restarts_seen = rec.restarts_at_action + (
                1 if rec.phase in (BACKOFF, DEACTIVATED) else 0
            )
        if rec.phase in (BACKOFF, NOT_REQUEUEABLE) and job.state in ("RUNNING", "CONFIGURING"):
            rec.admitted_at = job.start_time
        elif rec.phase in (ADMITTED, READY, RECOVERING):
            rec.phase = PENDING  # re-derived from Slurm below
    return rec


def decide(
    cfg: GangConfig, st: GovState, snap: Snapshot, now: float
) -> tuple[GovState, list[Action]]:
    recs: dict[str, GangRecord] = {}
    seen: set[str] = set()
    timeout, recovery = cfg.timeout, cfg.recovery_timeout
    limit = cfg.requeuing.backoff_limit_count
    block = cfg.block_admission
    nodes, actions = strikes.reconcile(cfg, st.nodes, snap, now)
    struck: set[str] = set()

    def evict(rec: GangRecord, job: JobObs, reason: str, waited: float, deadline: float) -> None:
        # Node strikes (and drains) come first: the drain then reaches slurmctld before the
        # requeue frees the node, so no scheduling pass in between can hand it out again.
        actions.extend(strikes.strike(cfg, nodes, job, snap, now, struck, reason))
        rec.restarts_seen = job.restarts + (1 if job.requeue else 0)
        if not job.requeue:
            rec.phase = NOT_REQUEUEABLE
            kind = "cancel" if cfg.not_requeueable == "cancel" else "record"
            rec.why = f"{reason}: job cannot be requeued (Requeue=0 or not a batch job)"
            actions.append(
                Action(
                    kind,
                    job.job_id,
                    reason,
                    rec.why,
                    rec.count,
                    waited=waited,
                    deadline=deadline,
                    restarts=job.restarts,
                    partition=job.partition,
                    phase=rec.phase,
                )
            )
            return
        n = rec.count + 1
        rec.count = n
        rec.last_evicted_at = now
        rec.restarts_at_action = job.restarts
        rec.released_by_us = False
        if limit is not None and n > limit:
            rec.phase = DEACTIVATED
            rec.next_eligible = None
            rec.why = f"{reason}; requeue {n} > backoff_limit_count {limit}: deactivated"
            actions.append(
                Action(
                    "requeuehold",
                    job.job_id,
                    reason,
                    rec.why,
                    n,
                    waited=waited,
                    deadline=deadline,
                    restarts=job.restarts,
                    partition=job.partition,
                    phase=rec.phase,
                )
            )
            return
        delay = backoff_delay(cfg, job.job_id, n)
        start_at = now + delay
        rec.phase = BACKOFF
        rec.next_eligible = start_at
        rec.why = reason
        actions.append(
            Action(
                "requeue",
                job.job_id,
                reason,
                rec.why,
                n,
                start_at=start_at,
                backoff=delay,
                waited=waited,
                deadline=deadline,
                hold=block,
                restarts=job.restarts,
                partition=job.partition,
                phase=rec.phase,
            )
        )

    for job in snap.jobs:
        jid = job.job_id
        old = st.jobs.get(jid)
        # Once a gang, always a gang: while COMPLETING, Slurm shows only the nodes still
        # completing in NumNodes, so the size rule alone would drop a requeued job.
        if not is_gang(cfg, job) and (old is None or old.phase == DONE):
            continue
        seen.add(jid)
        if old is not None:
            rec = _new_rec(GangRecord)  # shallow copy; the input state is never mutated
            rec.__dict__.update(old.__dict__)
        else:
            rec = _bootstrap(job)
        recs[jid] = rec
        if rec.submit_time is None:
            rec.submit_time = job.submit_time
        if rec.restarts_seen is None:
            rec.restarts_seen = job.restarts
        elif job.restarts > rec.restarts_seen:
            # Slurm requeued it on its own (prolog failure, node failure, operator requeue).
            rec.restarts_seen = job.restarts
            rec.why = f"requeued by Slurm (Restarts={job.restarts}, Reason={job.reason})"
            actions.append(
                Action(
                    "note",
                    jid,
                    "RequeuedBySlurm",
                    rec.why,
                    rec.count,
                    restarts=job.restarts,
                    partition=job.partition,
                    phase=rec.phase,
                )
            )
            if rec.phase in (ADMITTED, READY, RECOVERING, NOT_REQUEUEABLE):
                rec.phase = PENDING
        rec.partition = job.partition
        if job.finished:
            if rec.phase != DONE:
                rec.phase, rec.done_at = DONE, now
                rec.why = job.state
                actions.append(Action("note", jid, "Finished", job.state, rec.count, phase=DONE))
            continue
        if rec.phase == DONE:  # reused id or requeued after we saw it finish
            rec.phase, rec.done_at = PENDING, None

        # An operator's `scontrol release` of a deactivated job resets the counter.
        if rec.phase == DEACTIVATED and not (job.state == "PENDING" and job.held):
            rec.phase, rec.count, rec.next_eligible, rec.why = (
                PENDING,
                0,
                None,
                "released by operator",
            )
            rec.released_by_us = False
            actions.append(
                Action(
                    "annotate",
                    jid,
                    "Released",
                    rec.why,
                    0,
                    restarts=job.restarts,
                    partition=job.partition,
                    phase=PENDING,
                )
            )
        if rec.phase == DEACTIVATED:
            continue

        if job.state == "PENDING":
            if rec.phase in (ADMITTED, READY, RECOVERING, NOT_REQUEUEABLE):
                rec.phase = PENDING  # back in the queue without a requeue (e.g. preempted)
            if rec.phase == BACKOFF:
                if rec.next_eligible is not None and now < rec.next_eligible:
                    if (
                        not job.held
                        and job.eligible_time is not None
                        and abs(job.eligible_time - rec.next_eligible) > 2.0
                    ):
                        # e.g. the governor died between requeue and StartTime update
                        actions.append(
                            Action(
                                "set_start",
                                jid,
                                "Backoff",
                                "repair StartTime",
                                rec.count,
                                start_at=rec.next_eligible,
                                phase=BACKOFF,
                            )
                        )
                    continue
                rec.phase = WAITING if (block and job.held) else PENDING
            if block:
                if job.held:
                    rec.phase = WAITING
                    rec.released_by_us = False
                elif not rec.released_by_us:
                    rec.phase = WAITING
                    actions.append(
                        Action(
                            "hold",
                            jid,
                            "Admission",
                            "block_admission: queued",
                            rec.count,
                            phase=WAITING,
                        )
                    )
                else:
                    rec.phase = PENDING
            else:
                rec.phase = PENDING
            continue

        if job.state not in ("RUNNING", "CONFIGURING"):
            continue  # COMPLETING, SUSPENDED, ...: nothing to decide
        start = job.start_time if job.start_time is not None else now
        if (
            rec.phase == BACKOFF
            and rec.admitted_at == start
            and rec.restarts_at_action == job.restarts
        ):
            # Our requeue was decided (and persisted) but never reached Slurm: re-issue it,
            # same attempt number, so a crash cannot double-count or double-requeue.
            actions.append(
                Action(
                    "requeue",
                    jid,
                    rec.why or REASON_TIMEOUT,
                    "re-issue interrupted requeue",
                    rec.count,
                    start_at=rec.next_eligible,
                    hold=block,
                    restarts=job.restarts,
                    partition=job.partition,
                    phase=BACKOFF,
                )
            )
            continue
        if rec.phase == NOT_REQUEUEABLE and rec.admitted_at == start:
            continue
        if rec.phase not in (ADMITTED, READY, RECOVERING) or rec.admitted_at != start:
            rec.phase, rec.admitted_at, rec.ready_at, rec.lost_at = ADMITTED, start, None, None
            rec.released_by_us = False
            rec.why = ""
        ok, why = readiness.check(job, snap.nodes, cfg.probe.mode)
        if rec.phase == ADMITTED:
            if ok:
                rec.phase, rec.ready_at, rec.why = READY, now, ""
                strikes.clear_on_ready(nodes, job)
                actions.append(
                    Action(
                        "note",
                        jid,
                        "PodsReady",
                        "all nodes ready",
                        rec.count,
                        waited=now - start,
                        partition=job.partition,
                        phase=READY,
                    )
                )
            elif now >= start + timeout:
                evict(rec, job, REASON_TIMEOUT, now - start, start + timeout)
            else:
                rec.why = why
        elif rec.phase == READY:
            if not ok and recovery > 0:
                rec.phase, rec.lost_at, rec.why = RECOVERING, now, why
                actions.append(
                    Action(
                        "note",
                        jid,
                        "ReadinessLost",
                        why,
                        rec.count,
                        partition=job.partition,
                        phase=RECOVERING,
                    )
                )
        elif rec.phase == RECOVERING:
            if ok:
                rec.phase, rec.lost_at, rec.why = READY, None, ""
                strikes.clear_on_ready(nodes, job)
                actions.append(
                    Action(
                        "note",
                        jid,
                        "Recovered",
                        "all nodes ready again",
                        rec.count,
                        partition=job.partition,
                        phase=READY,
                    )
                )
            elif rec.lost_at is not None and now >= rec.lost_at + recovery:
                evict(
                    rec, job, REASON_RECOVERY, now - (rec.ready_at or start), rec.lost_at + recovery
                )
            else:
                rec.why = why

    # Jobs gone from Slurm (purged after MinJobAge) or finished long ago.
    for jid, old in st.jobs.items():
        if jid in seen:
            continue
        if old.phase == DONE:
            if old.done_at is not None and now - old.done_at < DONE_KEEP_SECONDS:
                recs[jid] = old
        else:
            recs[jid] = replace(old, phase=DONE, done_at=now, why="gone from slurmctld")

    if block:
        busy = any(
            r.phase in (ADMITTED, RECOVERING) or (r.phase == PENDING and r.released_by_us)
            for r in recs.values()
        )
        if not busy:
            waiting = [r for r in recs.values() if r.phase == WAITING]
            if waiting:

                def key(r: GangRecord):
                    if cfg.requeuing.timestamp == "eviction" and r.last_evicted_at is not None:
                        t = r.last_evicted_at
                    else:
                        t = r.submit_time or 0.0
                    return (t, int(r.job_id) if r.job_id.isdigit() else 0, r.job_id)

                nxt = min(waiting, key=key)
                nxt.phase, nxt.released_by_us, nxt.why = (
                    PENDING,
                    True,
                    "released by block_admission",
                )
                actions.append(
                    Action(
                        "release",
                        nxt.job_id,
                        "Admission",
                        "no admitted-but-not-ready gang job",
                        nxt.count,
                        partition=nxt.partition,
                        phase=PENDING,
                    )
                )
    return GovState(jobs=recs, counters=st.counters, version=st.version, nodes=nodes), actions
