"""Which jobs one governor cycle reads in full from slurmctld (issue 24, item 5).

Reading every job in full each cycle (`scontrol show job --json`) costs seconds and tens of
MB with 10k queued jobs on 24.11 (bench/README-gang.md, `live`), almost all of it for pending
jobs whose decisions read nothing but their state. On Slurm >= 24.05 a cycle reads instead:

1. a state listing of every job (`squeue --json --only-job-state`: each job's name as squeue
   prints it, `N`, `JobId_T` or `JobId+Offset`, and its state; no user text), parsed with
   the same grammars as a full record (slurm_records.parse_job_states);
2. in full, `squeue --json --states=all --jobs=...` (the same records as scontrol's, checked
   on 24.11), or for at most few_ids() plain job ids (no array, no het job; 4 up to 10k
   listed jobs, one more per 2,000, at most 24) one `scontrol show job --json ID` each
   (slurmctld's single-job RPC, the same record: squeue loads every job in the client,
   ~50 ms at 10k queued and ~230 ms at 50k, the single read 7-10 ms): every job that is not
   plainly PENDING (running, configuring, completing, suspended, finished, PENDING with a
   flag), every job whose listed state differs from its
   last full record or that has none (new), an array's record of pending tasks whose task
   ids differ from the listed ones, the gangs the governor names (policy.full_reads:
   backoff, deactivated, block_admission's), a het job's every component with any one,
   and the kept records read longest ago, in batches: enough that each is at most
   STALE_SECONDS old (at most REFRESH_MAX a cycle: the bound holds up to REFRESH_MAX *
   STALE_SECONDS / cycle seconds kept jobs, 60k at 1 s cycles). A batch is taken when the
   cycle reads in full anyway, REFRESH_EVERY seconds after the last one, or when a record
   would pass the bound before the next: squeue filters --jobs in the client (slurmctld
   packs every job), so a full read of 30 ids costs about what one of 2 does, and a
   quiet cycle (2 in 3 with a quiet queue) makes none; a cycle whose own reads are a few
   plain ids (read one by one) takes no batch along unless one is due.

Every other pending job keeps its last full record (the same object, so the policy sees the
same observation and keeps its decision record as it is). What such a record may miss, for
at most STALE_SECONDS (+ one interval): an owner's or operator's `scontrol update` of a
pending job (size, partition, QOS, Comment, Priority) and a requeue by Slurm that began and
ended between two cycles (its RequeuedBySlurm note comes at the refresh or when the job
starts again, whichever is first). No decision reads those while the job is plainly pending
and in a phase full_reads does not name; a job that starts is read in full that cycle.

Running gangs that the governor found ready (policy.settled_reads) are kept the same way,
under the same refresh, while the listing shows the state of their last full record and
this cycle's node read shows every node of that record listed, allocated (HELD_FLAGS) and
free of UNSETTLED_FLAGS (readiness.READ_FLAGS and IDLE/FUTURE: no longer this job's). What
such a record may miss, and why no decision needs it at once: policy.settled_reads.

Records are listed in the full reads' order (slurmctld's job list; the listing has its own).
With more than FULL_SHARE of the listed jobs to request, more ids than fit one command line
(MAX_IDS), on the first cycle, or when squeue refuses a one-job filter (the job left since the
listing), the cycle reads every job in full, unfiltered (with the jobs command, scontrol's
on 24.11, as the full path does). A plain job read one by one that left
since the listing comes back as no record (slurmctld's empty list, or "Invalid job id"), as a
filtered squeue read leaves it out: its kept record is dropped. 22.05 and 23.x (no listing) read
every job in full every cycle, as before.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from nodeforge.slurm_records import JobRecord, JobState, SlurmDataError, array_task_ids

STALE_SECONDS = 300.0  # the oldest a pending job's full record may be (bench/README-gang.md)
FULL_SHARE = 0.5
# kept records refreshed per cycle, at most: a batch of 200 costs squeue ~440 ms at 50k
# queued (~200 ms + ~1.2 ms an id; 500: ~790 ms), so a refresh cycle stays under 1 s there
REFRESH_MAX = 200
# Seconds between refreshes of a quiet queue (at most stale / 10): a batch of the share of
# the kept records due in that time. At 10k queued that is 100 ids every 3 s, ~90 ms of
# `squeue --jobs` (49 ms + 0.4 ms an id, measured live on 24.11.5): the refresh cycle stays
# within the 250 ms goal, where 10 s (200 ids, the REFRESH_MAX cap) made it ~270 ms.
REFRESH_EVERY = 3.0
MAX_IDS = 4000  # ~40 kB of argv: far below Linux's 128 kB per argument
# Up to few_ids(listed) plain ids, one `scontrol show job --json ID` each (7-10 ms:
# slurmctld's single-job RPC) beats one `squeue --jobs`, which loads every job in the
# client: 49-74 ms for 2-64 ids at 10k queued, 233-313 ms at 50k (~4.7 us a queued job,
# + 0.4-1.2 ms an id), measured live on 24.11.5 (bench/README-gang.md, `calls`). The
# break-even is ~7 ids at 10k and ~25 at 50k: one id more per QUEUED_PER_ID listed jobs.
FEW_IDS_MIN, FEW_IDS_MAX = 4, 24
QUEUED_PER_ID = 2000


def few_ids(listed: int) -> int:
    """How many plain ids a cycle reads one by one, with *listed* jobs in the listing."""
    return max(FEW_IDS_MIN, min(FEW_IDS_MAX, listed // QUEUED_PER_ID))


# A settled job's node with any of these (or none of HELD_FLAGS, or not listed) is read in
# full: what readiness reads (its READ_FLAGS, spelled out: read_plan must not import the
# policy) and the node no longer being allocated (a shrink; FUTURE/IDLE).
UNSETTLED_FLAGS = frozenset(
    {"DOWN", "NOT_RESPONDING", "FAIL", "POWERING_UP", "POWER_DOWN", "POWERED_DOWN"}
    | {"POWERING_DOWN", "UNKNOWN", "IDLE", "FUTURE"}
)
HELD_FLAGS = frozenset({"ALLOCATED", "MIXED"})

NodeFlags = Mapping[str, frozenset[str]]
_JID = operator.attrgetter("job_id")


def _is_meta(r: JobRecord) -> bool:
    """An array's one record of its pending tasks (listed as one `A_T` entry per task)."""
    return r.array_job_id is not None and r.array_task_id is None


