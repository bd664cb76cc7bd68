"""`nodeforge node health`: is this node fit for jobs? Drains it if not, undrains its own drains.

Run by slurmd as HealthCheckProgram (every HealthCheckInterval s, params `health_interval`)
and by the readiness gate before RESUME, so a sick node never goes idle.

Every node: slurmd and munge active; the Enroot and Docker data directories below
`MAX_USED` full. GPU nodes (params `expected_gpus` set): NVML answers (`nvidia-smi`), the GPU
count equals expected_gpus, persistence mode is on, no uncorrectable (volatile) ECC errors,
and no new node-level XID in the kernel log since the last run (the cursor is the start time
of the previous run, kept in `XID_CURSOR`).

Drain rules (Slurm keeps one Reason per node):
- an XID drain is sticky: a later passing run does not clear it (the operator resumes);
- failure: drain with Reason="nodeforge-health: <check>: <detail>", unless the node is already
  drained by someone else (an operator's reason is never overwritten; it stays drained);
- success: resume the node only when its drain reason is ours ("nodeforge-health:"); the
  readiness gate's "nodeforge: ..." drains and everyone else's are left alone.
Bounded: each probe has a timeout and the whole run a budget; a run that exceeds it drains
with "timed out". Reports: health.json and nodeforge_health.prom in the gang metrics directory
(node_exporter's textfile collector).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from nodeforge.errors import CommandError, NodeforgeError
from nodeforge.fsutil import write_atomic

from .host import Host, private_dir
from .paths import Paths
from .readiness import NodeClient, from_record, reads_json
from .slurm_setup import read_features

log = logging.getLogger("nodeforge.health")

REASON_PREFIX = "nodeforge-health:"
GATE_PREFIX = "nodeforge:"  # the readiness gate's own drains (bootstrap/readiness.py)
MAX_USED = 0.95  # a data directory fuller than this fails the node
DATA_DIRS = (Path("/var/lib/enroot"), Path("/var/lib/docker"))
REPORT_DIR = Path("/var/lib/nodeforge/gang")  # gang metrics dir = node_exporter textfile dir
REPORT_JSON = "health.json"
REPORT_PROM = "nodeforge_health.prom"
XID_CURSOR = Path("/var/lib/nodeforge/health-xid-since")
# XIDs caused by the application, not the node (NVIDIA's XID catalogue: 13 graphics engine
# exception, 31 MMU fault, 43 channel stopped, 45 preemptive cleanup, 68/69 video/graphics
# engine errors). Every other XID means the GPU or the node needs attention.
APP_XIDS = frozenset({13, 31, 43, 45, 68, 69})
NVIDIA_SMI_QUERY = (
    "index,pci.bus_id,uuid,persistence_mode,ecc.errors.uncorrected.volatile.total,name"
)

# Check names (typed constants: they are Prometheus labels and drain reasons).
SLURMD, MUNGE, DISK, NVML, GPU_COUNT, PERSISTENCE, ECC, XID, TIMEOUT = (
    "slurmd",
    "munge",
    "disk",
    "nvml",
    "gpu_count",
    "persistence",
    "ecc",
    "xid",
    "timeout",
)
SERVICE_UNITS = ((SLURMD, "slurmd.service"), (MUNGE, "munge.service"))
# Actions on the Slurm node (typed constants, reported in health.json).
DRAINED, CLEARED, LEFT, NOTHING, UNREACHABLE, UNREADABLE = (
    "drained",
    "cleared",
    "left drained by someone else",
    "nothing",
    "slurmctld unreachable",
    "node record unreadable",  # scontrol answered, but not in Slurm's shape: nothing done
)

_BUS_RE = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]")
_UUID_RE = re.compile(r"GPU-[0-9a-fA-F-]{1,64}")
_XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]{1,20})\): (\d{1,4})\b")


class HealthError(NodeforgeError):
    """Unparseable probe output (it fails the check that ran the probe)."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Gpu:
    index: int
    bus_id: str
    uuid: str
    persistence: bool
    ecc_uncorrected: int | None  # None: ECC not supported/disabled ("[N/A]")
    name: str


@dataclass(frozen=True)
class Xid:
    bus_id: str
    code: int

    @property
    def node_fault(self) -> bool:
        return self.code not in APP_XIDS


