"""Gang governor configuration: `/etc/nodeforge/gang.yaml`, validated into typed dataclasses.

Knobs follow Kueue's `waitForPodsReady` (names in snake_case); defaults are documented in
docs/gang.md and are the dataclass defaults below. Unknown keys and wrong types are errors
that name the file and the key. It lives in the core, not in gang/, because the agent
validates a controller's `gang` params with it (and the agent never imports gang/).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeforge import scalars
from nodeforge.errors import NodeforgeError

DEFAULT_PATH = Path("/etc/nodeforge/gang.yaml")


class ConfigError(NodeforgeError):
    pass


@dataclass(frozen=True)
class Requeuing:
    timestamp: str = "eviction"  # eviction | creation: order of the admission queue
    backoff_base_seconds: float = 60.0
    backoff_max_seconds: float = 3600.0
    backoff_limit_count: int | None = None  # None = requeue forever
    # deactivate at a timeout this long after the gang's first admission; None = no limit
    backoff_limit_seconds: float | None = None
    # both limits set: deactivate when "any" of them is passed, or only when "all" are
    backoff_limit_combine: str = "any"
    jitter: float = 0.0001  # fraction: delay * (1 + jitter * u), u in [0, 1)


@dataclass(frozen=True)
class Gangs:
    min_nodes: int = 2  # jobs with at least this many nodes are gangs; 0 turns the rule off
    partitions: tuple[str, ...] = ()
    qos: tuple[str, ...] = ()
    comment_flag: str = ""  # a job whose Comment contains this token is a gang


@dataclass(frozen=True)
class Probe:
    # none | command (`nodeforge gang ready` marks the job) | collective (the same, after a
    # bounded all-reduce across the job's nodes: gang/collective.py)
    mode: str = "none"
    command: tuple[str, ...] = ()  # run on every node by `gang ready --local`
    timeout: float = 60.0
    # collective only: where every node listens, how much each all-reduce moves, thresholds
    port: int = 29571
    bytes: int = 4 * 1024 * 1024
    pings: int = 5
    min_bandwidth_mb_s: float = 0.0  # MB/s (10^6 bytes); 0 = not checked
    max_latency_ms: float = 0.0  # round trip; 0 = not checked
    transport: str = "auto"  # auto (NCCL's all_reduce_perf on GPU nodes when installed) | tcp


@dataclass(frozen=True)
class Deadlines:
    """Per-job readiness timeouts (docs/gang.md): a user asks with `<key>=<time>` in the job
    field the operator allows; the value is bounded by min/max_seconds."""

    field: str = "none"  # none | comment | extra: where users may ask (sbatch --comment/--extra)
    key: str = "nfg-timeout"
    min_seconds: float = 60.0
    max_seconds: float = 3600.0
    out_of_bounds: str = "refuse"  # refuse (the default timeout applies) | clamp


@dataclass(frozen=True)
class GangConfig:
    timeout: float = 300.0
    recovery_timeout: float = 0.0  # 0 (or false) disables; true = same as timeout
    block_admission: bool = False
    requeuing: Requeuing = field(default_factory=Requeuing)
    gangs: Gangs = field(default_factory=Gangs)
    probe: Probe = field(default_factory=Probe)
    deadlines: Deadlines = field(default_factory=Deadlines)
    not_requeueable: str = "record"  # record | cancel
    interval_seconds: float = 1.0
    command_timeout: float = 15.0
    state_file: str = "/var/lib/nodeforge/gang/state.json"
    event_log: str = "/var/log/nodeforge/gang-events.jsonl"
    metrics_file: str = "/var/lib/nodeforge/gang/metrics.prom"
    seed: int = 0  # jitter seed (jitter is a pure function of seed, job and attempt)
    # Node strikes (gang/strikes.py): a node that was not up when a gang timed out gets a
    # strike; this many within the window drain it. Off by default: a drain outlives the job
    # and only an operator undoes it, so turning it on is the operator's decision.
    node_strike_limit: int = 0
    node_strike_window_seconds: float = 3600.0
    # At most this many nodes drained by the governor at once (0 = no cap): a cluster-wide
    # blip (switch, controller network) must not turn into a cluster-wide drain.
    node_strike_max_drained: int = 10


# No leading zero: YAML 1.1 read `010` as 8, so a written 010 is ambiguous, not 10. ASCII
# digits only (a regex \d takes other scripts' digits too).
_DURATION = re.compile(r" *((?:0|[1-9][0-9]{0,11})(?:\.[0-9]{1,9})?) *(ms|s|m|h)? *")
_ENUMS = {
    "requeuing.timestamp": ("eviction", "creation"),
    "probe.mode": ("none", "command", "collective"),
    "probe.transport": ("auto", "tcp"),
    "not_requeueable": ("record", "cancel"),
    "requeuing.backoff_limit_combine": ("any", "all"),
    "deadlines.field": ("none", "comment", "extra"),
    "deadlines.out_of_bounds": ("refuse", "clamp"),
}
_DURATIONS = {
    "timeout",
    "recovery_timeout",
    "interval_seconds",
    "command_timeout",
    "requeuing.backoff_base_seconds",
    "requeuing.backoff_max_seconds",
    "probe.timeout",
    "node_strike_window_seconds",
    "requeuing.backoff_limit_seconds",
    "deadlines.min_seconds",
    "deadlines.max_seconds",
}
_COUNTS = (
    "min_nodes",
    "seed",
    "backoff_limit_count",
    "node_strike_limit",
    "node_strike_max_drained",
)


_DEADLINE_KEY = re.compile(r"[a-z][a-z0-9_-]{0,31}")
# probe.bytes: a number, or with a binary suffix; the all-reduce's vector is at most 256 MiB
_SIZE = re.compile(r" *(0|[1-9][0-9]{0,11}) *(KiB|MiB)? *")
MAX_PROBE_BYTES = 256 * 1024 * 1024
# (key, low, high, unit): bounded numbers of the collective probe
_BOUNDED = {
    "probe.port": (1024, 65535, "a TCP port"),
    "probe.pings": (1, 100, "a count"),
    "probe.min_bandwidth_mb_s": (0.0, 1e6, "MB/s"),
    "probe.max_latency_ms": (0.0, 60000.0, "milliseconds"),
}
MAX_SECONDS = 30 * 86400.0  # no duration knob makes sense beyond 30 days
MAX_COUNT = 10**9


def _duration(value: Any, where: str) -> float:
    forms = "expected seconds (a number, or '30s'/'5m'/'1h'/'250ms')"
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {forms}, got {value!r}")
    if isinstance(value, (int, float)):
        v = float(value)
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value)):
        v = float(m.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]
    else:
        # `5:00` and `010` reach here as text (nodeforge/strict_yaml.py): say why.
        note = scalars.yaml11_note(value) if isinstance(value, str) else None
        why = f" ({note})" if note else ""
        raise ConfigError(f"{where}: {forms}, got {value!r:.60}{why}")
    if not math.isfinite(v) or not 0 <= v <= MAX_SECONDS:
        raise ConfigError(
            f"{where}: must be a finite number of seconds in 0..{MAX_SECONDS:.0f}, got {value!r}"
        )
    return v


def _size(value: Any, where: str) -> int:
    forms = "expected bytes (an integer, or '512KiB'/'4MiB')"
    if isinstance(value, bool):
        raise ConfigError(f"{where}: {forms}, got {value!r}")
    if isinstance(value, int):
        v = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        v = int(m.group(1)) * {None: 1, "KiB": 1024, "MiB": 1024 * 1024}[m.group(2)]
    else:
        raise ConfigError(f"{where}: {forms}, got {value!r:.60}")
    if not 1 <= v <= MAX_PROBE_BYTES:
        raise ConfigError(f"{where}: must be 1..{MAX_PROBE_BYTES} bytes (256MiB), got {value!r}")
    return v


def _bounded(value: Any, where: str, key: str) -> Any:
    lo, hi, unit = _BOUNDED[key]
    integral = isinstance(lo, int) and isinstance(hi, int)
    ok_type = (int,) if integral else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integral else "a number"
        raise ConfigError(f"{where}: expected {kind} ({unit}) in {lo}..{hi:g}, got {value!r:.60}")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ConfigError(f"{where}: must be in {lo}..{hi:g} ({unit}), got {value!r}")
    return value if integral else float(value)


_PATH = re.compile(r"/(?:[A-Za-z0-9_.+@-]{1,255}/){0,31}[A-Za-z0-9_.+@-]{1,255}")
_PATH_KEYS = ("state_file", "event_log", "metrics_file")
# Slurm partition and QOS names (the same grammar as the params' partition names)
_SLURM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_COMMENT_FLAG = re.compile(r"[!-~]{0,64}")  # printable ASCII, no space: one Comment token
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
LIST_MAX = 64
ARG_MAX = 4096
_SECTIONS = {"requeuing": Requeuing, "gangs": Gangs, "probe": Probe, "deadlines": Deadlines}


def _show(v: Any) -> str:
    """A value in an error: its repr, cut to 60 characters (an error is one readable line)."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _strings(v: Any, name: str, where: str) -> tuple[str, ...]:
    """partitions / qos: Slurm names; probe.command: arguments (no control characters)."""
    if isinstance(v, str):
        v = [v] if name != "command" else v.split()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{where}: expected a list of strings, got {_show(v)}")
    if len(v) > LIST_MAX:
        raise ConfigError(f"{where}: {len(v)} items; at most {LIST_MAX}")
    for x in v:
        if name == "command":
            if not x or len(x) > ARG_MAX or _CONTROL.search(x):
                raise ConfigError(
                    f"{where}: {_show(x)} is not an argument (1-{ARG_MAX} characters, no "
                    "control characters)"
                )
        elif not _SLURM_NAME.fullmatch(x):
            raise ConfigError(
                f"{where}: {_show(x)} is not a Slurm {'QOS' if name == 'qos' else 'partition'} "
                "name ([A-Za-z0-9][A-Za-z0-9_.-], at most 64 characters)"
            )
    return tuple(v)


