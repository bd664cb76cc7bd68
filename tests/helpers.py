"""Helpers shared by the tests (imported as tests.helpers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

E2E_ROOT = Path(os.environ.get("NODEFORGE_E2E_DIR", "/var/tmp/nodeforge-e2e"))
REPO = Path(__file__).resolve().parents[1]
BUILD_TOOLS = (
    "packer",
    "mmdebstrap",
    "systemd-nspawn",
    "mkfs.ext4",
    "qemu-img",
    "ssh-keygen",
    "zstd",
    "dpkg-deb",
    "ip",
    "nsenter",
)


def nodeforge(
    *args: str, timeout: float = 3600, check: bool = True, **kw
) -> subprocess.CompletedProcess:
    cp = subprocess.run(
        [sys.executable, "-m", "nodeforge", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        **kw,
    )
    if check and cp.returncode != 0:
        pytest.fail(
            f"nodeforge {' '.join(args)} exited {cp.returncode}\nstdout:\n{cp.stdout}\n"
            f"stderr:\n{cp.stderr[-6000:]}",
            pytrace=False,
        )
    return cp


def build_image(output: Path, mirror: Path, versions: Path, *extra: str) -> tuple[dict, float]:
    t0 = time.monotonic()
    cp = nodeforge(
        "build",
        "--artifact-mirror",
        str(mirror),
        "--versions-file",
        str(versions),
        "--output",
        str(output),
        "--json",
        *extra,
    )
    return json.loads(cp.stdout), time.monotonic() - t0


def process_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may linger where PID 1 does not reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def qemu_image_manifest(**phases: float) -> dict:
    """An image manifest as the qemu target writes it before the disk seal (test input)."""
    return {
        "schema": 1,
        "name": "t",
        "target": "qemu",
        "created": "2026-12-03T00:00:00+00:00",
        "arch": "amd64",
        "base": {"name": "debian13", "suite": "trixie", "mirror": "m", "key": "k", "cached": True},
        "inputs": {},
        "tools": {"nodeforge": "0", "packer": "1.6.6", "ansible-core": "2.19"},
        "phases": phases or {"preflight": 1.0, "base": 1.0, "provision": 1.0},
    }


def debugfs_read(disk: Path, work: Path, request: str) -> str:
    """Run one debugfs request (`cat /etc/x`, `ls /root/.ssh`) on a qcow2 disk, no mount.
    debugfs reports a missing path on stderr and exits 0: callers check the text."""
    raw = work / "inspect.raw"
    subprocess.run(
        ["qemu-img", "convert", "-O", "raw", str(disk), str(raw)], check=True, timeout=600
    )
    try:
        return subprocess.run(
            ["debugfs", "-R", request, str(raw)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    finally:
        raw.unlink()


def ctrl_c_enabled() -> None:
    """preexec_fn for a child that the test interrupts with SIGINT, as Ctrl-C would: a test
    run started in the background (`cmd &` in a script) inherits SIGINT ignored, and Python
    then never raises KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
