"""The governor's view of Slurm: jobs and nodes from nodeforge.slurm_records (Slurm's JSON,
so no user-written text can shift or add a field), shaped into what the policy decides on,
and the scontrol commands it issues.

Job identity: an array task is `ArrayJobId_TaskId`; the components of a heterogeneous job are
one gang (readiness over all of them). Every command the governor issues names its job by
job_address(), the one place that formats a job for a command, from the parsed identity:
Slurm's own numeric id is the wrong name for an array task (the task that carries the array's
id: `scontrol requeue <ArrayJobId>` requeues every task of the array) and for a het component
(the leader's id is the whole het job). Never text taken from a job.
"""

from __future__ import annotations

import io
import math
import mmap
import operator
import os
import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count, repeat
from typing import NewType, cast

from nodeforge import proc, slurm_records
from nodeforge.errors import CommandError
from nodeforge.slurm_records import FINISHED, JobRecord, expand_hostlist  # noqa: F401 (re-export)

from . import read_plan

# Holds (state_reason) and who can undo them: the owner can `scontrol release` a user hold;
# only an operator (Slurm admin/operator) an admin hold (checked on 22.05, tests/e2e).
USER_HOLD = "JobHeldUser"
ADMIN_HOLD = "JobHeldAdmin"
HELD_REASONS = frozenset({USER_HOLD, ADMIN_HOLD, "job_requeued_in_held_state"})


# What a command names a job by: built only by job_address() (mypy holds the commands to it).
JobAddress = NewType("JobAddress", str)


def job_address(r: JobRecord, *, whole_het: bool = False) -> JobAddress | None:
    """The name Slurm's commands (scontrol requeue, requeuehold, hold, release, update JobId=,
    scancel) take for exactly this job, on 22.05 and 24.11:
    - an array task: `ArrayJobId_TaskId` (its own JobId is the ArrayJobId for one task, and
      that id names the whole array);
    - an array's record of tasks not started yet: `ArrayJobId_[ids]` (those tasks, not the
      running ones);
    - a het job component: `LeaderId+Offset`; with *whole_het*, for the leader's record, the
      leader's id alone, which names every component (the governor's het gang);
    - any other job: its JobId.
    None when the record cannot be named exactly (an array record without task ids): the
    caller issues no command rather than one that may hit other jobs."""
    if r.array_job_id is not None:
        if r.array_task_id is not None:
            return JobAddress(f"{r.array_job_id}_{r.array_task_id}")
        return JobAddress(f"{r.array_job_id}_[{r.array_tasks}]") if r.array_tasks else None
    if r.het_job_id is not None:
        if whole_het and r.het_job_offset == 0 and r.job_id == r.het_job_id:
            return JobAddress(str(r.het_job_id))
        if r.het_job_offset is None:
            return None
        return JobAddress(f"{r.het_job_id}+{r.het_job_offset}")
    return JobAddress(str(r.job_id))


@dataclass(slots=True)
class JobObs:  # treat as immutable
    job_id: str  # identity key: JobId, ArrayJobId_TaskId, or the het leader's JobId
    state: str  # PENDING, RUNNING, CONFIGURING, COMPLETING, ... (as scontrol shows it)
    reason: str
    nodes: tuple[str, ...]
    num_nodes: int
    partition: str = ""
    qos: str = ""
    comment: str = ""
    admin_comment: str = ""
    extra: str = ""  # sbatch --extra (24.11)
    start_time: float | None = None
    submit_time: float | None = None
    eligible_time: float | None = None
    restarts: int = 0
    requeue: bool = True  # Requeue=1 and a batch job (any BatchFlag >= 1)
    held: bool = False  # PENDING with Priority=0 or a hold reason
    name: str = ""
    priority: int = 1
    admin_held: bool = False  # a hold only an operator (or the governor) can release
    slurm_id: int = 0  # Slurm's numeric JobId: identity only, never a command's target
    components: int = 1  # het job: number of components merged into this observation
    address: JobAddress | None = None  # what commands name it by (job_address); None: none

    @property
    def finished(self) -> bool:
        return self.state in FINISHED


