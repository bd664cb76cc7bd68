"""Containment of one hook attempt (nodeforge.contain.run_group with contain=): a `setsid` daemon,
a TERM-ignoring grandchild and a double fork are all gone when the attempt ends or times out.
Each mechanism this machine offers is tested for real (the systemd scope runs in the e2e tier,
where systemd is PID 1)."""

from __future__ import annotations

import os
import time

import pytest

from nodeforge.bootstrap import contain
from tests.helpers import process_running

pytestmark = pytest.mark.unit


def _kinds():
    kinds = ["subreaper"]
    if contain._cgroup_base() is not None:
        kinds.append("cgroup")
    return kinds


def _gone(pid: int, within: float = 3.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not process_running(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(params=_kinds())
def kind(request, monkeypatch):
    monkeypatch.setattr(contain, "containment", lambda: request.param)
    return request.param


def test_setsid_daemon_is_stopped_when_the_hook_exits(kind, tmp_path):
    pidf = tmp_path / "pid"
    script = (
        f"setsid sh -c 'echo $$ > {pidf}; exec sleep 300' </dev/null >/dev/null 2>&1 &\n"
        f"while [ ! -s {pidf} ]; do sleep 0.01; done\nexit 0\n"
    )
    with open(tmp_path / "out", "w") as out:
        gr = contain.run_group(
            ["sh", "-c", script], timeout=20, output=out, grace=0.5, contain="test-daemon"
        )
    pid = int(pidf.read_text())
    assert gr.returncode == 0 and not gr.timed_out and gr.containment == kind
    assert gr.leftovers, "the daemon was running after the hook exited"
    assert _gone(pid), f"setsid daemon {pid} survived ({kind})"


def test_timeout_stops_term_ignoring_double_fork(kind, tmp_path):
    pidf = tmp_path / "pid"
    # A grandchild that ignores SIGTERM and double-forks away from both the group and the parent.
    script = (
        f"( trap '' TERM; setsid sh -c \"trap '' TERM; echo \\$\\$ > {pidf}; "
        f'while :; do sleep 0.1; done" & ) &\nsleep 300\n'
    )
    t = time.monotonic()
    with open(tmp_path / "out", "w") as out:
        gr = contain.run_group(
            ["sh", "-c", script], timeout=1, output=out, grace=0.3, contain="test-timeout"
        )
    assert gr.timed_out and time.monotonic() - t < 8
    pid = int(pidf.read_text())
    assert _gone(pid), f"TERM-ignoring daemon {pid} survived the timeout ({kind})"


def test_cgroup_directory_is_removed(monkeypatch, tmp_path):
    base = contain._cgroup_base()
    if base is None:
        pytest.skip("no writable cgroup v2 here (needs root); the subreaper tests cover this host")
    monkeypatch.setattr(contain, "containment", lambda: "cgroup")
    before = {p.name for p in base.iterdir() if p.name.startswith("nodeforge-")}
    gr = contain.run_group(
        ["sh", "-c", "setsid sleep 300 & exit 3"], timeout=10, grace=0.3, contain="test-rmdir"
    )
    assert gr.returncode == 3
    assert {p.name for p in base.iterdir() if p.name.startswith("nodeforge-")} == before


def test_subreaper_is_switched_off_afterwards(monkeypatch):
    import ctypes

    monkeypatch.setattr(contain, "containment", lambda: "subreaper")
    contain.run_group(["true"], timeout=5, contain="test-off")
    libc = ctypes.CDLL(None, use_errno=True)
    val = ctypes.c_int(-1)
    assert libc.prctl(37, ctypes.byref(val), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    assert val.value == 0


def test_output_cap_keeps_head_and_tail(tmp_path):
    script = "i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done\n"
    with open(tmp_path / "out", "w") as out:
        out.write("header\n")
        gr = contain.run_group(
            ["sh", "-c", script], timeout=20, output=out, output_cap=1000, contain="test-cap"
        )
    text = (tmp_path / "out").read_text()
    total = sum(len(f"line-{i}\n") for i in range(2000))
    assert gr.dropped == total - 1000
    assert text.startswith("header\nline-0\nline-1\n") and text.endswith("line-1999\n")
    assert f"[... {total - 1000} bytes of output dropped here" in text
    assert len(text) < 1200


def test_output_under_the_cap_is_whole(tmp_path):
    with open(tmp_path / "out", "w") as out:
        gr = contain.run_group(
            ["sh", "-c", "echo a; echo b >&2"],
            timeout=10,
            output=out,
            output_cap=1000,
            contain="test-small",
        )
    assert gr.dropped == 0 and (tmp_path / "out").read_text() == "a\nb\n"


def test_containment_is_reported():
    assert contain.containment() in ("scope", "cgroup", "subreaper")
    assert os.path.isdir("/run/systemd/system") == (contain.containment() == "scope")


def test_scope_command_bounds_runtime_and_follows_the_agent_unit(monkeypatch):
    """The scope argv (run for real in the e2e tier, where systemd is PID 1): systemd itself
    ends the scope after timeout + 2*grace + 30 s even if the agent was SIGKILLed, and stopping
    the agent's unit stops the hook."""
    monkeypatch.setattr(contain, "require_tool", lambda t: f"/usr/bin/{t}")
    monkeypatch.setattr(contain, "_own_unit", lambda: "nodeforge-init.service")
    box = contain._Box.make("scope", "hook-10-x", 5, 600)
    argv = box.wrap(["/etc/nodeforge/on-init.d/10-x"])
    assert argv[:4] == ["/usr/bin/systemd-run", "--scope", "--quiet", "--collect"]
    assert argv[4].startswith("--unit=nodeforge-hook-10-x-")
    assert argv[5:] == [
        "--property=TimeoutStopSec=5s",
        "--property=RuntimeMaxSec=640s",
        "--property=PartOf=nodeforge-init.service",
        "--",
        "/etc/nodeforge/on-init.d/10-x",
    ]