def listing_key(r: JobRecord) -> str:
    """How the state listing names the job of a record that is not an array's record of
    pending tasks: by the record's own job id (checked on 24.11: array task 2 of array 4,
    split out as job 9, is `9_2`; het component 6 at offset 1 is `6+1`)."""
    if r.array_job_id is not None:
        return f"{r.job_id}_{r.array_task_id}"
    if r.het_job_id is not None:
        return f"{r.job_id}+{r.het_job_offset}"
    return str(r.job_id)


def request(r: JobRecord) -> str:
    """What squeue's --jobs takes to read *r* again in full (checked on 24.11): an array's
    record of pending tasks by the array's id (with every task of the array: `A_T` would
    print task T alone, expanded, not the record); a het component by its leader's id
    (every component: the gang is one merged observation); any other job, array tasks
    included, by its own id."""
    if _is_meta(r):
        return str(r.array_job_id)
    if r.het_job_id is not None:
        return str(r.het_job_id)
    return str(r.job_id)


@dataclass
class Known:
    """Between cycles: each job's last full record, when it was read (in that order: the
    oldest read first, so the refresh takes them from the front), and the records by the
    listing's key (*by_key*) or, for an array's record of pending tasks, by its job id
    (*meta*: the listing names its tasks `JobId_T`). Kept in step by store/drop."""

    records: dict[int, JobRecord] = field(default_factory=dict)
    read_at: dict[int, float] = field(default_factory=dict)
    by_key: dict[str, JobRecord] = field(default_factory=dict)
    meta: dict[int, JobRecord] = field(default_factory=dict)
    refreshed_at: float | None = None  # the last refresh's (or unfiltered full read's) time
    # For plan()'s memo (_Base): the listing keys whose record changed since it was made
    # (None: an array's record of pending tasks changed, or all were cleared: made anew),
    # and the records' list as assemble() last returned it, valid while *version* stands.
    touched: set[str] | None = field(default=None, repr=False)
    version: int = field(default=0, repr=False)
    memo: _Base | None = field(default=None, repr=False)
    values: tuple[int, list[JobRecord]] | None = field(default=None, repr=False)

    def _touch(self, r: JobRecord) -> None:
        self.version += 1
        if self.touched is not None:
            if _is_meta(r):
                self.touched = None
            else:
                self.touched.add(listing_key(r))

    def store(self, r: JobRecord, now: float) -> JobRecord:
        """Enter a freshly read record; an equal one already known stays (the same object:
        the policy then sees the same observation)."""
        jid = r.job_id
        old = self.records.get(jid)
        if old is not None and (old is r or old == r):
            r = old
        else:
            if old is not None:
                self._unindex(old)
                self._touch(old)
            self._touch(r)
            self.records[jid] = r
            if _is_meta(r):
                self.meta[jid] = r
            else:
                self.by_key[listing_key(r)] = r
        self.read_at.pop(jid, None)  # (re-entered: now the newest)
        self.read_at[jid] = now
        return r

    def _unindex(self, r: JobRecord) -> None:
        if _is_meta(r):
            if self.meta.get(r.job_id) is r:
                del self.meta[r.job_id]
        else:
            k = listing_key(r)
            if self.by_key.get(k) is r:
                del self.by_key[k]

    def drop(self, jid: int) -> None:
        r = self.records.pop(jid, None)
        if r is not None:
            self._unindex(r)
            self._touch(r)
        self.read_at.pop(jid, None)

    def keep_only(self, jids: set[int], also: set[int] | None = None) -> None:
        """Drop every record whose id is in neither *jids* nor *also*."""
        gone = self.records.keys() - jids  # (no union of the two: *jids* may be the queue)
        for jid in gone - also if also else gone:
            self.drop(jid)

    def listed(self) -> list[JobRecord]:
        """The records in order: the same list while none changed (jobs_from_records and
        decide() then see the very same objects)."""
        if self.values is None or self.values[0] != self.version:
            self.values = (self.version, list(self.records.values()))
        return self.values[1]

    def clear(self) -> None:
        self.version += 1
        self.touched = self.memo = None
        self.refreshed_at = None
        self.records.clear()
        self.read_at.clear()
        self.by_key.clear()
        self.meta.clear()


