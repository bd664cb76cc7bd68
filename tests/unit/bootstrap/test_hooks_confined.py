"""Hook paths and hook fetches confined (issue 23, items 4 and 5): on-init.d and every
directory above it are real, root's and not writable by others; a hook name never collides
with the runner's own cache entries; a file:// hook that is not a regular file (a FIFO blocked
the boot forever) is a failed fetch, at once. A refusal drains the node with the reason."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nodeforge.bootstrap.agent import StepFailed, stop_on_sigterm
from nodeforge.bootstrap.hooks import HookError, discover
from nodeforge.bootstrap.paths import Paths
from tests.helpers import process_running
from tests.unit.support import COMPUTE, hook_params, make, runner, script

pytestmark = pytest.mark.unit

params = hook_params  # the hook tests' params (support.HOOK_PARAMS)


@pytest.fixture
def paths(tmp_path):
    p = Paths.under(tmp_path / "root")
    for d in (p.root, p.root / "etc", p.on_init_d.parent, p.on_init_d):
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
    p.params_json.parent.mkdir(parents=True)
    p.params_json.write_text("{}")
    return p


# -- on-init.d and its ancestors ---------------------------------------------------------------
def test_symlinked_on_init_d_is_refused(paths, tmp_path):
    """A link is only as safe as wherever it points, and that can change under the agent."""
    real = tmp_path / "hooks-elsewhere"
    real.mkdir(mode=0o755)
    script(real / "10-x", f"touch {tmp_path}/ran\n")
    paths.on_init_d.rmdir()
    paths.on_init_d.symlink_to(real)
    with pytest.raises(HookError, match=r"hooks: .*/on-init\.d is a symlink; refused"):
        discover(paths, params())


def test_symlinked_ancestor_is_refused(paths, tmp_path):
    moved = tmp_path / "nodeforge-elsewhere"
    paths.on_init_d.parent.rename(moved)
    paths.on_init_d.parent.symlink_to(moved)
    with pytest.raises(HookError, match=r"/etc/nodeforge \(above .*on-init\.d\) is a symlink"):
        discover(paths, params())


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o1777])
def test_writable_ancestor_is_refused(paths, mode):
    """Whoever can write /etc/nodeforge can rename on-init.d away and put their own in place."""
    script(paths.on_init_d / "10-x", "true\n")
    paths.on_init_d.parent.chmod(mode)
    with pytest.raises(HookError, match=r"hooks: .*/etc/nodeforge is group- or world-writable"):
        discover(paths, params())
    paths.on_init_d.parent.chmod(0o755)
    assert [h.name for h in discover(paths, params())] == ["10-x"]


def test_refused_ancestor_drains_the_node_and_runs_nothing(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    script(paths.on_init_d / "10-x", f"touch {tmp_path}/ran\n")
    paths.on_init_d.parent.chmod(0o777)
    with pytest.raises(StepFailed, match="group- or world-writable"):
        agent.init()
    reason = fm.nodes["c1"]["Reason"]
    assert reason.startswith("nodeforge: hooks: ") and "world-writable" in reason
    assert "DRAIN" in fm.nodes["c1"]["State"] and not (tmp_path / "ran").exists()


# -- hook names against the runner's cache -----------------------------------------------------
@pytest.mark.parametrize("reverse", [False, True])
def test_name_that_is_another_hooks_prefix_directory_is_refused(paths, reverse):
    """An S3 prefix hook `setup` owns the cache entry `setup.d`; a hook named `setup.d` would
    fetch over (or into) it. Refused before anything runs, both hooks named, either order."""
    hooks = [
        {"uri": "s3://bucket/lifecycle/", "script": "on_create.sh", "name": "setup"},
        {"uri": "https://h.example/setup.d", "name": "setup.d"},
    ]
    spec = params(hooks=hooks[::-1] if reverse else hooks)
    with pytest.raises(
        HookError,
        match=r"hook setup\.d refused: its cache entry 'setup\.d' is the one hook setup "
        r"\(s3://bucket/lifecycle/\) uses for its S3 prefix; give one of them another `name`",
    ):
        discover(paths, spec)


def test_name_of_a_runner_temporary_is_refused(paths):
    with pytest.raises(HookError, match=r"hooks\[0\]: cannot use '\.setup\.d\.old'"):
        discover(paths, params(hooks=["https://h.example/.setup.d.old"]))


def test_stale_cache_entry_of_the_other_kind_is_replaced(paths, tmp_path):
    """An earlier boot's prefix directory where this boot's file hook goes (or the reverse) is
    the runner's own leftover: cleared, and the hook runs."""
    src = script(tmp_path / "src" / "setup.d", f"touch {tmp_path}/ran\n")
    (paths.hook_cache / "setup.d" / "sub").mkdir(parents=True)
    res = runner(paths).run_all(discover(paths, params(hooks=[src.as_uri()])))
    assert res.ok, res.failure
    assert (tmp_path / "ran").exists() and (paths.hook_cache / "setup.d").is_file()


# -- file:// hooks that are not regular files --------------------------------------------------
def test_fifo_file_hook_is_a_failed_fetch_not_a_hang(paths, tmp_path):
    fifo = tmp_path / "hook.sh"
    os.mkfifo(fifo)
    t = time.monotonic()
    res = runner(paths).run_all(discover(paths, params(hooks=[fifo.as_uri()]))).failure
    assert time.monotonic() - t < 5
    assert res is not None and res.status == "fetch-failed"
    assert res.reason == (
        f"hook hook.sh could not be fetched: cannot read {fifo}: not a regular file (a FIFO)"
    )
    assert not (paths.hook_cache / "hook.sh").exists()


def test_device_file_hook_is_refused(paths):
    res = runner(paths).run_all(discover(paths, params(hooks=["file:///dev/zero"]))).failure
    assert res is not None and "not a regular file (a character device)" in res.reason


# -- the first-boot unit's start bound ---------------------------------------------------------
def test_sigterm_at_the_unit_bound_drains_with_the_reason_and_stops_the_hook(tmp_path):
    """systemd sends SIGTERM when nodeforge-init.service reaches TimeoutStartSec. The agent
    fails the running step with that reason, the node stays drained with it (sinfo -R), and
    the hook it was running is stopped with its children."""
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0, "hook_timeout": 120})
    pidfile = tmp_path / "hook.pid"
    script(paths.on_init_d / "10-hangs", f"echo $$ > {pidfile}\nsleep 60\n")
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    t = time.monotonic()
    timer.start()
    try:
        with stop_on_sigterm(), pytest.raises(StepFailed, match="stopped by SIGTERM"):
            agent.init()
    finally:
        timer.cancel()
    assert time.monotonic() - t < 20
    reason = fm.nodes["c1"]["Reason"]
    assert reason.startswith("nodeforge: hooks step failed: stopped by SIGTERM (nodeforge-init")
    assert "DRAIN" in fm.nodes["c1"]["State"]
    assert agent.state.status == "failed" and agent.state.steps["hooks"].status == "failed"
    assert not process_running(int(pidfile.read_text()))
    assert signal.getsignal(signal.SIGTERM) is not None  # restored, not left ignoring