@dataclass
class Config:
    expected_gpus: int | None = None  # None: not a GPU node, no GPU checks
    units: tuple[tuple[str, str], ...] = SERVICE_UNITS  # (check, unit) that must be active
    data_dirs: tuple[Path, ...] = DATA_DIRS
    max_used: float = MAX_USED
    probe_timeout: float = 10.0  # per command
    budget: float = 20.0  # whole run; beyond it the node is drained "timed out"
    report_dir: Path = REPORT_DIR
    xid_cursor: Path = XID_CURSOR


@dataclass
class Report:
    node: str
    started: float  # epoch s
    checks: list[Check] = field(default_factory=list)
    duration: float = 0.0
    gpus: int | None = None
    action: str = NOTHING

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def reason(self) -> str:
        # An XID comes first: its drain is sticky (see decide()), whatever else failed.
        bad = sorted((c for c in self.checks if not c.ok), key=lambda c: c.name != XID)
        if not bad:
            return ""
        text = f"{REASON_PREFIX} {bad[0].name}: {bad[0].detail}"
        if len(bad) > 1:
            text += f" (+{len(bad) - 1} more)"
        return clean(text, 200)


def clean(text: str, limit: int) -> str:
    """One printable line for a Slurm Reason / a log: probe output is not trusted."""
    text = "".join(ch if 32 <= ord(ch) < 127 and ch not in "\"'\\" else " " for ch in text)
    return " ".join(text.split())[:limit]