@dataclass(frozen=True)
class Snapshot:
    jobs: list[JobObs]
    nodes: dict[str, frozenset[str]] = field(default_factory=dict)
    taken_at: float = 0.0
    node_reasons: dict[str, str] = field(default_factory=dict)  # only nodes that have one
    bytes_read: int = 0  # what slurmctld returned for this snapshot


def obs_from_record(r: JobRecord) -> JobObs:
    held = r.state == "PENDING" and (r.priority == 0 or r.reason in HELD_REASONS)
    return JobObs(
        job_id=r.key,
        state=r.state,
        reason=r.reason,
        nodes=r.nodes,
        num_nodes=r.num_nodes,
        partition=r.partition,
        qos=r.qos,
        comment=r.comment,
        admin_comment=r.admin_comment,
        extra=r.extra,
        start_time=r.start_time,
        submit_time=r.submit_time,
        eligible_time=r.eligible_time,
        restarts=r.restarts,
        requeue=r.requeue and r.batch,
        held=held,
        name=r.name,
        priority=1 if r.priority is None else r.priority,
        admin_held=held and r.reason == ADMIN_HOLD,
        slurm_id=r.job_id,
        address=job_address(r),
    )


def _merge_het(leader: JobObs, parts: list[JobObs], address: JobAddress | None) -> JobObs:
    """One observation for a het job: ready only when every component is; the leader's
    Restarts, times and id; *address* names the whole het job (a requeue of the leader's
    id requeues every component)."""
    states = {p.state for p in parts}
    if "PENDING" in states:
        state = "PENDING"
    elif "CONFIGURING" in states:
        state = "CONFIGURING"
    elif states == {"RUNNING"}:
        state = "RUNNING"
    elif "COMPLETING" in states:
        state = "COMPLETING"
    else:
        state = leader.state
    nodes: list[str] = []
    for p in parts:
        nodes.extend(n for n in p.nodes if n not in nodes)
    reason = next((p.reason for p in parts if p.reason not in ("None", "")), leader.reason)
    return JobObs(
        **{
            **{k: getattr(leader, k) for k in JobObs.__slots__},
            "state": state,
            "reason": reason,
            "nodes": tuple(nodes),
            "num_nodes": sum(p.num_nodes for p in parts),
            "requeue": all(p.requeue for p in parts),
            "components": len(parts),
            "address": address,
        }
    )


def jobs_from_records(
    records: list[JobRecord], cache: dict[int, tuple[JobRecord, JobObs]] | None = None
) -> list[JobObs]:
    """*cache* (id(record) -> (record, obs)) reuses the observation of a record the reader
    took from its own cache (the same object): unchanged jobs cost a lookup. The cache holds
    each record it names, so an id in it cannot belong to another, newer object. Records
    that changed are added; entries of records no longer listed stay until they outnumber
    the listed ones (then the cache is rebuilt from this cycle's)."""
    ids = list(map(id, records))
    hits: list[tuple[JobRecord, JobObs] | None] = (
        list(map(cache.get, ids)) if cache is not None else [None] * len(records)
    )
    out: list[JobObs]
    het: dict[int, list[JobRecord]] = {}
    miss: list[int] = []
    all_hit = None not in hits  # (tuples compare with None in C)
    if all_hit:  # every job unchanged: no Python-level loop
        out = list(map(_OBS, cast(list[tuple[JobRecord, JobObs]], hits)))
    else:
        miss = list(compress(range(len(hits)), map(operator.not_, hits)))
        for i in miss:
            r = records[i]
            if r.het_job_id is not None:
                het.setdefault(r.het_job_id, []).append(r)  # merged below, never cached
            else:
                hits[i] = (r, obs_from_record(r))
        out = list(map(_OBS, filter(None, hits)))  # (a hit is a non-empty tuple)
    for hid, recs in het.items():
        recs.sort(key=lambda r: r.het_job_offset or 0)
        lead = next((r for r in recs if r.job_id == hid), None)
        if lead is None:
            continue  # the leader is not listed (purged): nothing to command
        parts = [obs_from_record(r) for r in recs]
        out.append(_merge_het(parts[recs.index(lead)], parts, job_address(lead, whole_het=True)))
    if len(set(map(_KEY, out))) != len(out):
        keys: set[str] = set()
        for o in out:
            if o.job_id in keys:
                raise slurm_records.SlurmDataError(f"Slurm JSON: job {o.job_id} is listed twice")
            keys.add(o.job_id)
    if cache is not None:
        if not all_hit:
            # only the new records are entered (an entry holds its record, so its id names
            # no other object while it is there): proportional to what changed
            for i in miss:
                h = hits[i]
                if h is not None:
                    cache[ids[i]] = h
        if len(cache) > 2 * len(ids) + CACHE_SLACK:
            cache.clear()  # entries of records no longer listed: rebuilt from this cycle's
            # C-level, no Python loop; compress leaves out the misses (None)
            cache.update(
                compress(zip(ids, cast(list[tuple[JobRecord, JobObs]], hits), strict=True), hits)
            )
    return out


