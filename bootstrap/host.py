"""The side effects the agent has on its machine, behind one injectable object.

Role steps, munge, identity and the readiness gate call `host.run(...)` (default:
`nodeforge.proc.run`), `host.chown`, `host.sleep` and `host.monotonic`, so unit tests swap in a
recorder and check ORDER and idempotence without root, systemd or Slurm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeforge import proc
from nodeforge.errors import CommandError, NodeforgeError

Runner = Callable[..., subprocess.CompletedProcess]
# `systemctl is-active` states that it reports with exit status 0
ACTIVE_STATES = frozenset({"active", "reloading", "refreshing"})


def _chown(path: Path, user: str, group: str) -> None:
    shutil.chown(path, user, group)


def _source_address(target: str) -> str | None:
    """The local address the kernel would use to reach *target* (a UDP connect sends nothing)."""
    import socket

    fam = socket.AF_INET6 if ":" in target else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _sethostname(name: str) -> None:
    import socket

    socket.sethostname(name)


@dataclass
class Host:
    run: Runner = proc.run
    chown: Callable[[Path, str, str], None] = _chown
    sleep: Callable[[float], None] = time.sleep
    monotonic: Callable[[], float] = time.monotonic
    source_address: Callable[[str], str | None] = _source_address
    sethostname: Callable[[str], None] = _sethostname

    def ok(self, argv: Sequence[str], **kw: Any) -> bool:
        """True when the command exits 0 (never raises on a non-zero exit)."""
        try:
            cp = self.run(list(argv), check=False, **kw)
        except CommandError:  # timeout
            return False
        return cp.returncode == 0

    def wait_until(
        self,
        what: str,
        check: Callable[[], bool],
        *,
        timeout: float,
        interval: float = 1.0,
        hint: str = "",
    ) -> float:
        """Poll *check* until it is true; raise a NodeforgeError naming *what* after *timeout* s.

        Returns the seconds waited. Every wait in the agent goes through here, so none is unbounded.
        """
        start = self.monotonic()
        while True:
            if check():
                return self.monotonic() - start
            if self.monotonic() - start >= timeout:
                msg = f"{what} did not happen within {timeout:g}s"
                raise NodeforgeError(f"{msg}. {hint}".strip())
            self.sleep(interval)

    # -- systemd ------------------------------------------------------------------------------
    def systemctl(self, *args: str, timeout: float = 120) -> None:
        self.run(["systemctl", *args], timeout=timeout)

    def start(self, unit: str, timeout: float = 180, *, restart: bool = False) -> None:
        """Start *unit* (*restart*: also a running one, e.g. to read a new key)."""
        self.run(
            ["systemctl", "restart" if restart else "start", unit],
            timeout=timeout,
            hint=f"see `journalctl -u {unit}` and `systemctl status {unit}`",
        )

    def is_active(self, unit: str) -> bool:
        return self.ok(["systemctl", "is-active", "--quiet", unit], timeout=30)

    def active_units(self, units: Sequence[str]) -> dict[str, bool]:
        """Which of *units* are active, asked with ONE `systemctl is-active` (it prints one
        state per unit, in order): a process spawn less per extra unit on the path to ready.
        A timeout counts as not active (as in is_active); output that does not have one state
        per unit is not guessed at: then each unit is asked alone."""
        if len(units) < 2:
            return {u: self.is_active(u) for u in units}
        try:
            cp = self.run(["systemctl", "is-active", *units], check=False, timeout=30)
        except CommandError:  # timeout
            return dict.fromkeys(units, False)
        states = (cp.stdout or "").splitlines()
        if len(states) != len(units):
            return {u: self.is_active(u) for u in units}
        # is-active's exit status 0 stands for these (systemd: active or reloading)
        return {u: s.strip() in ACTIVE_STATES for u, s in zip(units, states, strict=True)}


def private_dir(path: Path) -> Path:
    """Create *path* (and parents) and make sure it is 0700, whatever it was before."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path
