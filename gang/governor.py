"""The governor loop: observe Slurm, decide (policy.decide), persist, act, record."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nodeforge.errors import CommandError, NodeforgeError

from . import metrics, policy, strikes
from . import state as state_mod
from .config import GangConfig
from .events import EventLog, encode_admin
from .slurm import SlurmCli, Snapshot
from .state import GovState

log = logging.getLogger("nodeforge.gang")
JOB_ALREADY_PENDING = "Job is pending execution"  # scontrol requeue of a job not running


class Governor:
    def __init__(
        self, cfg: GangConfig, slurm: SlurmCli | None = None, clock: Callable[[], float] = time.time
    ):
        self.cfg = cfg
        self.slurm = slurm or SlurmCli(timeout=cfg.command_timeout)
        self.clock = clock
        self.state: GovState = state_mod.load(cfg.state_file)
        self.events = EventLog(cfg.event_log)
        self.stop_event = threading.Event()
        self.up = True
        self.last_cycle_seconds: float | None = None

    # ---- one cycle ------------------------------------------------------------------------
    def cycle(self) -> list[policy.Action]:
        t0 = time.monotonic()
        try:
            snap = self.slurm.snapshot()
        except NodeforgeError as exc:
            if self.up:
                log.warning("slurmctld unreachable, will retry: %s", exc)
                self.events.write({"action": "slurmctld_unreachable", "detail": str(exc)[-500:]})
            self.up = False
            self._write_metrics()
            return []
        if not self.up:
            self.events.write({"action": "slurmctld_reachable"})
        self.up = True
        now = self.clock()
        new_state, actions = policy.decide(self.cfg, self.state, snap, now)
        self.state = new_state
        # Write-ahead: the decision (phase, counter, next eligible) is on disk before Slurm
        # is touched, so a crash in between re-issues the same attempt, never a second one.
        state_mod.save(self.state, self.cfg.state_file)
        if actions:
            jobs = {j.job_id: j for j in snap.jobs}
            for a in actions:
                self._execute(a, jobs.get(a.job_id))
            state_mod.save(self.state, self.cfg.state_file)
        self.last_cycle_seconds = time.monotonic() - t0
        self._write_metrics()
        return actions

    def _write_metrics(self) -> None:
        if self.cfg.metrics_file:
            metrics.write(
                self.cfg.metrics_file, metrics.render(self.state, self.last_cycle_seconds, self.up)
            )

    def _admin(self, a: policy.Action, job, phase: str, why: str) -> None:
        existing = job.admin_comment if job is not None else ""
        rec = self.state.jobs.get(a.job_id)
        text = encode_admin(
            existing,
            count=a.count,
            phase=phase,
            next_eligible=a.start_at if a.start_at else (rec.next_eligible if rec else None),
            restarts=a.restarts,
            why=why,
        )
        self.slurm.set_admin_comment(a.job_id, text)

    def _execute(self, a: policy.Action, job) -> None:
        ev = {
            "action": a.kind,
            "job_id": a.job_id,
            "reason": a.reason,
            "detail": a.detail,
            "count": a.count,
            "phase": a.phase,
        }
        if a.start_at is not None:
            ev["next_eligible"] = round(a.start_at, 3)
        if a.deadline is not None:
            ev["deadline"] = round(a.deadline, 3)
        if a.waited is not None:
            ev["waited"] = round(a.waited, 3)
        if a.backoff is not None:
            ev["backoff_seconds"] = round(a.backoff, 3)
        if a.node:
            ev["node"] = a.node
        st = self.state
        try:
            if a.kind == "requeue":
                self._admin(a, job, "backoff", a.reason)
                self._requeue(a.job_id, a.hold, ev)
                ev["requeued_at"] = requeued_at = round(time.time(), 3)
                if a.deadline is not None:
                    metrics.observe(
                        st,
                        "nodeforge_gang_deadline_to_requeue_seconds",
                        max(0.0, requeued_at - a.deadline),
                    )
                self.slurm.set_start_time(a.job_id, a.start_at or self.clock())
                self._count_eviction(a)
            elif a.kind == "requeuehold":
                self._admin(a, job, "deactivated", a.reason)
                self._requeue(a.job_id, True, ev)
                ev["requeued_at"] = round(time.time(), 3)
                st.counters.deactivated += 1
                self._count_eviction(a)
            elif a.kind == "set_start":
                self.slurm.set_start_time(a.job_id, a.start_at or self.clock())
            elif a.kind == "hold":
                self.slurm.hold(a.job_id)
                self._admin(a, job, "waiting_admission", "block_admission")
            elif a.kind == "release":
                self.slurm.release(a.job_id)
                st.counters.released += 1
            elif a.kind in ("record", "cancel"):
                self._admin(a, job, "not_requeueable", "not_requeueable")
                st.counters.not_requeueable += 1
                log.warning(
                    "gang job %s timed out but cannot be requeued (%s)%s",
                    a.job_id,
                    a.detail,
                    "; cancelling" if a.kind == "cancel" else "",
                )
                if a.kind == "cancel":
                    self.slurm.cancel(a.job_id)
            elif a.kind == "annotate":
                self._admin(a, job, a.phase, a.reason)
            elif a.kind == "strike":
                st.counters.node_strikes += 1
            elif a.kind == "drain":
                self._drain(a, ev)
            elif a.kind == "drain_skipped":
                _count_skip(st, a.reason)
            elif a.kind == "note" and a.reason == "PodsReady" and a.waited is not None:
                metrics.observe(st, "kueue_admitted_until_ready_wait_time_seconds", a.waited)
        except NodeforgeError as exc:
            st.counters.requeue_errors += 1
            ev["error"] = str(exc)[-800:]
            log.error("gang action %s on job %s failed: %s", a.kind, a.job_id, exc)
        self.events.write(ev)
        if ev["action"] in ("drain", "drain_skipped"):
            log.warning("gang %s node=%s job=%s: %s", ev["action"], a.node, a.job_id, ev["detail"])
        elif a.kind != "note":
            log.info(
                "gang %s job=%s reason=%s count=%s %s",
                a.kind,
                a.job_id,
                a.reason,
                a.count,
                a.detail,
            )

    def _requeue(self, job_id: str, hold: bool, ev: dict) -> None:
        try:
            if hold:
                self.slurm.requeuehold(job_id)
            else:
                self.slurm.requeue(job_id)
        except CommandError as exc:
            # Slurm got there first. Draining a node that is being powered up makes slurmctld
            # requeue its jobs ("DRAIN/FAIL request for node X which is allocated and being
            # powered up. Requeuing jobs"), and a struck node's drain goes out just before
            # its gang's requeue. The job is back in the queue with Restarts+1 all the same;
            # the hold and the backoff (StartTime, set next) are still ours to apply.
            if JOB_ALREADY_PENDING not in exc.output:
                raise
            ev["requeued_by"] = "slurmctld"
            if hold:
                self.slurm.hold(job_id)

    def _drain(self, a: policy.Action, ev: dict) -> None:
        """Drain a struck node, unless someone else took it out since the snapshot: the
        re-check narrows "never override a foreign drain/down" to the few ms before scontrol."""
        now = self.slurm.show_node(a.node)
        other = strikes.taken_out_by_other(*now) if now is not None else ""
        if other:
            ev.update(action="drain_skipped", reason="AlreadyOut")
            ev["detail"] = f"node {a.node} has {a.count} strike(s) but is already {other}"
            _count_skip(self.state, "AlreadyOut")
            rec = self.state.nodes.get(a.node)
            if rec is not None:
                rec.drain = ""  # decided, not done: the next cycle must not report it again
            return
        self.slurm.drain_node(a.node, a.detail)
        self.state.counters.nodes_drained += 1

    def _count_eviction(self, a: policy.Action) -> None:
        metrics.inc_evicted(self.state, policy.REASON_TIMEOUT, a.partition)
        if a.waited is not None:
            name = (
                "kueue_pods_ready_to_evicted_time_seconds"
                if a.reason == policy.REASON_RECOVERY
                else "nodeforge_gang_admitted_to_evicted_time_seconds"
            )
            metrics.observe(self.state, name, a.waited)

    # ---- loop -----------------------------------------------------------------------------
    def run(self, max_cycles: int | None = None, duration: float | None = None) -> int:
        """Cycle every interval_seconds until stop(), max_cycles or duration (all bounded)."""
        end = None if duration is None else time.monotonic() + duration
        n = 0
        self.events.write({"action": "governor_start"})
        while not self.stop_event.is_set():
            started = time.monotonic()
            self.cycle()
            n += 1
            if max_cycles is not None and n >= max_cycles:
                break
            if end is not None and time.monotonic() >= end:
                break
            wait = max(0.0, self.cfg.interval_seconds - (time.monotonic() - started))
            if end is not None:
                wait = min(wait, max(0.0, end - time.monotonic()))
            self.stop_event.wait(wait)
        self.events.write({"action": "governor_stop", "cycles": n})
        return n

    def stop(self) -> None:
        self.stop_event.set()


def _count_skip(st: GovState, reason: str) -> None:
    st.counters.drains_skipped[reason] = st.counters.drains_skipped.get(reason, 0) + 1


def snapshot_only(slurm: SlurmCli) -> Snapshot:
    return slurm.snapshot()
