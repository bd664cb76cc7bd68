"""Node strikes: stop Slurm handing the same never-booting node to gang after gang.

A requeue for the readiness (or recovery) timeout frees every node of the gang, the bad ones
too, and Slurm may give a node that is still POWERING_UP (or NOT_RESPONDING, DOWN, never
registered) to the next gang, which then waits out the timeout as well. So each node that was
not up when a gang was evicted gets a strike; a node with `node_strike_limit` strikes within
`node_strike_window_seconds` is drained with a Reason that says why, and Slurm stops placing
jobs on it. Nodes that were up get no strike (the gang's wait was not their fault), and a
gang that becomes ready proves its nodes up: their strikes start over.

The governor never resumes a node: the operator does (`scontrol update NodeName=...
State=RESUME`), and that clears its strikes. A node that someone else already took out of
service (DRAIN/DOWN/FAIL with another Reason) is never touched, and at most
`node_strike_max_drained` nodes are held drained at once, so a cluster-wide blip cannot
become a cluster-wide drain.

Pure functions on this cycle's copy of the node records, called by policy.decide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from . import readiness
from .actions import Action
from .config import GangConfig
from .slurm_view import JobObs, Snapshot
from .state import DRAINED, DRAINING, NodeStrikes, Strike

# Every Reason the governor gives starts with this; it is how a governor that lost its state
# file finds the nodes it drained, and how a drain by someone else is told from ours.
REASON_PREFIX = "nodeforge-gang:"
REASON_STRIKES = "NodeStrikes"
REASON_REISSUE = "ReissueDrain"  # a decided drain that did not reach slurmctld
DRAIN_FLAGS = ("DRAIN", "DRAINED", "DRAINING")
# Out of service by someone's decision (an operator, Slurm's own health checks): left alone.
OUT_FLAGS = (*DRAIN_FLAGS, "DOWN", "FAIL")


def is_ours(reason: str) -> bool:
    return reason.startswith(REASON_PREFIX)


def drained_by_us(flags: frozenset[str], reason: str) -> bool:
    return is_ours(reason) and any(f in flags for f in DRAIN_FLAGS)


def taken_out_by_other(flags: frozenset[str], reason: str) -> str:
    """Why the node is already out of service by someone else's hand; "" if it is not."""
    if is_ours(reason):
        return ""
    out = [f for f in OUT_FLAGS if f in flags]
    if not out:
        return ""
    return "+".join(out) + (f" ({reason})" if reason else "")


def drain_reason(strikes: int, window: float, job_id: str, why: str) -> str:
    """The Reason shown by `sinfo -R`. No `word=` in it: scontrol's Key=Value output must
    still parse."""
    plural = "s" if strikes != 1 else ""
    return (
        f"{REASON_PREFIX} not ready at {strikes} gang timeout{plural} within {int(window)}s "
        f"(last job {job_id}: {why})"
    )


def reconcile(
    cfg: GangConfig, old: Mapping[str, NodeStrikes], snap: Snapshot, now: float
) -> tuple[dict[str, NodeStrikes], list[Action]]:
    """Carry the node records into this cycle (copies; *old* is not changed).

    Strikes older than the window are dropped (a drained node keeps them: they are the
    evidence for its drain). A drain we decided is confirmed once Slurm shows it, re-issued
    if it did not get there, abandoned if someone else took the node out meanwhile. A node we
    drained that is no longer drained with our Reason was resumed (or re-drained) by someone
    else: its strikes are cleared. Nodes drained with our Reason that the state does not
    know (state file lost) are taken back into it.
    """
    horizon = now - cfg.node_strike_window_seconds
    out: dict[str, NodeStrikes] = {}
    acts: list[Action] = []
    for name, o in old.items():
        rec = replace(o, strikes=list(o.strikes))
        if not rec.drain:
            rec.strikes = [s for s in rec.strikes if s.at > horizon]
        flags = snap.nodes.get(name)
        if rec.drain and flags is not None:
            reason = snap.node_reasons.get(name, "")
            other = taken_out_by_other(flags, reason)
            last_job = rec.strikes[-1].job_id if rec.strikes else ""
            n = len(rec.strikes)
            if drained_by_us(flags, reason):
                rec.drain = DRAINED
            elif rec.drain == DRAINING and other:
                rec.drain = ""
                acts.append(_skipped(rec, last_job, "AlreadyOut", f"is {other} since the decision"))
            elif rec.drain == DRAINING and not cfg.node_strike_limit:
                rec.drain = ""
                acts.append(_skipped(rec, last_job, "Disabled", "node_strike_limit is now 0"))
            elif rec.drain == DRAINING:
                acts.append(
                    Action("drain", last_job, REASON_REISSUE, rec.drain_reason, n, node=name)
                )
            else:
                why = f"now {other}" if other else "resumed"
                kind = "DrainTakenOver" if other else "NodeResumed"
                acts.append(
                    Action(
                        "note",
                        last_job,
                        kind,
                        f"node {name} {why}; its {n} strike(s) cleared",
                        0,
                        node=name,
                    )
                )
                continue  # strikes cleared: the record goes
        if rec.strikes or rec.drain:
            out[name] = rec
    for name, reason in snap.node_reasons.items():
        if name not in out and drained_by_us(snap.nodes.get(name, frozenset()), reason):
            out[name] = NodeStrikes(name, drain=DRAINED, drain_reason=reason)
    return out, acts


