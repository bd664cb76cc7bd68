"""The governor's loop wakes for a gang's deadline instead of waiting for its next interval
tick (bench/README-gang.md, `deadline`: on 24.11 the delay was spread over one interval by
the cycle phase)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nodeforge.gang import config as gcfg
from nodeforge.gang import policy
from nodeforge.gang.governor import Governor
from nodeforge.gang.slurm import JobObs, Snapshot
from nodeforge.gang.state import ADMITTED, READY, RECOVERING, GangRecord, GovState

pytestmark = pytest.mark.unit

START = 1_000_000_000.0  # Slurm StartTime of the gang (whole seconds)


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Slurm:
    """Serves one snapshot (a 2-node gang, one node still powering up), records commands."""

    def __init__(self):
        self.calls: list[tuple] = []

    def snapshot(self) -> Snapshot:
        j = JobObs("9", "CONFIGURING", "None", ("gn1", "gn2"), 2, partition="main",
                   start_time=START)  # fmt: skip
        booting = frozenset({"ALLOCATED", "CLOUD", "POWERING_UP"})
        return Snapshot([j], nodes={"gn1": frozenset({"ALLOCATED"}), "gn2": booting})

    def __getattr__(self, name):  # requeue, set_admin_comment, set_start_time, hold, ...
        return lambda *a: self.calls.append((name, *a))


def governor(tmp_path, clock: Clock, **cfg) -> Governor:
    c = gcfg.from_dict(
        {
            "timeout": 10,
            "interval_seconds": 1,
            "requeuing": {"jitter": 0},
            "state_file": str(tmp_path / "state.json"),
            "event_log": str(tmp_path / "events.jsonl"),
            "metrics_file": str(tmp_path / "metrics.prom"),
            **cfg,
        },
        "t",
    )
    return Governor(c, Slurm(), clock=clock)  # type: ignore[arg-type]


def test_loop_wakes_at_the_deadline_and_requeues_then(tmp_path):
    clock = Clock(START + 9.3)  # the deadline (START + 10) is 0.7 s ahead
    g = governor(tmp_path, clock)
    assert g.cycle() == [] and g.state.jobs["9"].phase == ADMITTED
    wait = g.next_wait(elapsed=0.05)
    assert wait == pytest.approx(0.7)  # not the 0.95 s left of the interval
    clock.t += wait
    kinds = [a.kind for a in g.cycle()]
    assert "requeue" in kinds and ("requeue", "9") in g.slurm.calls  # type: ignore[attr-defined]


def test_without_a_deadline_ahead_the_interval_rules(tmp_path):
    clock = Clock(START + 1)
    g = governor(tmp_path, clock)
    assert g.next_wait(elapsed=0.1) == pytest.approx(0.9)  # nothing tracked yet
    g.cycle()
    assert g.next_wait(elapsed=0.1) == pytest.approx(0.9)  # deadline 9 s ahead: later
    assert g.next_wait(elapsed=1.5) == 0.0  # a slow cycle: at once, as before
    g.state.jobs["9"] = replace(g.state.jobs["9"], admitted_at=START - 20)
    assert g.next_wait(elapsed=0.1) == pytest.approx(0.9)  # passed: no busy loop on it


def test_next_deadline_covers_admitted_and_recovering_gangs():
    cfg = gcfg.GangConfig(timeout=10, recovery_timeout=5)
    st = GovState()
    st.jobs = {
        "1": GangRecord("1", phase=ADMITTED, admitted_at=100.0),  # due 110
        "2": GangRecord("2", phase=RECOVERING, admitted_at=50.0, lost_at=103.0),  # due 108
        "3": GangRecord("3", phase=READY, admitted_at=99.0),  # ready: no deadline
        "4": GangRecord("4", phase=ADMITTED, admitted_at=80.0),  # due 90: passed
    }
    assert policy.next_deadline(cfg, st, 100.5) == 108.0
    assert policy.next_deadline(cfg, st, 108.0) == 110.0
    assert policy.next_deadline(replace(cfg, recovery_timeout=0), st, 100.5) == 110.0
    assert policy.next_deadline(cfg, st, 111.0) is None
