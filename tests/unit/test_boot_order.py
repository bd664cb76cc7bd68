"""The agent starts before basic.target and network-online.target and waits for them itself
(bootstrap/boot_order.py; docs/contracts.md "Boot ordering"): once per run, bounded, after a
node.yaml that was in place before boot and before anything that needs the network or what the
boot writes (cloud-init, tmpfiles credentials)."""

from __future__ import annotations

import json
import subprocess
import threading

import pytest

from nodeforge.bootstrap import boot_order
from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.boot_order import BASIC, NETWORK_ONLINE, BootWait, BootWaitError
from nodeforge.bootstrap.host import Host
from nodeforge.errors import CommandError
from tests.unit.test_bootstrap import COMPUTE, CTL, make

pytestmark = pytest.mark.unit

BOOT_WAIT = ["systemctl", "start", BASIC, NETWORK_ONLINE]


class FakeSystemctl:
    """A fake runner for `systemctl start TARGET...`: reached (0), failed (rc) or a timeout."""

    def __init__(self, rc: int = 0, timeout: bool = False, out: str = ""):
        self.rc, self.timeout, self.out = rc, timeout, out
        self.calls: list[tuple[list[str], float | None]] = []

    def __call__(self, argv, check=True, timeout=None, **kw):
        self.calls.append((list(argv), timeout))
        if self.timeout:
            raise CommandError(list(argv), -1, "", hint=f"timed out after {timeout}s")
        return subprocess.CompletedProcess(argv, self.rc, self.out, None)


def _host(run) -> Host:
    return Host(run=run, sleep=lambda s: None)


def test_reached_targets_are_waited_for_with_one_call_and_only_once():
    fake = FakeSystemctl()
    bw = BootWait(_host(fake), timeout=42)
    bw.wait((BASIC, NETWORK_ONLINE), "the identity step")
    assert bw.wait((BASIC, NETWORK_ONLINE), "again") == 0.0
    assert bw.wait((NETWORK_ONLINE,), "the controller") == 0.0
    assert fake.calls == [(BOOT_WAIT, 42)]  # one spawn, bounded by the agent's timeout
    assert bw.reached == {BASIC, NETWORK_ONLINE}


def test_timeout_is_a_clear_error_naming_the_target_and_the_timeout():
    bw = BootWait(_host(FakeSystemctl(timeout=True)), timeout=7)
    with pytest.raises(BootWaitError) as ei:
        bw.wait((NETWORK_ONLINE,), "reading params")
    msg = str(ei.value)
    assert "network-online.target not reached within 7s" in msg
    assert "nodeforge-init.service" in msg and "before reading params" in msg
    assert "systemctl list-jobs" in msg and "nodeforge node init" in msg
    assert bw.reached == set()  # not reached: a later call would wait again


def test_failed_target_job_is_logged_and_not_fatal(caplog):
    """As a unit ordered After= a target starts whatever the target's outcome."""
    fake = FakeSystemctl(rc=1, out="A dependency job for network-online.target failed.\n")
    bw = BootWait(_host(fake))
    bw.wait((NETWORK_ONLINE,), "x")
    assert "dependency job for network-online.target failed" in caplog.text
    assert bw.wait((NETWORK_ONLINE,), "y") == 0.0 and len(fake.calls) == 1


# -- in the agent ------------------------------------------------------------------------------
def _boot_waits(fm) -> list[int]:
    return [i for i, c in enumerate(fm.calls) if c[:2] == ["systemctl", "start"] and
            all(u.endswith(".target") for u in c[2:])]  # fmt: skip


def test_local_node_yaml_is_read_before_the_wait_and_everything_else_after_it(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, CTL)  # node_address given: nothing to detect
    state = agent.init()
    assert state.status == "ready"
    waits = _boot_waits(fm)
    assert len(waits) == 1 and fm.calls[waits[0]] == BOOT_WAIT
    assert waits[0] == 0  # the first command the agent runs: params came from the file alone
    assert state.steps["params"].detail["boot_wait_s"] >= 0
    assert state.steps["params"].detail["source"].startswith("file:")


def test_address_detection_waits_first_and_the_wait_is_not_repeated(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)  # no node_address: route to the controller
    order: list[str] = []
    run = agent.host.run

    def recording_run(argv, *a, **kw):
        if argv[:2] == ["systemctl", "start"] and argv[-1] == NETWORK_ONLINE:
            order.append("wait")
        return run(argv, *a, **kw)

    def source_address(target):
        order.append("route")
        return "10.9.0.5"

    agent.host.run, agent.host.source_address = recording_run, source_address
    assert agent.init().status == "ready"
    assert order == ["wait", "route"]
    assert len(_boot_waits(fm)) == 1