def strike(
    cfg: GangConfig,
    nodes: dict[str, NodeStrikes],
    job: JobObs,
    snap: Snapshot,
    now: float,
    struck: set[str],
    reason: str,
) -> list[Action]:
    """A strike for each node of *job* that was not up at its eviction; a drain (or a recorded
    skip) for each node that reaches the limit. Changes *nodes* and *struck* in place."""
    limit = cfg.node_strike_limit
    if not limit:
        return []
    acts: list[Action] = []
    window = int(cfg.node_strike_window_seconds)
    named = readiness.unready_nodes(job, snap.nodes)
    if cfg.probe.mode == "collective":
        down = {n for n, _ in named}
        named += [
            (n, "below the collective preflight's threshold")
            for n in readiness.slow_nodes(job)
            if n not in down
        ]
    for name, why in named:
        if name in struck:
            continue  # gangs sharing a node that time out in one cycle are one observation
        struck.add(name)
        rec = nodes.setdefault(name, NodeStrikes(name))
        rec.strikes.append(Strike(now, job.job_id, why))
        n = len(rec.strikes)
        acts.append(
            Action(
                "strike",
                job.job_id,
                reason,
                f"node {name} {why}: strike {n} of {limit} within {window}s",
                n,
                partition=job.partition,
                node=name,
            )
        )
        if n >= limit and not rec.drain:
            acts.append(_drain_or_skip(cfg, nodes, rec, snap, now, job.job_id, why))
    return acts


def _drain_or_skip(
    cfg: GangConfig,
    nodes: Mapping[str, NodeStrikes],
    rec: NodeStrikes,
    snap: Snapshot,
    now: float,
    job_id: str,
    why: str,
) -> Action:
    flags = snap.nodes.get(rec.name)
    if flags is None:
        # No state to check for someone else's drain: wait for the next strike.
        return _skipped(rec, job_id, "NotListed", "is not listed by slurmctld")
    other = taken_out_by_other(flags, snap.node_reasons.get(rec.name, ""))
    if other:
        return _skipped(rec, job_id, "AlreadyOut", f"is already {other}")
    cap = cfg.node_strike_max_drained
    held = sum(1 for r in nodes.values() if r.drain)
    if cap and held >= cap:
        return _skipped(
            rec,
            job_id,
            "MaxDrained",
            f"{held} node(s) are drained by the governor already (node_strike_max_drained {cap})",
        )
    rec.drain, rec.drain_decided_at = DRAINING, now
    rec.drain_reason = drain_reason(len(rec.strikes), cfg.node_strike_window_seconds, job_id, why)
    return Action(
        "drain", job_id, REASON_STRIKES, rec.drain_reason, len(rec.strikes), node=rec.name
    )


def _skipped(rec: NodeStrikes, job_id: str, reason: str, why: str) -> Action:
    n = len(rec.strikes)
    return Action(
        "drain_skipped",
        job_id,
        reason,
        f"node {rec.name} has {n} strike(s) but {why}: not drained",
        n,
        node=rec.name,
    )


def clear_on_ready(nodes: dict[str, NodeStrikes], job: JobObs) -> None:
    """All of *job*'s nodes were up together: their strikes start over."""
    for n in job.nodes:
        rec = nodes.get(n)
        if rec is not None and not rec.drain:
            del nodes[n]
