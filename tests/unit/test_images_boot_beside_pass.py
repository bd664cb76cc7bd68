"""A pass over a cached layer starts while its sandbox boots (images/local.py
boot_beside_pass): the pass waits at the SSH gate for `up`; a failed boot fails it at once;
an interrupt while it runs stops the sandbox, which ends it. Fakes stand in for the sandbox
and the pass (labelled below); the gate's state file is the real one."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from nodeforge.images import ssh_gate
from nodeforge.images.local import boot_beside_pass
from nodeforge.images.pipeline import Phases

pytestmark = pytest.mark.unit


class FakeSandbox:
    """FIXTURE: records start/stop; start() takes *boot_s* seconds or raises *boot_error*."""

    def __init__(self, boot_s: float = 0.3, boot_error: BaseException | None = None):
        self.boot_s, self.boot_error = boot_s, boot_error
        self.events: list[str] = []
        self.stopped = threading.Event()

    def start(self) -> None:
        self.events.append("boot start")
        time.sleep(self.boot_s)
        if self.boot_error is not None:
            raise self.boot_error
        self.events.append("boot done")

    def stop(self) -> None:
        self.events.append("stop")
        self.stopped.set()


def _run(sb: FakeSandbox, run_pass, state, phases=None) -> Phases:
    phases = phases or Phases(lambda *a: None)
    boot_beside_pass(
        lambda: sb,
        lambda s: s.start(),
        lambda s: s.stop(),
        run_pass,
        state,
        phases,
    )
    return phases


def _gated_pass(sb: FakeSandbox, state, after_gate=lambda: None):
    """FIXTURE pass: starts at once (the controller's start-up), then waits at the real
    gate's state check as ssh's ProxyCommand would."""

    def run() -> None:
        sb.events.append("pass start")
        if ssh_gate.wait_state(state, 10) != ssh_gate.UP:
            sb.events.append("pass unreachable")
            raise RuntimeError("UNREACHABLE: the build sandbox did not boot")
        sb.events.append("pass connected")
        after_gate()

    return run


def test_the_pass_starts_during_the_boot_and_connects_only_once_it_is_up(tmp_path):
    sb = FakeSandbox()
    state = tmp_path / "state"
    phases = _run(sb, _gated_pass(sb, state), state)
    ev = sb.events
    assert ev.index("pass start") < ev.index("boot done") < ev.index("pass connected")
    assert state.read_text() == ssh_gate.UP
    assert set(phases.durations) == {"sandbox", "provision"}
    assert phases.durations["sandbox"] >= 0.3 and "provision.pass" in phases.steps


def test_a_failed_boot_fails_the_pass_at_its_gate_and_raises_the_boot_error(tmp_path):
    sb = FakeSandbox(boot_error=OSError("nspawn exited with 1"))
    state = tmp_path / "state"
    with pytest.raises(OSError, match="nspawn exited"):
        _run(sb, _gated_pass(sb, state), state)
    assert state.read_text() == ssh_gate.FAILED
    assert sb.events[-1] == "pass unreachable"  # it ended before the error went on


def test_a_pass_that_fails_while_the_sandbox_boots_is_raised_after_the_boot(tmp_path):
    sb = FakeSandbox()

    def broken() -> None:
        raise ValueError("ERROR! the playbook could not be parsed")

    with pytest.raises(ValueError, match="could not be parsed"):
        _run(sb, broken, tmp_path / "state")
    assert sb.events == ["boot start", "boot done"]


def test_an_interrupt_while_the_pass_runs_stops_the_sandbox_which_ends_the_pass(tmp_path):
    sb = FakeSandbox(boot_s=0.05)
    state = tmp_path / "state"

    def until_the_sandbox_stops() -> None:
        assert sb.stopped.wait(20), "the pass was never ended"
        sb.events.append("pass lost its connection")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(sb, _gated_pass(sb, state, until_the_sandbox_stops), state)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert sb.events[-2:] == ["stop", "pass lost its connection"]
