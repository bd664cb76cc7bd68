"""Helpers shared by the e2e tests (imported as tests.helpers)."""

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
BUILD_TOOLS = ("packer", "mmdebstrap", "systemd-nspawn", "mkfs.ext4", "qemu-img", "ssh-keygen",
               "zstd", "dpkg-deb", "ip", "nsenter")


def nodeforge(*args: str, timeout: float = 3600, check: bool = True,
              **kw) -> subprocess.CompletedProcess:
    cp = subprocess.run([sys.executable, "-m", "nodeforge", *args], capture_output=True,
                        text=True, timeout=timeout, cwd=REPO, **kw)
    if check and cp.returncode != 0:
        pytest.fail(f"nodeforge {' '.join(args)} exited {cp.returncode}\nstdout:\n{cp.stdout}\n"
                    f"stderr:\n{cp.stderr[-6000:]}", pytrace=False)
    return cp


def build_image(output: Path, mirror: Path, versions: Path, *extra: str) -> tuple[dict, float]:
    t0 = time.monotonic()
    cp = nodeforge("build", "--artifact-mirror", str(mirror), "--versions-file", str(versions),
                   "--output", str(output), "--json", *extra)
    return json.loads(cp.stdout), time.monotonic() - t0


