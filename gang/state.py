"""Governor state: one record per gang job, persisted atomically (write, fsync, rename).

Losing the file is survivable: the counter, phase and next eligible time are also written to
the job's AdminComment (see events.encode_admin), and deadlines derive from Slurm's own
StartTime; Slurm's Restarts counter tells whether an interrupted requeue went through.
Nodes the governor drained are found again by their Reason prefix; only strikes that have
not yet drained a node are lost with the file (the node then needs its strikes anew).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_json

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


# Node drain states (NodeRecord.drain); "" = not drained by this governor.
DRAINING = "draining"  # drain decided and persisted; not yet seen in Slurm
DRAINED = "drained"  # Slurm shows the node drained with our reason


@dataclass(frozen=True)
class Strike:
    at: float  # the gang's eviction (decision) time
    job_id: str
    why: str  # the node's state at the deadline, e.g. "POWERING_UP"


@dataclass
class NodeRecord:
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
    nodes: dict[str, NodeRecord] = field(default_factory=dict)  # struck or drained by us


def to_json(st: GovState) -> dict:
    return dataclasses.asdict(st)


def from_json(d: dict) -> GovState:
    jobs = {k: GangRecord(**v) for k, v in d.get("jobs", {}).items()}
    c = d.get("counters", {})
    nodes = {
        k: NodeRecord(**{**v, "strikes": [Strike(**s) for s in v.get("strikes", [])]})
        for k, v in d.get("nodes", {}).items()
    }
    return GovState(jobs=jobs, counters=Counters(**c), version=d.get("version", 1), nodes=nodes)


def load(path: str | os.PathLike) -> GovState:
    p = Path(path)
    if not p.exists():
        return GovState()
    try:
        return from_json(json.loads(p.read_text()))
    except (ValueError, TypeError) as exc:
        raise NodeforgeError(
            f"{p}: governor state is unreadable ({exc}); move it aside and restart "
            "`nodeforge gang run` (counters are recovered from the jobs' AdminComment)"
        ) from exc


def save(st: GovState, path: str | os.PathLike) -> None:
    write_json(path, to_json(st), 0o600, compact=True)
