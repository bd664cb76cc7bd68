"""The agent's path to ready does no avoidable work: no extra process spawn in the munge step,
no download stack (urllib, http.client, ssl) imported on a node without extension hooks, no
1 s poll where a local daemon answers in milliseconds (issue 12, "agent share")."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from nodeforge.bootstrap import munge
from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.host import Host
from nodeforge.bootstrap.params import parse_params
from nodeforge.bootstrap.paths import Paths
from tests.unit.support import COMPUTE, CTL, FakeMachine, make

pytestmark = pytest.mark.unit

DOWNLOAD_STACK = ("nodeforge.download", "urllib.request", "http.client", "ssl")


def _munge_calls(fm: FakeMachine) -> list[list[str]]:
    return [c for c in fm.calls if c[0] == "systemctl" and c[-1] == "munge.service"]


def test_first_boot_starts_munge_with_one_systemctl_call(tmp_path):
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    first_munge_n = fm.calls.index(["munge", "-n"])
    before = [c for c in _munge_calls(fm) if fm.calls.index(c) < first_munge_n]
    # the key was written: one restart (it starts a stopped munged), no is-active first
    assert before == [["systemctl", "restart", "munge.service"]]
    assert paths.munge_key.read_bytes() == agent.params.munge_key_bytes()


def test_unchanged_key_only_starts_munge(tmp_path):
    paths = Paths.under(tmp_path)
    fm = FakeMachine(tmp_path, "c1")
    host = Host(run=fm.run, chown=lambda *a: None, sleep=lambda s: None)
    params = parse_params(COMPUTE, "test")
    munge.run(host, paths, params, "test")  # writes the key
    fm.calls.clear()
    fm.active.discard("munge.service")  # e.g. stopped by an operator; key already in place
    detail = munge.run(host, paths, params, "test")
    assert detail == {"key": "unchanged"}
    assert _munge_calls(fm) == [["systemctl", "start", "munge.service"]]
    assert fm.calls[-1] == ["munge", "-n"]


def test_munge_poll_is_short_when_munged_answers_late(tmp_path):
    """munged that answers on the 3rd `munge -n`: the waits between are 0.05 s, not 1 s."""
    paths = Paths.under(tmp_path)
    fm = FakeMachine(tmp_path, "c1")
    sleeps: list[float] = []
    answers = iter([1, 1, 0])
    real_run = fm.run

    def run(argv, **kw):
        if argv[0] == "munge":
            return subprocess.CompletedProcess(argv, next(answers), "", None)
        return real_run(argv, **kw)

    host = Host(run=run, chown=lambda *a: None, sleep=sleeps.append)
    munge.run(host, paths, parse_params(COMPUTE, "test"), "test")
    assert sleeps == [0.05, 0.05]


_NODE_PATH = """
import json, sys
from nodeforge.bootstrap import agent, hooks
from nodeforge.bootstrap.node_roles import compute
from nodeforge.bootstrap.params import parse_params
from nodeforge.bootstrap.paths import Paths
paths = Paths.under(sys.argv[1])
params = parse_params(json.loads(sys.argv[2]), "test")
found = [h.name for h in hooks.discover(paths, params)]
print(json.dumps({"hooks": found, "loaded": [m for m in sys.argv[3].split() if m in sys.modules]}))
"""


def _node_path(tmp_path, params: dict) -> dict:
    cp = subprocess.run(
        [sys.executable, "-c", _NODE_PATH, str(tmp_path), json.dumps(params), " ".join(DOWNLOAD_STACK)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return json.loads(cp.stdout)


def test_node_without_extension_hooks_never_loads_the_download_stack(tmp_path):
    got = _node_path(tmp_path, COMPUTE)
    assert got == {"hooks": [], "loaded": []}


def test_extension_hook_still_loads_it_and_is_validated(tmp_path):
    """The control: a named extension hook needs nodeforge.download, and gets it."""
    got = _node_path(tmp_path, COMPUTE | {"hooks": ["https://hooks.example/setup.sh"]})
    assert got["hooks"] == ["setup.sh"]
    assert "nodeforge.download" in got["loaded"]


# -- one `systemctl is-active` for all of the health check's units --------------------------
def _host(answer):
    calls: list[list[str]] = []

    def run(argv, **kw):
        calls.append([str(a) for a in argv])
        return answer(calls[-1])

    return Host(run=run), calls


def _cp(argv, rc, out=""):
    return subprocess.CompletedProcess(argv, rc, out, None)


def test_active_units_asks_once_and_reads_one_state_per_unit():
    host, calls = _host(lambda a: _cp(a, 0, "active\ninactive\nreloading\n"))
    got = host.active_units(["slurmd.service", "munge.service", "x.service"])
    assert got == {"slurmd.service": True, "munge.service": False, "x.service": True}
    assert calls == [["systemctl", "is-active", "slurmd.service", "munge.service", "x.service"]]


@pytest.mark.parametrize("out", ["", "active\n", "active\nactive\nactive\n", "Failed to connect\n"])
def test_active_units_output_it_cannot_pair_is_asked_unit_by_unit(out):
    def answer(a):
        if "--quiet" in a:
            return _cp(a, 0 if a[-1] == "munge.service" else 3)
        return _cp(a, 1, out)

    host, calls = _host(answer)
    got = host.active_units(["slurmd.service", "munge.service"])
    assert got == {"slurmd.service": False, "munge.service": True}
    assert calls[1:] == [
        ["systemctl", "is-active", "--quiet", "slurmd.service"],
        ["systemctl", "is-active", "--quiet", "munge.service"],
    ]


def test_active_units_timeout_is_not_active():
    from nodeforge.errors import CommandError

    def answer(a):
        raise CommandError(a, -1, "", hint="timed out after 30s")

    host, calls = _host(answer)
    assert host.active_units(["slurmd.service", "munge.service"]) == {
        "slurmd.service": False,
        "munge.service": False,
    }
    assert len(calls) == 1


def test_health_services_check_is_one_spawn_and_names_the_inactive_unit(tmp_path):
    from nodeforge.bootstrap import health

    host, calls = _host(lambda a: _cp(a, 0, "active\nfailed\n"))
    cfg = health.Config(units=(("slurmd", "slurmd.service"), ("munge", "munge.service")))
    checks = health.Checker(host, cfg).services()
    assert [(c.name, c.ok, c.detail) for c in checks] == [
        ("slurmd", True, "active"),
        ("munge", False, "munge.service is not active"),
    ]
    assert len(calls) == 1


def test_compute_polls_a_starting_controller_every_quarter_second(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    fm.ctl_up = False
    pings = []
    sleeps: list[float] = []
    inner = fm.run

    def run(argv, *a, **kw):
        if [str(x) for x in argv] == ["scontrol", "ping"]:
            pings.append(1)
            fm.ctl_up = len(pings) >= 3  # slurmctld answers the 3rd ping
        return inner(argv, *a, **kw)

    agent.host.run = run  # type: ignore[method-assign]
    agent.host.sleep = sleeps.append  # type: ignore[method-assign]
    fm.ping_waits_for_slurmd_c = False
    state = agent.init()
    assert state.status == "ready"
    assert len(pings) == 3
    assert sleeps[:2] == [0.25, 0.25]


# -- state.json: progress atomic but not fsynced, the outcome durable ------------------------
def test_write_atomic_not_durable_skips_fsync_but_still_replaces_whole(tmp_path, monkeypatch):
    from nodeforge import fsutil

    synced: list[int] = []
    monkeypatch.setattr(fsutil.os, "fsync", synced.append)
    f = tmp_path / "s.json"
    assert fsutil.write_atomic(f, "old\n", durable=False)
    assert fsutil.write_atomic(f, "new\n", durable=False)
    assert synced == [] and f.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary left
    assert fsutil.write_atomic(f, "last\n")
    assert len(synced) == 2  # the file and its directory


def _saves(monkeypatch) -> list[bool]:
    from nodeforge.bootstrap.state import State

    flags: list[bool] = []
    real = State.save

    def save(self, path, *, durable=True):
        flags.append(durable)
        real(self, path, durable=durable)

    monkeypatch.setattr(State, "save", save)
    return flags


def test_agent_fsyncs_state_only_for_the_outcome(tmp_path, monkeypatch):
    from nodeforge.bootstrap.state import State

    agent, _fm, paths, _ = make(tmp_path, COMPUTE)
    flags = _saves(monkeypatch)
    agent.init()
    assert len(flags) > 10 and flags[-1] is True and not any(flags[:-1])
    assert State.load(paths.state_file).status == "ready"


def test_agent_fsyncs_a_failure(tmp_path, monkeypatch):
    from nodeforge.bootstrap.agent import StepFailed
    from nodeforge.bootstrap.state import State

    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    fm.fail_on["systemctl restart slurmd.service"] = 1
    flags = _saves(monkeypatch)
    with pytest.raises(StepFailed):
        agent.init()
    assert flags[-1] is True and flags[-2] is True  # the step's failure, then the run's
    st = State.load(paths.state_file)
    assert st.status == "failed" and st.steps["role"].status == "failed"


# -- `slurmd -C` started before the munge step (branch readyfloor) ---------------------------
EARLY_THREADS = ("slurmd-C", "hooks")


def _slurmd_c(fm: FakeMachine) -> list[int]:
    return [i for i, c in enumerate(fm.calls) if c[:2] == ["slurmd", "-C"]]


def test_compute_starts_slurmd_c_before_munge_and_runs_it_once(tmp_path):
    """`slurmd -C` needs neither munged nor slurmctld: it runs beside the munge step's wait for
    munged, and the role step uses that one result (no second `slurmd -C`)."""
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    started = threading.Event()
    real_run = fm.run

    def run(argv, **kw):  # munged's start waits until slurmd -C has started: proves the overlap
        if argv[:2] == ["systemctl", "restart"] and argv[-1] == "munge.service":
            started.wait(5)
        return real_run(argv, **kw)

    fm.slurmd_c_started = started
    agent.host.run = run
    state = agent.init()
    assert state.status == "ready"
    assert started.is_set() and len(_slurmd_c(fm)) == 1
    assert fm.nodes["c1"]["CPUs"] == "4"  # the early result reached the create
    assert not [t for t in threading.enumerate() if t.name in EARLY_THREADS]


def test_failed_munge_step_joins_the_early_slurmd_c(tmp_path):
    """A run that fails before the role step leaves no thread behind and the failure is the
    munge step's, recorded as such."""
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    fm.fail_on["systemctl restart munge.service"] = 1
    with pytest.raises(StepFailed, match="munge"):
        agent.init()
    assert agent.state.steps["munge"].status == "failed"
    assert agent.state.steps["role"].status == "pending"
    assert not [t for t in threading.enumerate() if t.name in EARLY_THREADS]


