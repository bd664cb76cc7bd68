"""`nodeforge node gave-up` (bootstrap/gave_up.py): an agent killed 4 times in one boot ends
failed with "agent restarted too often", its node drained with it and the metric saying so,
instead of a stale "running" (issue 28). The kill is modelled by an exception no step catches
(BaseException, as SIGKILL is for the process): the agent leaves its state as a kill does."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeforge.bootstrap import gave_up, hooks
from nodeforge.bootstrap.host import Host
from nodeforge.bootstrap.state import State
from nodeforge.bootstrap.status import as_text
from nodeforge.errors import NodeforgeError
from tests.unit.support import COMPUTE, FakeHost, ansible_render, make, script

pytestmark = pytest.mark.unit
# systemd 257 (the image's), killed a 4th time: the restart counted and refused, Result=signal
# (measured, e2e test_cluster_faults)
GAVE_UP = gave_up.UnitEnd("failed", "failed", "signal", 4)


class Killed(BaseException):
    """FIXTURE: the agent's process gone mid-hook (no step can record it, as with SIGKILL)."""


def killed_mid_hook(tmp_path, monkeypatch):
    """A compute whose agent was killed while its hooks step ran: state "running", node
    drained with the agent's "running hooks"."""
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    script(paths.on_init_d / "10-import", "exit 0\n")

    def die(self, hooks_list):
        raise Killed

    monkeypatch.setattr(hooks.Runner, "run_all", die)
    with pytest.raises(Killed):
        agent.init()
    st = State.load(paths.state_file)
    assert st.status == "running" and st.steps["hooks"].status == "running"  # the stale record
    assert fm.nodes["c1"]["Reason"] == "nodeforge: running hooks"
    return agent, fm, paths


def test_given_up_after_4_kills_fails_the_step_drains_and_writes_the_metric(tmp_path, monkeypatch):
    agent, fm, paths = killed_mid_hook(tmp_path, monkeypatch)
    fm.calls.clear()
    what = gave_up.record(paths, agent.host, GAVE_UP)
    why = (
        "agent restarted too often: killed 4 times in this boot, systemd gave up "
        "(nodeforge-init.service StartLimitBurst=4)"
    )
    assert what == f"step hooks failed: {why}"
    st = State.load(paths.state_file)
    assert st.status == "failed"
    assert st.steps["hooks"].status == "failed" and st.steps["hooks"].error == why
    assert st.steps["hooks"].ended is not None
    # drained with the reason (sinfo -R), not left with "running hooks"
    assert fm.nodes["c1"]["Reason"] == f"nodeforge: hooks step failed: {why}"
    assert "DRAIN" in fm.nodes["c1"]["State"]
    # the hook the killed run left in its scope is stopped
    assert ["systemctl", "stop", hooks.LEFTOVER_SCOPES] in fm.calls
    prom = (paths.textfile_dir / "nodeforge_bootstrap.prom").read_text()
    assert 'nodeforge_bootstrap_failed{step="hooks"} 1' in prom
    assert 'nodeforge_bootstrap_failed{step="role"} 0' in prom
    text = as_text(st)
    assert "agent restarted too often" in text and "failed" in text


def test_a_kill_that_systemd_restarts_is_left_to_the_next_run(tmp_path, monkeypatch):
    """OnFailure= fires on every kill (the unit passes through "failed"); while systemd
    restarts the agent (ActiveState activating) nothing is recorded."""
    agent, fm, paths = killed_mid_hook(tmp_path, monkeypatch)
    before = paths.state_file.read_text()
    fm.calls.clear()
    assert (
        gave_up.record(
            paths, agent.host, gave_up.UnitEnd("activating", "auto-restart", "signal", 1)
        )
        is None
    )
    assert paths.state_file.read_text() == before and fm.calls == []
    assert fm.nodes["c1"]["Reason"] == "nodeforge: running hooks"


