"""Role steps: what turns a booted copy of the image into a controller, compute or login node.

Each module has `run(ctx) -> dict` (idempotent; returns details for state.json) and
`verify(ctx) -> bool` (cheap check used when resuming after a reboot). A module may also have
`early(ctx) -> Early`: work of its step that needs neither munged nor the controller, which the
agent starts before the munge step (see agent.Agent._start_early) and hands to `run` in
`ctx.early`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..host import Host
from ..params import Params
from ..paths import Paths
from ..slurm import SlurmFeatures


@dataclass
class RoleContext:
    host: Host
    paths: Paths
    params: Params
    features: SlurmFeatures
    node: str  # this node's Slurm NodeName / hostname
    address: str  # this node's address (NodeAddr / SlurmctldHost address)
    # The role step's work started before the munge step (the module's `early`), or None.
    early: Early | None = None


@dataclass(frozen=True)
class Early:
    """Background work started ahead of the role step. `hw_spec` waits for a compute's
    `slurmd -C` and returns (or raises) its result; every caller of the agent joins it, also
    on failure, so no thread outlives `node init`."""

    hw_spec: Callable[[], dict[str, str]]

    def join(self) -> None:
        """Wait for the work, whatever its outcome (the role step reports any error)."""
        try:
            self.hw_spec()
        except Exception:  # noqa: BLE001, S110 - the role step raises it where it uses it
            pass
