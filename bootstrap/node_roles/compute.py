"""Compute role step: configless, dynamic `slurmd -Z`, registered DRAINED (readiness gate).

1. A minimal client slurm.conf (/run/nodeforge) and a bounded wait for slurmctld (`scontrol ping`).
2. The gate holds the node: created in slurmctld with this node's full spec (`slurmd -C` +
   NodeAddr + Feature + Gres) as FUTURE, then drained "nodeforge: initializing".
3. A drop-in for slurmd.service overrides ExecStart (keeps `--systemd`; the unit is Type=notify):
   `slurmd --systemd -Z --conf-server <ctl>:6817 --conf "Feature=… Gres=…" [-N node]`.
4. slurmd started; once it has registered, the reason becomes "nodeforge: running hooks".
The agent's `ready` step resumes the node after the hooks succeed.
"""

from __future__ import annotations

from nodeforge.slurm import has

from ..readiness import INITIALIZING, RUNNING_HOOKS, Gate
from ..slurm import client_conf, conf_server, dropin, hardware_spec, node_conf
from . import RoleContext

SLURMD = "/usr/sbin/slurmd"


def gate(ctx: RoleContext) -> Gate:
    return Gate(ctx.host, ctx.node, ctx.paths.slurm_client_conf)


def slurmd_exec(ctx: RoleContext, extra_features: tuple[str, ...] = ()) -> list[str]:
    # Slurm >= 23.02 units are Type=notify and need --systemd; Debian 12's 22.05 unit is
    # Type=simple with `slurmd -D -s` and its slurmd has no --systemd flag.
    notify = has(ctx.features.version_tuple, "slurmd_systemd_notify")
    mode = ["--systemd"] if notify else ["-D", "-s"]
    argv = [SLURMD, *mode, "-Z", "--conf-server", conf_server(ctx.params)]
    conf = node_conf(ctx.params, extra_features)
    if conf:
        argv += ["--conf", conf]
    if ctx.params.node_name:
        argv += ["-N", ctx.node]
    return [*argv, "$SLURMD_OPTIONS"]


def node_spec(ctx: RoleContext, extra_features: tuple[str, ...] = ()) -> dict[str, str]:
    spec = {"NodeAddr": ctx.address, "NodeHostname": ctx.node}
    spec.update(hardware_spec(ctx.host, ctx.params))
    feats = list(dict.fromkeys([*ctx.params.features, *extra_features]))
    if feats:
        spec["Feature"] = ",".join(feats)
    if ctx.params.gres:
        spec["Gres"] = ",".join(ctx.params.gres)
    return spec


def wait_controller(ctx: RoleContext, g: Gate) -> float:
    client_conf(ctx.paths, ctx.params)
    return ctx.host.wait_until(
        f"slurmctld at {conf_server(ctx.params)} answering (scontrol ping)",
        g.controller_up,
        timeout=ctx.params.wait_timeout,
        interval=2.0,
        hint="is the controller up, and is this node's munge key the cluster's? "
        "Raise wait_timeout in params for slow controllers",
    )


def start_slurmd(
    ctx: RoleContext,
    g: Gate,
    hold_reason: str,
    after_reason: str,
    extra_features: tuple[str, ...] = (),
) -> dict:
    h, p = ctx.host, ctx.params
    detail: dict[str, object] = {}
    detail["controller_wait_s"] = round(wait_controller(ctx, g), 2)
    detail["slurm_node"] = g.hold(node_spec(ctx, extra_features), hold_reason)
    if dropin(ctx.paths, "slurmd.service", slurmd_exec(ctx, extra_features)):
        h.systemctl("daemon-reload")
    if h.is_active("slurmd.service"):
        h.systemctl("restart", "slurmd.service", timeout=p.wait_timeout)
    else:
        h.start("slurmd.service", timeout=p.wait_timeout)

    def registered() -> bool:
        info = g.show()
        return info is not None and "FUTURE" not in info.get("State", "FUTURE")

    detail["register_wait_s"] = round(
        h.wait_until(
            f"node {ctx.node} registered with slurmctld",
            registered,
            timeout=p.wait_timeout,
            hint="see `journalctl -u slurmd`",
        ),
        2,
    )
    # Registration clears the Reason text (the DRAIN flag stays): say what is happening.
    g.drain(after_reason)
    return detail


DOCKER_UNITS = ("containerd.service", "docker.service")


def start_docker(ctx: RoleContext) -> str:
    """Compute nodes run containers: dockerd + containerd, disabled at bake, started here."""
    if not ctx.params.docker:
        return "disabled by params (docker: false)"
    for unit in DOCKER_UNITS:
        ctx.host.systemctl("enable", unit)
        ctx.host.start(unit, timeout=ctx.params.wait_timeout)
    return "active"


def run(ctx: RoleContext) -> dict:
    # Docker first: a compute that cannot run containers must not register at all.
    docker = start_docker(ctx)
    detail = start_slurmd(ctx, gate(ctx), INITIALIZING, RUNNING_HOOKS)
    detail["docker"] = docker
    return detail


def verify(ctx: RoleContext) -> bool:
    docker_ok = not ctx.params.docker or all(ctx.host.is_active(u) for u in DOCKER_UNITS)
    return docker_ok and ctx.host.is_active("slurmd.service")
