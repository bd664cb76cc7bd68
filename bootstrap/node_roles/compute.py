"""Compute role step: configless, dynamic `slurmd -Z`, registered DRAINED (readiness gate).

1. A minimal client slurm.conf (/run/nodeforge) and a bounded wait for slurmctld (`scontrol ping`);
   `slurmd -C` (the hardware spec) and the node's health checks (health.precheck: a pass is
   the stamp that lets slurmd's start-up HealthCheckProgram run skip the Python check) run at
   the same time, in threads. A node that fails them is created drained.
2. The gate holds the node: created in slurmctld with this node's full spec (`slurmd -C` +
   NodeAddr + Feature + Gres) as FUTURE. Only when something must run before the node takes
   jobs (hooks) is it also drained "nodeforge: initializing"; without hooks the FUTURE node is
   already in its final state (registration makes it IDLE), which saves the drain, the RESUME
   and the ping that every RESUME costs (see readiness.py).
3. A drop-in for slurmd.service overrides ExecStart (keeps `--systemd`; the unit is Type=notify):
   `slurmd --systemd -Z --conf-server <ctl>:6817 --conf "Feature=… Gres=…" [-N node]`.
4. slurmd started; once it has registered, a drained node's reason becomes
   "nodeforge: running hooks".
The agent's `ready` step resumes a drained node after the hooks succeed and waits until
slurmctld shows it ready (readiness.NodeState.ready).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic
from nodeforge.slurm_facts import has

from .. import gres, health
from ..readiness import HELD_CREATED_FINAL, INITIALIZING, RUNNING_HOOKS, Gate, reads_json
from ..rejoin import ControllerAway
from ..slurm_setup import client_conf, conf_server, dropin, hardware_spec, node_conf
from . import Early, RoleContext

T = TypeVar("T")

SLURMD = "/usr/sbin/slurmd"


def gate(ctx: RoleContext) -> Gate:
    json = reads_json(ctx.features.version_tuple)  # scontrol show node --json
    return Gate(ctx.host, ctx.node, ctx.paths.slurm_client_conf, json=json)


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


def early(ctx: RoleContext) -> Early:
    """`slurmd -C` (this node's hardware, for the create), started in a thread. It needs
    neither munged nor the controller, so the agent starts it before the munge step: at first
    boot `systemctl restart munge` waits for munged's start, and `slurmd -C` (0.01-0.09 s,
    measured) then no longer follows it on the path to ready.
    The hooks lookup (has_hooks) runs beside them as well."""
    return Early(
        hw_spec=hw_spec_in_background(ctx),
        # importing the hooks module (~10 ms of CPU) and looking for hooks: beside munged's
        # start too, not at the head of the role step
        has_hooks=in_background(lambda: has_hooks(ctx), "hooks"),
    )


def hw_spec_in_background(ctx: RoleContext) -> Callable[[], dict[str, str]]:
    env = gres.hardware_spec_env(ctx.paths)  # gpu image: see there why
    h, p = ctx.host, ctx.params
    return in_background(lambda: hardware_spec(h, p, env), "slurmd-C")


def node_spec(
    ctx: RoleContext, extra_features: tuple[str, ...] = (), hw: dict[str, str] | None = None
) -> dict[str, str]:
    spec = {"NodeAddr": ctx.address, "NodeHostname": ctx.node}
    if hw is None:
        hw = hardware_spec(ctx.host, ctx.params, gres.hardware_spec_env(ctx.paths))
    spec.update(hw)
    feats = list(dict.fromkeys([*ctx.params.features, *extra_features]))
    if feats:
        spec["Feature"] = ",".join(feats)
    node_gres = gres.node_gres(ctx.params)  # + gpu:<expected_gpus>: never registered GPU-less
    if node_gres:
        spec["Gres"] = ",".join(node_gres)
    return spec


def wait_controller(ctx: RoleContext, g: Gate) -> float:
    """Seconds until slurmctld answers; `ControllerAway` after wait_timeout (the node is then
    outside Slurm: `nodeforge node rejoin` starts the agent again once slurmctld answers)."""
    client_conf(ctx.paths, ctx.params)
    try:
        return _wait_controller(ctx, g)
    except NodeforgeError as exc:
        raise ControllerAway(
            f"{exc} (nodeforge-rejoin.timer starts the agent again once slurmctld answers)"
        ) from exc


def _wait_controller(ctx: RoleContext, g: Gate) -> float:
    return ctx.host.wait_until(
        f"slurmctld at {conf_server(ctx.params)} answering (scontrol ping)",
        g.controller_up,
        timeout=ctx.params.wait_timeout,
        # A compute that boots with its controller: each look is one `scontrol ping` (a refused
        # connection while slurmctld starts), so a short poll costs little and the node does
        # not sit up to 2 s past the controller's start.
        interval=0.25,
        hint="is the controller up, is this node's munge key the cluster's, and is its clock "
        "within munge's TTL (300 s) of the controller's (munged refuses credentials from a "
        "skewed clock)? Raise wait_timeout in params for slow controllers",
    )


def in_background(fn: Callable[[], T], name: str) -> Callable[[], T]:
    """Start *fn* in a thread; the returned callable waits for it and returns (or raises) its
    result. Every caller joins it, also on failure, so nothing outlives the step."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
            box["error"] = exc

    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()

    def result() -> T:
        t.join()
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["value"]  # type: ignore[return-value]

    return result


