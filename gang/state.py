"""Governor state: one record per gang job, persisted atomically (write, fsync, rename).

Losing the file is survivable: the counter, phase and next eligible time are also written to
the job's AdminComment (see events.encode_admin), and deadlines derive from Slurm's own
StartTime; Slurm's Restarts counter tells whether an interrupted requeue went through.
Nodes the governor drained are found again by their Reason prefix; only strikes that have
not yet drained a node are lost with the file (the node then needs its strikes anew).

Between full writes, a cycle that changes a few records appends only those to a log next to
the file (`state.json.log`, see save_if_changed); load() applies it. The full file is
rewritten (the log compacted) when the governor starts and when the log outgrows the file.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import secrets
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path

from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import fsync_dir, write_atomic

# Phases (Kueue wording in brackets)
PENDING = "pending"  # waiting for Slurm to allocate [queued]
WAITING = "waiting_admission"  # held by block_admission until the cluster has no unready gang
ADMITTED = "admitted"  # allocation granted, not all ready yet [admitted, PodsReady=false]
READY = "ready"  # [PodsReady=true]
RECOVERING = "recovering"  # was ready, lost readiness; recovery_timeout running
BACKOFF = "backoff"  # requeued; StartTime pushed to next_eligible [requeued w/ backoff]
DEACTIVATED = "deactivated"  # over backoff_limit_count: requeuehold [deactivated]
NOT_REQUEUEABLE = "not_requeueable"  # timed out but cannot be requeued (recorded, maybe cancelled)
DONE = "done"

PHASES = (
    PENDING,
    WAITING,
    ADMITTED,
    READY,
    RECOVERING,
    BACKOFF,
    DEACTIVATED,
    NOT_REQUEUEABLE,
    DONE,
)


@dataclass
class GangRecord:
    job_id: str
    phase: str = PENDING
    count: int = 0  # own requeue counter n (timeouts acted on); reset by `scontrol release`
    admitted_at: float | None = None  # Slurm StartTime of the current allocation
    ready_at: float | None = None
    lost_at: float | None = None
    next_eligible: float | None = None
    last_evicted_at: float | None = None
    restarts_at_action: int | None = None  # Slurm Restarts before our last requeue
    restarts_seen: int | None = None  # Slurm Restarts explained so far (ours + noted)
    released_by_us: bool = False
    submit_time: float | None = None
    partition: str = ""
    why: str = ""
    updated: float = 0.0
    done_at: float | None = None
    # Kueue semantics and identity (see docs/gang.md)
    run_restarts: int | None = None  # Restarts of the run whose admission admitted_at is
    admitted_nodes: int = 0  # node count at admission: fewer later is lost readiness
    obs_submit: float | None = None  # SubmitTime and Restarts at the last observation:
    obs_restarts: int | None = None  # a new SubmitTime without a requeue is a reused id
    hold_ours: bool = False  # the job's current hold was placed by the governor
    hold_confirmed: bool = False  # deactivation: our admin hold seen in Slurm
    priority: int = 0  # Slurm priority before our hold (a hold sets it to 0)
    slurm_reason: str = ""  # Slurm's pending Reason at the last observation
    eligible_at: float | None = None  # Slurm's EligibleTime at the last observation
    hold_asked_at: float | None = None  # deactivation: when we last asked for the admin hold
    timeout: float | None = None  # this run's timeout from the job's own request; None = config
    first_admitted_at: float | None = None  # first admission (backoff_limit_seconds runs from it)


# Node drain states (NodeStrikes.drain); "" = not drained by this governor.
DRAINING = "draining"  # drain decided and persisted; not yet seen in Slurm
DRAINED = "drained"  # Slurm shows the node drained with our reason


@dataclass(frozen=True)
class Strike:
    at: float  # the gang's eviction (decision) time
    job_id: str
    why: str  # the node's state at the deadline, e.g. "POWERING_UP"


@dataclass
class NodeStrikes:
    """Strikes of one node (only those within node_strike_window_seconds are kept)."""

    name: str
    strikes: list[Strike] = field(default_factory=list)
    drain: str = ""  # "" | draining | drained
    drain_reason: str = ""  # the Reason we gave Slurm (starts with strikes.REASON_PREFIX)
    drain_decided_at: float | None = None


@dataclass
class Counters:
    evicted: dict[str, int] = field(default_factory=dict)  # "reason|queue" -> n
    deactivated: int = 0
    released: int = 0
    not_requeueable: int = 0
    requeue_errors: int = 0
    node_strikes: int = 0
    nodes_drained: int = 0  # drains that reached slurmctld
    drains_skipped: dict[str, int] = field(default_factory=dict)  # reason -> n
    # histogram sums/counts: name -> [sum, count, bucket counts...]
    hist: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class GovState:
    jobs: dict[str, GangRecord] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    version: int = 1
    nodes: dict[str, NodeStrikes] = field(default_factory=dict)  # struck or drained by us
    # Not persisted: the observations this state was decided on (job key -> JobObs, and the
    # node map), so that decide() can skip a job whose observation is the very same object
    # (the reader's cache hands out the same object for an unchanged job).
    seen_jobs: dict = field(default_factory=dict, compare=False, repr=False)
    seen_nodes: object = field(default=None, compare=False, repr=False)
    # Not persisted: that snapshot's job list and keys (policy._Seen), so that decide() can
    # move seen_jobs on when the next one lists the same jobs in the same places.
    seen_view: object = field(default=None, compare=False, repr=False)
    # Not persisted: which records the next decide() must look at although nothing changed
    # (policy._Watch); None: it looks at every job.
    watch: object = field(default=None, compare=False, repr=False)
    # Not persisted: policy.full_reads/settled_reads of this state (policy._Reads), made
    # once, or carried forward by decide() from the last state's; None: made when asked.
    reads: object = field(default=None, compare=False, repr=False)


# A record's fields at their defaults are left out of the file (from_json restores them):
# most of a pending gang's 27 fields are None/0/"", and the file is rewritten and fsynced
# whole on every change, so its size is the cost.
_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(GangRecord)
    if f.default is not dataclasses.MISSING
}


def _record_dict(r: GangRecord) -> dict:
    return {
        k: v
        for k, v in r.__dict__.items()
        if k not in _DEFAULTS or type(v) is not type(_DEFAULTS[k]) or v != _DEFAULTS[k]
    }


def to_json(st: GovState) -> dict:
    # GangRecord holds only scalars: a dict copy is ~10x faster than dataclasses.asdict at 10k
    return {
        "jobs": {k: _record_dict(v) for k, v in st.jobs.items()},
        "counters": dataclasses.asdict(st.counters),
        "version": st.version,
        "nodes": {k: dataclasses.asdict(v) for k, v in st.nodes.items()},
    }


def dumps(st: GovState) -> bytes:
    return json.dumps(to_json(st), separators=(",", ":")).encode()


def from_json(d: dict) -> GovState:
    jobs = {k: GangRecord(**v) for k, v in d.get("jobs", {}).items()}
    c = d.get("counters", {})
    nodes = {
        k: NodeStrikes(**{**v, "strikes": [Strike(**s) for s in v.get("strikes", [])]})
        for k, v in d.get("nodes", {}).items()
    }
    return GovState(jobs=jobs, counters=Counters(**c), version=d.get("version", 1), nodes=nodes)


def log_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.log")


def load(path: str | os.PathLike) -> GovState:
    p = Path(path)
    try:
        d = json.loads(p.read_text()) if p.exists() else {}
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        _apply_log(d, log_path(p))
        return from_json(d)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise NodeforgeError(
            f"{p}: governor state is unreadable ({exc}); move it (and {log_path(p).name}) "
            "aside and restart `nodeforge gang run` (counters are recovered from the jobs' "
            "AdminComment)"
        ) from exc


def _apply_log(d: dict, lp: Path) -> None:
    """Apply the log's batches to the file's content *d*, in order. The log belongs to the
    file only when its first line names the file's `log` token: a log left behind by a
    compaction that was cut short (new file renamed in, old log not yet removed) is older
    than the file and is ignored. A line that does not parse is a batch whose write was cut
    short (crash, full disk): its cycle never reached Slurm (the state is written before any
    command), so it is skipped, as if that cycle had not run."""
    token = d.pop("log", None)
    if token is None or not lp.exists():
        return
    lines = lp.read_bytes().split(b"\n")
    try:
        head = json.loads(lines[0])
    except ValueError:
        return  # the log's first write was cut short: nothing in it was acted on
    if head != {"log": token}:
        return
    jobs = d.setdefault("jobs", {})
    for line in lines[1:]:
        try:
            batch = json.loads(line)
        except ValueError:
            continue
        for k, v in batch["jobs"].items():
            if v is None:
                jobs.pop(k, None)
            else:
                jobs[k] = v
        d.update(batch.get("rest", {}))


def save(st: GovState, path: str | os.PathLike) -> bytes:
    """Write atomically (temp + fsync + rename); returns what was written."""
    data = dumps(st)
    _write(data, path)
    return data


@dataclass(frozen=True)
class Saved:
    """What was last written: the job records (decide() never mutates a record it was
    given, so keeping them is enough), each record's serialized member of the file, the
    small rest, serialized, and where the file and its log stand."""

    jobs: dict[str, GangRecord]
    rest: bytes
    parts: dict[str, bytes] = field(default_factory=dict)
    token: str = ""  # the file's `log` token; "" = the file has none (written by save())
    file_bytes: int = 0
    log_bytes: int = 0  # 0 = no log since the file was written


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # what dumps() writes, reused
LOG_MIN_COMPACT = 1 << 20  # the log is compacted when larger than the file and than this


def _rest(st: GovState) -> bytes:
    """`{"counters":...,"version":...,"nodes":...}`: the file's members after "jobs"."""
    d = {
        "counters": dataclasses.asdict(st.counters),
        "version": st.version,
        "nodes": {k: dataclasses.asdict(v) for k, v in st.nodes.items()},
    }
    return _ENCODE(d).encode()