def test_failed_early_slurmd_c_fails_the_role_step_with_its_error(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    fm.fail_on["slurmd -C"] = 1
    with pytest.raises(StepFailed, match="role"):
        agent.init()
    assert agent.state.steps["munge"].status == "done"
    assert agent.state.steps["role"].status == "failed"
    assert "slurmd -C" in (agent.state.steps["role"].error or "")
    assert "start slurmd.service" not in fm.events  # never started without a spec


def test_resumed_compute_does_not_start_slurmd_c_early(tmp_path):
    """A reboot: the role step was done; it is verified (slurmd inactive after the reboot, so
    it runs again and asks `slurmd -C` itself, after munge)."""
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    fm.reboot()
    fm.calls.clear()
    agent.init()
    munge_at = fm.calls.index(["systemctl", "start", "munge.service"])
    assert [i > munge_at for i in _slurmd_c(fm)] == [True]


def test_controller_starts_nothing_early(tmp_path):

    agent, fm, _paths, _ = make(tmp_path, CTL)
    agent.init()
    assert _slurmd_c(fm) == []  # the controller has no `early`: nothing started before munge


def test_early_hooks_lookup_decides_the_drain_at_create(tmp_path):
    """The hooks lookup started before munge is the one the create uses: a baked hook makes
    the node drained at create (and resumed after the hook), none leaves it in its final state."""
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "10-ok").write_text("#!/bin/sh\nexit 0\n")
    (paths.on_init_d / "10-ok").chmod(0o755)
    agent.init()
    assert "drain c1: nodeforge: initializing" in fm.events
    assert fm.events.index("drain c1: nodeforge: initializing") < fm.events.index(
        "start slurmd.service"
    )
    agent2, fm2, _p, _ = make(tmp_path / "b", COMPUTE)
    agent2.init()
    assert not [e for e in fm2.events if e.startswith("drain")]
    assert not [t for t in threading.enumerate() if t.name in EARLY_THREADS]


def test_early_work_that_cannot_start_is_left_to_the_role_step(tmp_path, monkeypatch):
    """Outside any step nothing may fail the run unrecorded: the role step does the work."""
    from nodeforge.bootstrap.node_roles import compute

    def broken(ctx):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(compute, "early", broken)
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    state = agent.init()
    assert state.status == "ready" and len(_slurmd_c(fm)) == 1
    assert fm.nodes["c1"]["CPUs"] == "4"
