"""The health fast path: the agent's in-process check before slurmd starts leaves a root-only,
this-boot, short-lived, single-use stamp; the HealthCheckProgram wrapper (POSIX sh, run here
for real under /bin/sh against temp paths) skips the Python check only on a valid stamp."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.bootstrap import health
from nodeforge.bootstrap.host import Host
from nodeforge.bootstrap.paths import Paths
from tests.unit.support import COMPUTE, FakeGpuNode, make

pytestmark = pytest.mark.unit

BOOT = "3f1c2a4e-5b6d-4e7f-8a9b-0c1d2e3f4a5b"
OTHER_BOOT = "00000000-1111-4222-8333-444444444444"
UP = 1234  # seconds since boot in the fixture /proc/uptime


def fake_proc(paths: Paths, boot: str = BOOT, up: float = UP + 0.42) -> None:
    """FIXTURE /proc files below the temp root (the wrapper and the agent read these)."""
    paths.boot_id.parent.mkdir(parents=True, exist_ok=True)
    paths.boot_id.write_text(boot + "\n")
    paths.proc_uptime.write_text(f"{up:.2f} 999.00\n")


class Wrapper:
    """The real wrapper text at temp paths; its full check is a recording script that exits
    7, so "ran the full check" and "took the fast path" are told apart by exit code too."""

    def __init__(self, tmp_path: Path):
        self.paths = Paths.under(tmp_path)
        self.marker = tmp_path / "full-check-ran"
        full = tmp_path / "full-check"
        full.write_text(f"#!/bin/sh\necho ran >> {shlex.quote(str(self.marker))}\nexit 7\n")
        full.chmod(0o755)
        self.script = tmp_path / "nodeforge-health"
        p = self.paths
        self.script.write_text(
            health.wrapper_text(p.health_stamp, p.boot_id, p.proc_uptime, str(full))
        )
        fake_proc(p)

    def stamp(self, text: str) -> Path:
        d = self.paths.health_stamp.parent
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.paths.health_stamp.write_text(text)
        return self.paths.health_stamp

    def run(self) -> str:
        """'fast' or 'full' (asserting the exit code that goes with each)."""
        before = self.marker.read_text().count("ran") if self.marker.exists() else 0
        cp = subprocess.run(["/bin/sh", str(self.script)], capture_output=True, timeout=10)
        after = self.marker.read_text().count("ran") if self.marker.exists() else 0
        if after > before:
            assert cp.returncode == 7, cp
            return "full"
        assert cp.returncode == 0, cp
        return "fast"


def test_valid_stamp_skips_once_then_full(tmp_path):
    w = Wrapper(tmp_path)
    s = w.stamp(f"{BOOT} {UP - 3}\n")
    assert w.run() == "fast"
    assert not s.exists()  # single use: slurmd's start-up run only
    assert w.run() == "full"  # every later (periodic) run is the full check


@pytest.mark.parametrize(
    "text,why",
    [
        (f"{BOOT} {UP - health.STAMP_MAX_AGE - 1}\n", "older than STAMP_MAX_AGE"),
        (f"{OTHER_BOOT} {UP}\n", "another boot (node init again after a reboot)"),
        (f"{BOOT} {UP + 5}\n", "from the future"),
        (f"{BOOT} 0{UP}\n", "leading zero (octal in sh arithmetic)"),
        (f"{BOOT} 99999999999999999999\n", "huge"),
        (f"{BOOT} {UP}.5\n", "not an integer"),
        (f"{BOOT} -{UP}\n", "negative"),
        (f"{BOOT}\n", "no time"),
        (f"{BOOT} {UP}", "truncated: no final newline"),
        ("", "empty"),
        (f"\n{BOOT} {UP}\n", "blank first line"),
        (f"{BOOT}x {UP}\n", "boot id with junk"),
    ],
)
def test_invalid_stamp_runs_the_full_check(tmp_path, text, why):
    w = Wrapper(tmp_path)
    w.stamp(text)
    assert w.run() == "full", why


def test_missing_stamp_and_missing_dir_run_the_full_check(tmp_path):
    w = Wrapper(tmp_path)
    assert w.run() == "full"
    w.stamp(f"{BOOT} {UP}\n").unlink()
    assert w.run() == "full"


def test_boot_id_is_read_at_run_time(tmp_path):
    w = Wrapper(tmp_path)
    w.stamp(f"{BOOT} {UP}\n")
    fake_proc(w.paths, boot=OTHER_BOOT)  # rebooted since the stamp was written
    assert w.run() == "full"


def test_symlinked_stamp_is_not_trusted(tmp_path):
    w = Wrapper(tmp_path)
    real = tmp_path / "elsewhere"
    real.write_text(f"{BOOT} {UP}\n")
    w.paths.health_stamp.parent.mkdir(parents=True, mode=0o700)
    w.paths.health_stamp.symlink_to(real)
    assert w.run() == "full"
    assert real.exists()  # and not removed through the link


def test_symlinked_stamp_dir_is_not_trusted(tmp_path):
    w = Wrapper(tmp_path)
    real = tmp_path / "otherdir"
    real.mkdir(mode=0o700)
    (real / w.paths.health_stamp.name).write_text(f"{BOOT} {UP}\n")
    w.paths.health_stamp.parent.parent.mkdir(parents=True, exist_ok=True)
    w.paths.health_stamp.parent.symlink_to(real)
    assert w.run() == "full"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user owns")
@pytest.mark.parametrize("what", ["file", "dir"])
def test_stamp_owned_by_another_user_is_not_trusted(tmp_path, what):
    w = Wrapper(tmp_path)
    s = w.stamp(f"{BOOT} {UP}\n")
    os.chown(s if what == "file" else s.parent, 65534, 65534)  # nobody
    assert w.run() == "full"


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=60))
def test_any_other_stamp_text_runs_the_full_check(tmp_path_factory, text):
    """Only "<this boot id> <recent whole seconds>" passes; any other text does not."""
    w = Wrapper(tmp_path_factory.mktemp("w"))
    fields = text.split()
    ok = (
        len(fields) == 2
        and fields[0] == BOOT
        and fields[1].isascii()
        and fields[1].isdigit()
        and UP - health.STAMP_MAX_AGE <= int(fields[1]) <= UP
    )
    if ok or "\x00" in text:
        return  # (hypothesis almost never builds a valid one; NUL cannot be written as text)
    w.stamp(text + "\n")
    assert w.run() == "full", repr(text)


# -- the agent's side: precheck writes the stamp only on a pass -------------------------------
def setup_node(tmp_path: Path) -> Paths:
    paths = Paths.under(tmp_path)
    paths.params_json.parent.mkdir(parents=True, exist_ok=True)
    paths.params_json.write_text(json.dumps({"node": "c1"}))
    fake_proc(paths)
    return paths


def test_precheck_pass_writes_a_private_stamp_that_the_wrapper_accepts(tmp_path):
    paths = setup_node(tmp_path)
    node = FakeGpuNode()
    node.active.discard("slurmd.service")  # not started yet: not part of this check
    rep = health.precheck(Host(run=node.run), paths)
    assert rep.ok and health.SLURMD not in {c.name for c in rep.checks}
    s = paths.health_stamp
    assert s.read_text() == f"{BOOT} {UP}\n"
    assert s.stat().st_mode & 0o777 == 0o600 and s.parent.stat().st_mode & 0o777 == 0o700
    assert s.stat().st_uid == os.geteuid()
    health.install_wrapper(paths)
    cp = subprocess.run(["/bin/sh", str(tmp_path / "usr/local/sbin/nodeforge-health")])
    assert cp.returncode == 0 and not s.exists()  # fast path taken, stamp used up


def test_failed_precheck_leaves_no_stamp_and_removes_an_old_one(tmp_path):
    paths = setup_node(tmp_path)
    paths.health_stamp.parent.mkdir(parents=True, mode=0o700)
    paths.health_stamp.write_text(f"{BOOT} {UP}\n")  # an earlier pass, same boot
    node = FakeGpuNode()
    node.active.discard("munge.service")
    rep = health.precheck(Host(run=node.run), paths)
    assert rep.reason == "nodeforge-health: munge: munge.service is not active"
    assert not paths.health_stamp.exists()


def test_precheck_without_a_boot_id_writes_no_stamp(tmp_path):
    paths = setup_node(tmp_path)
    paths.boot_id.write_text("not-a-boot-id\n")
    assert health.precheck(Host(run=FakeGpuNode().run), paths).ok
    assert not paths.health_stamp.exists()


def test_precheck_refuses_a_symlinked_stamp_dir(tmp_path):
    paths = setup_node(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    paths.health_stamp.parent.parent.mkdir(parents=True, exist_ok=True)
    paths.health_stamp.parent.symlink_to(target)
    assert health.precheck(Host(run=FakeGpuNode().run), paths).ok
    assert list(target.iterdir()) == []  # nothing written through the link


def test_failing_full_run_removes_the_stamp(tmp_path):
    paths = setup_node(tmp_path)
    paths.health_stamp.parent.mkdir(parents=True, mode=0o700)
    paths.health_stamp.write_text(f"{BOOT} {UP}\n")
    node = FakeGpuNode()
    node.active.discard("munge.service")
    assert not health.run(Host(run=node.run), paths, slurm=False).ok
    assert not paths.health_stamp.exists()


# -- in the agent: ordering, and a sick node -------------------------------------------------
def _run_wrapper_at_slurmd_start(fm, paths: Paths, seen: list) -> None:
    """Wrap the FakeMachine: when the agent starts slurmd, run the installed wrapper the way
    slurmd's start-up health check would (its full check, /usr/local/bin/nodeforge, is not on
    this machine: only the fast path can exit 0)."""
    inner = fm.run

    def run(argv, *a, **kw):
        if [str(x) for x in argv] == ["systemctl", "restart", "slurmd.service"]:
            stamp = paths.health_stamp.read_text() if paths.health_stamp.exists() else None
            w = paths.root / "usr/local/sbin/nodeforge-health"
            rc = subprocess.run(["/bin/sh", str(w)], capture_output=True, timeout=10).returncode
            seen.append((stamp, rc))
        return inner(argv, *a, **kw)

    fm.run = run


def test_stamp_is_written_before_slurmd_starts_and_its_first_run_is_fast(tmp_path):
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    fake_proc(paths)
    seen: list = []
    _run_wrapper_at_slurmd_start(fm, paths, seen)
    agent.host.run = fm.run  # type: ignore[method-assign]
    st = agent.init()
    assert seen == [(f"{BOOT} {UP}\n", 0)], seen
    assert fm.nodes["c1"]["State"] == "IDLE"
    assert st.steps["ready"].detail["slurm"] == "not drained"


def test_sick_node_gets_no_stamp_is_created_drained_and_keeps_the_health_reason(
    tmp_path, monkeypatch
):
    agent, fm, paths, _ = make(tmp_path, COMPUTE)  # no hooks: would be created in final state
    fake_proc(paths)
    full = os.statvfs_result((4096, 4096, 100, 1, 1, 0, 0, 0, 0, 255))  # 99 % used
    monkeypatch.setattr(health.os, "statvfs", lambda p: full)
    (tmp_path / "var/lib/enroot").mkdir(parents=True, exist_ok=True)
    seen: list = []
    _run_wrapper_at_slurmd_start(fm, paths, seen)
    agent.host.run = fm.run  # type: ignore[method-assign]
    st = agent.init()
    assert seen and seen[0][0] is None and seen[0][1] != 0  # no stamp: the full check runs
    # drained before slurmd starts (a node without hooks would otherwise register IDLE)
    restart = fm.calls.index(["systemctl", "restart", "slurmd.service"])
    assert any(c[:2] == ["scontrol", "update"] and "State=DRAIN" in c for c in fm.calls[:restart])
    node = fm.nodes["c1"]
    assert "DRAIN" in node["State"], node
    assert node["Reason"].startswith("nodeforge-health: disk: "), node
    assert st.steps["ready"].detail["slurm"].startswith("kept drained (nodeforge-health: disk")
    assert not paths.health_stamp.exists()
