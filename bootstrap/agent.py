"""`nodeforge node init`: the first-boot agent, step by step, resumable.

Steps: params → identity → munge → role → hooks → ready. Each is recorded in state.json with
start/end/duration/status/error. On a rerun (a reboot, or the operator after a fix) a step that
is done is verified cheaply and skipped; `params` and `ready` always run (both are cheap and
must reflect this boot). The agent starts the Slurm daemons itself every boot (they are not
enabled), so the readiness gate is applied again before slurmd comes back after a reboot.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from nodeforge import redact
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import restrict_mode, write_atomic

from . import identity, metrics, munge
from .host import Host
from .node_roles import Early, RoleContext
from .params import Params, ParamsError, is_ip, unusable_address
from .params_sources import Loaded, SourceConfig, load_params
from .paths import Paths
from .readiness import Gate
from .rejoin import CONTROLLER_AWAY, ControllerAway
from .slurm_setup import SlurmFeatures, read_features
from .state import State, now, uptime

log = logging.getLogger("nodeforge.agent")

# Only this node's role module is imported (start-up time: see bench/README.md, node section).
ROLE_MODULES = ("controller", "compute", "login")


def role_module(role: str) -> ModuleType:
    if role not in ROLE_MODULES:
        raise NodeforgeError(f"role: {role!r} is not one of {', '.join(ROLE_MODULES)}")
    return importlib.import_module(f"{__package__}.node_roles.{role}")


def restrict_outputs(paths: Paths) -> None:
    """Narrow what holds params or errors to root-only: state.json, the params copy and the
    logs under the log directory (an older agent, or a tool, may have left them wider)."""
    for d in (paths.state_file.parent, paths.log_dir, paths.hooks_log_dir):
        restrict_mode(d, 0o700)
    for f in (paths.state_file, paths.params_json):
        restrict_mode(f, 0o600)
    for d in (paths.log_dir, paths.hooks_log_dir):
        try:
            names = sorted(os.listdir(d))[:LOGS_MAX]
        except OSError:
            continue
        for name in names:
            if name.endswith(".log"):
                restrict_mode(d / name, 0o600)


LOGS_MAX = 4096  # log files narrowed per directory (bounded: a directory may be huge)


class StepFailed(NodeforgeError):
    exit_code = 1


class Stopped(NodeforgeError):
    """SIGTERM while `node init` ran: systemd's start bound of nodeforge-init.service
    (TimeoutStartSec, roles/node_agent) was reached, or someone stopped the unit."""

    def __init__(self, signum: int):
        super().__init__(
            f"stopped by {signal.Signals(signum).name} (nodeforge-init.service start bound "
            "TimeoutStartSec reached, or the unit was stopped)"
        )


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While `node init` runs, SIGTERM fails the current step (Stopped) instead of killing the
    process outright: the step records the reason, a compute/login node is left drained with
    it, the hook being run is stopped with everything it started (contain.run_group), and the unit
    ends failed. Only the first SIGTERM: the drain that follows must not be cut short."""

    def stop(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_IGN)
        raise Stopped(signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@dataclass
class Agent:
    paths: Paths = field(default_factory=Paths)
    host: Host = field(default_factory=Host)
    sources: SourceConfig | None = None
    hostname: Callable[[], str] = socket.gethostname
    hook_sleep: Callable[[float], None] | None = None
    hook_grace: float = 5.0

    # filled while running
    state: State = field(init=False)
    loaded: Loaded | None = field(init=False, default=None)
    features: SlurmFeatures | None = field(init=False, default=None)
    node: str = field(init=False, default="")
    address: str = field(init=False, default="")
    early: Early | None = field(init=False, default=None)
    # steps an earlier run left "running": it was killed or the power was cut mid-step
    interrupted: frozenset[str] = field(init=False, default=frozenset())

    @property
    def params(self) -> Params:
        assert self.loaded is not None
        return self.loaded.params

    # -- main ---------------------------------------------------------------------------------
    def init(self) -> State:
        restrict_outputs(self.paths)
        self.state = State.load(self.paths.state_file)
        st = self.state
        self.interrupted = frozenset(n for n, r in st.steps.items() if r.status == "running")
        t0 = now()
        st.first_started = st.first_started or t0
        st.last_started = t0
        st.boots += 1
        st.status, st.last_error, st.retry = "running", None, None
        self._save()
        self.paths.rejoin_wanted.unlink(missing_ok=True)
        try:
            self._step("params", self._params, always=True)
            self._step("identity", self._identity, verify=self._identity_ok)
            self._start_early()
            self._step("munge", self._munge, verify=self._munge_ok)
            self._step("role", self._role, verify=self._role_ok)
            self._step("hooks", self._hooks, verify=lambda: True)
            self._step("ready", self._ready, always=True)
        except Exception:  # StepFailed, or a crash already logged with its traceback
            st.status = "failed"
            self._save(durable=True)
            self._write_outcome_metric()
            raise
        finally:
            if self.early is not None:  # joined (also on failure): no thread outlives init
                self.early.join()
                self.early = None  # this run's: never handed to a later run
        st.status = "ready"
        st.ready_at = st.steps["ready"].ended
        if st.time_to_ready is None and st.ready_at and st.first_started:
            # first readiness only (first `node init` -> ready); reboots: uptime_at_ready
            st.time_to_ready = round(st.ready_at - st.first_started, 3)
        st.uptime_at_ready = uptime(self.paths.root / "proc")
        self._save(durable=True)
        self._write_outcome_metric()
        return st

    def _write_outcome_metric(self) -> None:
        """nodeforge_bootstrap_failed{step} for node_exporter (failures.py); best effort: a
        metric that cannot be written never changes the node's outcome. Not when the params
        step failed: bad params write nothing but state.json, and where node_exporter serves
        is itself a param (metrics.env), so nothing would serve it."""
        from . import failures

        if self.loaded is None:
            return
        try:
            d = self.paths.textfile_dir
            d.mkdir(parents=True, exist_ok=True)
            write_atomic(d / failures.PROM_FILE, failures.prometheus(self.state.to_dict()), 0o644)
        except OSError as exc:
            log.warning("bootstrap metric not written (%s)", exc)

    def _save(self, *, durable: bool = False) -> None:
        """Progress records are atomic but not fsynced (two fsyncs per save, ~14 saves on the
        path to ready); the outcome (ready or failed) is durable. A power cut in between
        brings an older record back, and `node init` then runs a step again (every step is
        resumable)."""
        self.state.save(self.paths.state_file, durable=durable)

    def _step(
        self,
        name: str,
        fn: Callable[[], dict[str, Any] | None],
        *,
        verify: Callable[[], bool] | None = None,
        always: bool = False,
    ) -> None:
        rec = self.state.steps[name]
        if not always and rec.status in ("done", "skipped") and verify is not None:
            t0 = now()
            try:
                ok = verify()
            except NodeforgeError as exc:
                log.info("step %s: verify failed (%s); running it again", name, exc)
                ok = False
            if ok:
                # This run's record: the cheap verification (so durations add up to this run).
                rec.status, rec.error = "skipped", None
                rec.started, rec.ended = t0, now()
                rec.duration = round(rec.ended - t0, 3)
                self._save()
                log.info("step %s: done before, verified, skipped", name)
                return
        self.state.begin(name, now())
        self._save()
        log.info("step %s: start", name)
        try:
            detail = fn() or {}
        except StepFailed:
            raise  # already recorded by the step itself
        except NodeforgeError as exc:
            away = isinstance(exc, ControllerAway)  # outside Slurm: `node rejoin` retries it
            if away:
                self.state.retry = CONTROLLER_AWAY
            self._fail(name, str(exc))
            if away:
                write_atomic(self.paths.rejoin_wanted, f"{CONTROLLER_AWAY}\n", 0o600)
            raise StepFailed(f"step {name} failed: {exc}") from exc
        except Exception as exc:
            import traceback  # only on a crash

            log.error("step %s crashed:\n%s", name, redact.text(traceback.format_exc()))
            self._fail(name, f"{type(exc).__name__}: {exc}")
            raise
        rec.detail = detail
        self.state.end(name, now())
        self._save()
        log.info("step %s: done in %.2fs", name, rec.duration or 0.0)

    def _fail(self, name: str, error: str, reason: str | None = None) -> None:
        # A crash's message is not a NodeforgeError's (redacted when made): redact it here, as
        # it goes to state.json, the log and the drain reason.
        error = redact.text(error)
        reason = redact.text(reason) if reason is not None else None
        self.state.end(name, now(), "failed", error)
        self._save(durable=True)
        log.error("step %s failed: %s", name, error)
        if self.loaded is not None and name in ("role", "hooks", "ready"):
            first = error.strip().splitlines()[0] if error.strip() else "error"
            self._drain(reason or f"{name} step failed: {first}")

    def _drain(self, reason: str) -> None:
        """Leave a compute/login node drained with *reason* (best effort, never raises)."""
        if self.loaded is None or self.params.role == "controller":
            return
        if not self.paths.slurm_client_conf.exists():
            return  # the node was never announced to slurmctld: it cannot get a job
        Gate(self.host, self.node, self.paths.slurm_client_conf, timeout=15).fail(reason)

    # -- steps --------------------------------------------------------------------------------
    def _params(self) -> dict:
        cfg = self.sources or SourceConfig(self.paths)
        self.loaded = load_params(cfg)
        p = self.params
        st = self.state
        if st.role and st.role != p.role:
            raise NodeforgeError(
                f"{self.loaded.source}: role: this node was initialised as {st.role!r} and params "
                f"now say {p.role!r}; a node does not change role. Boot a fresh copy of the image "
                f"(or, to start over on purpose, remove {self.paths.state_file})"
            )
        self.features = read_features(self.paths)
        current = self.hostname()
        self.node = identity.node_name(p, current)
        self._refuse_local_broadcast()
        self.address = self._address()
        st.role, st.node, st.cluster, st.source = (
            p.role,
            self.node,
            p.cluster_name,
            self.loaded.source,
        )
        self.paths.params_json.parent.mkdir(parents=True, exist_ok=True)
        public = p.public_dict() | {
            "node": self.node,
            "address": self.address,
            "source": self.loaded.source,
            "slurm_version": self.features.slurm_version,
        }
        if p.users_keypair is not None:
            # hooks get the PATH of the root-only private key, never the key itself
            public["users_keypair_file"] = str(identity.users_keypair_paths(self.paths)[0])
        write_atomic(self.paths.params_json, json.dumps(public, indent=2) + "\n", 0o600)
        detail = {
            "source": self.loaded.source,
            "role": p.role,
            "node": self.node,
            "address": self.address,
            "metrics": metrics.apply(self.host, self.paths, p.metrics_listen, self.address),
        }
        if p.gang is not None and p.role != "controller":
            # validated (a shared params document fails everywhere), used by the controller
            detail["gang"] = "ignored: only the controller runs the gang governor"
            log.info("params: gang ignored on a %s (only the controller uses it)", p.role)
        return detail

    def _refuse_local_broadcast(self) -> None:
        """A controller address that is the broadcast address of one of this node's subnets
        (the prefix params cannot know). The kernel refuses a UDP connect to it
        (EACCES), so the route probe comes back empty; only then are the subnets read (no
        cost on the path to ready)."""
        p = self.params
        addr = p.controller.address if p.role != "controller" else ""
        if not addr or not is_ip(addr) or ":" in addr or self.host.source_address(addr):
            return  # no IPv4 controller address, or one the kernel routes to one host
        why = unusable_address(addr, identity.local_networks(self.host))
        if why is not None:
            source = self.loaded.source if self.loaded else "params"
            raise ParamsError(f"{source}: controller.address: {addr} is {why}")

    def _address(self) -> str:
        p = self.params
        if p.node_address:
            return p.node_address
        if p.role == "controller" and p.controller.address:
            return p.controller.address
        target = p.controller.address if p.role != "controller" else ""
        return identity.detect_address(self.host, target)

    def _hosts(self) -> dict[str, str]:
        p = self.params
        out: dict[str, str] = {}
        if p.controller.host and p.controller.address and p.role != "controller":
            out[p.controller.host] = p.controller.address
        if self.address and (p.node_address or p.role == "controller"):
            out[self.node] = self.address
        return out

    def _identity(self) -> dict:
        done = identity.run(self.host, self.paths, self.params, self.hostname(), self._hosts())
        assert self.loaded is not None
        added = identity.install_admin_keys(self.paths, self.loaded.ssh_keys)
        if added:
            done["admin_keys"] = len(added)  # how many, never the keys themselves
        return done

    def _identity_ok(self) -> bool:
        return identity.verify(self.paths, self.params, self.hostname(), self._hosts())

    def _munge(self) -> dict:
        return munge.run(
            self.host, self.paths, self.params, self.loaded.source if self.loaded else ""
        )

    def _munge_ok(self) -> bool:
        return munge.verify(
            self.host, self.paths, self.params, self.loaded.source if self.loaded else ""
        )

    def _ctx(self) -> RoleContext:
        assert self.features is not None
        return RoleContext(
            self.host, self.paths, self.params, self.features, self.node, self.address,
            self.early,
        )  # fmt: skip

    def _start_early(self) -> None:
        """Start the role step's work that needs neither munged nor the controller (a
        compute's `slurmd -C`: node_roles `early`) before the munge step, when the role step
        is to run. The munge step's `systemctl start|restart munge` waits for munged's start
        (0.04-0.1 s, measured); this runs beside that wait instead of after it
        (bench/README.md, branch readyfloor)."""
        if self.state.steps["role"].status in ("done", "skipped"):
            return  # a resumed node: the role step is most likely verified and skipped
        try:
            start = getattr(role_module(self.params.role), "early", None)
            if start is not None:
                self.early = start(self._ctx())
        except Exception as exc:  # noqa: BLE001 - outside any step: the role step does the work
            log.warning("role work before munge not started (%s); the role step does it", exc)
            self.early = None

    def _role(self) -> dict:
        detail = role_module(self.params.role).run(self._ctx())
        detail["role"] = self.params.role
        return detail

    def _role_ok(self) -> bool:
        return role_module(self.params.role).verify(self._ctx())

    def _hooks(self) -> dict:
        from . import hooks as hooks_mod  # urllib & co.: only when the hooks step runs

        p = self.params
        try:
            hooks = hooks_mod.discover(self.paths, p)
        except hooks_mod.HookError as exc:  # a refused hook: none runs, the reason drains
            self._fail("hooks", str(exc), reason=str(exc).splitlines()[0])
            raise StepFailed(f"step hooks failed: {exc}") from exc
        results: list[dict[str, Any]] = []
        if "hooks" in self.interrupted:
            # the killed run's hook may still run (its scope outlives the agent): stop it
            # before running the hooks again, never two copies of a hook at once
            hooks_mod.stop_leftovers(self.host)
            # hooks that succeeded in the interrupted run are not run again (as after a
            # reboot once the step is done: extensions/README.md); the one cut off runs again
            prev = self.state.steps["hooks"].detail.get("results") or []
            ok = {r["name"]: r for r in prev if isinstance(r, dict) and r.get("status") == "ok"}
            results = [{**ok[h.name], "resumed": True} for h in hooks if h.name in ok]
            hooks = [h for h in hooks if h.name not in ok]
        controller_name = p.controller.target if p.role != "controller" else self.node

        def record(res: Any) -> None:  # hooks_mod.HookResult
            results.append(
                {
                    "name": res.name,
                    "status": res.status,
                    "attempts": res.attempts,
                    "exit": res.exit_code,
                    "signal": res.signal,
                    "duration": round(res.duration, 3),
                    "log": res.log,
                }
            )
            self.state.steps["hooks"].detail["results"] = results
            self._save()

        runner = hooks_mod.Runner(
            self.paths,
            hooks_mod.HookEnv(
                p.role, p.cluster_name, self.node, controller_name, self.paths.params_json
            ),
            sleep=self.hook_sleep or self.host.sleep,
            backoff=p.hook_backoff,
            backoff_max=p.hook_backoff_max,
            grace=self.hook_grace,
            on_result=record,
            output_max=p.hook_output_max,
        )
        report = runner.run_all(hooks)
        failure = report.failure
        if failure is not None:
            self.state.steps["hooks"].detail["results"] = results
            self._fail("hooks", failure.reason + f"; see {failure.log}", reason=failure.reason)
            raise StepFailed(f"step hooks failed: {failure.reason}; see {failure.log}")
        return {"results": results, "count": len(results)}

    def _ready(self) -> dict:
        p = self.params
        if p.role == "compute":
            return role_module("compute").ready(self._ctx())  # node health, then RESUME
        if p.role == "login" and not role_module("login").uses_sackd(self._ctx()):
            return {"slurm": "kept drained (login node)"}
        return {}
