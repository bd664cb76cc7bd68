"""The agent's own wait for systemd's boot targets.

nodeforge-init.service starts as soon as its files are mounted (DefaultDependencies=no, not
after basic.target or network-online.target: docs/contracts.md "Boot ordering"), so the
interpreter start and the local work overlap the rest of the boot. Whatever needs the network
(or what cloud-init does before network-online.target) first waits here: `systemctl start
TARGET...` queues nothing new at boot, its job merges with the one the boot already has, and
returns when the target is reached. One spawn, no polling, bounded by a timeout. The agent
starts that spawn in a thread before its params step (`start`), so the spawn and its D-Bus round
trip overlap the params parse; `wait` then only collects it.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from nodeforge.errors import CommandError, NodeforgeError

from .host import Host

log = logging.getLogger("nodeforge.agent")

NETWORK_ONLINE = "network-online.target"
BASIC = "basic.target"
# systemd-networkd-wait-online gives up after 120 s by default and network-online.target is then
# reached all the same (it only Wants= it): 300 s is for a boot that is stuck, not slow.
NETWORK_ONLINE_TIMEOUT = 300.0
# A join's bound past the command's own timeout (which kills systemctl): the thread's own return
JOIN_SLACK = 10.0
UNIT = "nodeforge-init.service"


class BootWaitError(NodeforgeError):
    exit_code = 1


# What the command gave: its CompletedProcess and duration, or its CommandError (the timeout)
_Outcome = tuple[subprocess.CompletedProcess, float] | BaseException


@dataclass
class BootWait:
    """Waits for boot targets, each at most once per `node init` run."""

    host: Host
    timeout: float = NETWORK_ONLINE_TIMEOUT
    reached: set[str] = field(default_factory=set)
    waited_s: float = 0.0  # blocked in `wait` (on the agent's path)
    command_s: float = 0.0  # the `systemctl start` itself (in the thread, or in `wait`)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _pending: tuple[str, ...] = ()
    _outcome: _Outcome | None = field(default=None, repr=False)

    def start(self, targets: Sequence[str]) -> None:
        """Start the wait for *targets* in a thread; `wait` for them collects it, `join` ends it
        on any outcome (no thread outlives the run)."""
        todo = tuple(t for t in targets if t not in self.reached)
        if not todo or self._thread is not None:
            return
        self._pending, self._outcome = todo, None

        def target() -> None:
            try:
                self._outcome = self._spawn(todo)
            except BaseException as exc:  # noqa: BLE001 - raised by wait() where it is needed
                self._outcome = exc

        self._thread = threading.Thread(target=target, name="nodeforge-boot-wait", daemon=True)
        self._thread.start()

    def join(self) -> None:
        """End a started wait whatever its outcome (the run's failure path: its error, if any,
        is not this run's concern any more). Bounded: the command's own timeout kills it."""
        if self._thread is not None:
            self._thread.join(self.timeout + JOIN_SLACK)
            self._thread = None

    def wait(self, targets: Sequence[str], why: str) -> float:
        """Return when every target in *targets* is reached (seconds waited; 0.0 when this run
        already waited for them). A target whose job fails is logged and not waited for again:
        the unit used to start after it whatever its outcome (After= only), and the step that
        needs the network reports its own error. Raise BootWaitError after *timeout* s."""
        todo = [t for t in targets if t not in self.reached]
        if not todo:
            return 0.0
        t0 = self.host.monotonic()
        if self._thread is not None and set(todo) <= set(self._pending):
            todo = list(self._pending)
            thread, self._thread = self._thread, None
            thread.join(self.timeout + JOIN_SLACK)
            outcome = self._outcome if not thread.is_alive() else None
        else:
            try:
                outcome = self._spawn(tuple(todo))
            except CommandError as exc:
                outcome = exc
        names = " and ".join(todo)
        if not isinstance(outcome, tuple):  # the timeout (a missing systemctl: MissingToolError)
            if outcome is not None and not isinstance(outcome, CommandError):
                raise outcome
            it = "them" if len(todo) > 1 else "it"
            raise BootWaitError(
                f"{names} not reached within {self.timeout:g}s (the agent's timeout for it; "
                f"{UNIT} starts before {it} and waits for {it} before {why}). See "
                f"`systemctl list-jobs`, `systemctl status {todo[-1]}` and "
                "`journalctl -b -u systemd-networkd-wait-online.service`, then run "
                "`nodeforge node init` again"
            ) from outcome
        cp, took = outcome
        dt = self.host.monotonic() - t0
        if cp.returncode != 0:
            out = (cp.stdout or "").strip().splitlines()
            log.warning(
                "%s: its start job did not succeed (%s); going on, as a unit ordered after it "
                "would", names, out[-1] if out else f"exit {cp.returncode}",
            )  # fmt: skip
        self.reached.update(todo)
        self.waited_s += dt
        self.command_s += took
        log.info("waited %.3fs for %s (before %s; systemctl took %.3fs)", dt, names, why, took)
        return dt

    def _spawn(self, targets: tuple[str, ...]) -> tuple[subprocess.CompletedProcess, float]:
        t0 = self.host.monotonic()
        cp = self.host.run(["systemctl", "start", *targets], check=False, timeout=self.timeout)
        return cp, self.host.monotonic() - t0
