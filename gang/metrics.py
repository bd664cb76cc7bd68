"""Prometheus text-format metrics (node_exporter textfile collector), Kueue names where they fit.

Kueue names used: kueue_evicted_workloads_total{cluster_queue,reason},
kueue_pods_ready_to_evicted_time_seconds, kueue_admitted_until_ready_wait_time_seconds,
kueue_pending_workloads{cluster_queue,status}, kueue_admitted_active_workloads{cluster_queue}.
`cluster_queue` is the Slurm partition. nodeforge-only: nodeforge_gang_* (node strikes and
drains among them: Kueue has no equivalent).
"""

from __future__ import annotations

import operator
import os
from collections import Counter

from nodeforge.fsutil import write_atomic

from .collector import CollectorStats
from .state import ADMITTED, BACKOFF, DEACTIVATED, PENDING, READY, RECOVERING, WAITING, GovState

_PHASE_QUEUE = operator.attrgetter("phase", "partition")
BUCKETS = (1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
HISTOGRAMS = {
    "kueue_admitted_until_ready_wait_time_seconds": "Time from admission (allocation) to all nodes ready",
    "kueue_pods_ready_to_evicted_time_seconds": "Time from ready to eviction (recovery_timeout path)",
    "nodeforge_gang_admitted_to_evicted_time_seconds": "Time from admission to eviction (timeout path)",
    "nodeforge_gang_deadline_to_requeue_seconds": "Delay between a deadline and the requeue reaching slurmctld",
}


def observe(st: GovState, name: str, value: float) -> None:
    h = st.counters.hist.setdefault(name, [0.0, 0.0] + [0.0] * len(BUCKETS))
    h[0] += value
    h[1] += 1
    for i, b in enumerate(BUCKETS):
        if value <= b:
            h[2 + i] += 1


# Kueue's eviction reason for a deactivated workload, and the cause beneath it
# (kubernetes-sigs/kueue apis/kueue/v1beta1/workload_types.go: WorkloadDeactivated,
# WorkloadRequeuingLimitExceeded). Kueue < 0.10 said "InactiveWorkload"; counts a state
# file kept under that name are shown under the current one.
REASON_DEACTIVATED = "Deactivated"
CAUSE_REQUEUING_LIMIT = "RequeuingLimitExceeded"
_OLD_REASONS = {"InactiveWorkload": REASON_DEACTIVATED}


def esc(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def inc_evicted(st: GovState, reason: str, queue: str, cause: str = "") -> None:
    k = f"{reason}|{cause}|{queue}"
    st.counters.evicted[k] = st.counters.evicted.get(k, 0) + 1


def _evicted_key(k: str) -> tuple[str, str, str]:
    parts = k.split("|", 2)
    if len(parts) == 2:  # a state file from before underlying_cause
        parts = [parts[0], "", parts[1]]
    return _OLD_REASONS.get(parts[0], parts[0]), parts[1], parts[2]


def render(
    st: GovState,
    cycle_seconds: float | None = None,
    up: bool = True,
    slurm_bytes: int = 0,
    gc_stats: CollectorStats | None = None,
) -> str:
    L: list[str] = []

    def head(name: str, typ: str, help_: str) -> None:
        L.append(f"# HELP {name} {help_}")
        L.append(f"# TYPE {name} {typ}")

    head("kueue_evicted_workloads_total", "counter", "Workloads evicted (requeued or deactivated)")
    evicted: dict[tuple[str, str, str], int] = {}
    for k, v in st.counters.evicted.items():  # one series per label set, old names merged
        key = _evicted_key(k)
        evicted[key] = evicted.get(key, 0) + v
    for (reason, cause, q), v in sorted(evicted.items()):
        L.append(
            f'kueue_evicted_workloads_total{{cluster_queue="{esc(q)}",reason="{esc(reason)}",'
            f'underlying_cause="{esc(cause)}"}} {v}'
        )
    for name, help_ in HISTOGRAMS.items():
        head(name, "histogram", help_)
        h = st.counters.hist.get(name, [0.0, 0.0] + [0.0] * len(BUCKETS))
        for i, b in enumerate(BUCKETS):
            L.append(f'{name}_bucket{{le="{b}"}} {int(h[2 + i])}')
        L.append(f'{name}_bucket{{le="+Inf"}} {int(h[1])}')
        L.append(f"{name}_sum {h[0]:.3f}")
        L.append(f"{name}_count {int(h[1])}")
    pend: dict[tuple[str, str], int] = {}
    adm: dict[str, int] = {}
    phases: dict[str, int] = {}
    # counted in C (Counter over attrgetter): a Python loop was ~7 ms per cycle at 7.6k gangs
    for (phase, part), n in Counter(map(_PHASE_QUEUE, st.jobs.values())).items():
        phases[phase] = phases.get(phase, 0) + n
        q = part or ""
        if phase in (PENDING, WAITING):
            pend[(q, "active")] = pend.get((q, "active"), 0) + n
        elif phase in (BACKOFF, DEACTIVATED):
            pend[(q, "inadmissible")] = pend.get((q, "inadmissible"), 0) + n
        elif phase in (ADMITTED, READY, RECOVERING):
            adm[q] = adm.get(q, 0) + n
    head(
        "kueue_pending_workloads",
        "gauge",
        "Gang jobs pending (active) or in backoff/deactivated (inadmissible)",
    )
    for (q, s), v in sorted(pend.items()):
        L.append(f'kueue_pending_workloads{{cluster_queue="{esc(q)}",status="{s}"}} {v}')
    head("kueue_admitted_active_workloads", "gauge", "Gang jobs holding an allocation")
    for q, v in sorted(adm.items()):
        L.append(f'kueue_admitted_active_workloads{{cluster_queue="{esc(q)}"}} {v}')
    head("nodeforge_gang_jobs", "gauge", "Gang jobs by governor phase")
    for ph, v in sorted(phases.items()):
        L.append(f'nodeforge_gang_jobs{{phase="{esc(ph)}"}} {v}')
    c = st.counters
    for name, v, help_ in (
        (
            "nodeforge_gang_deactivated_total",
            c.deactivated,
            "Gang jobs put in requeuehold over backoff_limit_count/seconds",
        ),
        (
            "nodeforge_gang_admission_released_total",
            c.released,
            "Gang jobs released by block_admission",
        ),
        (
            "nodeforge_gang_not_requeueable_total",
            c.not_requeueable,
            "Timed-out gang jobs that could not be requeued",
        ),
        (
            "nodeforge_gang_action_errors_total",
            c.requeue_errors,
            "Slurm commands of the governor that failed",
        ),
        (
            "nodeforge_gang_node_strikes_total",
            c.node_strikes,
            "Strikes given to nodes that were not up when a gang was evicted",
        ),
        (
            "nodeforge_gang_nodes_drained_total",
            c.nodes_drained,
            "Nodes drained by the governor for reaching node_strike_limit",
        ),
    ):
        head(name, "counter", help_)
        L.append(f"{name} {v}")
    head(
        "nodeforge_gang_node_drains_skipped_total",
        "counter",
        "Nodes at node_strike_limit left undrained (AlreadyOut, MaxDrained, NotListed, ...)",
    )
    for reason, v in sorted(c.drains_skipped.items()):
        L.append(f'nodeforge_gang_node_drains_skipped_total{{reason="{esc(reason)}"}} {v}')
    head("nodeforge_gang_nodes_drained", "gauge", "Nodes held drained by the governor now")
    L.append(f"nodeforge_gang_nodes_drained {sum(1 for r in st.nodes.values() if r.drain)}")
    head("nodeforge_gang_nodes_struck", "gauge", "Undrained nodes with strikes in the window")
    L.append(
        "nodeforge_gang_nodes_struck "
        f"{sum(1 for r in st.nodes.values() if r.strikes and not r.drain)}"
    )
    head("nodeforge_gang_up", "gauge", "1 if the last cycle read slurmctld")
    L.append(f"nodeforge_gang_up {1 if up else 0}")
    if cycle_seconds is not None:
        head("nodeforge_gang_cycle_seconds", "gauge", "Duration of the last governor cycle")
        L.append(f"nodeforge_gang_cycle_seconds {cycle_seconds:.6f}")
    head("nodeforge_gang_slurm_bytes", "gauge", "Bytes slurmctld returned in the last cycle")
    L.append(f"nodeforge_gang_slurm_bytes {slurm_bytes}")
    if gc_stats is not None:  # the daemon's collector, run between cycles (collector.py)
        head(
            "nodeforge_gang_gc_seconds_total",
            "counter",
            "CPU seconds of Python's cyclic collector, run between cycles (not in cycle_seconds)",
        )
        for kind in sorted(gc_stats.seconds):
            L.append(
                f'nodeforge_gang_gc_seconds_total{{pass="{kind}"}} {gc_stats.seconds[kind]:.6f}'
            )
        head("nodeforge_gang_gc_passes_total", "counter", "Passes of the cyclic collector")
        for kind in sorted(gc_stats.passes):
            L.append(f'nodeforge_gang_gc_passes_total{{pass="{kind}"}} {gc_stats.passes[kind]}')
    return "\n".join(L) + "\n"


def write(path: str | os.PathLike, text: str) -> None:
    # Rewritten every cycle even when unchanged: the textfile collector reports its mtime.
    write_atomic(path, text, 0o644, skip_unchanged=False)
