"""Is an admitted gang job ready? (Kueue's PodsReady, mapped onto Slurm.)"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .slurm_view import JobObs

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
# A node with any of these is not ready for its gang. A drain (or a pending reboot, ASAP or
# not) is an operator's decision about the node's *future* jobs, like a Kubernetes cordon,
# which does not make running pods unready: it is not in here.
BAD_NODE_FLAGS = NODE_DOWN_FLAGS
# A job that was ready loses readiness only when a node fails under it (Kueue: a pod of the
# workload stops being ready), or when it runs on fewer nodes than it was admitted with.
LOSS_FLAGS = ("DOWN", "NOT_RESPONDING", "FAIL")
# Every flag a function here reads: the policy's watch counts a node as changed only when
# its flags differ in these (or it appeared or went), so a drain alone re-decides no job.
READ_FLAGS = frozenset(NODE_DOWN_FLAGS) | frozenset(BAD_NODE_FLAGS) | frozenset(LOSS_FLAGS)
READY_MARK = "nfg-ready="
# `nodeforge gang ready` with probe.mode collective: the nodes below the thresholds, bound to
# the run (Restarts) like the ready mark. Job text is the user's: full-match grammar, and only
# nodes of the job's own allocation count (a forged name strikes nothing).
SLOW_MARK = "nfg-slow="
_NODE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_SLOW = re.compile(rf"nfg-slow=(0|[1-9][0-9]{{0,9}}):({_NODE}(?:,{_NODE}){{0,1023}})")
PREFLIGHT_SLOW = "collective preflight: below threshold:"


def ready_marker(restarts: int) -> str:
    """Token `nodeforge gang ready` puts in the job's Comment; bound to the run (Restarts)."""
    return f"{READY_MARK}{restarts}"


def probe_passed(job: JobObs) -> bool:
    return ready_marker(job.restarts) in job.comment.replace(",", " ").split()


def slow_marker(restarts: int, nodes: list[str] | tuple[str, ...]) -> str:
    return f"{SLOW_MARK}{restarts}:{','.join(nodes)}"


def slow_nodes(job: JobObs) -> tuple[str, ...]:
    """The job's own nodes that its collective preflight of this run named slow."""
    named: set[str] = set()
    for word in job.comment.split():
        m = _SLOW.fullmatch(word)
        if m and int(m.group(1)) == job.restarts:
            named.update(m.group(2).split(","))
    return tuple(n for n in job.nodes if n in named)


def check(
    job: JobObs,
    nodes: Mapping[str, frozenset[str]],
    probe_mode: str = "none",
    admitted_nodes: int = 0,
) -> tuple[bool, str]:
    """Return (ready, why-not). Only meaningful for admitted jobs (RUNNING/CONFIGURING)."""
    if admitted_nodes and job.num_nodes < admitted_nodes:
        return False, f"runs on {job.num_nodes} of the {admitted_nodes} nodes it was admitted with"
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
    if probe_mode == "collective":
        slow = slow_nodes(job)
        if slow:
            return False, f"{PREFLIGHT_SLOW} {','.join(slow)}"
        if not probe_passed(job):
            return False, "collective preflight not passed (nodeforge gang ready)"
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


def still_ready(
    job: JobObs, nodes: Mapping[str, frozenset[str]], admitted_nodes: int
) -> tuple[bool, str]:
    """A ready job stays ready unless a node of it is DOWN, NOT_RESPONDING or FAIL (or gone
    from slurmctld), or it lost nodes (`--no-kill`): a drain or a reboot request is not
    lost readiness."""
    if job.state not in ("RUNNING", "CONFIGURING"):
        return False, job.state
    if admitted_nodes and job.num_nodes < admitted_nodes:
        return False, f"runs on {job.num_nodes} of the {admitted_nodes} nodes it was admitted with"
    for n in job.nodes:
        flags = nodes.get(n)
        if flags is None:
            return False, f"node {n} unknown to slurmctld"
        bad = [f for f in LOSS_FLAGS if f in flags]
        if bad:
            return False, f"node {n} {'+'.join(bad)}"
    return True, ""