def _string(v: Any, key: str, where: str) -> str:
    if not isinstance(v, str) or (key != "gangs.comment_flag" and not v):
        raise ConfigError(f"{where}: expected a string, got {_show(v)}")
    if key == "gangs.comment_flag" and not _COMMENT_FLAG.fullmatch(v):
        raise ConfigError(
            f"{where}: one token of printable ASCII (no spaces), at most 64 characters, "
            f"got {_show(v)}"
        )
    if key == "deadlines.key" and not _DEADLINE_KEY.fullmatch(v):
        raise ConfigError(
            f"{where}: 1-32 characters of a-z, 0-9, '-' and '_', starting with a "
            f"letter, got {_show(v)}"
        )
    if key in _PATH_KEYS and (
        not _PATH.fullmatch(v) or len(v) > 4096 or any(p in (".", "..") for p in v.split("/"))
    ):
        raise ConfigError(
            f"{where}: an absolute path of letters, digits and _.+@- (no '.' or '..' "
            f"segments), got {_show(v)}"
        )
    return v


def _build(cls, data: Any, rel: str, src: str, outer: str):
    """*rel*: the section's prefix inside gang.yaml ("" or "requeuing."); *outer*: what comes
    before every key in an error ("" in gang.yaml, "gang." in node params)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        section = (outer + rel).rstrip(".") or "top level"
        raise ConfigError(f"{src}: '{section}' must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise ConfigError(
            f"{src}: unknown key(s) {', '.join(_show(outer + rel + k) for k in unknown[:5])}; "
            f"allowed here: {', '.join(sorted(fields))} (see docs/gang.md)"
        )
    kw: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key = rel + name
        where = f"{src}: '{outer}{key}'"
        v = data[name]
        sub = _SECTIONS.get(name) if not rel else None
        if sub is not None:
            kw[name] = _build(sub, v, name + ".", src, outer)
        elif key in _DURATIONS:
            if v is None and key == "requeuing.backoff_limit_seconds":
                kw[name] = None
                continue
            kw[name] = _duration(v, where)
        elif key == "probe.bytes":
            kw[name] = _size(v, where)
        elif key in _BOUNDED:
            kw[name] = _bounded(v, where, key)
        elif key in _ENUMS:
            if v not in _ENUMS[key]:
                raise ConfigError(
                    f"{where}: must be one of {', '.join(_ENUMS[key])}, got {_show(v)}"
                )
            kw[name] = v
        elif name in ("partitions", "qos", "command"):
            kw[name] = _strings(v, name, where)
        elif f.type in ("bool",):
            if not isinstance(v, bool):
                raise ConfigError(f"{where}: expected true or false, got {_show(v)}")
            kw[name] = v
        elif name in _COUNTS:
            if v is None and name == "backoff_limit_count":
                kw[name] = None
                continue
            try:
                kw[name] = scalars.integer(v, 0, MAX_COUNT)
            except scalars.ScalarError as exc:
                raise ConfigError(
                    f"{where}: expected a non-negative integer up to {MAX_COUNT}, "
                    f"got {_show(v)} ({exc})"
                ) from None
        elif name == "jitter":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ConfigError(f"{where}: expected a number between 0 and 1, got {_show(v)}")
            kw[name] = float(v)
        else:  # plain strings
            kw[name] = _string(v, key, where)
    return cls(**kw)


def from_dict(data: Any, src: str = "<config>", *, prefix: str = "") -> GangConfig:
    """Validate a gang.yaml mapping. *prefix* goes before every key an error names: the agent
    passes "gang." for the `gang` section of node params (`node.yaml: 'gang.timeout': ...`)."""
    if isinstance(data, dict) and isinstance(data.get("recovery_timeout"), bool):
        # `recovery_timeout: true` = on, as long as `timeout` (Kueue's default when enabled)
        on = data["recovery_timeout"]
        data = {**data, "recovery_timeout": data.get("timeout", GangConfig.timeout) if on else 0}
    cfg = _build(GangConfig, data, "", src, prefix)
    k = prefix
    if cfg.timeout <= 0:
        raise ConfigError(f"{src}: '{k}timeout' must be > 0 seconds, got {cfg.timeout}")
    if cfg.interval_seconds <= 0:
        raise ConfigError(f"{src}: '{k}interval_seconds' must be > 0, got {cfg.interval_seconds}")
    if cfg.node_strike_window_seconds <= 0:
        raise ConfigError(
            f"{src}: '{k}node_strike_window_seconds' must be > 0 seconds, "
            f"got {cfg.node_strike_window_seconds}"
        )
    r = cfg.requeuing
    if r.backoff_max_seconds < r.backoff_base_seconds:
        raise ConfigError(
            f"{src}: '{k}requeuing.backoff_max_seconds' ({r.backoff_max_seconds}) must be >= "
            f"'{k}requeuing.backoff_base_seconds' ({r.backoff_base_seconds})"
        )
    if r.backoff_limit_seconds is not None and r.backoff_limit_seconds <= 0:
        raise ConfigError(
            f"{src}: '{k}requeuing.backoff_limit_seconds' must be > 0 seconds (or null for no "
            f"limit), got {r.backoff_limit_seconds}"
        )
    d = cfg.deadlines
    if not 0 < d.min_seconds <= d.max_seconds:
        raise ConfigError(
            f"{src}: '{k}deadlines.min_seconds' ({d.min_seconds}) must be > 0 and <= "
            f"'{k}deadlines.max_seconds' ({d.max_seconds})"
        )
    if cfg.probe.mode == "collective" and cfg.probe.timeout <= 0:
        raise ConfigError(
            f"{src}: '{k}probe.timeout' must be > 0 seconds with probe.mode collective"
        )
    return cfg


def load(path: str | Path = DEFAULT_PATH, *, missing_ok: bool = True) -> GangConfig:
    import yaml

    from nodeforge import strict_yaml

    p = Path(path)
    if not p.exists():
        if missing_ok and p == DEFAULT_PATH:
            return GangConfig()
        raise ConfigError(f"{p}: config file not found (create it, or pass --config PATH)")
    try:
        with p.open("rb") as fh:  # one byte past the cap is enough to refuse it
            text = fh.read(strict_yaml.MAX_BYTES + 1).decode()
        data = strict_yaml.load(text)
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except strict_yaml.StrictYAMLError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    return from_dict(data, str(p))