def test_a_resumed_run_waits_once_and_not_before_its_local_params(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, CTL)
    agent.init()
    n = len(fm.calls)
    state = agent.init()  # a reboot or a rerun: resumes, steps verified
    assert state.steps["identity"].status == "skipped"
    again = [
        c for c in fm.calls[n:] if c[:2] == ["systemctl", "start"] and c[-1].endswith(".target")
    ]
    assert again == [BOOT_WAIT] and fm.calls[n] == BOOT_WAIT


def test_node_yaml_written_during_boot_is_read_after_the_wait(tmp_path):
    """No node.yaml at the agent's start: cloud-init's write_files (before
    network-online.target) may write it. The wait comes first, then every source in order."""
    agent, fm, paths, _ = make(tmp_path, CTL)
    written = paths.node_yaml.read_text()
    paths.node_yaml.unlink()
    cmdline_reads: list[bool] = []
    paths.cmdline.parent.mkdir(parents=True, exist_ok=True)
    paths.cmdline.write_text("quiet\n")
    run = agent.host.run

    def boot_writes_it(argv, *a, **kw):
        if argv == BOOT_WAIT:
            cmdline_reads.append(True)
            paths.node_yaml.write_text(written)
            paths.node_yaml.chmod(0o600)
        return run(argv, *a, **kw)

    agent.host.run = boot_writes_it
    state = agent.init()
    assert state.status == "ready" and state.node == "ctl"
    assert cmdline_reads == [True] and len(_boot_waits(fm)) == 1


def test_tmpfiles_credential_makes_an_existing_node_yaml_wait(tmp_path):
    """A `tmpfiles.extra` credential (the qemu harness writes node.yaml that way): the file may
    be half written when the agent starts, so it is read only after basic.target."""
    agent, fm, paths, _ = make(tmp_path, CTL)
    final = paths.node_yaml.read_text()
    paths.node_yaml.write_text('{"role": "controller", "cluster_name"')  # truncated
    paths.system_credentials.mkdir(parents=True)
    (paths.system_credentials / "tmpfiles.extra").write_text("f~ /etc/nodeforge/node.yaml ...\n")
    run = agent.host.run

    def tmpfiles_finishes(argv, *a, **kw):
        if argv == BOOT_WAIT:
            paths.node_yaml.write_text(final)
        return run(argv, *a, **kw)

    agent.host.run = tmpfiles_finishes
    assert agent.init().status == "ready"
    assert _boot_waits(fm) == [0]


def test_timeout_fails_the_params_step_before_any_change_to_the_node(tmp_path):
    agent, fm, paths, _ = make(tmp_path, CTL)
    agent.boot_timeout = 3
    run = agent.host.run

    def stuck(argv, *a, **kw):
        if argv == BOOT_WAIT:
            raise CommandError(argv, -1, "", hint=f"timed out after {kw.get('timeout')}s")
        return run(argv, *a, **kw)

    agent.host.run = stuck
    seen: list[list[str]] = []
    agent.host.run = lambda argv, *a, **kw: (seen.append(list(argv)), stuck(argv, *a, **kw))[1]
    with pytest.raises(StepFailed, match="network-online.target not reached within 3s"):
        agent.init()
    st = json.loads(paths.state_file.read_text())
    assert st["status"] == "failed"
    assert (
        "basic.target and network-online.target not reached within 3s"
        in st["steps"]["params"]["error"]
    )
    assert st["steps"]["identity"]["status"] == "pending"
    assert fm.hostname == "node1" and seen == [BOOT_WAIT]  # nothing else was run


def _wait_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nodeforge-boot-wait"]


def test_invalid_local_params_fail_and_the_started_wait_is_joined(tmp_path):
    """The wait was started before params; a params error still ends it (no thread left)."""
    agent, fm, _paths, _ = make(tmp_path, CTL | {"role": "nope"})
    done: list[bool] = []
    run = agent.host.run

    def slow(argv, *a, **kw):
        if argv == BOOT_WAIT:
            threading.Event().wait(0.2)  # still running when params fails
            done.append(True)
        return run(argv, *a, **kw)

    agent.host.run = slow
    with pytest.raises(StepFailed, match="role"):
        agent.init()
    assert fm.calls == [BOOT_WAIT] and done == [True] and _wait_threads() == []


# -- the wait in a thread (started before params, collected where it is needed) -----------------
class Blocking(FakeSystemctl):
    """`systemctl start` that returns only when released (or raises *exc* then)."""

    def __init__(self, exc: BaseException | None = None, **kw):
        super().__init__(**kw)
        self.entered, self.release, self.exc = threading.Event(), threading.Event(), exc

    def __call__(self, argv, check=True, timeout=None, **kw):
        self.entered.set()
        assert self.release.wait(10), "never released"
        if self.exc is not None:
            raise self.exc
        return super().__call__(argv, check=check, timeout=timeout, **kw)


