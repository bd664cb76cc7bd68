"""The governor's loop wakes for a gang's deadline instead of waiting for its next interval
tick (bench/README-gang.md, `deadline`: on 24.11 the delay was spread over one interval by
the cycle phase)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_

from nodeforge.gang import config as gcfg
from nodeforge.gang import policy
from nodeforge.gang.governor import Governor
from nodeforge.gang.slurm_view import JobAddress, JobObs, Snapshot
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

    def snapshot(self, need=None, settled=()) -> Snapshot:
        j = JobObs("9", "CONFIGURING", "None", ("gn1", "gn2"), 2, partition="main",
                   start_time=START, address=JobAddress("9"))  # fmt: skip
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


def _walk(cfg, st, now):
    """The reference: an independent walk over every record."""
    due = None
    for rec in st.jobs.values():
        if rec.phase == ADMITTED and rec.admitted_at is not None:
            t = rec.admitted_at + cfg.timeout
        elif rec.phase == RECOVERING and rec.lost_at is not None and cfg.recovery_timeout > 0:
            t = rec.lost_at + cfg.recovery_timeout
        else:
            continue
        if t > now and (due is None or t < due):
            due = t
    return due


_PHASES = [ADMITTED, RECOVERING, READY]
_rec = st_.builds(
    lambda k, ph, a, lost: GangRecord(k, phase=ph, admitted_at=a, lost_at=lost),
    st_.sampled_from(["1", "2", "3", "4", "5"]),
    st_.sampled_from(_PHASES),
    st_.none() | st_.integers(90, 120).map(float),
    st_.none() | st_.integers(90, 120).map(float),
)
# one step: put a new record under its key, drop a key, replace the whole dict, or a config
_step = st_.one_of(
    st_.tuples(st_.just("put"), _rec),
    st_.tuples(st_.just("drop"), st_.sampled_from(["1", "2", "3", "4", "5"])),
    st_.tuples(st_.just("new_dict"), st_.lists(_rec, max_size=5)),
    st_.tuples(st_.just("cfg"), st_.tuples(st_.integers(1, 20), st_.integers(0, 20))),
)


@settings(max_examples=300, deadline=None)
@given(steps=st_.lists(st_.tuples(_step, st_.integers(95, 145).map(float)), max_size=25))
def test_kept_clocks_give_what_the_walk_over_every_record_gives(steps):
    """Called again and again on one state, next_deadline returns exactly the reference
    walk's deadline whatever happened to the records in between: records put, dropped, the
    dict replaced, a record put back, the config changed."""
    cfg = gcfg.GangConfig(timeout=10, recovery_timeout=5)
    st = GovState()
    for (kind, arg), now in steps:
        if kind == "put":
            st.jobs[arg.job_id] = arg
        elif kind == "drop":
            st.jobs.pop(arg, None)
        elif kind == "new_dict":
            st.jobs = {r.job_id: r for r in arg}
        else:
            cfg = replace(cfg, timeout=arg[0], recovery_timeout=arg[1])
        assert policy.next_deadline(cfg, st, now) == _walk(cfg, st, now)


def test_a_gang_admitted_in_a_later_cycle_is_woken_for(tmp_path):
    """The wake-up follows the states decide() hands on: a gang that becomes admitted after
    the first cycles gets its wake-up at its deadline."""
    clock = Clock(START - 5)
    g = governor(tmp_path, clock)

    class Later(Slurm):
        def snapshot(self, need=None, settled=()) -> Snapshot:
            state = "PENDING" if clock.t < START else "CONFIGURING"
            nodes = () if state == "PENDING" else ("gn1", "gn2")
            j = JobObs("9", state, "None", nodes, 2, partition="main",
                       start_time=START if nodes else None, address=JobAddress("9"))  # fmt: skip
            booting = frozenset({"ALLOCATED", "CLOUD", "POWERING_UP"})
            return Snapshot([j], nodes={"gn1": frozenset({"ALLOCATED"}), "gn2": booting})

    g.slurm = Later()  # type: ignore[assignment]
    g.cycle()
    assert g.next_wait(elapsed=0.0) == pytest.approx(1.0)  # pending: no clock yet
    clock.t = START + 2.5
    g.cycle()
    assert g.state.jobs["9"].phase == ADMITTED
    assert g.next_wait(elapsed=0.0) == pytest.approx(1.0)  # deadline 7.5 s ahead
    clock.t = START + 9.6
    g.cycle()
    wait = g.next_wait(elapsed=0.0)
    assert wait == pytest.approx(0.4)  # wakes at START + 10, not at the next tick
    clock.t += wait
    assert "requeue" in [a.kind for a in g.cycle()]