CACHE_SLACK = 1024  # entries of records no longer listed kept before the cache is rebuilt


_OBS = operator.itemgetter(1)
_KEY = operator.attrgetter("job_id")


class JobCache:
    """Between cycles: each job's JSON text -> JobRecord, and record -> JobObs; and the last
    records list with its observations (the reader hands out the same list while no record
    changed: then the same observations, with no pass over the queue). A list that differs
    from the last one in a few places (a running job's record changed, jobs left and came,
    the rest of a 50k queue kept in its order) is patched there: the last observations of
    the runs of the same records, and the others observed (_patch), not a pass over every
    record. *keys*: the last observations' keys (made when a patch first needs them)."""

    def __init__(self) -> None:
        self.records = slurm_records.BlockCache()
        self.obs: dict[int, tuple[JobRecord, JobObs]] = {}
        # (records, their observations, whether they are in the same places: no het job)
        self.last: tuple[list[JobRecord], list[JobObs], bool] | None = None
        self.keys: set[str] | None = None

    def observe(self, records: list[JobRecord]) -> list[JobObs]:
        last = self.last
        if last is not None:
            if last[0] is records:
                return last[1]
            if last[2]:
                if self.keys is None:
                    self.keys = set(map(_KEY, last[1]))
                out = _patch(records, last[0], last[1], self.obs, self.keys)
                if out is not None:
                    self.last = (records, out, True)
                    return out
        self.keys = None
        out = jobs_from_records(records, self.obs)
        # (het components are merged into one observation, after the others: places differ)
        self.last = (records, out, len(out) == len(records) and not _any_het(records))
        return out


PATCH_SHARE = 0.125  # beyond this share of places changed, the whole pass (C level) is cheaper
PATCH_MIN = 16  # places a patch may change in any list, however short
PATCH_LOOK = 8  # places looked ahead to tell a dropped record from an added one
_HET = operator.attrgetter("het_job_id")


def _any_het(records: list[JobRecord]) -> bool:
    return any(map(operator.is_not, map(_HET, records), repeat(None)))  # (C level)


def _same_run(a: list, i: int, b: list, j: int) -> int:
    """How many places from *i* in *a* and *j* in *b* hold the very same objects (C level,
    in windows that double: a long run costs about one pass, a short one little)."""
    n = min(len(a) - i, len(b) - j)
    t, w = 0, 32
    while t < n:
        w = min(w, n - t)
        k = next(
            compress(count(), map(operator.is_not, a[i + t : i + t + w], b[j + t : j + t + w])), -1
        )
        if k >= 0:
            return t + k
        t += w
        w *= 2
    return n


def _among(x: object, seq: list, start: int) -> bool:
    """Is *x* itself (not an equal object) in the PATCH_LOOK places of *seq* from *start*?"""
    return any(map(operator.is_, repeat(x), seq[start : start + PATCH_LOOK]))


