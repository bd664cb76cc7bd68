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
from ..slurm_setup import SlurmFeatures


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
    """Background work started ahead of the role step. Each field waits for its thread and
    returns (or raises) its result: `hw_spec` a compute's `slurmd -C`, `has_hooks` whether
    anything runs between registration and ready (it imports the hooks module). The agent
    joins them, also on failure, so no thread outlives `node init`."""

    hw_spec: Callable[[], dict[str, str]]
    has_hooks: Callable[[], bool]

    def join(self) -> None:
        """Wait for the work, whatever its outcome (the role step reports any error)."""
        for job in (self.hw_spec, self.has_hooks):
            try:
                job()
            except Exception:  # noqa: BLE001, S110 - the role step raises it where it uses it
                pass