# -- parsers (recorded outputs in tests/fixtures/gpu/) ---------------------------------------
def parse_nvidia_smi(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv,noheader,nounits` lines."""
    gpus = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 6:
            raise HealthError(f"nvidia-smi line {n}: expected 6 fields, got {clean(line, 80)!r}")
        idx, bus, uuid, pers, ecc = parts[:5]
        name = ",".join(parts[5:]).strip()
        if not idx.isdigit() or int(idx) > 1024:
            raise HealthError(f"nvidia-smi line {n}: bad index {clean(idx, 20)!r}")
        if not _BUS_RE.fullmatch(bus) or not _UUID_RE.fullmatch(uuid):
            raise HealthError(f"nvidia-smi line {n}: bad bus id or uuid")
        if pers not in ("Enabled", "Disabled"):
            raise HealthError(f"nvidia-smi line {n}: bad persistence mode {clean(pers, 20)!r}")
        if ecc in ("[N/A]", "N/A", "[Not Supported]"):
            ecc_v = None
        elif ecc.isdigit() and len(ecc) <= 12:
            ecc_v = int(ecc)
        else:
            raise HealthError(f"nvidia-smi line {n}: bad ECC count {clean(ecc, 20)!r}")
        gpus.append(Gpu(int(idx), bus, uuid, pers == "Enabled", ecc_v, clean(name, 64)))
    return gpus


def parse_xids(text: str) -> list[Xid]:
    """XID events from kernel log lines ("NVRM: Xid (PCI:0000:18:00): 79, pid=...")."""
    return [Xid(m.group(1), int(m.group(2))) for m in _XID_RE.finditer(text)]


# -- checks ----------------------------------------------------------------------------------
@dataclass
class Checker:
    host: Host
    cfg: Config
    now: Callable[[], float] = time.time

    def services(self) -> list[Check]:
        out = []
        up = self.host.active_units([unit for _, unit in self.cfg.units])  # one systemctl
        for name, unit in self.cfg.units:
            out.append(Check(name, up[unit], "active" if up[unit] else f"{unit} is not active"))
        return out

    def disks(self) -> Check:
        full = []
        for d in self.cfg.data_dirs:
            try:
                st = os.statvfs(d)
            except FileNotFoundError:
                continue  # not on this node (e.g. docker: false)
            taken = st.f_blocks - st.f_bfree
            if taken + st.f_bavail <= 0:
                continue
            used = taken / (taken + st.f_bavail)  # what df calls Use% (root reserve excluded)
            if used >= self.cfg.max_used:
                full.append(f"{d} {used:.0%} full")
        return Check(DISK, not full, "; ".join(full) or "ok")

    def gpus(self) -> tuple[list[Check], int | None]:
        expected = self.cfg.expected_gpus
        assert expected is not None
        try:
            cp = self.host.run(
                ["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                check=False,
                timeout=self.cfg.probe_timeout,
            )
        except CommandError as exc:
            what = "timed out" if exc.returncode == -1 else "failed"
            return [
                Check(NVML, False, f"nvidia-smi {what} after {self.cfg.probe_timeout:g}s")
            ], None
        except NodeforgeError:  # MissingToolError: not a gpu image
            if expected == 0:
                return [Check(NVML, True, "no nvidia-smi, 0 GPUs expected")], 0
            return [Check(NVML, False, "nvidia-smi not installed (not a gpu image)")], None
        out = cp.stdout or ""
        if cp.returncode != 0:
            if expected == 0 and "No devices were found" in out:
                return [Check(NVML, True, "no GPUs"), Check(GPU_COUNT, True, "0 of 0")], 0
            first = out.strip().splitlines()[0] if out.strip() else f"exit {cp.returncode}"
            return [Check(NVML, False, f"nvidia-smi: {clean(first, 100)}")], None
        try:
            gpus = parse_nvidia_smi(out)
        except HealthError as exc:
            return [Check(NVML, False, str(exc))], None
        checks = [
            Check(NVML, True, f"{len(gpus)} GPUs answer"),
            Check(GPU_COUNT, len(gpus) == expected, f"{len(gpus)} of {expected} GPUs"),
        ]
        off = [g.bus_id for g in gpus if not g.persistence]
        checks.append(
            Check(
                PERSISTENCE, not off, f"persistence mode off on {', '.join(off)}" if off else "on"
            )
        )
        ecc = [f"{g.bus_id}={g.ecc_uncorrected}" for g in gpus if g.ecc_uncorrected]
        checks.append(
            Check(ECC, not ecc, f"uncorrectable ECC errors {', '.join(ecc)}" if ecc else "none")
        )
        return checks, len(gpus)

    def xids(self, since: float | None) -> Check:
        argv = ["journalctl", "-k", "-q", "--no-pager", "-o", "cat", "--grep", "NVRM: Xid"]
        argv += [f"--since=@{since:.0f}"] if since is not None else ["-b"]
        try:
            cp = self.host.run(argv, check=False, timeout=self.cfg.probe_timeout)
        except CommandError:
            return Check(XID, False, f"journalctl timed out after {self.cfg.probe_timeout:g}s")
        # journalctl --grep exits 1 when nothing matches.
        if cp.returncode not in (0, 1):
            return Check(XID, False, f"journalctl failed (exit {cp.returncode})")
        bad = [x for x in parse_xids(cp.stdout or "") if x.node_fault]
        if not bad:
            return Check(XID, True, "no new node-level XID")
        codes = sorted({f"{x.code}@{x.bus_id}" for x in bad})
        return Check(XID, False, f"XID {', '.join(codes[:4])}")


def _read_cursor(path: Path) -> float | None:
    try:
        v = float(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return v if math.isfinite(v) and 0 < v < 1e11 else None  # plausible epoch seconds


def run_checks(
    host: Host,
    cfg: Config,
    node: str,
    now: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> Report:
    """All checks, bounded by cfg.budget (a stuck check -> one failing "timeout" check)."""
    rep = Report(node=node, started=now())
    t0 = monotonic()
    current = {"check": "start"}
    done = threading.Event()
    result: dict[str, object] = {}

    def work() -> None:
        try:
            ck = Checker(host, cfg, now)
            checks: list[Check] = []
            current["check"] = "services"
            checks += ck.services()
            current["check"] = DISK
            checks.append(ck.disks())
            if cfg.expected_gpus is not None:
                current["check"] = NVML
                gpu_checks, count = ck.gpus()
                checks += gpu_checks
                result["gpus"] = count
                if count:
                    current["check"] = XID
                    checks.append(ck.xids(_read_cursor(cfg.xid_cursor)))
            result["checks"] = checks
        except Exception as exc:  # noqa: BLE001 - a crashing check fails the node, with what
            result["checks"] = [
                Check(
                    current["check"],
                    False,
                    f"check crashed: {type(exc).__name__}: {clean(str(exc), 80)}",
                )
            ]
        finally:
            done.set()

    # A daemon thread: a probe stuck in the kernel (a hung disk) cannot keep the run alive.
    threading.Thread(target=work, name="nodeforge-health", daemon=True).start()
    if not done.wait(cfg.budget):
        rep.checks = [
            Check(TIMEOUT, False, f"timed out after {cfg.budget:g}s (in {current['check']})")
        ]
    else:
        rep.checks = list(result.get("checks", []))  # type: ignore[call-overload]
        rep.gpus = result.get("gpus")  # type: ignore[assignment]
    rep.duration = round(monotonic() - t0, 3)
    if "checks" in result and done.is_set() and rep.gpus:
        # Completed: the next run looks only at newer XIDs (an XID drain is sticky instead).
        write_atomic(cfg.xid_cursor, f"{rep.started:.0f}\n", 0o644)
    return rep


# -- Slurm: drain / clear ---------------------------------------------------------------------
def decide(state: str, reason: str, healthy: bool) -> str:
    """What to do to a node in *state* (`IDLE+DRAIN+...`) with drain *reason* (pure,
    unit-tested). A reason the reader could not attribute (slurm_records.REASON_AMBIGUOUS)
    starts with neither prefix, so it is never taken for ours."""
    drained = "DRAIN" in state
    ours = reason.startswith(REASON_PREFIX)
    if healthy:
        # An XID drain is sticky: the XID is not "new" any more on the next run, but the GPU
        # still needs a look (reset or reboot); the operator resumes the node.
        sticky = reason.startswith(f"{REASON_PREFIX} {XID}:")
        return CLEARED if drained and ours and not sticky else NOTHING
    if drained and reason and reason != "none" and not ours and not reason.startswith(GATE_PREFIX):
        return LEFT  # an operator's (or anyone else's) drain: never overwritten
    return DRAINED


@dataclass
class HealthAction(NodeClient):
    """Drains or resumes this node after a health run. It reads the node through the readiness
    gate's own reader (readiness.NodeClient), so an operator's Reason or Comment text can
    neither pose as a state nor as our own drain."""

    timeout: float = 10.0

    def _env(self) -> dict[str, str] | None:
        # health may run before the agent wrote the client config: scontrol's default then
        return {"SLURM_CONF": str(self.client_conf)} if self.client_conf.exists() else None

    def apply(self, rep: Report) -> str:
        from nodeforge.slurm_records import SlurmDataError  # lazy, as in readiness

        try:
            rec = self.record()
        except CommandError:
            return UNREACHABLE
        except SlurmDataError as exc:
            log.error("node %s: cannot read its Slurm record, nothing done: %s", self.node, exc)
            return UNREADABLE
        if rec is None:  # scontrol failed, or slurmctld does not know the node
            return UNREACHABLE
        state = str(from_record(rec))
        action = decide(state, rec.reason, rep.ok)
        if action == DRAINED:
            if rec.reason == rep.reason and "DRAIN" in state:
                return DRAINED  # already drained with this reason
            args: tuple[str, ...] = (
                "update",
                f"NodeName={self.node}",
                "State=DRAIN",
                f"Reason={rep.reason}",
            )
        elif action == CLEARED:
            args = ("update", f"NodeName={self.node}", "State=RESUME")
        else:
            return action
        try:
            cp = self._scontrol(*args, check=False)
        except CommandError:
            return UNREACHABLE
        return action if cp.returncode == 0 else UNREACHABLE


# -- reports -------------------------------------------------------------------------------
def prometheus(rep: Report) -> str:
    lines = [
        "# HELP nodeforge_health_ok 1 when the last `nodeforge node health` run passed.",
        "# TYPE nodeforge_health_ok gauge",
        f"nodeforge_health_ok {int(rep.ok)}",
        "# HELP nodeforge_health_check_ok Result of each health check of the last run.",
        "# TYPE nodeforge_health_check_ok gauge",
        *(f'nodeforge_health_check_ok{{check="{c.name}"}} {int(c.ok)}' for c in rep.checks),
        "# HELP nodeforge_health_duration_seconds Duration of the last run.",
        "# TYPE nodeforge_health_duration_seconds gauge",
        f"nodeforge_health_duration_seconds {rep.duration:.3f}",
        "# HELP nodeforge_health_last_run_timestamp_seconds Start of the last run.",
        "# TYPE nodeforge_health_last_run_timestamp_seconds gauge",
        f"nodeforge_health_last_run_timestamp_seconds {rep.started:.0f}",
    ]
    if rep.gpus is not None:
        lines += [
            "# HELP nodeforge_health_gpus GPUs that answered NVML in the last run.",
            "# TYPE nodeforge_health_gpus gauge",
            f"nodeforge_health_gpus {rep.gpus}",
        ]
    return "\n".join(lines) + "\n"


def write_reports(rep: Report, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    body = asdict(rep) | {"ok": rep.ok, "reason": rep.reason}
    write_atomic(directory / REPORT_JSON, json.dumps(body, indent=2) + "\n", 0o644)
    write_atomic(directory / REPORT_PROM, prometheus(rep), 0o644)


def node_config(paths: Paths) -> tuple[str, Config]:
    """This node's name and expected_gpus from params.json (written by `node init`)."""
    try:
        raw = json.loads(paths.params_json.read_text())
    except FileNotFoundError:
        raise NodeforgeError(
            f"{paths.params_json}: missing; run `nodeforge node init` first"
        ) from None
    except json.JSONDecodeError as exc:
        raise NodeforgeError(f"{paths.params_json}: not valid JSON ({exc})") from exc
    node = raw.get("node") if isinstance(raw, dict) else None
    if not isinstance(node, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", node):
        raise NodeforgeError(f"{paths.params_json}: node: missing or not a node name")
    exp = raw.get("expected_gpus")
    if exp is not None and (
        isinstance(exp, bool) or not isinstance(exp, int) or not 0 <= exp <= 64
    ):
        raise NodeforgeError(f"{paths.params_json}: expected_gpus: expected an integer 0..64")
    root = paths.root
    cfg = Config(
        expected_gpus=exp,
        data_dirs=tuple(root / d.relative_to("/") for d in DATA_DIRS),
        report_dir=root / REPORT_DIR.relative_to("/"),
        xid_cursor=root / XID_CURSOR.relative_to("/"),
    )
    return node, cfg


def run(
    host: Host,
    paths: Paths,
    cfg: Config | None = None,
    *,
    slurm: bool = True,
    now: Callable[[], float] = time.time,
) -> Report:
    """One health run: checks, then (slurm) drain/clear, then the reports."""
    node, default_cfg = node_config(paths)
    # Before the checks: an image without its Slurm features file fails here, naming it.
    as_json = reads_json(read_features(paths).version_tuple) if slurm else False
    rep = run_checks(host, cfg or default_cfg, node, now=now)
    if slurm:
        rep.action = HealthAction(host, node, paths.slurm_client_conf, as_json).apply(rep)
    write_reports(rep, (cfg or default_cfg).report_dir)
    if not rep.ok:
        clear_stamp(paths)  # a sick node: no later wrapper run may take the fast path
        log.warning("node %s unhealthy: %s (%s)", node, rep.reason, rep.action)
    return rep


# -- the agent's pass stamp: slurmd's start-up run skips the Python check ---------------------
# slurmd runs HealthCheckProgram at its start, BEFORE it registers (Slurm 24.11 slurmd.c:
# run_script_health_check() before _registration_engine): a Python `node health` there cost
# ~0.145 s on every compute's path to ready (bench/README.md). The agent runs the same checks
# in-process just before it starts slurmd (precheck) and records a pass in a stamp; the
# wrapper (POSIX sh) exits 0 at once on a valid stamp and removes it, else runs the full check.
# Valid = a regular file owned by root in a root-owned, non-symlink directory below the
# agent's run dir (tmpfs: gone at reboot), naming this boot's boot_id, written less than
# STAMP_MAX_AGE s ago (CLOCK_BOOTTIME, /proc/uptime), and used at most once.
STAMP_MAX_AGE = 30
"""Seconds a pass vouches for slurmd's start-up run: the agent starts slurmd well under a
second after its check when the controller answers (a slow `systemctl restart` under load:
seconds); a stamp older than this (a long controller wait) only costs the full check. Far
below any sensible HealthCheckInterval, and single-use anyway, so periodic runs stay full."""
_BOOT_ID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def read_boot(paths: Paths) -> tuple[str, int] | None:
    """(boot_id, whole seconds since boot), or None when either is unreadable/odd."""
    try:
        boot = paths.boot_id.read_text().strip()
        up = float(paths.proc_uptime.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not _BOOT_ID_RE.fullmatch(boot) or not math.isfinite(up) or not 0 <= up < 1e9:
        return None
    return boot, int(up)


def clear_stamp(paths: Paths) -> None:
    paths.health_stamp.unlink(missing_ok=True)  # unlink never follows a symlink


def write_stamp(paths: Paths, boot: str, up: int) -> None:
    """Root-only: the directory is made 0700 and must be ours and no symlink, the file is
    written 0600 by the one atomic writer (mkstemp + rename: never through a symlink)."""
    d = paths.health_stamp.parent
    if d.is_symlink():
        raise HealthError(f"{d}: is a symlink; refusing to write the health stamp")
    private_dir(d)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise HealthError(f"{d}: not a private directory of uid {os.geteuid()}")
    write_atomic(paths.health_stamp, f"{boot} {up}\n", 0o600, skip_unchanged=False)


def precheck(host: Host, paths: Paths, *, now: Callable[[], float] = time.time) -> Report:
    """The compute role step's check before slurmd starts: every check but slurmd's own (it is
    not started yet; its start-up run is the one the stamp stands for). A pass writes the
    stamp; anything else leaves none (an earlier one is removed first). No reports: the ready
    step's full run writes them."""
    clear_stamp(paths)
    node, cfg = node_config(paths)
    boot = read_boot(paths)  # before the checks: the stamp's age counts from their start
    units = tuple(u for u in cfg.units if u[0] != SLURMD)
    rep = run_checks(host, replace(cfg, units=units), node, now=now)
    if not rep.ok:
        log.warning("node %s unhealthy before slurmd starts: %s", node, rep.reason)
    elif boot is None:
        log.warning("no boot id or uptime readable: no health stamp (slurmd runs the check)")
    else:
        try:
            write_stamp(paths, *boot)
        except (OSError, HealthError) as exc:  # no stamp: slurmd runs the full check
            log.warning("health stamp not written: %s", exc)
    return rep


FULL_CHECK = "/usr/local/bin/nodeforge node health --quiet"
HEALTH_WRAPPER = Path("/usr/local/sbin/nodeforge-health")


def wrapper_text(
    stamp: Path,
    boot_id: Path,
    proc_uptime: Path,
    full_check: str = FULL_CHECK,
    max_age: int = STAMP_MAX_AGE,
) -> str:
    """The HealthCheckProgram script (paths injectable for tests). Fork-free on the fast
    path but for `rm`; any doubt (missing, symlink, other owner, other boot, too old, odd
    text, rm failing) falls through to the full check."""
    named = {"d": stamp.parent, "s": stamp, "b": boot_id, "u": proc_uptime}
    q = {k: shlex.quote(str(v)) for k, v in named.items()}
    return (
        "#!/bin/sh\n# written by nodeforge node init: Slurm's HealthCheckProgram\n"
        "# slurmd runs it with an almost empty environment.\n"
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nexport PATH\n"
        "# Fast path (bootstrap/health.py, STAMP_MAX_AGE): the agent passed this node's checks\n"
        "# moments before it started slurmd; its stamp stands for slurmd's start-up run, once.\n"
        f"d={q['d']}\ns={q['s']}\n"
        'if [ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ] && [ -f "$s" ] && [ ! -L "$s" ] \\\n'
        f'  && [ -O "$s" ] && read -r sb st < "$s" && read -r b < {q["b"]} \\\n'
        f"  && read -r up _ < {q['u']}; then\n"
        "  up=${up%%.*}\n"
        '  case "$st" in\n'
        "  ''|*[!0-9]*|0?*|??????????*) ;;  # digits only, no octal, < 1e9\n"
        '  *) if [ "$sb" = "$b" ] && [ "$st" -le "$up" ] \\\n'
        f'      && [ "$up" -le $((st + {int(max_age)})) ] && rm -f -- "$s"; then exit 0; fi ;;\n'
        "  esac\nfi\n"
        f"exec {full_check}\n"
    )


def install_wrapper(paths: Paths) -> bool:
    """Slurm runs HealthCheckProgram without arguments: a wrapper on every slurmd node."""
    text = wrapper_text(paths.health_stamp, paths.boot_id, paths.proc_uptime)
    return write_atomic(paths.root / HEALTH_WRAPPER.relative_to("/"), text, 0o755)