def _patch(
    records: list[JobRecord],
    last: list[JobRecord],
    last_obs: list[JobObs],
    cache: dict[int, tuple[JobRecord, JobObs]],
    keys: set[str],
) -> list[JobObs] | None:
    """jobs_from_records(*records*, *cache*) from the last list (*last*, no het job: its
    components are merged, out of place) by alignment: runs of the same records take their
    last observations; between them a record is new or changed (observed, in its place) and
    a last one is passed over (it left). Each place's observation is its own record's, so
    the alignment only decides the cost; *keys* (the last observations' keys) is moved on
    only when this returns a list. None (the caller takes the whole pass) for a het record,
    a key listed twice, or more changed places than PATCH_SHARE of the list."""
    n, m = len(records), len(last)
    budget = PATCH_SHARE * n + PATCH_MIN
    out: list[JobObs] = []
    gone: list[str] = []  # keys of the last observations not in *out*
    added: list[str] = []  # keys of the observations made or taken from the cache
    i = j = 0
    while i < n:
        run = _same_run(records, i, last, j) if j < m else 0
        if run:
            out += last_obs[j : j + run]
            i, j = i + run, j + run
            continue
        if len(added) + len(gone) > budget:
            return None
        r = records[i]
        if j < m and _among(r, last, j + 1):
            gone.append(last_obs[j].job_id)  # last[j] left (the next ones are here)
            j += 1
            continue
        if r.het_job_id is not None:
            return None
        hit = cache.get(id(r))
        o = hit[1] if hit is not None else obs_from_record(r)
        if hit is None:
            cache[id(r)] = (r, o)  # (entries of records no longer listed: until the rebuild)
        out.append(o)
        added.append(o.job_id)
        i += 1
        if j < m and (o.job_id == last_obs[j].job_id or not _among(last[j], records, i)):
            gone.append(last_obs[j].job_id)  # last[j] changed into r, or left for it
            j += 1
    gone += map(_KEY, last_obs[j:])  # (left at the end)
    was = set(gone)
    if len(set(added)) != len(added) or any(k in keys and k not in was for k in added):
        return None  # a key listed twice: the whole pass says so
    keys.difference_update(was)
    keys.update(added)
    if len(cache) > 2 * n + CACHE_SLACK:  # jobs_from_records' bound, and its rebuild
        cache.clear()
        cache.update(zip(map(id, records), zip(records, out, strict=True), strict=True))
    return out


def parse_jobs(
    text: str | slurm_records.Buffer,
    source: str = "squeue --json",
    cache: JobCache | None = None,
) -> list[JobObs]:
    if cache is None:
        return jobs_from_records(slurm_records.parse_jobs(text, source))
    return cache.observe(slurm_records.parse_jobs(text, source, cache.records))


def parse_nodes(
    text: str | slurm_records.Buffer,
    source: str = "sinfo --json",
    cache: slurm_records.BlockCache | None = None,
) -> dict[str, slurm_records.NodeRecord]:
    return slurm_records.parse_nodes(text, source, cache)


def start_spec(start_at: float, now: float) -> str:
    """StartTime as an offset from slurmctld's now: no local time, so no DST ambiguity."""
    return f"now+{max(0, math.ceil(start_at - now))}"


