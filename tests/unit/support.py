"""Helpers and fixture values the unit tests share (imported as tests.unit.support; the pytest
fixtures are in conftest.py beside it). Test modules import these, never each other."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from nodeforge.bootstrap.params import Params, parse_params

REPO = Path(__file__).resolve().parents[2]
ROLES_DIR = REPO / "roles"

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


def _trusted(v: Any) -> Any:
    """Role defaults are templates themselves (paths built from others): trusted as such."""
    from ansible.template import trust_as_template

    if isinstance(v, str):
        return trust_as_template(v)
    if isinstance(v, list):
        return [_trusted(x) for x in v]
    if isinstance(v, dict):
        return {k: _trusted(x) for k, x in v.items()}
    return v


def ansible_render(role: str, template: str, extra: dict | None = None) -> str:
    """Render a bake-time template the way Ansible does, with the role's defaults."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    defaults = yaml.safe_load((ROLES_DIR / role / "defaults/main.yml").read_text())
    variables = _trusted(defaults or {})
    variables.update(extra or {})
    variables.setdefault("ansible_managed", "Ansible managed")
    templar = Templar(loader=DataLoader(), variables=variables)
    source = (ROLES_DIR / role / "templates" / template).read_text()
    return templar.template(trust_as_template(source))


def fake_vm_runner(argv, **kw):
    """proc.run for the VM harness without qemu-img / ssh-keygen (fake overlay and key)."""
    if Path(argv[0]).name == "qemu-img":
        Path(argv[-1]).write_bytes(b"overlay")
        return None
    if argv[0] == "ssh-keygen":
        k = Path(argv[argv.index("-f") + 1])
        k.write_text("priv")
        k.with_suffix(".pub").write_text("ssh-ed25519 AAAA fake\n")
        return None
    from nodeforge import proc

    return proc.run(argv, **kw)
