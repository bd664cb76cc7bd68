"""Is an admitted gang job ready? (Kueue's PodsReady, mapped onto Slurm.)"""

from __future__ import annotations

from collections.abc import Mapping

from .slurm import JobObs

# The node itself is not up (as opposed to a drain someone chose, or a job-level wait such
# as a running prolog, which names no node): what a node strike is given for.
NODE_DOWN_FLAGS = (
    "DOWN",
    "NOT_RESPONDING",
    "POWERING_UP",
    "FAIL",
    "POWER_DOWN",
    "POWERED_DOWN",
    "POWERING_DOWN",
    "UNKNOWN",
)
# A node with any of these is not ready for its gang.
BAD_NODE_FLAGS = ("DRAIN", "DRAINED", "DRAINING", *NODE_DOWN_FLAGS)
READY_MARK = "nfg-ready="


def ready_marker(restarts: int) -> str:
    """Token `nodeforge gang ready` puts in the job's Comment; bound to the run (Restarts)."""
    return f"{READY_MARK}{restarts}"


def probe_passed(job: JobObs) -> bool:
    return ready_marker(job.restarts) in job.comment.replace(",", " ").split()


def check(
    job: JobObs, nodes: Mapping[str, frozenset[str]], probe_mode: str = "none"
) -> tuple[bool, str]:
    """Return (ready, why-not). Only meaningful for admitted jobs (RUNNING/CONFIGURING)."""
    if job.state == "CONFIGURING":
        return False, "CONFIGURING"
    if job.state != "RUNNING":
        return False, job.state
    if job.reason == "Prolog":
        return False, "Reason=Prolog"
    for n in job.nodes:
        flags = nodes.get(n)
        if flags is None:
            return False, f"node {n} unknown to slurmctld"
        bad = [f for f in BAD_NODE_FLAGS if f in flags]
        if bad:
            return False, f"node {n} {'+'.join(bad)}"
    if probe_mode == "command" and not probe_passed(job):
        return False, "app probe not signalled (nodeforge gang ready)"
    return True, ""


def unready_nodes(job: JobObs, nodes: Mapping[str, frozenset[str]]) -> list[tuple[str, str]]:
    """The job's nodes that are not up, with why: [(node, "POWERING_UP"), ...]. A node that
    slurmctld does not list (e.g. a CLOUD node hidden as powered down) counts as not up."""
    out = []
    for n in job.nodes:
        flags = nodes.get(n)
        if flags is None:
            out.append((n, "unknown to slurmctld"))
            continue
        bad = [f for f in NODE_DOWN_FLAGS if f in flags]
        if bad:
            out.append((n, "+".join(bad)))
    return out