@dataclass
class Plan:
    """*requests*: what the full read's --jobs names (None: every job, unfiltered);
    *asked*: ids of known records the full read must return (one it does not return is
    gone); *listed*: the known records the listing names (every other one is gone)."""

    requests: set[str] | None
    asked: set[int]
    refreshed: bool = False  # the kept records' refresh is in *requests*
    listed: set[int] = field(default_factory=set)  # known records the listing names (+ asked)
    by_id: bool = False  # *requests* are at most few_ids() plain job ids: read one by one
    all_listed: bool = False  # *listed* holds every known record: assemble drops none unasked


def _plain(r: JobRecord) -> bool:
    """A job that is neither an array's (task or record of pending tasks) nor a het
    component: its own id names exactly it, for squeue's --jobs and scontrol's show job."""
    return r.array_job_id is None and r.het_job_id is None


def _needed(r: JobRecord, need: Collection[str]) -> bool:
    return r.key in need or (r.het_job_id is not None and str(r.het_job_id) in need)


def _settled(r: JobRecord, s: JobState, settled: Collection[str], nodes: NodeFlags) -> bool:
    """A running gang the governor found ready (*settled*: policy.settled_reads), listed in
    the state of its last full record, not a het component (one merged observation: read
    with its leader), every node of that record held and up in this cycle's node map."""
    if r.base_state != "RUNNING" or not s.shows(r) or r.het_job_id is not None:
        return False
    if r.key not in settled:
        return False
    for n in r.nodes:
        f = nodes.get(n)
        # (a node that is not ALLOCATED or MIXED no longer runs this job: it shrank)
        if f is None or not f.isdisjoint(UNSETTLED_FLAGS) or f.isdisjoint(HELD_FLAGS):
            return False
    return bool(r.nodes)


