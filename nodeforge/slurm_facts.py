"""Slurm facts shared by the agent, the lab and the roles.

- The one table of version thresholds (slurm_versions.json next to this file; the slurm role
  reads the same file), so "which Slurm has X" is answered in one place for Python and Jinja.
- The one controller ping (`scontrol ping`), wherever it has to run.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from .errors import MissingToolError, NodeforgeError

THRESHOLDS_FILE = Path(__file__).with_name("slurm_versions.json")
_RELEASE = re.compile(r"(\d{1,4})\.(\d{1,4})")


def version_tuple(version: str | tuple[int, ...]) -> tuple[int, ...]:
    """(major, minor, micro) of a Slurm version string such as "24.11.5" or "22.05.8-1"."""
    if isinstance(version, tuple):
        return version
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if "0" <= ch <= "9")  # str.isdigit takes '²' too
        out.append(int(digits or 0))
    return tuple(out)


@functools.cache
def thresholds() -> dict[str, tuple[int, int]]:
    """feature -> first (major, minor) that has it, from slurm_versions.json."""
    raw = json.loads(THRESHOLDS_FILE.read_text())
    out: dict[str, tuple[int, int]] = {}
    for key, value in raw.items():
        if key.startswith("_"):
            continue
        m = _RELEASE.fullmatch(value) if isinstance(value, str) else None
        if m is None:
            raise NodeforgeError(f'{THRESHOLDS_FILE}: {key}: expected a release like "23.02"')
        out[key] = (int(m.group(1)), int(m.group(2)))
    return out


def has(version: str | tuple[int, ...], feature: str) -> bool:
    """True when Slurm *version* has *feature* (a key of slurm_versions.json)."""
    return version_tuple(version) >= thresholds()[feature]


@functools.cache
def releases() -> tuple[tuple[int, int], ...]:
    """Slurm's major releases in order (slurm_versions.json `_releases`)."""
    raw = json.loads(THRESHOLDS_FILE.read_text()).get("_releases") or []
    out = []
    for value in raw:
        m = _RELEASE.fullmatch(value) if isinstance(value, str) else None
        if m is None:
            raise NodeforgeError(f'{THRESHOLDS_FILE}: _releases: expected releases like "23.02"')
        out.append((int(m.group(1)), int(m.group(2))))
    return tuple(out)


def talks_to(controller: str, daemon: str) -> str | None:
    """None when a slurmctld of release *controller* accepts a slurmd of release *daemon*;
    else why not, naming both versions."""
    known = releases()
    c, d = version_tuple(controller)[:2], version_tuple(daemon)[:2]
    for v, text in ((c, controller), (d, daemon)):
        if v not in known:
            first, last = known[0], known[-1]
            return (
                f"Slurm {text} is not a release nodeforge knows "
                f"({first[0]}.{first[1]:02d} .. {last[0]}.{last[1]:02d})"
            )
    gap = known.index(c) - known.index(d)
    if gap < 0:
        return f"slurmd {daemon} is newer than slurmctld {controller}; upgrade the controller first"
    if gap > 2:
        return (
            f"slurmd {daemon} is {gap} releases older than slurmctld {controller}; Slurm supports "
            "the two previous releases only"
        )
    return None


def controller_up(run: Callable[[list[str]], subprocess.CompletedProcess]) -> bool:
    """True when `scontrol ping` says slurmctld is UP.

    *run* runs the argv where it has to (the agent's host with its client config, a node of
    the local cluster) and returns without raising on the exit status. A timeout or a node
    that cannot be entered counts as "not up yet"; a missing tool is raised, not waited on.
    """
    try:
        cp = run(["scontrol", "ping"])
    except MissingToolError:
        raise
    except NodeforgeError:
        return False
    return cp.returncode == 0 and " is UP" in (cp.stdout or "")
