"""Helpers and fixture values the unit tests share (imported as tests.unit.support; the pytest
fixtures are in conftest.py beside it). Test modules import these, never each other."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

from nodeforge.bootstrap.params import Params, parse_params

# Fixture: a munge key as params carry it (base64 of 64 bytes, over munge's 32-byte minimum).
MUNGE_KEY = base64.b64encode(b"k" * 64).decode()

# Fixture: the smallest params of a compute node for the hook tests (no hook retries, so a
# failing hook fails at once).
HOOK_PARAMS: dict[str, object] = {
    "role": "compute",
    "cluster_name": "demo",
    "controller": "ctl",
    "munge_key": MUNGE_KEY,
    "hook_retries": 0,
}


def hook_params(**kw: object) -> Params:
    """HOOK_PARAMS with *kw* over them, parsed as the agent parses a params document."""
    return parse_params({**HOOK_PARAMS, **kw}, "test")


def run_cli(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`python -m nodeforge ARGS` in a child process, as a user runs it (output captured,
    the exit status left to the caller to assert)."""
    return subprocess.run(
        [sys.executable, "-m", "nodeforge", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env if env is not None else dict(os.environ),
        timeout=timeout,
        check=False,
    )