def _needed_listed(s: JobState, r: JobRecord, need: Collection[str]) -> bool:
    """_needed for the record *r* the listing names *s*: a job listed `N` (no task, no het
    offset) is a record whose key is `N` (listing_key), so its own listed name says it
    without building r.key (a str per pending job per cycle: half of plan() at 50k). Never
    False where _needed is True; True where it is not only for a key `J_T` that names no
    job of the queue (J is the id of another array's task): an extra read, never a miss."""
    if s.key in need:
        return True  # (`N`, or `J_T`: task T's own id is J, so array J's task T is r)
    return (s.task is not None or s.het_offset is not None) and _needed(r, need)


def plan(
    listing: list[JobState],
    need: Collection[str],
    known: Known,
    now: float,
    elapsed: float,
    stale: float = STALE_SECONDS,
    settled: Collection[str] = (),
    nodes: NodeFlags | None = None,
    delta: Delta | None = None,
) -> Plan:
    """What this cycle reads in full (see the module doc). *need*: keys (JobObs.job_id) of
    jobs the governor reads in full while pending; *settled*: keys of running gangs it
    found ready, kept from their last full record while *nodes* (this cycle's node flags)
    shows theirs up; *elapsed*: seconds since the last plan (the share of the kept records
    refreshed now); *delta*: the reader's (slurm_records.BlockCache.delta) for the listing,
    so that a listing that changed updates the memo by what it added and dropped."""
    if not known.records:
        return Plan(None, set())
    b = _base(listing, need, known, delta)
    requests: set[str] = set()
    odd: set[str] = set()  # requests that are not a plain job's own id (arrays, het jobs)
    asked: set[int] = set()
    extra: set[int] = set()  # kept records beyond b.keep's: settled jobs, arrays' records

    def ask(q: str, plain: bool = False) -> None:
        requests.add(q)
        if not plain:
            odd.add(q)

    def read(r: JobRecord) -> None:
        ask(request(r), _plain(r))
        asked.add(r.job_id)

    for q, plain in b.asks.values():
        ask(q, plain)
    for r, s in b.contest.values():
        if settled and nodes is not None and _settled(r, s, settled, nodes):
            extra.add(r.job_id)
        else:
            read(r)
    metas: set[int] = set()
    for a, m in known.meta.items():
        try:
            same = b.unsplit.get(a, set()) == array_task_ids(m.array_tasks)
        except SlurmDataError:
            same = False  # (a task list the reader could not name: read every cycle)
        if not same or (need and _needed(m, need)):
            read(m)
            metas.add(m.job_id)
        elif a in b.unsplit:
            extra.add(m.job_id)
            metas.add(m.job_id)
    # every known record the listing names, and those asked for (b.listed: the kept and
    # contested ones; a record is one or the other, kept or read, never both)
    listed = b.listed | metas if metas else b.listed
    cached = _Kept(b.kept, extra - asked)
    few = few_ids(len(listing))
    squeue = bool(odd) or len(requests) > few  # (else: a few plain ids, one by one)
    refreshed = bool(cached) and _refresh(known, cached, squeue, now, elapsed, stale, read)
    if len(requests) > FULL_SHARE * len(listing) or len(requests) > MAX_IDS:
        return Plan(None, set())
    by_id = not odd and 0 < len(requests) <= few
    # (*listed* is a subset of the known records: as many means all of them)
    return Plan(requests, asked, refreshed, listed, by_id, len(listed) == len(known.records))


@dataclass
class _Kept:
    """The kept records' ids: plan()'s memo's, and this cycle's few others (read-only)."""

    base: set[int]
    extra: set[int]

    def __contains__(self, jid: int) -> bool:
        return jid in self.base or jid in self.extra

    def __bool__(self) -> bool:
        return bool(self.base or self.extra)

    def __len__(self) -> int:  # (disjoint: a record is kept by the memo or this cycle)
        return len(self.base) + len(self.extra)