def test_started_wait_runs_beside_the_caller_and_wait_collects_it():
    fake = Blocking()
    bw = BootWait(_host(fake), timeout=42)
    bw.start((BASIC, NETWORK_ONLINE))
    assert fake.entered.wait(5)  # running, and start() returned: the caller goes on meanwhile
    threading.Timer(0.1, fake.release.set).start()
    assert bw.wait((BASIC, NETWORK_ONLINE), "the identity step") >= 0.05  # blocked till done
    assert fake.calls == [(BOOT_WAIT, 42)] and bw.reached == {BASIC, NETWORK_ONLINE}
    assert bw.command_s >= 0.09 and _wait_threads() == []  # released 0.1 s after it entered
    assert bw.wait((NETWORK_ONLINE,), "again") == 0.0 and len(fake.calls) == 1
    bw.join()  # nothing left to join: a no-op


def test_started_wait_timeout_is_raised_where_it_is_collected_naming_both_targets():
    fake = Blocking(timeout=True)
    fake.release.set()
    bw = BootWait(_host(fake), timeout=7)
    bw.start((BASIC, NETWORK_ONLINE))
    with pytest.raises(BootWaitError) as ei:
        bw.wait((NETWORK_ONLINE,), "the identity step")  # a subset: collects the started one
    msg = str(ei.value)
    assert "basic.target and network-online.target not reached within 7s" in msg
    assert "before the identity step" in msg and "systemctl list-jobs" in msg
    assert isinstance(ei.value.__cause__, CommandError)
    assert bw.reached == set() and _wait_threads() == [] and len(fake.calls) == 1


def test_started_wait_other_exception_is_raised_as_is_and_the_thread_joined():
    fake = Blocking(exc=RuntimeError("dbus gone"))
    fake.release.set()
    bw = BootWait(_host(fake))
    bw.start((BASIC, NETWORK_ONLINE))
    with pytest.raises(RuntimeError, match="dbus gone"):
        bw.wait((BASIC, NETWORK_ONLINE), "x")
    assert bw.reached == set() and _wait_threads() == []


def test_a_thread_stuck_past_the_bound_is_a_timeout_not_a_hang(monkeypatch):
    """The command's own timeout kills systemctl; should the thread not return even then, the
    join is bounded too (timeout + JOIN_SLACK)."""
    monkeypatch.setattr(boot_order, "JOIN_SLACK", 0.1)
    fake = Blocking()  # ignores its timeout: released only at the end of the test
    bw = BootWait(_host(fake), timeout=0.1)
    bw.start((BASIC, NETWORK_ONLINE))
    try:
        with pytest.raises(BootWaitError, match="not reached within 0.1s"):
            bw.wait((BASIC, NETWORK_ONLINE), "x")
        bw.join()  # already handed over: returns at once
    finally:
        fake.release.set()
    for t in _wait_threads():
        t.join(5)
    assert _wait_threads() == []


def test_the_agent_reads_params_while_the_wait_runs(tmp_path):
    """The wait starts before the params step: `systemctl start` is already running before
    params.json (written by that step, before it collects the wait) exists, and still running
    when it appears."""
    agent, _fm, paths, _ = make(tmp_path, CTL)
    run = agent.host.run
    seen: list[tuple[bool, bool]] = []

    def overlapped(argv, *a, **kw):
        if argv == BOOT_WAIT:
            before = paths.params_json.exists()
            ev = threading.Event()
            seen.append(
                (before, any(ev.wait(0.02) or paths.params_json.exists() for _ in range(250)))
            )
        return run(argv, *a, **kw)

    agent.host.run = overlapped
    state = agent.init()
    assert seen == [(False, True)] and state.status == "ready"
    detail = state.steps["params"].detail
    assert detail["boot_targets_s"] >= 0.02 and detail["boot_wait_s"] >= 0
    assert _wait_threads() == []


def test_a_crash_in_params_while_the_wait_runs_leaves_no_thread(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, CTL)
    done: list[bool] = []
    run = agent.host.run

    def slow(argv, *a, **kw):
        if argv == BOOT_WAIT:
            threading.Event().wait(0.2)
            done.append(True)
        return run(argv, *a, **kw)

    def crash() -> str:
        raise RuntimeError("no hostname")

    agent.host.run, agent.hostname = slow, crash
    with pytest.raises(RuntimeError, match="no hostname"):
        agent.init()
    assert done == [True] and _wait_threads() == [] and fm.calls == [BOOT_WAIT]