def test_a_failure_the_agent_recorded_itself_is_kept(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    script(paths.on_init_d / "10-bad", "exit 3\n")
    with pytest.raises(NodeforgeError):
        agent.init()
    before = paths.state_file.read_text()
    reason = fm.nodes["c1"]["Reason"]
    assert (
        gave_up.record(paths, agent.host, gave_up.UnitEnd("failed", "failed", "exit-code", 0))
        is None
    )
    assert paths.state_file.read_text() == before and fm.nodes["c1"]["Reason"] == reason
    assert "10-bad failed (exit 3)" in reason


def test_killed_between_steps_fails_the_next_step(tmp_path, monkeypatch):
    agent, fm, paths = killed_mid_hook(tmp_path, monkeypatch)
    st = State.load(paths.state_file)
    st.steps["hooks"].status = "done"  # the kill came after hooks, before ready began
    st.save(paths.state_file)
    got = gave_up.record(paths, agent.host, gave_up.UnitEnd("failed", "failed", "timeout", 0))
    assert got == (
        "step ready failed: agent ended without recording an outcome "
        "(nodeforge-init.service Result=timeout)"
    )
    assert fm.nodes["c1"]["Reason"].startswith("nodeforge: ready step failed: agent ended")


@pytest.mark.parametrize(
    ("result", "restarts", "expect"),
    [
        ("signal", 4, "agent restarted too often: killed 4 times in this boot"),
        ("signal", 3, "agent restarted too often: killed 4 times in this boot"),
        ("start-limit-hit", 3, "agent restarted too often: killed 4 times in this boot"),
        ("core-dump", 3, "agent restarted too often: killed 4 times in this boot"),
        # a kill systemd did not restart for another reason (the unit was being stopped)
        (
            "signal",
            0,
            "agent ended without recording an outcome (nodeforge-init.service Result=signal)",
        ),
        (
            "timeout",
            3,
            "agent ended without recording an outcome (nodeforge-init.service Result=timeout)",
        ),
    ],
)
def test_reason_names_restarted_too_often_only_for_the_kill_at_the_limit(result, restarts, expect):
    assert gave_up.reason(gave_up.UnitEnd("failed", "failed", result, restarts)).startswith(expect)


def test_parse_show_reads_systemctls_answer():
    text = "NRestarts=4\nResult=signal\nActiveState=failed\nSubState=failed\n"
    assert gave_up.parse_show(text) == GAVE_UP


@pytest.mark.parametrize(
    "text",
    [
        "",
        "ActiveState=failed\nSubState=failed\nResult=start-limit-hit\n",  # no NRestarts
        "ActiveState=failed\nSubState=failed\nResult=x\nNRestarts=many\n",
        "ActiveState=failed\nSubState=failed\nResult=x\nNRestarts=1\nMainPID=4\n",
        "ActiveState=failed SubState=failed\nResult=x\nNRestarts=1\n",
    ],
)
def test_parse_show_refuses_what_is_not_its_grammar(text):
    with pytest.raises(NodeforgeError, match="systemctl show nodeforge-init.service"):
        gave_up.parse_show(text)


@given(st.text(max_size=200))
def test_parse_show_never_crashes(text):
    try:
        end = gave_up.parse_show(text)
    except NodeforgeError:
        return
    assert end.restarts >= 0 and end.active and end.result is not None


def test_the_units_wire_the_handler():
    init = ansible_render("node_agent", "nodeforge-init.service.j2")
    assert "OnFailure=nodeforge-init-gave-up.service" in init
    assert "StartLimitBurst=4" in init  # gave_up.START_LIMIT names it in the reason
    assert gave_up.START_LIMIT == 4
    handler = ansible_render("node_agent", "nodeforge-init-gave-up.service.j2")
    assert "ExecStart=/usr/local/bin/nodeforge node gave-up" in handler
    assert "Type=oneshot" in handler and "[Install]" not in handler  # never enabled


class Restarting(FakeHost):
    """FIXTURE: systemd's answers while the unit waits out RestartSec, then its end."""

    def __init__(self, answers: list[str]):
        super().__init__()
        self.answers = answers

    def answer(self, a, timeout, env):
        assert a[:2] == ["systemctl", "show"] and a[-1] == "nodeforge-init.service", a
        return 0, self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def show(active: str, sub: str, result: str, restarts: int) -> str:
    return f"ActiveState={active}\nSubState={sub}\nResult={result}\nNRestarts={restarts}\n"


def test_the_handler_waits_out_the_restart_delay_then_reads_the_end():
    """Started by the 4th kill (unit in auto-restart), it sees the refused restart."""
    fh = Restarting(
        [show("activating", "auto-restart", "signal", 3)] * 3
        + [show("failed", "failed", "signal", 4)]
    )
    sleeps: list[float] = []
    host = Host(run=fh.run, sleep=sleeps.append, monotonic=lambda: 0.0)
    assert gave_up.settled_unit(host) == GAVE_UP
    assert sleeps == [0.5, 0.5, 0.5]


def test_a_kill_while_the_handler_watches_the_restarted_agent_is_read_by_that_run():
    """Kills in quick succession: the handler started by the 3rd kill is still running when
    the 4th comes (whose OnFailure= start joins it). It watches the restarted agent (the
    unit activating) and reads the refused restart itself, not the restart it saw first."""
    fh = Restarting(
        [show("activating", "auto-restart", "signal", 2)] * 2
        + [show("activating", "start", "signal", 3)] * 4
        + [show("failed", "failed", "signal", 4)]
    )
    sleeps: list[float] = []
    host = Host(run=fh.run, sleep=sleeps.append, monotonic=lambda: 0.0)
    end = gave_up.settled_unit(host)
    assert end == GAVE_UP and len(sleeps) == 6


def test_an_agent_that_finishes_while_watched_is_left_alone():
    fh = Restarting(
        [show("activating", "start", "signal", 1)] * 2 + [show("active", "exited", "success", 1)]
    )
    host = Host(run=fh.run, sleep=lambda s: None, monotonic=lambda: 0.0)
    end = gave_up.settled_unit(host)
    assert (end.active, end.sub) == ("active", "exited")


def test_the_handler_wait_is_bounded():
    fh = Restarting([show("activating", "auto-restart", "signal", 1)])
    clock = iter(range(0, 1000, 5))
    host = Host(run=fh.run, sleep=lambda s: None, monotonic=lambda: float(next(clock)))
    end = gave_up.settled_unit(host, timeout=20)
    assert end.sub == "auto-restart" and len(fh.calls) <= 6