def save_if_changed(st: GovState, path: str | os.PathLike, last: Saved | None = None) -> Saved:
    """Persist *st* when it differs from *last*: a quiet cycle costs a comparison of the
    records, no serialization and no fsync (the fsync was 183 ms at 7.6k gangs).

    A cycle that changes some records appends one line to the log (`<file>.log`): those
    records (null for a gone one) and the rest of the state if it changed, then fsync; a
    few kB instead of the whole file (~2 MB at 7.6k gangs). The whole file is written
    (atomically, with a new `log` token, then the log removed) on the first call of a
    process (*last* None), when the file is missing, and when the log has grown past the
    file. A crash at any point leaves either the state before the cycle or after it (see
    _apply_log), and the records are absolute values, never increments, so nothing is
    counted twice."""
    rest = _rest(st)
    old_jobs, old_parts = (last.jobs, last.parts) if last is not None else ({}, {})
    jobs = st.jobs
    # Records that are the same objects as last time keep their bytes: the others are found
    # at C level (decide() keeps an unchanged record as the same object; a Python loop over
    # 7.6k records was ~3 ms), then compared field by field (record __dict__ compare; the
    # dataclass __eq__ builds tuples) and encoded.
    fresh = list(compress(jobs, map(operator.is_not, map(old_jobs.get, jobs), jobs.values())))
    if (
        last is not None
        and last.rest == rest
        and jobs.keys() == old_jobs.keys()
        and all(old_jobs[k].__dict__ == jobs[k].__dict__ for k in fresh)
    ):
        return last
    parts = dict(old_parts)  # (C level; gone ones are removed below)
    changed: list[bytes] = []
    for k in fresh:
        r, o = jobs[k], old_jobs.get(k)
        if o is not None and k in parts and o.__dict__ == r.__dict__:
            continue
        parts[k] = b = f"{_ENCODE(k)}:{_ENCODE(_record_dict(r))}".encode()
        changed.append(b)
    gone_keys = old_jobs.keys() - jobs.keys()
    for k in gone_keys:
        parts.pop(k, None)
    if (
        last is not None
        and last.token
        and last.log_bytes <= max(last.file_bytes, LOG_MIN_COMPACT)
        and os.path.exists(path)
    ):
        gone = [f"{_ENCODE(k)}:null".encode() for k in gone_keys]
        line = b'\n{"jobs":{' + b",".join(changed + gone) + b"}"
        if rest != last.rest:
            line += b',"rest":' + rest
        line += b"}"
        n = _append_log(path, last.token, line, new=last.log_bytes == 0)
        return Saved(dict(st.jobs), rest, parts, last.token, last.file_bytes, last.log_bytes + n)
    token = secrets.token_hex(8)
    data = (
        b'{"jobs":{'
        + b",".join(parts.values())
        + b"},"
        + rest[1:-1]
        + b',"log":'
        + _ENCODE(token).encode()
        + b"}"
    )
    _write(data, path)
    log_path(path).unlink(missing_ok=True)  # older than the file now: load() ignores it
    return Saved(dict(st.jobs), rest, parts, token, len(data), 0)


def _append_log(path: str | os.PathLike, token: str, line: bytes, new: bool) -> int:
    """Append *line* to the log (created with its header when *new*), fsynced; its size."""
    lp = log_path(path)
    if new:
        lp.unlink(missing_ok=True)
        line = _ENCODE({"log": token}).encode() + line
    flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT | os.O_EXCL if new else 0)
    fd = os.open(lp, flags, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        fsync_dir(lp.parent)
    return len(line)


def _write(data: bytes, path: str | os.PathLike) -> None:
    # Readable by root only: the state names users' jobs. Always written (the caller compared).
    write_atomic(path, data, 0o600, skip_unchanged=False)
