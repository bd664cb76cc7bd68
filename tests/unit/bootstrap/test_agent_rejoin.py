"""`nodeforge node rejoin` (bootstrap/rejoin.py): a compute whose slurmctld did not answer
within wait_timeout ends failed and outside Slurm; once slurmctld answers, nodeforge-rejoin
starts the agent again and the node joins (issue 28: none may be missing from Slurm). Any other
failure is never retried. On the agent's fake machine (tests/unit/support.py, a fixture)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeforge.bootstrap import rejoin
from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.state import State
from nodeforge.bootstrap.status import as_text
from tests.unit.support import COMPUTE, make, script

pytestmark = pytest.mark.unit
UNIT = "nodeforge-init.service"


def missed_controller(tmp_path):
    """A compute that booted while slurmctld was away for longer than its wait_timeout."""
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "wait_timeout": 1})
    script(paths.on_init_d / "10-mark", "exit 0\n")
    fm.ctl_up = False
    with pytest.raises(StepFailed, match="slurmctld at .* answering"):
        agent.init()
    return agent, fm, paths


def systemctl_calls(fm) -> list[list[str]]:
    return [c for c in fm.calls if c[:1] == ["systemctl"] and UNIT in c]


def test_a_node_that_missed_slurmctld_joins_once_it_answers(tmp_path):
    agent, fm, paths = missed_controller(tmp_path)
    st = State.load(paths.state_file)
    assert st.status == "failed" and st.steps["role"].status == "failed"
    assert st.retry == rejoin.CONTROLLER_AWAY
    assert paths.rejoin_wanted.read_text() == "controller-away\n"  # the service's condition
    assert "nodeforge-rejoin.timer starts the agent again" in st.steps["role"].error
    assert "c1" not in fm.nodes  # outside Slurm: nobody but the node can say so
    assert st.steps["hooks"].status == "pending"  # no hook before the node exists in Slurm
    assert "outside Slurm: nodeforge-rejoin.timer starts the agent again" in as_text(st)

    # slurmctld still away: the look waits, starts nothing
    fm.calls.clear()
    action, why = rejoin.rejoin(paths, agent.host)
    assert action is rejoin.Action.WAIT and "still does not answer" in why
    assert [c for c in fm.calls if c[0] == "scontrol"] == [["scontrol", "ping"]]  # one look
    assert systemctl_calls(fm) == []

    # slurmctld back: the unit is started again (its start limit reset first)
    fm.ctl_up = True
    fm.calls.clear()
    action, why = rejoin.rejoin(paths, agent.host)
    assert action is rejoin.Action.RESTART
    assert systemctl_calls(fm) == [
        ["systemctl", "reset-failed", UNIT],
        ["systemctl", "start", "--no-block", UNIT],
    ]
    # what systemd then runs: the agent resumes and the node joins
    st = agent.init()
    assert st.status == "ready" and st.retry is None
    assert not paths.rejoin_wanted.exists()
    assert st.steps["role"].runs == 2 and st.steps["hooks"].runs == 1
    assert fm.nodes["c1"]["State"].startswith("IDLE")

    # ready: the timer's looks do nothing, not even ask slurmctld
    fm.calls.clear()
    assert rejoin.rejoin(paths, agent.host)[0] is rejoin.Action.NOTHING
    assert fm.calls == []


def test_a_failed_hook_is_never_retried(tmp_path):
    """Drained with its reason in Slurm: an operator's to fix, never a loop of reruns."""
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    script(paths.on_init_d / "10-bad", "exit 3\n")
    with pytest.raises(StepFailed):
        agent.init()
    st = State.load(paths.state_file)
    assert st.status == "failed" and st.retry is None
    assert not paths.rejoin_wanted.exists()  # the timer does not even start the service
    fm.calls.clear()
    action, why = rejoin.rejoin(paths, agent.host)
    assert action is rejoin.Action.NOTHING and "not retried" in why
    assert fm.calls == []  # slurmctld not even asked


@given(
    status=st.sampled_from(["new", "running", "ready", "failed"]),
    retry=st.sampled_from([None, rejoin.CONTROLLER_AWAY, "other", ""]),
    up=st.booleans(),
)
def test_decide_restarts_only_a_controller_away_failure_with_slurmctld_up(status, retry, up):
    asked = []

    def answers():
        asked.append(1)
        return up

    action, why = rejoin.decide(State(status=status, retry=retry), answers)
    retried = status == "failed" and retry == rejoin.CONTROLLER_AWAY
    assert bool(asked) == retried  # slurmctld is asked only when its answer matters
    want = (
        (rejoin.Action.RESTART if up else rejoin.Action.WAIT) if retried else rejoin.Action.NOTHING
    )
    assert action is want and why
