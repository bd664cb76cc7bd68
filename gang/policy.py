"""The governor's decisions as one pure function: (config, state, observations, now) -> (new
state, actions). No I/O, no clock, no randomness beyond a seeded per-(job, attempt) jitter, so
the unit tests and bench/gang_sim.py exercise exactly the code the daemon runs.

Kueue's waitForPodsReady mapped onto Slurm:
- admitted = the job left PENDING (RUNNING/CONFIGURING); `timeout` runs from the first
  admission of this run (Slurm moves StartTime when cloud nodes finish powering up);
- ready = readiness.check(); a ready job that loses readiness (a node DOWN, NOT_RESPONDING,
  FAIL, or fewer nodes than at admission) gets `recovery_timeout`;
- eviction = `scontrol requeue` (+ StartTime pushed by the backoff), or `requeuehold` over
  `backoff_limit_count` (deactivated); a job that cannot be requeued is recorded (or
  cancelled when configured), never silently skipped;
- deactivation is final until an operator acts: requeuehold, then an admin hold the owner
  cannot release; only a release of that confirmed hold resets the counter;
- block_admission = gang jobs wait under the governor's own (admin) hold; one is released
  only when no released gang job is admitted-but-not-ready or released-and-able-to-start
  (one that waits for its own reasons, e.g. BeginTime or a dependency, does not block);
- node strikes (gang/strikes.py, no Kueue equivalent) = each node that was not up at an
  eviction gets a strike; `node_strike_limit` strikes within the window drain it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from heapq import heapify, heappop, heappush
from itertools import compress, filterfalse, islice
from operator import attrgetter, is_not, not_, or_
from typing import cast

from . import deadlines, readiness, strikes
from .actions import Action, ActionKind
from .config import GangConfig
from .events import decode_admin
from .slurm_view import JobObs, Snapshot
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
# why a gang was deactivated (rec.why and the AdminComment's why)
LIMIT_COUNT = "backoff_limit_count"
LIMIT_SECONDS = "backoff_limit_seconds"
# Kueue's PodsReady=False condition reasons, used as the eviction's underlying_cause
CAUSE_START = "WaitForStart"
CAUSE_RECOVERY = "WaitForRecovery"
ADMITTED_STATES = ("RUNNING", "CONFIGURING")
# A deactivated job still under requeuehold's own hold whose admin hold did not take: the
# admin hold is asked for again after this long (a job that is not held at all: at once).
HOLD_RETRY_SECONDS = 30.0
# Pending reasons that are the job's own: a released gang that waits for one of these does
# not hold up the block_admission queue (it might wait for hours, or forever).
OWN_WAIT_REASONS = frozenset(
    {
        "BeginTime",
        "Dependency",
        "DependencyNeverSatisfied",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "PartitionDown",
        "PartitionInactive",
        "PartitionConfig",
        "JobHeldUser",
        "JobHeldAdmin",
        "InvalidAccount",
        "InvalidQOS",
        "AccountNotAllowed",
        "QOSNotAllowed",
        "BadConstraints",
        "ReqNodeNotAvail",
        "Reservation",
        "ReservationDeleted",
        "JobArrayTaskLimit",
        "job_requeued_in_held_state",
    }
)


def waits_for_itself(reason: str, eligible_at: float | None = None, soon: float = 0.0) -> bool:
    """Slurm's pending Reason says the job cannot start for its own reasons (limits of its
    association or QOS included: AssocGrpNodeLimit, QOSMaxNodePerJobLimit, ...). A BeginTime
    that comes within *soon* seconds (from EligibleTime) is a short wait, not a stall."""
    if reason == "BeginTime" and eligible_at is not None and eligible_at <= soon:
        return False
    return reason in OWN_WAIT_REASONS or (
        reason.startswith(("Assoc", "QOS")) and ("Limit" in reason or "Max" in reason)
    )


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


def timeout_of(cfg: GangConfig, rec: GangRecord) -> float:
    """The readiness timeout of the record's current run: its own (deadlines.py) or the
    configured one."""
    return cfg.timeout if rec.timeout is None else rec.timeout


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
            rec.first_admitted_at = float(d["f"]) if "f" in d else None
        except ValueError:
            pass
        if rec.restarts_at_action is not None:
            # restarts explained by our own last action; anything beyond is Slurm's doing
            rec.restarts_seen = rec.restarts_at_action + (
                1 if rec.phase in (BACKOFF, DEACTIVATED) else 0
            )
        if rec.phase in (BACKOFF, NOT_REQUEUEABLE) and job.state in ADMITTED_STATES:
            rec.admitted_at = job.start_time
            rec.run_restarts = job.restarts
        elif rec.phase in (ADMITTED, READY, RECOVERING):
            rec.phase = PENDING  # re-derived from Slurm below
        rec.hold_ours = rec.phase in (WAITING, DEACTIVATED, BACKOFF) and job.held
        rec.hold_confirmed = rec.phase == DEACTIVATED and job.admin_held
    return rec


class _Cycle:
    """One decide() call: inputs, the records being built, and the actions so far."""

    def __init__(self, cfg: GangConfig, st: GovState, snap: Snapshot, now: float):
        self.cfg, self.st, self.snap, self.now = cfg, st, snap, now
        self.recs: dict[str, GangRecord] = {}
        self.seen: set[str] = set()
        self.nodes, self.actions = strikes.reconcile(cfg, st.nodes, snap, now)
        self.struck: set[str] = set()
        self.held_now: set[str] = set()  # gangs Slurm shows held in this snapshot
        # _decide_changed: every key whose record may differ from st.jobs' (None: any may)
        self.touched: set[str] | None = None
        # _decide_changed: keys of the records whose jobs are not listed (None: not known)
        self.unlisted: frozenset[str] | None = None

    def act(
        self, kind: ActionKind, rec: GangRecord, job: JobObs | None, reason: str, detail: str, **kw
    ) -> None:
        kw.setdefault("count", rec.count)
        kw.setdefault("phase", rec.phase)
        if job is not None:
            kw.setdefault("restarts", job.restarts)
            kw.setdefault("partition", job.partition)
        self.actions.append(Action(kind, rec.job_id, reason, detail, **kw))


def decide(
    cfg: GangConfig, st: GovState, snap: Snapshot, now: float
) -> tuple[GovState, list[Action]]:
    """One cycle, one small function per phase (Kueue's workload controller style)."""
    c = _Cycle(cfg, st, snap, now)
    jobs = snap.jobs
    changed = _in_place(st, jobs)
    last = cast(_Seen, st.seen_view) if changed is not None else None
    if last is None:
        keys = list(map(_KEY, jobs))
        seen_jobs = dict(zip(keys, jobs, strict=True))  # (C level; the reader lists each once)
    else:  # the last snapshot's jobs in the same places: its keys, its map moved on
        keys = last.keys
        seen_jobs = st.seen_jobs
        if changed:
            seen_jobs = dict(seen_jobs)
            seen_jobs.update((keys[i], jobs[i]) for i in changed)
    w = st.watch
    moved = _moved_nodes(st.seen_nodes, snap.nodes)
    if isinstance(w, _Watch) and w.cfg is cfg and moved is not None and not cfg.block_admission:
        watch = _decide_changed(c, w, keys, seen_jobs, moved, changed)
    else:
        watch = _decide_all(c)
    # (the key -> place map, made or not by this cycle, holds while the keys are the same)
    view = _Seen(jobs, keys, last.pos if last is not None else None, c.unlisted)
    out = GovState(jobs=c.recs, counters=st.counters, version=st.version, nodes=c.nodes)
    out.seen_jobs = seen_jobs
    out.seen_view = view
    out.seen_nodes = snap.nodes
    out.watch = watch
    out.reads = _reads_after(cfg, st.reads, c.touched, c.recs)
    return out, c.actions


@dataclass
class _Seen:
    """The snapshot a state was decided on, for the next decide() (not persisted): its jobs
    list and their keys; *pos*: key -> place (made when first needed, kept while the keys
    are); *unlisted*: keys of the state's records whose jobs it does not list (None: not
    known)."""

    jobs: list[JobObs]
    keys: list[str]
    pos: dict[str, int] | None = None
    unlisted: frozenset[str] | None = None


# Beyond this share of new observations (and a few), the C-level passes are cheaper.
IN_PLACE_SHARE, IN_PLACE_MIN = 0.125, 16


def _in_place(st: GovState, jobs: list[JobObs]) -> list[int] | None:
    """The places of *jobs* whose observation is not the last snapshot's, when *jobs* lists
    the last snapshot's jobs in the same places (a running job's observation changed, the
    rest of the queue kept); None otherwise (another length, another job in a place, many
    changed, no last snapshot)."""
    last = st.seen_view
    if not isinstance(last, _Seen) or len(last.jobs) != len(jobs):
        return None
    if len(st.seen_jobs) != len(jobs):
        return None  # (a seen_jobs that is not this view's: e.g. cleared)
    if last.jobs is jobs:
        return []
    limit = int(IN_PLACE_SHARE * len(jobs)) + IN_PLACE_MIN
    # (C level, and no further than one past the limit: jobs that left shift every place)
    changed = list(islice(compress(range(len(jobs)), map(is_not, jobs, last.jobs)), limit + 1))
    if len(changed) > limit:
        return None
    keys = last.keys
    if any(jobs[i].job_id != keys[i] for i in changed):
        return None
    return changed


_KEY = attrgetter("job_id")
_NODES = attrgetter("nodes")


def _moved_nodes(old: object, new: dict) -> frozenset[str] | None:
    """The nodes whose flags differ, in what readiness reads (readiness.READ_FLAGS), between
    two node maps (listed in one only included); empty for the same map object; None when
    *old* is no map (the first cycle). A drain, a resume or a reboot request alone moves no
    node: no phase function of a quiet record reads it (a strike, which reads drains and
    reasons, is decided only for a record whose clock is due, and that one is looked at)."""
    if new is old:
        return frozenset()
    if not isinstance(old, dict):
        return None
    try:
        diff = old.items() ^ new.items()  # (C level, flags hashable)
    except TypeError:
        return None
    return frozenset(k for k, _ in diff if _read(old.get(k)) != _read(new.get(k)))


def _read(flags: frozenset[str] | None) -> frozenset[str] | None:
    return None if flags is None else flags & readiness.READ_FLAGS


NODE_PHASES = (ADMITTED, READY, RECOVERING)  # quiet only while the node map is the same
_INF = float("inf")


@dataclass
class _Watch:
    """Derived from a decide() result, for the next one (not persisted): which records the
    next cycle must look at although their job's observation is the same object and the node
    map too. *loud*: records that are not quiet with their observation (_quiet_until None);
    *due*: a heap of (time, job id) for records quiet only until a time (a running clock).
    Every record of a listed job is in one of them or quiet for good; *due* may also hold
    stale entries (a record changed since), which cost one needless look. Valid for *cfg*
    and without block_admission (its release looks at every record)."""

    cfg: GangConfig
    loud: set[str]
    due: list[tuple[float, str]]


def _quiet_until(cfg: GangConfig, job: JobObs, old: GangRecord) -> float | None:
    """Until when (exclusive) a record *old* is quiet with the observation *job* and the
    node map it was decided on: this cycle would decide exactly what the last one did, so
    the record is kept as is (no copy, no work). inf: for good; None: not quiet. The last
    cycle ran every phase function on these very inputs (job, node map, config); what still
    differs is the clock, so a running clock is quiet only while its deadline is ahead
    (tests/unit/gang/test_gang_policy.py checks the result against the full path over random
    cycles)."""
    ph = old.phase
    if ph == PENDING:
        # block_admission: the two branches of _pending that leave it PENDING as it is (a
        # record that _admit_next released last cycle is not one of them: its job is held)
        ok = not cfg.block_admission or (
            job.state == "PENDING"
            and (
                (job.held and not old.hold_ours and not old.released_by_us)
                or (not job.held and old.released_by_us)
            )
        )
    elif ph == READY:
        ok = True
    elif ph == ADMITTED:
        if (
            job.state in ADMITTED_STATES
            and old.run_restarts == job.restarts
            and old.admitted_at is not None
        ):
            return old.admitted_at + timeout_of(cfg, old)
        return None
    elif ph == RECOVERING:
        if (
            job.state in ADMITTED_STATES
            and old.run_restarts == job.restarts
            and old.lost_at is not None
        ):
            return old.lost_at + cfg.recovery_timeout
        return None
    elif ph == BACKOFF:
        if (
            job.state == "PENDING"
            and old.next_eligible is not None
            and (
                job.held
                or job.eligible_time is None
                or abs(job.eligible_time - old.next_eligible) <= 2.0
            )
        ):
            return old.next_eligible
        return None
    elif ph == WAITING:
        ok = job.held and old.hold_ours
    elif ph == DEACTIVATED:
        ok = old.hold_confirmed and job.admin_held
    elif ph == DONE:
        # (a job that is no longer a gang by its looks, e.g. its NumNodes after the end, has
        # its record forgotten an hour after it finished: _record, then _forget, each time)
        ok = job.finished and is_gang(cfg, job)
    else:
        ok = False
    return _INF if ok else None


def _keep(c: _Cycle, job: JobObs, old: GangRecord) -> None:
    c.seen.add(job.job_id)
    c.recs[job.job_id] = old  # never mutated: a release copies it first
    if old.phase == WAITING:
        c.held_now.add(job.job_id)


def _process(c: _Cycle, job: JobObs) -> None:
    """Every phase function for one job whose record is not quiet."""
    rec = _record(c, job)
    if rec is None:
        return
    _observe(c, rec, job)
    if _finished(c, rec, job):
        return
    if rec.phase == DEACTIVATED and _deactivated(c, rec, job):
        return
    if job.state == "PENDING":
        _pending(c, rec, job)
    elif job.state in ADMITTED_STATES:
        _admitted(c, rec, job)
    # COMPLETING, SUSPENDED, ...: nothing to decide


def _decide_all(c: _Cycle) -> _Watch | None:
    """Every job: those whose observation and node map are the same objects as last cycle's
    and whose record is quiet (_quiet_until) are kept as they are, the others decided. Also
    builds the _Watch that lets the next cycle look only at what changed."""
    cfg, st, now = c.cfg, c.st, c.now
    same_nodes = c.snap.nodes is st.seen_nodes
    seen_get, old_get = st.seen_jobs.get, st.jobs.get
    loud: set[str] = set()
    due: list[tuple[float, str]] = []
    looked: list[JobObs] = []
    for job in c.snap.jobs:
        if seen_get(job.job_id) is job:
            old = old_get(job.job_id)
            if old is None:
                continue  # no record for this very observation last cycle: not a gang
            t = _quiet_until(cfg, job, old)
            if t is not None and now < t and (same_nodes or old.phase not in NODE_PHASES):
                _keep(c, job, old)
                if t != _INF:
                    due.append((t, job.job_id))
                continue
        _process(c, job)
        looked.append(job)
    _forget_gone(c)
    if cfg.block_admission:
        _admit_next(c)
        return None
    _classify(c, looked, loud, due.append)
    heapify(due)
    return _Watch(cfg, loud, due)


def _classify(c: _Cycle, looked: list[JobObs], loud: set[str], push: Callable) -> None:
    """Enter the records decided for *looked* into the next cycle's watch."""
    cfg, recs = c.cfg, c.recs
    for job in looked:
        rec = recs.get(job.job_id)
        if rec is None:
            continue
        t = _quiet_until(cfg, job, rec)
        if t is None:
            loud.add(job.job_id)
        elif t != _INF:
            push((t, job.job_id))


WATCH_SLACK = 1024  # stale entries in the heap beyond the records: rebuilt by a full pass


def _decide_changed(
    c: _Cycle,
    w: _Watch,
    keys: list[str],
    seen_jobs: dict[str, JobObs],
    moved: frozenset[str],
    changed: list[int] | None = None,
) -> _Watch | None:
    """The same config as last cycle: only jobs whose observation is a new object, loud
    records, records whose clock is due and jobs on a node whose flags changed (*moved*:
    readiness reads only the job's own nodes) are looked at (in the snapshot's order, as
    _decide_all would); every other record is quiet by _Watch's invariant and kept as it
    is. Records of jobs no longer listed go through _forget. *changed*: _in_place's places
    (the last snapshot's jobs in the same places): then those places and the loud and due
    records' are looked at, and the unlisted records are the last cycle's."""
    st, now = c.st, c.now
    jobs = c.snap.jobs
    due = list(w.due)  # (the input state is never mutated)
    loud = set(w.loud)
    look = loud.copy()
    while due and due[0][0] <= now:
        look.add(heappop(due)[1])
    last = st.seen_view if changed is not None else None
    if isinstance(last, _Seen) and not moved:
        looked = _looked_in_place(jobs, keys, cast(list[int], changed), look, last)
    else:
        # C level: a job is looked at when its observation is not last cycle's object, or
        # its record is loud or due
        fresh = map(is_not, map(st.seen_jobs.get, keys), jobs)
        mask = map(or_, fresh, map(look.__contains__, keys)) if look else fresh
        if moved:  # jobs on a node whose flags changed: readiness is theirs to look at again
            mask = map(or_, mask, map(not_, map(moved.isdisjoint, map(_NODES, jobs))))
        looked = list(compress(jobs, mask))
    c.recs = dict(st.jobs)  # the quiet ones kept as they are (decide never mutates them)
    if isinstance(last, _Seen) and last.unlisted is not None:
        gone = list(last.unlisted)  # (the same jobs listed: the same records unlisted)
    else:
        gone = list(st.jobs.keys() - seen_jobs.keys())
    unlisted = len(gone)
    old_get = st.jobs.get
    for job in looked:
        jid = job.job_id
        old = old_get(jid)
        if st.seen_jobs.get(jid) is job:
            if old is None:
                continue
            t = _quiet_until(c.cfg, job, old)
            if (
                t is not None
                and now < t
                and (old.phase not in NODE_PHASES or moved.isdisjoint(job.nodes))
            ):
                continue  # (a stale entry, or nodes of no concern: kept, entered again below)
        c.recs.pop(jid, None)
        _process(c, job)
        if jid not in c.recs and old is not None:
            gone.append(jid)  # no longer a gang: its old record is forgotten as a gone one
        loud.discard(jid)
    for jid in gone:
        loud.discard(jid)
        _forget(c, jid, st.jobs[jid])
    c.touched = {job.job_id for job in looked}.union(gone)  # (no other record is replaced)
    c.unlisted = frozenset(k for k in gone[:unlisted] if k in c.recs)  # (_forget kept them)
    _classify(c, looked, loud, partial(heappush, due))
    if len(due) > len(c.recs) + WATCH_SLACK:
        return None  # too many stale entries: the next cycle takes the full pass
    return _Watch(c.cfg, loud, due)


def _looked_in_place(
    jobs: list[JobObs], keys: list[str], changed: list[int], look: set[str], last: _Seen
) -> list[JobObs]:
    """The jobs to look at, in the snapshot's order, when the snapshot lists the last one's
    jobs in the same places: the *changed* places and those of the *look* keys (a key of a
    job no longer listed has none)."""
    pos = last.pos
    if pos is None:  # (kept in the view, and the next one's, while the keys are the same)
        pos = last.pos = dict(zip(keys, range(len(keys)), strict=False))
    places = set(changed)
    places.update(i for i in map(pos.get, look) if i is not None)
    return [jobs[i] for i in sorted(places)]


def _record(c: _Cycle, job: JobObs) -> GangRecord | None:
    """This cycle's copy of the job's record (the input state is never mutated); None if it
    is not a gang. A job id that Slurm reuses (new SubmitTime, no requeue) starts fresh."""
    jid = job.job_id
    old = c.st.jobs.get(jid)
    if (
        old is not None
        and old.obs_submit is not None
        and job.submit_time is not None
        and job.submit_time != old.obs_submit
        and job.restarts <= (old.obs_restarts or 0)
    ):
        old = None  # same id, another job: its count and history are not this job's
    # Once a gang, always a gang: while COMPLETING, Slurm shows only the nodes still
    # completing in NumNodes, so the size rule alone would drop a requeued job.
    if not is_gang(c.cfg, job) and (old is None or old.phase == DONE):
        return None
    c.seen.add(jid)
    if old is not None:
        rec = _new_rec(GangRecord)
        rec.__dict__.update(old.__dict__)
    else:
        rec = _bootstrap(job)
    c.recs[jid] = rec
    return rec


def _observe(c: _Cycle, rec: GangRecord, job: JobObs) -> None:
    """What Slurm says about the job, independent of its phase."""
    if rec.submit_time is None:
        rec.submit_time = job.submit_time
    if rec.restarts_seen is None:
        rec.restarts_seen = job.restarts
    elif job.restarts > rec.restarts_seen:
        # Slurm requeued it on its own (prolog failure, node failure, operator requeue).
        rec.restarts_seen = job.restarts
        rec.why = f"requeued by Slurm (Restarts={job.restarts}, Reason={job.reason})"
        c.act(ActionKind.NOTE, rec, job, "RequeuedBySlurm", rec.why)
        if rec.phase in (ADMITTED, READY, RECOVERING, NOT_REQUEUEABLE):
            rec.phase = PENDING
    rec.obs_submit, rec.obs_restarts = job.submit_time, job.restarts
    rec.partition = job.partition
    rec.slurm_reason = job.reason
    rec.eligible_at = job.eligible_time
    if job.state == "PENDING" and not job.held and job.priority > 0:
        rec.priority = job.priority  # a hold sets Priority=0: keep the last real one


def _finished(c: _Cycle, rec: GangRecord, job: JobObs) -> bool:
    if job.finished:
        if rec.phase != DONE:
            rec.phase, rec.done_at, rec.why = DONE, c.now, job.state
            c.act(ActionKind.NOTE, rec, job, "Finished", job.state, phase=DONE)
        return True
    if rec.phase == DONE:  # requeued after we saw it finish
        rec.phase, rec.done_at = PENDING, None
    return False


def _deactivated(c: _Cycle, rec: GangRecord, job: JobObs) -> bool:
    """Deactivated: requeuehold, then our admin hold. True = nothing more this cycle.

    Only a release of the *confirmed* admin hold is an operator's (the owner cannot release
    an admin hold); COMPLETING (the epilog after requeuehold) and other states never are. A
    requeuehold that did not reach Slurm, or that the owner undid before our admin hold
    closed it, is issued again with the same count."""
    if job.state == "PENDING":
        if job.admin_held:
            rec.hold_confirmed = True
            return True
        if rec.hold_confirmed:
            _operator_release(c, rec, job)
            return False
        if (
            job.held
            and rec.hold_asked_at is not None
            and c.now - rec.hold_asked_at < HOLD_RETRY_SECONDS
        ):
            return True  # still under requeuehold's own hold: ask again later, not every cycle
        rec.hold_ours, rec.hold_asked_at = True, c.now
        c.act(ActionKind.HOLD, rec, job, "Deactivated", "close the deactivation: admin hold")
        return True
    if job.state in ADMITTED_STATES:
        if rec.hold_confirmed and job.restarts != rec.restarts_at_action:
            _operator_release(c, rec, job)
            return False
        lost = job.restarts == rec.restarts_at_action
        detail = (
            "re-issue requeuehold that did not reach slurmctld"
            if lost
            else "started again before the admin hold closed it: requeuehold again"
        )
        rec.restarts_at_action = job.restarts
        rec.restarts_seen = job.restarts + 1
        reason = rec.why.split(";")[0] or REASON_TIMEOUT
        # a requeuehold that never reached slurmctld was not counted (it failed): count it now
        c.act(ActionKind.REQUEUEHOLD, rec, job, reason, detail, reissue=not lost)
        return True
    return True


def _operator_release(c: _Cycle, rec: GangRecord, job: JobObs) -> None:
    rec.phase, rec.count, rec.next_eligible, rec.why = PENDING, 0, None, "released by operator"
    rec.first_admitted_at = None  # the time limit, like the count, starts again
    rec.released_by_us = rec.hold_ours = rec.hold_confirmed = False
    c.act(ActionKind.ANNOTATE, rec, job, "Released", rec.why, count=0, phase=PENDING)


def _pending(c: _Cycle, rec: GangRecord, job: JobObs) -> None:
    if rec.phase in (ADMITTED, READY, RECOVERING, NOT_REQUEUEABLE):
        rec.phase = PENDING  # back in the queue without a requeue (e.g. preempted)
    if rec.phase == BACKOFF:
        nxt = rec.next_eligible
        if nxt is not None and not job.held and job.eligible_time is not None:
            # Before the backoff ends: the governor died between requeue and StartTime update.
            # After it: the old allocation was COMPLETING past the backoff (a slow epilog), and
            # when it ended Slurm moved a begin time already past to now + ~121 s (its
            # requeue hold-off, batch_requeue_fini): the backoff would silently become 2 min.
            early = c.now < nxt and abs(job.eligible_time - nxt) > 2.0
            late = c.now >= nxt and job.eligible_time > c.now + 2.0
            if early or late:
                c.act(
                    ActionKind.SET_START,
                    rec,
                    job,
                    "Backoff",
                    "repair StartTime",
                    start_at=max(nxt, c.now),
                )
                return
        if nxt is not None and c.now < nxt:
            return
        rec.phase = PENDING
    if not c.cfg.block_admission:
        rec.phase = PENDING
        return
    if job.held:
        if rec.hold_ours:
            rec.phase = WAITING
            c.held_now.add(rec.job_id)
        else:
            # Someone else's hold (the owner's, an operator's, Slurm's launch-failure hold):
            # never ours to release; the job is not in the admission queue.
            rec.phase, rec.released_by_us = PENDING, False
            rec.why = f"held by someone else ({job.reason}): not released by the governor"
        return
    if rec.released_by_us:
        rec.phase = PENDING
        return
    rec.phase, rec.hold_ours = WAITING, True
    c.held_now.add(rec.job_id)  # held by us in this cycle: may be released in this cycle
    c.act(ActionKind.HOLD, rec, job, "Admission", "block_admission: queued")


def _admitted(c: _Cycle, rec: GangRecord, job: JobObs) -> None:
    cfg, now = c.cfg, c.now
    if rec.phase == BACKOFF and rec.restarts_at_action == job.restarts:
        # Our requeue was decided (and persisted) but never reached Slurm: re-issue it,
        # same attempt number, so a crash cannot double-count or double-requeue.
        c.act(
            ActionKind.REQUEUE,
            rec,
            job,
            rec.why or REASON_TIMEOUT,
            "re-issue interrupted requeue",
            start_at=rec.next_eligible,
            hold=cfg.block_admission,
        )
        return
    if rec.phase == NOT_REQUEUEABLE and rec.run_restarts == job.restarts:
        return
    if rec.phase not in (ADMITTED, READY, RECOVERING) or rec.run_restarts != job.restarts:
        # First admission of this run: the clock starts here and is not moved by a later
        # StartTime (Slurm resets it when cloud nodes finish powering up).
        start = job.start_time if job.start_time is not None and job.start_time <= now else now
        rec.phase, rec.admitted_at, rec.ready_at, rec.lost_at = ADMITTED, start, None, None
        rec.run_restarts, rec.admitted_nodes = job.restarts, job.num_nodes
        rec.released_by_us = rec.hold_ours = False
        rec.why = ""
        if rec.first_admitted_at is None:
            rec.first_admitted_at = start
        _own_deadline(c, rec, job)
    start = rec.admitted_at if rec.admitted_at is not None else now
    if rec.phase == ADMITTED:
        _wait_for_ready(c, rec, job, start)
    elif rec.phase == READY:
        ok, why = readiness.still_ready(job, c.snap.nodes, rec.admitted_nodes)
        if not ok and cfg.recovery_timeout > 0:
            rec.phase, rec.lost_at, rec.why = RECOVERING, now, why
            c.act(ActionKind.NOTE, rec, job, "ReadinessLost", why)
    elif rec.phase == RECOVERING:
        ok, why = readiness.still_ready(job, c.snap.nodes, rec.admitted_nodes)
        if ok:
            rec.phase, rec.lost_at, rec.why = READY, None, ""
            strikes.clear_on_ready(c.nodes, job)
            c.act(ActionKind.NOTE, rec, job, "Recovered", "all nodes ready again")
        elif rec.lost_at is not None and now >= rec.lost_at + cfg.recovery_timeout:
            _evict(
                c,
                rec,
                job,
                REASON_RECOVERY,
                CAUSE_RECOVERY,
                now - (rec.ready_at or start),
                rec.lost_at + cfg.recovery_timeout,
            )
        else:
            rec.why = why


def _own_deadline(c: _Cycle, rec: GangRecord, job: JobObs) -> None:
    """At an admission: the job's own timeout request for this run, judged within the
    operator's bounds (gang/deadlines.py). A refused one leaves the configured timeout; every
    verdict is recorded (event + the job's AdminComment), a job that asks for nothing is not."""
    dec = deadlines.request(c.cfg.deadlines, c.cfg.timeout, job)
    rec.timeout = None if dec is None else dec.timeout
    if dec is None:
        return
    applied = timeout_of(c.cfg, rec)
    c.act(
        ActionKind.DEADLINE,
        rec,
        job,
        dec.verdict.value,
        dec.detail,
        timeout=applied,
        admin=deadlines.admin_token(dec, applied),
    )


def _wait_for_ready(c: _Cycle, rec: GangRecord, job: JobObs, start: float) -> None:
    ok, why = readiness.check(job, c.snap.nodes, c.cfg.probe.mode, rec.admitted_nodes)
    deadline = start + timeout_of(c.cfg, rec)
    if ok:
        rec.phase, rec.ready_at, rec.why = READY, c.now, ""
        strikes.clear_on_ready(c.nodes, job)
        c.act(ActionKind.NOTE, rec, job, "PodsReady", "all nodes ready", waited=c.now - start)
    elif c.now >= deadline:
        _evict(c, rec, job, REASON_TIMEOUT, CAUSE_START, c.now - start, deadline)
    else:
        if why != rec.why and why.startswith(readiness.PREFLIGHT_SLOW):
            # at once, so the owner sees which node; the strike waits for the timeout
            c.act(ActionKind.NOTE, rec, job, "PreflightSlow", why)
        rec.why = why


def _evict(
    c: _Cycle, rec: GangRecord, job: JobObs, reason: str, cause: str, waited: float, deadline: float
) -> None:
    cfg, now = c.cfg, c.now
    # Node strikes (and drains) come first: the drain then reaches slurmctld before the
    # requeue frees the node, so no scheduling pass in between can hand it out again.
    c.actions.extend(strikes.strike(cfg, c.nodes, job, c.snap, now, c.struck, reason))
    rec.restarts_seen = job.restarts + (1 if job.requeue else 0)
    common = {"waited": waited, "deadline": deadline, "cause": cause}
    if not job.requeue:
        rec.phase = NOT_REQUEUEABLE
        kind = ActionKind.CANCEL if cfg.not_requeueable == "cancel" else ActionKind.RECORD
        rec.why = f"{reason}: job cannot be requeued (Requeue=0 or not a batch job)"
        c.act(kind, rec, job, reason, rec.why, **common)
        return
    n = rec.count = rec.count + 1
    rec.last_evicted_at = now
    rec.restarts_at_action = job.restarts
    rec.released_by_us = False
    over = over_limit(cfg, rec, n, now)
    if over:
        rec.phase, rec.next_eligible = DEACTIVATED, None
        rec.hold_ours, rec.hold_confirmed = True, False
        rec.why = f"{reason}; {over}: deactivated"
        c.act(ActionKind.REQUEUEHOLD, rec, job, reason, rec.why, **common)
        return
    delay = backoff_delay(cfg, job.job_id, n)
    rec.phase, rec.next_eligible, rec.why = BACKOFF, now + delay, reason
    rec.hold_ours = cfg.block_admission  # requeued under our admin hold: back in the queue
    c.act(
        ActionKind.REQUEUE,
        rec,
        job,
        reason,
        rec.why,
        start_at=now + delay,
        backoff=delay,
        hold=cfg.block_admission,
        **common,
    )


def over_limit(cfg: GangConfig, rec: GangRecord, n: int, now: float) -> str:
    """Why the *n*-th eviction deactivates the gang ("" = it does not): more than
    backoff_limit_count requeues, and/or backoff_limit_seconds passed since its first
    admission; with both set, backoff_limit_combine says whether any or all must be passed."""
    r = cfg.requeuing
    passed: list[str] = []
    limits = 0
    if r.backoff_limit_count is not None:
        limits += 1
        if n > r.backoff_limit_count:
            passed.append(f"requeue {n} > {LIMIT_COUNT} {r.backoff_limit_count}")
    if r.backoff_limit_seconds is not None:
        limits += 1
        first = rec.first_admitted_at
        if first is not None and now - first >= r.backoff_limit_seconds:
            passed.append(
                f"{now - first:.0f}s since first admission >= {LIMIT_SECONDS} "
                f"{r.backoff_limit_seconds:g}"
            )
    if not passed or (r.backoff_limit_combine == "all" and len(passed) < limits):
        return ""
    return " and ".join(passed)


def _forget_gone(c: _Cycle) -> None:
    """Jobs gone from Slurm (purged after MinJobAge) or finished long ago."""
    jobs = c.st.jobs
    for jid in filterfalse(c.seen.__contains__, jobs):  # C-level skip of the seen ones
        _forget(c, jid, jobs[jid])


def _forget(c: _Cycle, jid: str, old: GangRecord) -> None:
    """A record whose job Slurm no longer lists (or no longer a gang): done, then dropped."""
    if old.phase == DONE:
        if old.done_at is not None and c.now - old.done_at < DONE_KEEP_SECONDS:
            c.recs[jid] = old
        else:
            c.recs.pop(jid, None)
    else:
        c.recs[jid] = replace(old, phase=DONE, done_at=c.now, why="gone from slurmctld")


def admission_key(cfg: GangConfig, r: GangRecord) -> tuple:
    """Slurm priority first (higher first), then Kueue's requeuingStrategy timestamp."""
    if cfg.requeuing.timestamp == "eviction" and r.last_evicted_at is not None:
        t = r.last_evicted_at
    else:
        t = r.submit_time or 0.0
    return (-r.priority, t, int(r.job_id) if r.job_id.isdigit() else 0, r.job_id)


def _admit_next(c: _Cycle) -> None:
    """block_admission: release the next queued gang when none blocks. Blocking: admitted and
    not (or no longer) ready, or released and able to start (a released gang that waits for
    its own BeginTime, dependency or limits would stall the queue)."""
    recs = c.recs.values()
    busy = any(
        r.phase in (ADMITTED, RECOVERING)
        or (
            r.phase == PENDING
            and r.released_by_us
            and not waits_for_itself(r.slurm_reason, r.eligible_at, c.now + c.cfg.timeout)
        )
        for r in recs
    )
    if busy:
        return
    # only jobs under our hold (seen in Slurm, or placed in this cycle)
    waiting = [r for r in recs if r.phase == WAITING and r.hold_ours and r.job_id in c.held_now]
    if not waiting:
        return
    nxt = min(waiting, key=lambda r: admission_key(c.cfg, r))
    if c.st.jobs.get(nxt.job_id) is nxt:  # kept as is by _quiet: copy before changing it
        nxt = c.recs[nxt.job_id] = replace(nxt)
    nxt.phase, nxt.released_by_us, nxt.hold_ours = PENDING, True, False
    nxt.why = "released by block_admission"
    c.act(
        ActionKind.RELEASE,
        nxt,
        None,
        "Admission",
        "no admitted-but-not-ready gang job",
        partition=nxt.partition,
    )


# Phases in which a pending job's decisions read more than its state (holds, EligibleTime,
# Priority, Reason): the reader reads these jobs in full every cycle (read_plan.py).
FULL_READ_PHASES = frozenset({BACKOFF, WAITING, DEACTIVATED})


def full_reads(cfg: GangConfig, st: GovState) -> frozenset[str]:
    """Keys of the gangs whose jobs the next cycle must read in full even while they are
    plainly pending. A pending gang in PENDING reads nothing else, except under
    block_admission: its hold and Reason decide the admission queue (and non-pending jobs
    are read in full anyway)."""
    return _reads(cfg, st).full


@dataclass(frozen=True)
class _Reads:
    """full_reads and settled_reads of one state for one config (not persisted): made by a
    walk of the records, or by decide() from the last state's and the keys it touched (a
    walk of 37k records was ~5 ms each, every cycle, at 50k queued)."""

    cfg: GangConfig
    full: frozenset[str]
    settled: frozenset[str]


def _full_phases(cfg: GangConfig) -> frozenset[str]:
    return FULL_READ_PHASES | {PENDING} if cfg.block_admission else FULL_READ_PHASES


def _reads(cfg: GangConfig, st: GovState) -> _Reads:
    r = st.reads
    if isinstance(r, _Reads) and r.cfg is cfg:
        return r
    full = _full_phases(cfg)
    r = st.reads = _Reads(
        cfg,
        frozenset(k for k, v in st.jobs.items() if v.phase in full),
        frozenset(k for k, v in st.jobs.items() if v.phase == READY),
    )
    return r


def _reads_after(
    cfg: GangConfig, last: object, touched: set[str] | None, recs: dict[str, GangRecord]
) -> _Reads | None:
    """The new state's _Reads from the last state's: only the *touched* keys can have
    changed phase or gone (None: not known, made by a walk when asked)."""
    if touched is None or not isinstance(last, _Reads) or last.cfg is not cfg:
        return None
    if not touched:
        return last
    full = _full_phases(cfg)
    phase = {k: r.phase for k in touched if (r := recs.get(k)) is not None}
    return _Reads(
        cfg,
        last.full.difference(touched).union(k for k, p in phase.items() if p in full),
        last.settled.difference(touched).union(k for k, p in phase.items() if p == READY),
    )


def settled_reads(st: GovState) -> frozenset[str]:
    """Keys of the running gangs the next cycle may keep from their last full record while
    their listed state is the same and their nodes are up (read_plan.py): those found ready.
    Every field of a running job that a decision reads, by phase function:
    - _record/_observe: Restarts (grows only by a requeue, which lists the job
      COMPLETING/PENDING: read in full; Slurm holds a requeued batch job back ~121 s before
      it may start again), SubmitTime (a reused id is a new job: listed as new), Partition,
      Reason, EligibleTime, Priority (kept in the record; Priority only while pending; read
      by no decision of a READY gang);
    - _finished / the PENDING branch: the state (the listing's);
    - _admitted, READY: readiness.still_ready: the state, NumNodes and NodeList against the
      node map. Node failures come from the node read (a settled job whose node is down,
      not responding, not allocated or unlisted is read in full); what a kept record may miss
      for at most the refresh bound: a shrink (`scontrol update NumNodes`, or a --no-kill
      node failure whose DOWN came and went between two node reads) whose freed node was
      handed to another job at once: then RECOVERING begins at the refresh, not at once;
    - an action's job fields (restarts, partition, address: the same while running).
    ADMITTED (the ready mark in Comment, Reason=Prolog, preflight marks), RECOVERING,
    BACKOFF, DEACTIVATED and NOT_REQUEUEABLE read their running job in full every cycle."""
    r = st.reads
    if isinstance(r, _Reads):  # (settled does not depend on the config)
        return r.settled
    return frozenset(k for k, v in st.jobs.items() if v.phase == READY)


def next_deadline(cfg: GangConfig, st: GovState, now: float) -> float | None:
    """The earliest timeout still ahead of *now*: an admitted gang's `timeout`, a recovering
    one's `recovery_timeout`. The governor's loop wakes for it instead of waiting for its next
    interval tick, so a deadline is acted on one snapshot after it passes, not up to one
    interval later (Kueue, too, requeues after exactly the time left). Deadlines already
    passed are not returned: those are the regular cycle's (no busy loop on one it skipped).
    With decide()'s _Watch for this state: its heap in order, then the loud records (an
    admitted record of a job that is not running, e.g. COMPLETING, has no entry); else a
    plain walk (1.5 ms at 7.6k gangs)."""
    w = st.watch
    if isinstance(w, _Watch) and w.cfg is cfg:
        return _next_deadline_watched(cfg, st, w, now)
    due = None
    for rec in st.jobs.values():
        t = _deadline_of(cfg, rec)
        if t is not None and t > now and (due is None or t < due):
            due = t
    return due


def _deadline_of(cfg: GangConfig, rec: GangRecord) -> float | None:
    if rec.phase == ADMITTED and rec.admitted_at is not None:
        return rec.admitted_at + timeout_of(cfg, rec)
    if rec.phase == RECOVERING and rec.lost_at is not None and cfg.recovery_timeout > 0:
        return rec.lost_at + cfg.recovery_timeout
    return None


def _next_deadline_watched(cfg: GangConfig, st: GovState, w: _Watch, now: float) -> float | None:
    """next_deadline from the watch: every admitted or recovering record of a listed job is
    in *due* at its deadline or in *loud*; records of jobs no longer listed are done (decide
    made them so). Entries are taken in time order from a copy until the first that is
    still its record's deadline (stale ones and backoffs are passed over)."""
    get = st.jobs.get
    due = None
    for jid in w.loud:
        rec = get(jid)
        t = None if rec is None else _deadline_of(cfg, rec)
        if t is not None and t > now and (due is None or t < due):
            due = t
    heap = list(w.due)
    while heap and (due is None or heap[0][0] < due):
        t, jid = heappop(heap)
        rec = get(jid)
        if t > now and rec is not None and _deadline_of(cfg, rec) == t:
            return t
    return due
