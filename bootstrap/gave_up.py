"""`nodeforge node gave-up`: the final record of a first boot that systemd stopped restarting.

nodeforge-init.service starts an agent killed outright again (Restart=on-abort), at most 4
starts per boot (StartLimitBurst=4). Killed a 4th time, systemd does not restart it (systemd
257 in the image counts the refused restart, NRestarts=4, and leaves Result=signal, measured
by the e2e; an older one fails the restart with Result=start-limit-hit) and no agent is left to
say so: state.json still said "running" and the node stayed drained with "nodeforge: running
hooks". The unit's OnFailure= starts
nodeforge-init-gave-up.service, which runs this: the step that was running is failed with the
reason, the hook the last run left behind is stopped, the node is drained with the reason
(where slurmctld answers), and nodeforge_bootstrap_failed{step} is written.

OnFailure= also fires on each kill that systemd does restart (the unit passes through
"failed"), and after a failure the agent recorded itself: only a unit that stays failed with
the agent's state still "running" is recorded here; anything else is left as it is. A start
of this oneshot while it runs joins the running one, so a kill during a run of this handler
starts nothing new: the handler therefore watches the unit while it is activating (waiting
out RestartSec, then the restarted agent), bounded by WATCH_S, and reads the end itself;
returning once the unit left auto-restart left a quick 4th kill unrecorded ("running hooks"
for good).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic

from .host import Host
from .paths import Paths
from .readiness import Gate
from .state import STEPS, State, now

log = logging.getLogger("nodeforge.agent")

UNIT = "nodeforge-init.service"
START_LIMIT = 4  # StartLimitBurst of the unit (roles/node_agent nodeforge-init.service.j2)
_SHOW = re.compile(r"(ActiveState|SubState|Result|NRestarts)=([a-z0-9-]{0,40})")
_KEYS = ("ActiveState", "SubState", "Result", "NRestarts")
# The watch over a restarted agent (within the handler's TimeoutStartSec=180, with room for
# its bounded scontrol calls); a kill after it starts a new run of the handler.
WATCH_S = 120.0


@dataclass(frozen=True)
class UnitEnd:
    """How systemd left nodeforge-init.service (`systemctl show`)."""

    active: str  # ActiveState: "failed" once systemd will not restart it
    sub: str  # SubState: "auto-restart" while it waits to restart the agent
    result: str  # Result: "start-limit-hit" when it gave up restarting
    restarts: int  # NRestarts: automatic restarts in this boot


def parse_show(text: str) -> UnitEnd:
    """`systemctl show -p ActiveState -p SubState -p Result -p NRestarts` output; every line
    must be one of those keys with a plain value (anything else is refused, naming the line)."""
    got: dict[str, str] = {}
    for line in text.splitlines():
        if not line:
            continue
        m = _SHOW.fullmatch(line)
        if m is None:
            raise NodeforgeError(f"systemctl show {UNIT}: unexpected line {line[:80]!r}")
        got[m.group(1)] = m.group(2)
    missing = [k for k in _KEYS if k not in got]
    if missing or not got["NRestarts"].isdigit():
        raise NodeforgeError(
            f"systemctl show {UNIT}: no usable {', '.join(missing) or 'NRestarts'}"
        )
    return UnitEnd(got["ActiveState"], got["SubState"], got["Result"], int(got["NRestarts"]))


def read_unit(host: Host) -> UnitEnd:
    argv = ["systemctl", "show", *(a for k in _KEYS for a in ("-p", k)), UNIT]
    return parse_show(host.run(argv, timeout=30).stdout or "")


def settled_unit(host: Host, timeout: float = WATCH_S) -> UnitEnd:
    """The unit once it is no longer activating: neither waiting to restart the agent nor
    running it again (bounded by *timeout*: then as it is, and record() leaves a unit that is
    not failed alone)."""
    deadline = host.monotonic() + timeout
    end = read_unit(host)
    while end.active == "activating" and host.monotonic() < deadline:
        host.sleep(0.5)
        end = read_unit(host)
    return end


KILLED = ("signal", "core-dump", "start-limit-hit")  # Results of a kill not restarted


def reason(end: UnitEnd) -> str:
    # each start ended killed; NRestarts may count the refused restart too (systemd 257)
    killed = min(end.restarts + 1, START_LIMIT)
    if end.result in KILLED and end.restarts + 1 >= START_LIMIT:
        return (
            f"agent restarted too often: killed {killed} times in this boot, systemd gave up "
            f"({UNIT} StartLimitBurst={START_LIMIT})"
        )
    return f"agent ended without recording an outcome ({UNIT} Result={end.result})"


def record(paths: Paths, host: Host, end: UnitEnd) -> str | None:
    """Record the end of a first boot that systemd gave up on; returns the reason, or None
    when there is nothing to record (the unit restarts, or the agent recorded its outcome)."""
    if end.active != "failed":
        return None  # restarting (or not failed at all): the next run records its outcome
    state = State.load(paths.state_file)
    if state.status != "running":
        return None  # ready, or a failure the agent recorded itself (a failed step, SIGTERM)
    running = [n for n in STEPS if state.steps[n].status == "running"]
    pending = [n for n in STEPS if state.steps[n].status not in ("done", "skipped")]
    step = (running or pending or ["ready"])[0]  # killed mid-step, or between two steps
    why = reason(end)
    if step == "hooks":
        from . import hooks

        hooks.stop_leftovers(host)  # the killed run's hook: never left running on its own
    state.end(step, now(), "failed", why)
    state.status = "failed"
    state.save(paths.state_file, durable=True)
    log.error("step %s failed: %s", step, why)
    if state.role in ("compute", "login") and state.node and paths.slurm_client_conf.exists():
        Gate(host, state.node, paths.slurm_client_conf, timeout=15).fail(
            f"{step} step failed: {why}"
        )
    if state.steps["params"].status in ("done", "skipped"):
        _write_metric(paths, state)  # as the agent does: not when params never loaded
    return f"step {step} failed: {why}"


def _write_metric(paths: Paths, state: State) -> None:
    from . import failures

    try:
        paths.textfile_dir.mkdir(parents=True, exist_ok=True)
        text = failures.prometheus(state.to_dict())
        write_atomic(paths.textfile_dir / failures.PROM_FILE, text, 0o644)
    except OSError as exc:
        log.warning("bootstrap metric not written (%s)", exc)