def reload_if_needed(h, unit: str) -> bool:
    """`systemctl daemon-reload` only when systemd says the unit needs it (NeedDaemonReload).

    A unit that is inactive and unreferenced (slurmd on a first boot: not enabled) is loaded
    from disk, new drop-ins included, by the next systemctl call; a reload re-runs every
    generator and took 0.25-0.28 s on 2 loaded cores against ~0.03 s for the question
    (measured). Anything but a clear "no" reloads.
    """
    cp = h.run(
        ["systemctl", "show", "-p", "NeedDaemonReload", "--value", unit], check=False, timeout=30
    )
    if cp.returncode == 0 and (cp.stdout or "").strip() == "no":
        return False
    h.systemctl("daemon-reload")
    return True


def start_slurmd(
    ctx: RoleContext,
    g: Gate,
    hold_reason: str,
    after_reason: str,
    extra_features: tuple[str, ...] = (),
    *,
    drain: bool = True,
) -> dict:
    h, p = ctx.host, ctx.params
    detail: dict[str, object] = {}
    # Concurrent with asking slurmctld whether it is up and creating the node: `slurmd -C`,
    # and making systemd see the slurmd drop-in (it depends on params only).
    jobs: list[Callable[[], object]] = []
    health.install_wrapper(ctx.paths)  # slurmd runs HealthCheckProgram from its start on
    hide = gres.slurmd_hidden_paths(ctx.paths)  # gpu image without a GPU: see there why
    if dropin(ctx.paths, "slurmd.service", slurmd_exec(ctx, extra_features), hide):
        jobs.append(in_background(lambda: reload_if_needed(h, "slurmd.service"), "reload"))
    # `slurmd -C`: started by the agent before the munge step (early), or here.
    hw = ctx.early.hw_spec if ctx.early is not None else hw_spec_in_background(ctx)
    jobs.append(hw)
    # Before slurmd starts, so that a pass is stamped for slurmd's start-up run (health.py).
    checked = in_background(lambda: health.precheck(h, ctx.paths), "health")
    jobs.append(checked)
    try:
        detail["controller_wait_s"] = round(wait_controller(ctx, g), 2)
        t0 = h.monotonic()
        spec = hw()
        t1 = h.monotonic()
        pre = checked()
        if not pre.ok:  # never registered idle, not even until the ready step drains it
            drain = True
            detail["health"] = pre.reason
        detail["health_extra_s"] = round(h.monotonic() - t1, 3)  # beyond slurmd -C
        t1 = h.monotonic()
        # Whether this disk ever registered the node: a name that is registered although it
        # did not is another machine's (a replaced instance), whose record is replaced.
        marker = ctx.paths.slurm_registered
        held = g.hold(
            node_spec(ctx, extra_features, spec), hold_reason, drain=drain,
            first_init=not marker.exists(), wait=p.wait_timeout,
        )  # fmt: skip
        if not marker.exists():
            write_atomic(marker, f"{ctx.node}\n", 0o600, durable=False)
        # state.json: where the role step's time goes (bench/README.md, node section)
        detail["hw_spec_extra_s"] = round(t1 - t0, 3)  # slurmd -C beyond the ping
        detail["slurm_create_s"] = round(h.monotonic() - t1, 3)
    except BaseException:
        for job in jobs:
            try:
                job()  # joined, so nothing outlives the step; the first error is the one raised
            except BaseException:  # noqa: BLE001, S110 - already failing with a better error
                pass
        raise
    t3 = h.monotonic()
    for job in jobs:
        job()  # e.g. daemon-reload failed: raised here, before slurmd starts
    detail["reload_extra_s"] = round(h.monotonic() - t3, 3)  # systemd check/reload beyond that
    detail["slurm_node"] = held
    # `restart` starts a stopped unit too: one systemctl call instead of is-active + start.
    t2 = h.monotonic()
    h.run(
        ["systemctl", "restart", "slurmd.service"],
        timeout=p.wait_timeout,
        hint="see `journalctl -u slurmd.service` and `systemctl status slurmd.service`",
    )
    detail["slurmd_start_s"] = round(h.monotonic() - t2, 3)  # Type=notify: slurmd's own start
    if held == HELD_CREATED_FINAL:
        # Nothing to do between registration and ready: the ready step's wait (the node
        # seen ready in slurmctld) covers registration too, with one poll loop, not two.
        return detail
    detail["register_wait_s"] = _wait_registered(ctx, g, after_reason)
    return detail


