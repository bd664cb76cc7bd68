"""`nodeforge node rejoin`: a node whose first boot failed because slurmctld did not answer
joins once slurmctld answers.

The role step waits for slurmctld at most `wait_timeout` (params): a first boot stays bounded.
A controller away for longer (it boots after its computes, a partition, munge refusing this
node's skewed clock) left the node failed and outside Slurm, where only the node itself could
say so: slurmctld cannot list or drain a node it never heard of. So nodeforge-rejoin.timer
runs this every 30 s (roles/node_agent): when the agent's record says it failed for exactly
that reason (`State.retry == CONTROLLER_AWAY`, set only by `ControllerAway`) and slurmctld now
answers `scontrol ping` with this node's key and clock, nodeforge-init.service is started
again; the agent resumes from state.json (the role step runs again, the hooks once).

Nothing else is retried: any other failed step left the node drained with its reason in
Slurm (an operator's to fix), and rerunning a failing hook would be a silent loop of drains.
Each look is one bounded `scontrol ping`; while slurmctld stays away the node only waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import StrEnum

from nodeforge.errors import NodeforgeError

from .gave_up import UNIT  # nodeforge-init.service: one name for both of its handlers
from .host import Host
from .paths import Paths
from .readiness import Gate
from .state import State

log = logging.getLogger("nodeforge.agent")

CONTROLLER_AWAY = "controller-away"  # State.retry: what a later `node rejoin` waits for
PING_TIMEOUT_S = 15.0  # one `scontrol ping`


class ControllerAway(NodeforgeError):
    """slurmctld did not answer within wait_timeout: the node is outside Slurm, and
    `nodeforge node rejoin` starts the agent again once slurmctld answers."""


class Action(StrEnum):
    NOTHING = "nothing"  # not failed, or failed for a reason that is not retried
    WAIT = "wait"  # failed for the controller's absence, and slurmctld still does not answer
    RESTART = "restart"  # slurmctld answers now: start nodeforge-init.service again


def decide(state: State, controller_answers: Callable[[], bool]) -> tuple[Action, str]:
    """What to do for the agent's record *state*; asks slurmctld only when that can matter."""
    if state.status != "failed":
        return Action.NOTHING, f"agent {state.status}: nothing to rejoin"
    if state.retry != CONTROLLER_AWAY:
        return Action.NOTHING, (
            "agent failed for another reason than slurmctld's absence: not retried "
            "(`nodeforge node status` says why)"
        )
    if not controller_answers():
        return Action.WAIT, "slurmctld still does not answer; the next look is the timer's"
    return Action.RESTART, f"slurmctld answers: starting {UNIT} again"


def rejoin(paths: Paths, host: Host) -> tuple[Action, str]:
    """One look (run by nodeforge-rejoin.service); returns what it did and why."""
    state = State.load(paths.state_file)

    def answers() -> bool:
        # The client config the role step wrote (slurmctld's address; configless nodes have
        # no slurm.conf): without it the agent never reached the controller wait.
        if not paths.slurm_client_conf.exists() or not state.node:
            return False
        return Gate(
            host, state.node, paths.slurm_client_conf, timeout=PING_TIMEOUT_S
        ).controller_up()

    action, why = decide(state, answers)
    if action is Action.RESTART:
        # reset-failed: the unit's start limit (StartLimitBurst=4, for an agent killed again and
        # again) must not refuse a start that follows a failure the agent recorded itself.
        host.systemctl("reset-failed", UNIT, timeout=30)
        host.systemctl("start", "--no-block", UNIT, timeout=30)
    log.info("rejoin: %s", why)
    return action, why
