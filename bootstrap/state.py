"""The agent's record of what it did: /var/lib/nodeforge/state.json.

Written atomically after every change, so a crash or reboot mid-step leaves a readable file; the
next `nodeforge node init` resumes: completed steps are verified cheaply and skipped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nodeforge import redact
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic

STEPS = ("params", "identity", "munge", "role", "hooks", "ready")
VERSION = 1
MODE = 0o600  # state.json holds errors: root-only (a wider file is narrowed on the next save)


@dataclass
class StepRecord:
    status: str = "pending"  # pending | running | done | failed | skipped
    started: float | None = None  # wall clock (epoch s)
    ended: float | None = None
    duration: float | None = None  # seconds, of the run that produced `status`
    error: str | None = None
    runs: int = 0  # how many times the step really ran (not counting verified skips)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class State:
    version: int = VERSION
    role: str | None = None
    node: str | None = None
    cluster: str | None = None
    source: str | None = None
    boots: int = 0
    first_started: float | None = None  # first `node init` on this node (epoch s)
    last_started: float | None = None
    ready_at: float | None = None  # last time this node became ready
    time_to_ready: float | None = None  # first readiness: ready_at - first_started
    uptime_at_ready: float | None = None  # seconds from this boot (PID 1 start) to ready
    status: str = "new"  # new | running | ready | failed
    last_error: str | None = None
    # Set with a failure `nodeforge node rejoin` retries (bootstrap/rejoin.py CONTROLLER_AWAY).
    retry: str | None = None
    steps: dict[str, StepRecord] = field(default_factory=lambda: {s: StepRecord() for s in STEPS})

    @classmethod
    def load(cls, path: Path) -> State:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, json.JSONDecodeError) as exc:
            raise NodeforgeError(
                f"{path}: unreadable state ({exc}); move it aside to start over: "
                f"mv {path} {path}.bad"
            ) from exc
        steps = {s: StepRecord() for s in STEPS}
        for name, rec in (raw.pop("steps", None) or {}).items():
            if name in steps and isinstance(rec, dict):
                known = {k: v for k, v in rec.items() if k in StepRecord.__dataclass_fields__}
                steps[name] = StepRecord(**known)
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(steps=steps, **known)

    def save(self, path: Path, *, durable: bool = True) -> None:
        # Root-only and redacted: it records errors, and an error may quote a value from params.
        text = json.dumps(redact.obj(self.to_dict()), indent=2, sort_keys=False) + "\n"
        write_atomic(path, text, MODE, durable=durable)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- transitions ------------------------------------------------------------------------
    def begin(self, name: str, now: float) -> None:
        rec = self.steps[name]
        rec.status, rec.started, rec.ended, rec.duration, rec.error = (
            "running",
            now,
            None,
            None,
            None,
        )
        rec.runs += 1

    def end(self, name: str, now: float, status: str = "done", error: str | None = None) -> None:
        rec = self.steps[name]
        rec.status, rec.ended, rec.error = status, now, error
        rec.duration = round(now - rec.started, 3) if rec.started is not None else None
        if error:
            self.last_error = f"{name}: {error}"


def now() -> float:
    return round(time.time(), 3)


def uptime(proc: Path = Path("/proc")) -> float | None:
    """Seconds since this machine booted: since PID 1 started, so that a container (whose
    /proc/uptime is the host's) reports its own boot, and a VM its kernel's."""
    import os

    try:
        up = float((proc / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        stat = (proc / "1/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return round(up - start_ticks / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return round(up, 3)