class OutputBuffer:
    """One command's output, read every cycle into the same memory: `scontrol show job --json`
    prints ~90 MB at 10k jobs on 24.11. The client writes into a memory file (memfd) that
    lives as long as this object, not into a pipe, and the reader reads it through a memory
    map kept between calls: no 32 kB pipe reads through a selector, no decoding of the whole
    text (the reader works on bytes and decodes only what it parses), no copy, and no fresh
    90 MB to fault in each cycle (the client overwrites the same pages).

    The output is [0, file offset after the client exits): the client inherits the file
    description with its offset at 0 and writes its output through stdio, in order. Bytes
    beyond that (a longer output of an earlier call) are cut off before the map is handed
    out (ftruncate + mremap: the pages before the cut stay mapped). The returned map is
    rewritten, and may be cut shorter, by the next call: nothing may read it after that (the
    reader's cache keeps its own copies, and the snapshot holds no view of it)."""

    __slots__ = ("file", "map")

    def __init__(self) -> None:
        self.file: io.FileIO | None = None
        self.map: mmap.mmap | None = None

    def run(self, cli: SlurmCli, argv: list[str]) -> mmap.mmap | bytes:
        if self.file is None:
            self.file = io.FileIO(os.memfd_create("nodeforge-slurm-out", os.MFD_CLOEXEC), "r+")
        fd = self.file.fileno()
        os.lseek(fd, 0, os.SEEK_SET)
        cp = cli._run(*argv, check=False, output_file=self.file)
        n = os.lseek(fd, 0, os.SEEK_CUR)
        if cp.returncode != 0:
            tail = os.pread(fd, min(n, 8192), max(0, n - 8192)).decode(errors="replace")
            raise CommandError(argv, cp.returncode, tail, hint=_HINT)
        if n == 0:
            return b""
        m = self.map
        if m is not None and len(m) != n:
            try:
                m.resize(n)  # the file to n bytes, the map with it (mremap)
            except (BufferError, OSError, ValueError):  # (a view still held): a new map
                m = None
        if m is None:
            os.ftruncate(fd, n)
            m = self.map = mmap.mmap(fd, n, mmap.MAP_SHARED)
        return m


_HINT = "is slurmctld up and SLURM_CONF right?"
# what a client prints, alone, for a job slurmctld does not know (ESLURM_INVALID_JOB_ID)
_GONE = re.compile(r"(?:slurm_load_jobs error: )?Invalid job id specified\n?")


