"""What the governor decided to do: one Action per Slurm command or recorded observation.

Its own module so that gang.policy (jobs) and gang.strikes (nodes) both produce them without
importing each other; `gang.policy.Action` stays the public name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ActionKind(str, Enum):  # noqa: UP042 - StrEnum would change str() of members in events
    """str-valued: events and tests compare and serialize the plain names."""

    REQUEUE = "requeue"
    REQUEUEHOLD = "requeuehold"  # deactivation: requeue held, then an admin hold
    SET_START = "set_start"
    HOLD = "hold"  # an admin hold (block_admission queue, or re-closing a deactivation)
    RELEASE = "release"
    CANCEL = "cancel"
    RECORD = "record"
    ANNOTATE = "annotate"
    NOTE = "note"
    STRIKE = "strike"
    DRAIN = "drain"
    DRAIN_SKIPPED = "drain_skipped"
    DEADLINE = "deadline"  # a job's own timeout request judged (gang/deadlines.py)

    def __str__(self) -> str:
        return self.value


# The kinds that issue a Slurm command to the job (its address, slurm.job_address): one whose
# job Slurm does not list now, or lists without an exact name, gets no command.
JOB_COMMANDS = frozenset(
    {
        ActionKind.REQUEUE,
        ActionKind.REQUEUEHOLD,
        ActionKind.SET_START,
        ActionKind.HOLD,
        ActionKind.RELEASE,
        ActionKind.CANCEL,
        ActionKind.RECORD,
        ActionKind.ANNOTATE,
        ActionKind.DEADLINE,
    }
)


@dataclass(frozen=True)
class Action:
    kind: ActionKind | str
    job_id: str  # for node actions: the gang job whose timeout gave the (last) strike
    reason: str = ""
    detail: str = ""
    count: int = 0  # node actions: the node's strikes within the window
    start_at: float | None = None
    waited: float | None = None  # admission (or readiness loss) -> this action, seconds
    backoff: float | None = None  # the backoff delay applied (start_at - decision time)
    deadline: float | None = None
    hold: bool = False  # requeue as requeuehold (block_admission puts it back in the queue)
    restarts: int = 0  # Slurm Restarts seen before acting
    partition: str = ""
    phase: str = ""  # the phase the record is in after this action
    node: str = ""  # node actions (strike, drain, drain_skipped, note NodeResumed)
    cause: str = ""  # Kueue's underlying_cause of an eviction
    reissue: bool = False  # the same attempt again (already counted): not a new eviction
    timeout: float | None = None  # deadline actions: the timeout that applies to this run
    admin: str = ""  # deadline actions: the AdminComment token the user sees
