"""Login role step: a configless client, never a place where jobs run.

- Slurm ≥ 23.11 with sackd: a drop-in for sackd.service
  (`sackd --systemd --conf-server <ctl>:6817`) keeps /run/slurm/conf fresh for the client
  commands; the node is not a Slurm node at all.
- Older Slurm (22.05): configless `slurmd -Z` with feature `nodeforge_login` gives the client
  commands their config, and the node is kept DRAINED forever with the reason
  "nodeforge: login node (no jobs)": partitions are `Nodes=ALL`, so draining is what keeps it
  out of scheduling. The agent's `ready` step never resumes a login node.
"""

from __future__ import annotations

from ..slurm_setup import conf_server, dropin
from . import RoleContext
from .compute import gate, start_slurmd, wait_controller

LOGIN_FEATURE = "nodeforge_login"
LOGIN_REASON = "nodeforge: login node (no jobs)"
SACKD = "/usr/sbin/sackd"


def uses_sackd(ctx: RoleContext) -> bool:
    return ctx.features.has_sackd


def run(ctx: RoleContext) -> dict:
    h, p = ctx.host, ctx.params
    g = gate(ctx)
    if not uses_sackd(ctx):
        d = start_slurmd(ctx, g, LOGIN_REASON, LOGIN_REASON, (LOGIN_FEATURE,))
        d["client"] = "slurmd (drained, Slurm < 23.11)"
        return d
    detail: dict[str, object] = {"client": "sackd"}
    detail["controller_wait_s"] = round(wait_controller(ctx, g), 2)
    if dropin(
        ctx.paths,
        "sackd.service",
        [SACKD, "--systemd", "--conf-server", conf_server(p), "$SACKD_OPTIONS"],
    ):
        h.systemctl("daemon-reload")
    if h.is_active("sackd.service"):
        h.systemctl("restart", "sackd.service", timeout=p.wait_timeout)
    else:
        h.start("sackd.service", timeout=p.wait_timeout)
    return detail


def verify(ctx: RoleContext) -> bool:
    unit = "sackd.service" if uses_sackd(ctx) else "slurmd.service"
    return ctx.host.is_active(unit)