class SlurmCli:
    """Runs Slurm's clients through nodeforge.proc. *prefix* (e.g. `nsenter --net=...`) and
    *env* (SLURM_CONF) let tests and the bench point it at a private cluster."""

    def __init__(
        self,
        prefix: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout: float = 15.0,
        clock: Callable[[], float] = time.time,
        stale_seconds: float = read_plan.STALE_SECONDS,
    ):
        self.prefix = list(prefix)
        self.stale_seconds = stale_seconds  # (read_plan.py: the planned read's refresh)
        self.env = env
        self.timeout = timeout
        self.clock = clock
        self._commands: tuple[list[str], list[str]] | None = None
        self._cache = JobCache()
        # (nodes last read, their flags, their reasons)
        self._nodes: tuple[
            dict[str, slurm_records.NodeRecord], dict[str, frozenset[str]], dict[str, str]
        ] = ({}, {}, {})
        self._node_records = slurm_records.BlockCache()  # each node's text -> NodeRecord
        self._out_jobs = OutputBuffer()
        self._out_nodes = OutputBuffer()
        # the planned read (read_plan.py, Slurm >= 24.05)
        self._state_argv: list[str] | None = None
        self._out_state = OutputBuffer()
        self._state_records = slurm_records.BlockCache()  # each listed job's text -> JobState
        self._known = read_plan.Known()
        self._planned_at: float | None = None
        # the full read of the planned path: squeue, which takes a --jobs filter, or for a
        # few plain job ids (read_plan.few_ids) slurmctld's single-job read, one per id
        self._full_argv = ["squeue", "--json", "--states=all"]
        self._one_argv = ["scontrol", "show", "job", "--json"]

    def _run(self, *argv: str, check: bool = True, output_file=None):
        return proc.run(
            [*self.prefix, *argv],
            env=self.env,
            timeout=self.timeout,
            check=check,
            hint=_HINT,
            output_file=output_file,
        )

    def commands(self) -> tuple[list[str], list[str]]:
        if self._commands is None:
            self._version()
        assert self._commands is not None
        return self._commands

    def _version(self) -> None:
        ver = slurm_records.parse_version(self._run("scontrol", "--version").stdout)
        self._commands = slurm_records.json_commands(ver)
        self._state_argv = slurm_records.state_command(ver)

    def state_command(self) -> list[str] | None:
        """The state listing's argv (read_plan.py), None on a Slurm without one."""
        if self._commands is None:
            self._version()
        return self._state_argv

    def snapshot(
        self, need: Collection[str] | None = None, settled: Collection[str] = ()
    ) -> Snapshot:
        """Every job and node as Slurm shows them now. *need* (the governor's: keys of the
        gangs whose pending jobs it reads in full, policy.full_reads) lets a Slurm with a
        state listing read only what the cycle needs (read_plan.py); None reads every job in
        full. *settled* (policy.settled_reads): running gangs found ready, which the plan
        keeps from their last full record while their nodes are up in this very node read
        (hence the nodes first)."""
        now = self.clock()
        jobs_argv, nodes_argv = self.commands()
        nodes_txt = self._out_nodes.run(self, nodes_argv)
        nodes = parse_nodes(nodes_txt, " ".join(nodes_argv), self._node_records)
        last = self._nodes[0]
        # every node's text unchanged (its cached record, in the same order): the same map
        # object, which lets decide() skip ready jobs; else new maps (a node's text moves
        # with every slurmd ping: decide() then compares the flags, at C level)
        if len(nodes) != len(last) or not all(map(operator.is_, nodes.values(), last.values())):
            flags = {n: r.flags for n, r in nodes.items()}
            reasons = {n: r.reason for n, r in nodes.items() if r.reason}
            self._nodes = (nodes, flags, reasons)
        _, flags, reasons = self._nodes
        state_argv = self.state_command()
        if need is not None and state_argv is not None:
            jobs, jobs_bytes = self._planned_jobs(state_argv, need, now, settled, flags)
        else:
            jobs_txt = self._out_jobs.run(self, jobs_argv)
            jobs_bytes = len(jobs_txt)
            jobs = parse_jobs(jobs_txt, " ".join(jobs_argv), self._cache)
            self._known = read_plan.Known()  # (a planned read starts from a full one)
        return Snapshot(
            jobs=jobs,  # (records and observations: no view into the maps is kept)
            nodes=flags,
            taken_at=now,
            node_reasons=reasons,
            bytes_read=jobs_bytes + len(nodes_txt),
        )

    def _planned_jobs(
        self,
        state_argv: list[str],
        need: Collection[str],
        now: float,
        settled: Collection[str] = (),
        nodes: Mapping[str, frozenset[str]] | None = None,
    ) -> tuple[list[JobObs], int]:
        """The state listing, then in full what read_plan.plan names; every other job from
        its last full record (read_plan.assemble: in the full reads' order)."""
        src = " ".join(state_argv)
        st_txt = self._out_state.run(self, state_argv)
        size = len(st_txt)
        listing = slurm_records.parse_job_states(st_txt, src, self._state_records)
        known = self._known
        elapsed = now - self._planned_at if self._planned_at is not None else math.inf
        delta = self._state_records.delta  # (what the listing added and dropped)
        p = read_plan.plan(
            listing, need, known, now, elapsed, self.stale_seconds, settled, nodes, delta
        )
        self._planned_at = now
        fresh: list[JobRecord] = []
        if p.by_id and p.requests:
            fresh, n = self._read_each(sorted(p.requests, key=int))
            size += n
        elif p.requests is None or p.requests:
            # every job (the first cycle, or more than FULL_SHARE asked for): the jobs read
            # of this Slurm, as the full path's (scontrol's on 24.11: 16.9 s at 50k queued,
            # squeue --json 17.5-18.1 s for the same 380 MB, measured live); a filter: squeue
            argv = self.commands()[0] if p.requests is None else self._filtered(p.requests)
            try:
                txt = self._out_jobs.run(self, argv)
            except CommandError:
                if p.requests is None:
                    raise
                # squeue refuses a filter of one job that left since the listing ("Invalid
                # job id"): the unfiltered read decides, as any full read would
                p = read_plan.Plan(None, set())
                argv = self.commands()[0]
                txt = self._out_jobs.run(self, argv)
            size += len(txt)
            src_full = " ".join(argv if p.requests is None else [*self._full_argv, "--jobs=..."])
            fresh = slurm_records.parse_jobs(txt, src_full, self._cache.records)
        records = read_plan.assemble(fresh, known, p, now)
        return self._cache.observe(records), size

    def _filtered(self, requests: Collection[str]) -> list[str]:
        """The full read of *requests* only (squeue's --jobs: the same records)."""
        return [*self._full_argv, "--jobs=" + ",".join(sorted(requests))]

    def _read_each(self, ids: list[str]) -> tuple[list[JobRecord], int]:
        """The records of a few plain jobs, one `scontrol show job --json ID` each (read_plan
        .few_ids), and the bytes read. A job that left since the listing is not returned
        (24.11 prints an empty list; an "Invalid job id" exit says the same), as a filtered
        squeue read leaves it out: assemble() then drops its record."""
        out: list[JobRecord] = []
        size = 0
        for jid in ids:
            argv = [*self._one_argv, jid]
            cp = self._run(*argv, check=False)
            text = cp.stdout or ""
            size += len(text)
            if cp.returncode != 0:
                if _GONE.fullmatch(text):
                    continue
                raise CommandError(argv, cp.returncode, text[-8192:], hint=_HINT)
            out += slurm_records.parse_jobs(text, " ".join(argv))
        return out, size

    def _one(self, argv: list[str], what: str) -> list[str]:
        """Ask for one job/node: `scontrol show job --json ID` (>= 23.02); 22.05's squeue/sinfo
        get a filter too (`--jobs=`, `--nodes=`). The caller still picks the record by id."""
        if argv[0] == "scontrol":
            return [*argv, what]
        return [*argv, f"--jobs={what}" if argv[0] == "squeue" else f"--nodes={what}"]

    def show_node(self, name: str) -> tuple[frozenset[str], str] | None:
        """(state flags, Reason) of one node now; None if slurmctld does not list it."""
        _, nodes_argv = self.commands()
        argv = self._one(nodes_argv, name)
        cp = self._run(*argv, check=False)
        if cp.returncode != 0:
            if "not found" in (cp.stdout or "").lower():
                return None
            raise CommandError(argv, cp.returncode, cp.stdout or "")
        n = parse_nodes(cp.stdout, " ".join(argv)).get(name)
        return None if n is None else (n.flags, n.reason)

    def show_job(self, job_id: int) -> JobObs | None:
        """The job whose numeric JobId is *job_id* (SLURM_JOB_ID inside a job): matched by
        that id, never by a key, so the array task that carries the array's id is that task
        (Slurm lists every task of the array for it)."""
        all_argv, _ = self.commands()
        jobs_argv = self._one(all_argv, str(job_id))
        cp = self._run(*jobs_argv, check=False)
        if cp.returncode != 0 and all_argv[0] == "squeue":  # a filter 22.05 refuses: read all
            jobs_argv = all_argv
            cp = self._run(*jobs_argv, check=False)
        if cp.returncode != 0:
            raise CommandError(jobs_argv, cp.returncode, cp.stdout or "")
        for j in parse_jobs(cp.stdout, " ".join(jobs_argv)):
            if j.slurm_id == job_id:
                return j
        return None

    def drain_node(self, name: str, reason: str) -> None:
        self._run("scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason={reason}")

    # Job commands: each takes the job's JobAddress (job_address), nothing else.
    def set_admin_comment(self, job: JobAddress, text: str) -> None:
        self._run("scontrol", "update", f"JobId={job}", f"AdminComment={text}")

    def set_comment(self, job: JobAddress, text: str) -> None:
        self._run("scontrol", "update", f"JobId={job}", f"Comment={text}")

    def requeue(self, job: JobAddress) -> None:
        self._run("scontrol", "requeue", job)

    def requeuehold(self, job: JobAddress) -> None:
        self._run("scontrol", "requeuehold", job)

    def set_start_time(self, job: JobAddress, ts: float) -> None:
        self._run("scontrol", "update", f"JobId={job}", f"StartTime={start_spec(ts, self.clock())}")

    def hold(self, job: JobAddress) -> None:
        """An admin hold when run as root/SlurmUser: the job's owner cannot release it."""
        self._run("scontrol", "hold", job)

    def release(self, job: JobAddress) -> None:
        self._run("scontrol", "release", job)

    def cancel(self, job: JobAddress) -> None:
        self._run("scancel", job)