@dataclass
class _Base:
    """plan()'s classification of one listing against Known's records and one *need*,
    kept between cycles while the listing is the same object (the reader hands out the same
    list for an unchanged listing) and *need* is equal; records that changed since
    (Known.touched) are classified again, by their listing key. Per listing key, exactly one
    of: *keep* (plainly pending, its record too, not needed: the record's id), *contest*
    (a known record that is not plainly pending or is needed: read, unless settled), *asks*
    (no record yet: what to request), *tasks* (an array task whose array's record of
    pending tasks shows it: (array, task), gathered in *unsplit*). *kept* = the ids in
    *keep*; *listed* = those and the contested records' ids."""

    listing: list[JobState]
    need: frozenset[str]
    keep: dict[str, int] = field(default_factory=dict)
    contest: dict[str, tuple[JobRecord, JobState]] = field(default_factory=dict)
    asks: dict[str, tuple[str, bool]] = field(default_factory=dict)
    tasks: dict[str, tuple[int, int]] = field(default_factory=dict)
    unsplit: dict[int, set[int]] = field(default_factory=dict)
    kept: set[int] = field(default_factory=set)
    listed: set[int] = field(default_factory=set)
    by_key: dict[str, JobState] | None = None  # the listing by key (made for the first update)


# Up to this many changed records, the memo is updated; beyond, it is made anew (the walk).
MEMO_UPDATE_MAX = 2000


# The reader's delta of a listing (slurm_records.BlockCache.delta): (the listing before,
# the listing now, the entries added, the entries dropped).
Delta = tuple[object, object, list, list]


def _base(
    listing: list[JobState], need: Collection[str], known: Known, delta: Delta | None = None
) -> _Base:
    """plan()'s memo (_Base) for this listing, *need* and Known's records now. A listing
    that is not the memo's is taken by the memo's update when *delta* leads from the memo's
    listing to it: the keys it dropped and added are classified again, as changed records'
    are. Else, or past MEMO_UPDATE_MAX keys, the memo is made anew."""
    need_f = frozenset(need)  # (the same object when *need* is a frozenset)
    b, touched = known.memo, known.touched
    step = None  # (entries added, entries dropped) from the memo's listing to this one
    if b is not None and b.listing is not listing:
        if delta is not None and delta[0] is b.listing and delta[1] is listing:
            step = delta[2], delta[3]
        else:
            b = None
    if (
        b is None
        or touched is None
        or b.need != need_f
        or len(touched) + (len(step[0]) + len(step[1]) if step else 0) > MEMO_UPDATE_MAX
    ):
        b = _Base(listing, need_f)
        _classify(b, listing, known)
        b.kept = set(b.keep.values())
        b.listed = b.kept | {r.job_id for r, _ in b.contest.values()}
    elif touched or step:
        added, dropped = step if step is not None else ((), ())
        b.by_key = _by_key_after(b, added, dropped)
        keys = touched.union(s.key for s in dropped).union(s.key for s in added)
        b.listing = listing
        for k in keys:  # (all removed first: a record may move from one key to another)
            _unclassify(b, k)
        _classify(b, filter(None, map(b.by_key.get, keys)), known)
    known.memo, known.touched = b, set()
    return b


def _by_key_after(b: _Base, added: Iterable[JobState], dropped: Iterable[JobState]) -> dict:
    """The memo's listing by key (made for its first update), moved on by the reader's
    delta (a changed entry is one dropped and one added under the same key: dropped
    first)."""
    by_key = b.by_key if b.by_key is not None else {s.key: s for s in b.listing}
    for s in dropped:
        if by_key.get(s.key) is s:
            del by_key[s.key]
    for s in added:
        by_key[s.key] = s
    return by_key


