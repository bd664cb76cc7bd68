"""Python's cyclic garbage collector, run between governor cycles instead of inside them.

Why: at 10k jobs the governor keeps ~10^6 long-lived objects (the cached job and node
records, the state). CPython's automatic collector runs whenever allocations pass its
thresholds, so its passes fall inside a cycle: the young passes cost ~7 ms of a 10k-job
cycle in which 1 % of the nodes change, and a full pass 58-107 ms (bench/README-gang.md).
The governor sleeps most of each interval, so the passes move there:

- automatic collection is off while the governor runs. Reference counting still frees all
  acyclic garbage at once; only reference cycles wait, for one cycle at most;
- after every cycle the young generation is collected and the survivors are frozen
  (``gc.freeze``: moved to the permanent generation, which no pass scans), so the next
  young pass looks only at what the next cycle allocated;
- every ``full_every`` seconds everything is unfrozen, collected in full and frozen again,
  when the governor has time before its next cycle (a full pass is deferred while a gang
  deadline is closer than twice the last full pass took, and forced once it is a whole
  ``full_every`` late, so it is never starved).

Its CPU time is reported apart from the cycle's (``nodeforge_gang_gc_seconds_total``).
The state is process-wide, so only ``Governor.run`` (the daemon, a process of its own)
uses it, as a context manager that restores the collector on exit.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FULL_EVERY = 300.0  # seconds between full passes
FIRST_FULL_GUESS = 0.2  # seconds a full pass is assumed to take before one was measured


@dataclass
class CollectorStats:
    """CPU seconds and passes, per kind ("young", "full"), since the collector started."""

    seconds: dict[str, float] = field(default_factory=lambda: {"young": 0.0, "full": 0.0})
    passes: dict[str, int] = field(default_factory=lambda: {"young": 0, "full": 0})
    deferred: int = 0  # full passes put off because the next cycle was too close
    last_full_seconds: float | None = None


class Collector:
    def __init__(
        self,
        full_every: float = FULL_EVERY,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.process_time,
    ):
        if not full_every > 0:  # also refuses NaN
            raise ValueError(f"full_every must be > 0 seconds, got {full_every!r}")
        self.full_every = full_every
        self.clock = clock
        self.cpu = cpu
        self.stats = CollectorStats()
        self._was_enabled: bool | None = None
        self._last_full = 0.0

    def __enter__(self) -> Collector:
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._full()  # what start-up built (state, imports) is collected once and frozen
        return self

    def __exit__(self, *exc) -> None:
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def between_cycles(self, idle: float) -> str:
        """Run the pass that is due; *idle* is the time left before the next cycle.
        Returns the kind of pass that ran ("young" or "full")."""
        if self._was_enabled is None:
            raise RuntimeError("Collector.between_cycles outside `with Collector()`")
        late = self.clock() - self._last_full - self.full_every
        if late >= 0:
            took = self.stats.last_full_seconds
            if idle >= 2 * (FIRST_FULL_GUESS if took is None else took) or late >= self.full_every:
                self._full()
                return "full"
            self.stats.deferred += 1
        self._pass("young", 0)
        gc.freeze()
        return "young"

    def _full(self) -> None:
        gc.unfreeze()
        self.stats.last_full_seconds = self._pass("full", 2)
        gc.freeze()
        self._last_full = self.clock()

    def _pass(self, kind: str, generation: int) -> float:
        c0 = self.cpu()
        gc.collect(generation)
        spent = self.cpu() - c0
        self.stats.seconds[kind] += spent
        self.stats.passes[kind] += 1
        return spent
