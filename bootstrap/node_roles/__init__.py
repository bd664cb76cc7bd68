"""Role steps: what turns a booted copy of the image into a controller, compute or login node.

Each module has `run(ctx) -> dict` (idempotent; returns details for state.json) and
`verify(ctx) -> bool` (cheap check used when resuming after a reboot).
"""

from __future__ import annotations

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