def _classify(b: _Base, entries: Iterable[JobState], known: Known) -> None:
    """Enter *entries* of the listing into *b* (see _Base)."""
    by_key, meta, need = known.by_key, known.meta, b.need
    get, keep, contest = by_key.get, b.keep, b.contest
    kept, listed = b.kept, b.listed  # (empty while the memo is made: filled after)
    for s in entries:
        key = s.key
        r = get(key)
        if r is not None:
            if (
                s.base_state != "PENDING"
                or s.state_flags
                or r.base_state != "PENDING"
                or r.state_flags
                or (
                    need
                    and (
                        key in need  # (see _needed_listed: inline, per pending job)
                        or ((s.task is not None or s.het_offset is not None) and _needed(r, need))
                    )
                )
            ):
                contest[key] = (r, s)
                listed.add(r.job_id)
            else:
                keep[key] = r.job_id
                kept.add(r.job_id)
                listed.add(r.job_id)
        elif s.task is not None:
            m = meta.get(s.job)
            if m is None or not s.pending or not s.shows(m):
                b.asks[key] = (str(s.job), False)  # the array: its record, its tasks
            else:
                b.tasks[key] = (s.job, s.task)
                b.unsplit.setdefault(s.job, set()).add(s.task)
        else:
            b.asks[key] = (str(s.job), s.het_offset is None)  # a job not read yet


def _unclassify(b: _Base, key: str) -> None:
    """Take what the listing key *key* entered out of *b*."""
    jid = b.keep.pop(key, None)
    if jid is None and key in b.contest:
        jid = b.contest.pop(key)[0].job_id
    if jid is not None:
        b.kept.discard(jid)
        b.listed.discard(jid)
    b.asks.pop(key, None)
    t = b.tasks.pop(key, None)
    if t is not None:
        left = b.unsplit[t[0]]
        left.discard(t[1])
        if not left:
            del b.unsplit[t[0]]


def _refresh(
    known: Known,
    cached: _Kept,
    squeue: bool,
    now: float,
    elapsed: float,
    stale: float,
    read: Callable[[JobRecord], None],
) -> bool:
    """plan()'s refresh phase: *read* the oldest of the *cached* records when one is due
    (*squeue*: this cycle reads with squeue anyway; a few ids read one by one are cheap, and
    a batch along would make them a squeue read); True when this cycle refreshed."""
    # the refresh, in batches (squeue's --jobs filter is the client's: a full read costs
    # about the same for 2 ids as for 100, so a quiet cycle should make none): when this
    # cycle reads with squeue anyway, when the last refresh is *every* old, or when a record
    # would pass *stale* before the next one. The oldest records first: every one that
    # would, and at least the share of the time since the last refresh in *stale* (so
    # the whole queue turns over within *stale*); at most REFRESH_MAX (a slow cycle must
    # not ask for a larger refresh, which would make the next one slower still).
    every = min(REFRESH_EVERY, stale / 10)
    since = elapsed if known.refreshed_at is None else now - known.refreshed_at
    horizon = stale - every
    records, read_at = known.records, known.read_at
    due = squeue or since >= every
    if not due:
        oldest = next((t for jid, t in read_at.items() if jid in cached), now)
        due = now - oldest >= horizon
    if not due:
        return False
    want = math.ceil(len(cached) * min(1.0, max(0.0, since) / stale))
    took = 0
    for jid, t in read_at.items():
        if took >= REFRESH_MAX or (took >= want and now - t < horizon):
            break
        if jid in cached:
            read(records[jid])
            took += 1
    return True


def assemble(fresh: list[JobRecord], known: Known, p: Plan, now: float) -> list[JobRecord]:
    """This cycle's records: the full read's, and the known ones of every other listed job,
    in the full reads' order. A record the full read was asked for and did not return is
    gone (its job left between the two calls)."""
    store = known.store
    if p.requests is None or p.refreshed:
        known.refreshed_at = now
    if p.requests is None:  # an unfiltered full read: it alone is the truth
        out = [store(r, now) for r in fresh]  # (unchanged records: the known objects)
        known.keep_only({r.job_id for r in out})
        return known.listed() if list(map(_JID, out)) == list(known.records) else out
    got = {store(r, now).job_id for r in fresh}
    for jid in p.asked - got:
        known.drop(jid)
    # (the read's records, also those the listing did not have, and the known ones plan()
    # found by the listing: no second walk of it; those asked for and gone are dropped)
    if not p.all_listed:  # (else: the records now are those listed, less dropped, + got)
        known.keep_only(p.listed, got)
    # in the order of the full reads (slurmctld's job list: the state listing has its own,
    # e.g. an array's pending tasks last), jobs first read later after them
    return known.listed()