def _wait_registered(ctx: RoleContext, g: Gate, after_reason: str) -> float:
    """start_slurmd's last phase: wait for slurmd's registration, then drain the node with
    *after_reason*; the seconds waited."""

    def registered() -> bool:
        return g.state().base not in ("", "FUTURE")

    waited = round(
        ctx.host.wait_until(
            f"node {ctx.node} registered with slurmctld",
            registered,
            timeout=ctx.params.wait_timeout,
            interval=g.poll,
            hint="see `journalctl -u slurmd`",
        ),
        2,
    )
    # Registration clears the Reason text (the DRAIN flag stays): say what is happening.
    g.drain(after_reason)
    return waited


def has_hooks(ctx: RoleContext) -> bool:
    """Whether anything runs between registration and ready (then the node is drained)."""
    from .. import hooks as hooks_mod  # imported here: a node without hooks never needs it

    try:
        return bool(hooks_mod.discover(ctx.paths, ctx.params))
    except NodeforgeError:
        return True  # the hooks step reports the error; until then the node stays drained


DOCKER_UNITS = ("containerd.service", "docker.service")
# The role step's `docker` detail when params turn dockerd off; `nodeforge verify` reads it to
# know what the node is meant to run (tests/infra/test_compute.py).
DOCKER_DISABLED = "disabled by params (docker: false)"


def start_docker(ctx: RoleContext) -> str:
    """Compute nodes run containers: dockerd + containerd, disabled at bake, started here."""
    if not ctx.params.docker:
        return DOCKER_DISABLED
    for unit in DOCKER_UNITS:
        ctx.host.systemctl("enable", unit)
        ctx.host.start(unit, timeout=ctx.params.wait_timeout)
    return "active"


def run(ctx: RoleContext) -> dict:
    # Docker first: a compute that cannot run containers must not register at all.
    docker = start_docker(ctx)
    # Drained at create when anything must pass before jobs: hooks, or the GPU health check
    # (expected_gpus); otherwise created in its final state (readiness.HELD_CREATED_FINAL).
    hooks = ctx.early.has_hooks() if ctx.early is not None else has_hooks(ctx)
    drain = hooks or ctx.params.expected_gpus is not None
    detail = start_slurmd(ctx, gate(ctx), INITIALIZING, RUNNING_HOOKS, drain=drain)
    detail["docker"] = docker
    return detail


def ready(ctx: RoleContext) -> dict:
    """The gate's last step: `node health` first, RESUME only if healthy (a sick node never
    goes idle; it stays drained with the health reason, which a later passing run clears).
    A node created in its final state (no hooks, no GPUs expected) was not drained: its
    health is checked all the same, and a failure drains it with the reason."""
    g = gate(ctx)
    rep = health.run(ctx.host, ctx.paths, slurm=False)
    if not rep.ok:
        g.drain(rep.reason)
        return {"slurm": f"kept drained ({rep.reason})"}
    return g.release(timeout=ctx.params.wait_timeout)


def verify(ctx: RoleContext) -> bool:
    docker_ok = not ctx.params.docker or all(ctx.host.is_active(u) for u in DOCKER_UNITS)
    return docker_ok and ctx.host.is_active("slurmd.service")
