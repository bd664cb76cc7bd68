"""The agent's own wait for systemd's boot targets.

nodeforge-init.service starts as soon as its files are mounted (DefaultDependencies=no, not
after basic.target or network-online.target: docs/contracts.md "Boot ordering"), so the
interpreter start and the local work overlap the rest of the boot. Whatever needs the network
(or what cloud-init does before network-online.target) first waits here: `systemctl start
TARGET...` queues nothing new at boot, its job merges with the one the boot already has, and
returns when the target is reached. One spawn, no polling, bounded by a timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from nodeforge.errors import CommandError, NodeforgeError

from .host import Host

log = logging.getLogger("nodeforge.agent")

NETWORK_ONLINE = "network-online.target"
BASIC = "basic.target"
# systemd-networkd-wait-online gives up after 120 s by default and network-online.target is then
# reached all the same (it only Wants= it): 300 s is for a boot that is stuck, not slow.
NETWORK_ONLINE_TIMEOUT = 300.0
UNIT = "nodeforge-init.service"


class BootWaitError(NodeforgeError):
    exit_code = 1


@dataclass
class BootWait:
    """Waits for boot targets, each at most once per `node init` run."""

    host: Host
    timeout: float = NETWORK_ONLINE_TIMEOUT
    reached: set[str] = field(default_factory=set)
    waited_s: float = 0.0

    def wait(self, targets: Sequence[str], why: str) -> float:
        """Return when every target in *targets* is reached (seconds waited; 0.0 when this run
        already waited for them). A target whose job fails is logged and not waited for again:
        the unit used to start after it whatever its outcome (After= only), and the step that
        needs the network reports its own error. Raise BootWaitError after *timeout* s."""
        todo = [t for t in targets if t not in self.reached]
        if not todo:
            return 0.0
        names = " and ".join(todo)
        it = "them" if len(todo) > 1 else "it"
        t0 = self.host.monotonic()
        try:
            cp = self.host.run(["systemctl", "start", *todo], check=False, timeout=self.timeout)
        except CommandError as exc:  # the timeout (a missing systemctl: MissingToolError)
            raise BootWaitError(
                f"{names} not reached within {self.timeout:g}s (the agent's timeout for it; "
                f"{UNIT} starts before {it} and waits for {it} before {why}). See "
                f"`systemctl list-jobs`, `systemctl status {todo[-1]}` and "
                "`journalctl -b -u systemd-networkd-wait-online.service`, then run "
                "`nodeforge node init` again"
            ) from exc
        dt = self.host.monotonic() - t0
        if cp.returncode != 0:
            out = (cp.stdout or "").strip().splitlines()
            log.warning(
                "%s: its start job did not succeed (%s); going on, as a unit ordered after it "
                "would", names, out[-1] if out else f"exit {cp.returncode}",
            )  # fmt: skip
        self.reached.update(todo)
        self.waited_s += dt
        log.info("waited %.3fs for %s (before %s)", dt, names, why)
        return dt
