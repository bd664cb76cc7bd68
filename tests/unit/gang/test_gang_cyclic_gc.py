"""Python's cyclic collector runs between governor cycles, never inside one (cyclic_gc.py):
its passes cost 7 ms (young) to 58-107 ms (full) of a 10k-job cycle when they fell inside."""

from __future__ import annotations

import gc
import weakref

import pytest

from nodeforge.gang import config as gcfg
from nodeforge.gang.cyclic_gc import Collector
from nodeforge.gang.governor import Governor
from nodeforge.gang.slurm_view import JobObs, Snapshot

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Node:
    """A container that is garbage only as a reference cycle."""

    def __init__(self):
        self.me = self


def cyclic_garbage() -> weakref.ref:
    n = Node()
    return weakref.ref(n)  # the only strong reference left is n.me


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_automatic_collection_is_off_inside_and_restored_after():
    gc.enable()
    with Collector(clock=Clock()):
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # start-up's survivors frozen by the first full pass
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    with Collector(clock=Clock()):
        pass
    assert not gc.isenabled()  # an embedding that had it off keeps it off


def test_young_pass_collects_cycles_made_since_the_last_pass():
    with Collector(clock=Clock()) as col:
        ref = cyclic_garbage()
        assert ref() is not None  # automatic collection is off: the cycle waits
        assert col.between_cycles(idle=1.0) == "young"
        assert ref() is None
        assert col.stats.passes == {"young": 1, "full": 1}


def test_frozen_survivors_wait_for_the_full_pass_which_comes_when_due():
    clock = Clock()
    with Collector(full_every=300, clock=clock) as col:
        keep = [Node()]
        ref = weakref.ref(keep[0])
        col.between_cycles(idle=1.0)  # keep[0] survives and is frozen
        scanned = [o for g in (0, 1, 2) for o in gc.get_objects(generation=g)]
        assert not any(o is keep[0] for o in scanned)  # in no generation a pass looks at
        del scanned
        keep.clear()  # now cyclic garbage, but frozen: a young pass does not see it
        clock.t = 299.0
        assert col.between_cycles(idle=1.0) == "young"
        assert ref() is not None
        clock.t = 300.0
        assert col.between_cycles(idle=1.0) == "full"
        assert ref() is None
        assert gc.get_freeze_count() > 0  # frozen again after the full pass


def test_full_pass_is_deferred_while_the_next_cycle_is_close_but_never_starved():
    clock = Clock()

    class Cpu:
        """process_time as the collector reads it: once before and once after each pass."""

        t, calls, cost = 0.0, 0, 0.0

        def __call__(self) -> float:
            self.calls += 1
            if self.calls % 2 == 0:
                self.t += self.cost
            return self.t

    cpu = Cpu()

    class Timed(Collector):
        def _pass(self, kind, generation):
            cpu.cost = 0.1 if kind == "full" else 0.001  # a full pass "takes" 0.1 s of CPU
            return super()._pass(kind, generation)

    with Timed(full_every=60, clock=clock, cpu=cpu) as col:
        assert col.stats.last_full_seconds == pytest.approx(0.1)
        clock.t = 60.0
        assert col.between_cycles(idle=0.15) == "young"  # < 2 x 0.1 s before the next cycle
        assert col.stats.deferred == 1
        assert col.between_cycles(idle=0.25) == "full"
        clock.t = 120.0 + 59.0
        assert col.between_cycles(idle=0.0) == "young"
        clock.t = 120.0 + 60.0  # a whole full_every late: forced, whatever the idle time
        assert col.between_cycles(idle=0.0) == "full"
        assert col.stats.deferred == 2
        assert col.stats.seconds["full"] == pytest.approx(0.3)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("-inf")])
def test_full_every_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="full_every"):
        Collector(full_every=bad)


def test_between_cycles_outside_the_context_is_an_error():
    with pytest.raises(RuntimeError, match="outside"):
        Collector().between_cycles(idle=1.0)


class GarbageSlurm:
    """Every snapshot allocates 5,000 reference cycles: far past the automatic collector's
    threshold (700 allocations), so with it on, passes would start inside the cycle."""

    def snapshot(self, need=None, settled=()) -> Snapshot:
        junk = [Node() for _ in range(5000)]
        del junk
        j = JobObs("9", "RUNNING", "None", ("n1", "n2"), 2, partition="main", start_time=1.0)
        return Snapshot([j], nodes={"n1": frozenset({"ALLOCATED"}), "n2": frozenset()})

    def __getattr__(self, name):  # requeue, set_admin_comment, ... (none expected)
        raise AssertionError(f"unexpected Slurm command {name}")


def test_governor_runs_no_collector_pass_inside_a_cycle(tmp_path):
    c = gcfg.from_dict(
        {
            "timeout": 1000,
            "interval_seconds": 0.001,
            "state_file": str(tmp_path / "state.json"),
            "event_log": str(tmp_path / "events.jsonl"),
            "metrics_file": str(tmp_path / "metrics.prom"),
        },
        "t",
    )
    g = Governor(c, GarbageSlurm(), clock=lambda: 2.0)  # type: ignore[arg-type]
    in_cycle, passes = [False], {"in": 0, "out": 0}
    cycle = g.cycle

    def traced():
        in_cycle[0] = True
        try:
            return cycle()
        finally:
            in_cycle[0] = False

    def seen(phase, info):
        if phase == "start":
            passes["in" if in_cycle[0] else "out"] += 1

    g.cycle = traced  # type: ignore[method-assign]
    gc.enable()
    gc.callbacks.append(seen)
    try:
        assert g.run(max_cycles=4) == 4
    finally:
        gc.callbacks.remove(seen)
    assert passes["in"] == 0
    assert passes["out"] >= 4  # the start-up full pass and one after each cycle but the last
    assert gc.isenabled()
    metrics = (tmp_path / "metrics.prom").read_text()
    assert 'nodeforge_gang_gc_passes_total{pass="young"} 3' in metrics  # as of the 4th cycle
    assert 'nodeforge_gang_gc_seconds_total{pass="full"}' in metrics
