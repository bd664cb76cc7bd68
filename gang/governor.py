"""The governor loop: observe Slurm, decide (policy.decide), persist, act, record."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nodeforge.errors import CommandError, NodeforgeError

from . import deadlines, metrics, policy, strikes
from . import state as state_mod
from .actions import JOB_COMMANDS, ActionKind
from .config import GangConfig
from .cyclic_gc import Collector
from .events import EventLog, encode_admin
from .slurm_view import JobAddress, JobObs, SlurmCli, Snapshot
from .state import GovState

log = logging.getLogger("nodeforge.gang")
JOB_ALREADY_PENDING = "Job is pending execution"  # scontrol requeue of a job not running
READ_BACKOFF_MAX = 60.0  # seconds between reads of a slurmctld that keeps failing


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
        self.last_bytes = 0
        self.failures = 0  # failed reads of slurmctld in a row
        self.retry_at = 0.0
        self._saved: state_mod.Saved | None = None  # what this process last wrote
        self.collector: Collector | None = None  # set while run() runs (cyclic_gc.py)
        # AdminComments this cycle wrote (job -> text): a second write in the same cycle
        # starts from it, not from the snapshot's older text
        self._written: dict[str, str] = {}

    # ---- one cycle ------------------------------------------------------------------------
    def cycle(self) -> list[policy.Action]:
        t0 = time.monotonic()
        if self.clock() < self.retry_at:
            return []  # backing off after failed reads of slurmctld
        try:
            snap = self.slurm.snapshot(
                need=policy.full_reads(self.cfg, self.state),
                settled=policy.settled_reads(self.state),
            )
        except NodeforgeError as exc:
            self._read_failed(exc)
            return []
        if not self.up:
            self.events.write({"action": "slurmctld_reachable", "failures": self.failures})
        self.up, self.failures, self.retry_at = True, 0, 0.0
        self.last_bytes = snap.bytes_read
        now = self.clock()
        new_state, actions = policy.decide(self.cfg, self.state, snap, now)
        self.state = new_state
        # Write-ahead: the decision (phase, counter, next eligible) is on disk before Slurm
        # is touched, so a crash in between re-issues the same attempt, never a second one.
        # A cycle that changed nothing writes nothing.
        self._saved = state_mod.save_if_changed(self.state, self.cfg.state_file, self._saved)
        if actions:
            self._written = {}
            jobs = {j.job_id: j for j in snap.jobs}
            for a in actions:
                self._execute(a, jobs.get(a.job_id))
            self._saved = state_mod.save_if_changed(self.state, self.cfg.state_file, self._saved)
        self.last_cycle_seconds = time.monotonic() - t0
        self._write_metrics()
        return actions

    def _read_failed(self, exc: NodeforgeError) -> None:
        """slurmctld unreachable, scontrol failing, or output that does not parse: an event
        on the first failure and on every doubling, retries backed off up to 60 s (never a
        1 Hz loop of errors); no decision is taken on a partial view."""
        self.failures += 1
        if self.up or self.failures & (self.failures - 1) == 0:
            log.warning(
                "reading slurmctld failed (%d in a row), will retry: %s", self.failures, exc
            )
            self.events.write(
                {
                    "action": "slurmctld_unreachable",
                    "failures": self.failures,
                    "detail": str(exc)[-500:],
                }
            )
        self.up = False
        delay = min(self.cfg.interval_seconds * 2 ** min(self.failures - 1, 16), READ_BACKOFF_MAX)
        self.retry_at = self.clock() + delay
        self._write_metrics()

    def _write_metrics(self) -> None:
        if self.cfg.metrics_file:
            metrics.write(
                self.cfg.metrics_file,
                metrics.render(
                    self.state,
                    self.last_cycle_seconds,
                    self.up,
                    self.last_bytes,
                    None if self.collector is None else self.collector.stats,
                ),
            )

    def _admin(self, a: policy.Action, job, tgt: JobAddress, phase: str, why: str) -> None:
        rec = self.state.jobs.get(a.job_id)
        text = encode_admin(
            self._existing_admin(a, job),
            count=a.count,
            phase=phase,
            next_eligible=a.start_at if a.start_at else (rec.next_eligible if rec else None),
            restarts=a.restarts,
            why=why,
            first_admitted=rec.first_admitted_at if rec else None,
        )
        self._set_admin(a, tgt, text)

    def _existing_admin(self, a: policy.Action, job) -> str:
        return self._written.get(a.job_id, job.admin_comment if job is not None else "")

    def _set_admin(self, a: policy.Action, tgt: JobAddress, text: str) -> None:
        self.slurm.set_admin_comment(tgt, text)
        self._written[a.job_id] = text

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
        if a.timeout is not None:
            ev["timeout_seconds"] = round(a.timeout, 3)
        st = self.state
        try:
            kind = ActionKind(a.kind)
            handler = self._handlers.get(kind)
            # ("" for a kind that issues no job command: never passed to Slurm)
            tgt = _target(a, job) if kind in JOB_COMMANDS else JobAddress("")
            if tgt:
                ev["address"] = tgt
            if handler is not None:
                handler(a, job, tgt, ev)
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

    # ---- one handler per action kind ------------------------------------------------------
    def _do_requeue(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        self._admin(a, job, tgt, "backoff", a.reason)
        self._requeue(tgt, a.hold, ev)
        ev["requeued_at"] = round(time.time(), 3)
        if a.deadline is not None:
            metrics.observe(
                self.state,
                "nodeforge_gang_deadline_to_requeue_seconds",
                max(0.0, ev["requeued_at"] - a.deadline),
            )
        self.slurm.set_start_time(tgt, a.start_at or self.clock())
        self._count_eviction(a)
        if a.hold:
            self.slurm.hold(tgt)  # block_admission: back in the queue under our admin hold

    def _do_requeuehold(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        """Deactivate: requeuehold, then an admin hold (the owner can release the hold that
        requeuehold leaves; not an admin hold). Counted once, not when re-closing."""
        self._admin(a, job, tgt, "deactivated", a.reason)
        self._requeue(tgt, True, ev)
        ev["requeued_at"] = round(time.time(), 3)
        if not a.reissue:
            self.state.counters.deactivated += 1
            self._count_eviction(a)
        self.slurm.hold(tgt)

    def _do_set_start(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        self.slurm.set_start_time(tgt, a.start_at or self.clock())

    def _do_hold(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        self.slurm.hold(tgt)
        if a.reason == "Admission":
            self._admin(a, job, tgt, "waiting_admission", "block_admission")

    def _do_release(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        self.slurm.release(tgt)
        self.state.counters.released += 1

    def _do_not_requeueable(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        self._admin(a, job, tgt, "not_requeueable", "not_requeueable")
        self.state.counters.not_requeueable += 1
        cancel = a.kind == ActionKind.CANCEL
        log.warning(
            "gang job %s timed out but cannot be requeued (%s)%s",
            a.job_id,
            a.detail,
            "; cancelling" if cancel else "",
        )
        if cancel:
            self.slurm.cancel(tgt)

    def _do_annotate(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        self._admin(a, job, tgt, a.phase, a.reason)

    def _do_deadline(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        """The verdict on the job's own timeout, where its owner sees it (scontrol show job)."""
        self._set_admin(a, tgt, deadlines.with_token(self._existing_admin(a, job), a.admin))

    def _do_strike(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        self.state.counters.node_strikes += 1

    def _do_drain(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        self._drain(a, ev)

    def _do_drain_skipped(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        _count_skip(self.state, a.reason)

    def _do_note(self, a: policy.Action, job, tgt: JobAddress, ev: dict) -> None:
        if a.reason == "PodsReady" and a.waited is not None:
            metrics.observe(self.state, "kueue_admitted_until_ready_wait_time_seconds", a.waited)

    @property
    def _handlers(self) -> dict[ActionKind, Callable]:
        K = ActionKind
        return {
            K.REQUEUE: self._do_requeue,
            K.REQUEUEHOLD: self._do_requeuehold,
            K.SET_START: self._do_set_start,
            K.HOLD: self._do_hold,
            K.RELEASE: self._do_release,
            K.RECORD: self._do_not_requeueable,
            K.CANCEL: self._do_not_requeueable,
            K.ANNOTATE: self._do_annotate,
            K.STRIKE: self._do_strike,
            K.DRAIN: self._do_drain,
            K.DRAIN_SKIPPED: self._do_drain_skipped,
            K.NOTE: self._do_note,
            K.DEADLINE: self._do_deadline,
        }

    def _requeue(self, job: JobAddress, hold: bool, ev: dict) -> None:
        """requeue or requeuehold. The caller follows a requeuehold with an admin hold
        (`scontrol hold` as root): a hold the governor places is one the owner cannot release."""
        try:
            if hold:
                self.slurm.requeuehold(job)
            else:
                self.slurm.requeue(job)
        except CommandError as exc:
            # Slurm got there first. Draining a node that is being powered up makes slurmctld
            # requeue its jobs ("DRAIN/FAIL request for node X which is allocated and being
            # powered up. Requeuing jobs"), and a struck node's drain goes out just before
            # its gang's requeue. The job is back in the queue with Restarts+1 all the same;
            # the hold and the backoff (StartTime, set next) are still ours to apply.
            if JOB_ALREADY_PENDING not in exc.output:
                raise
            ev["requeued_by"] = "slurmctld"

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
        if a.kind == ActionKind.REQUEUEHOLD:
            # Kueue counts a deactivation under its own reason, with the cause beneath it
            reason, cause = metrics.REASON_DEACTIVATED, metrics.CAUSE_REQUEUING_LIMIT
        else:
            reason, cause = policy.REASON_TIMEOUT, a.cause
        metrics.inc_evicted(self.state, reason, a.partition, cause)
        if a.waited is not None:
            name = (
                "kueue_pods_ready_to_evicted_time_seconds"
                if a.reason == policy.REASON_RECOVERY
                else "nodeforge_gang_admitted_to_evicted_time_seconds"
            )
            metrics.observe(self.state, name, a.waited)

    # ---- loop -----------------------------------------------------------------------------
    def run(
        self,
        max_cycles: int | None = None,
        duration: float | None = None,
        collector: Collector | None = None,
    ) -> int:
        """Cycle every interval_seconds until stop(), max_cycles or duration (all bounded).
        Python's cyclic collector runs between cycles, not inside them (cyclic_gc.py)."""
        end = None if duration is None else time.monotonic() + duration
        n = 0
        self.events.write({"action": "governor_start"})
        with collector or Collector() as col:
            self.collector = col
            try:
                while not self.stop_event.is_set():
                    started = time.monotonic()
                    self.cycle()
                    n += 1
                    if max_cycles is not None and n >= max_cycles:
                        break
                    if end is not None and time.monotonic() >= end:
                        break
                    wait = self.next_wait(time.monotonic() - started)
                    t = time.monotonic()
                    col.between_cycles(wait)  # (not asked twice: next_wait walks the gangs)
                    wait = max(0.0, wait - (time.monotonic() - t))
                    if end is not None:
                        wait = min(wait, max(0.0, end - time.monotonic()))
                    self.stop_event.wait(wait)
            finally:
                self.collector = None  # a closed collector's stats are no longer the daemon's
        self.events.write({"action": "governor_stop", "cycles": n})
        return n

    def next_wait(self, elapsed: float) -> float:
        """Seconds until the next cycle: the rest of the interval, or less when a gang's
        deadline falls before that (policy.next_deadline). Measured on 24.11 (bench/
        README-gang.md, `deadline`): without it, a deadline waited for the next interval
        tick, so deadline -> requeue was spread over a whole interval by the cycle phase."""
        wait = max(0.0, self.cfg.interval_seconds - elapsed)
        now = self.clock()
        due = policy.next_deadline(self.cfg, self.state, now)
        return wait if due is None else min(wait, due - now)

    def stop(self) -> None:
        self.stop_event.set()


def _target(a: policy.Action, job: JobObs | None) -> JobAddress:
    """The address of the job *a* was decided about, from this snapshot's record of it (never
    from the key, a stored id or the job's text): no command when there is none."""
    if job is None or job.job_id != a.job_id:
        raise NodeforgeError(
            f"gang {a.kind} for job {a.job_id}: slurmctld no longer lists it; no command issued"
        )
    if not job.address:
        raise NodeforgeError(
            f"gang {a.kind} for job {a.job_id}: Slurm's record names no single job "
            "(an array record without task ids); no command issued"
        )
    return job.address


def _count_skip(st: GovState, reason: str) -> None:
    st.counters.drains_skipped[reason] = st.counters.drains_skipped.get(reason, 0) + 1


def snapshot_only(slurm: SlurmCli) -> Snapshot:
    return slurm.snapshot()
