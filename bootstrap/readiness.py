"""Readiness gate: a node is never given a job before its hooks have succeeded.

Verified on Slurm 22.05.8 (see docs/agent.md, "Readiness gate"):

1. Before slurmd starts, the node is created in slurmctld already drained:
   `scontrol create NodeName=X NodeAddr=… CPUs=… RealMemory=… Feature=… Gres=… State=FUTURE`
   then `scontrol update NodeName=X State=DRAIN Reason="nodeforge: initializing"`.
   The full hardware spec must be given at create time: when `slurmd -Z` registers a node that
   already exists, slurmctld keeps the existing definition and ignores slurmd's --conf.
   On a reboot the node already exists (create fails or is a no-op), and the drain is applied
   to it before slurmd starts again.
2. slurmd -Z registers: the node becomes IDLE+DRAIN (registration clears the Reason text, so
   the agent sets it again: "nodeforge: running hooks"). A job pending for it stays pending.
3. Hooks succeed: `State=RESUME`, only if the drain reason is still ours ("nodeforge:"), so an
   operator's own drain is never undone. A hook fails, hangs or crashes: Reason becomes
   "nodeforge: hook <name> failed (exit N)" / "timed out after Ns" / "killed by signal S" and
   the node stays drained, visible in `sinfo -R`.

Root with the cluster's munge key is a Slurm administrator, so the node can do this itself; the
client config is a minimal slurm.conf in /run/nodeforge (configless nodes have none yet).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from nodeforge.errors import NodeforgeError
from nodeforge.slurm import controller_up

from .host import Host
from .slurm import parse_node

log = logging.getLogger("nodeforge.readiness")

PREFIX = "nodeforge:"
INITIALIZING = "nodeforge: initializing"
RUNNING_HOOKS = "nodeforge: running hooks"


@dataclass
class Gate:
    host: Host
    node: str
    client_conf: Path
    timeout: float = 30.0  # per scontrol call

    def _scontrol(self, *args: str, check: bool = True):
        return self.host.run(
            ["scontrol", *args],
            check=check,
            timeout=self.timeout,
            env={"SLURM_CONF": str(self.client_conf)},
        )

    def controller_up(self) -> bool:
        return controller_up(lambda argv: self._scontrol(*argv[1:], check=False))

    def show(self) -> dict[str, str] | None:
        cp = self._scontrol("--future", "-o", "show", "node", self.node, check=False)
        if cp.returncode != 0 or not (cp.stdout or "").strip() or "not found" in cp.stdout:
            return None
        return parse_node(cp.stdout)

    def hold(self, spec: dict[str, str], reason: str = INITIALIZING) -> str:
        """Make sure the node exists in slurmctld and is drained, BEFORE slurmd starts."""
        created = "existing"
        if self.show() is None:
            words = [
                f"NodeName={self.node}",
                *(f"{k}={v}" for k, v in spec.items() if v),
                "State=FUTURE",
            ]
            cp = self._scontrol("create", *words, check=False)
            if cp.returncode != 0 and "already exists" not in (cp.stdout or ""):
                raise NodeforgeError(
                    f"scontrol create {' '.join(words)} failed (exit {cp.returncode}): "
                    f"{(cp.stdout or '').strip()}; check MaxNodeCount on the controller and that "
                    "this node's munge key is the cluster's"
                )
            created = "created"
        self.drain(reason)
        return created

    def drain(self, reason: str) -> None:
        self._scontrol("update", f"NodeName={self.node}", "State=DRAIN", f"Reason={reason}")

    def release(self) -> str:
        """Resume the node if the drain is ours; return what was done."""
        info = self.show()
        if info is None:
            raise NodeforgeError(
                f"node {self.node} is not known to slurmctld; cannot mark it ready"
            )
        state = info.get("State", "")
        reason = info.get("Reason", "")
        if "DRAIN" not in state:
            return "not drained"
        if reason and reason != "none" and not reason.startswith(PREFIX):
            log.warning(
                "node %s drained by someone else (%s); leaving it drained", self.node, reason
            )
            return f"left drained (reason not ours: {reason})"
        self._scontrol("update", f"NodeName={self.node}", "State=RESUME")
        return "resumed"

    def fail(self, reason: str) -> None:
        """Best effort: record *reason* as the drain reason (the node stays drained)."""
        if not reason.startswith(PREFIX):
            reason = f"{PREFIX} {reason}"
        try:
            self.drain(reason[:200])
        except NodeforgeError as exc:
            log.error("could not set drain reason on %s: %s", self.node, exc)
