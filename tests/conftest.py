"""Shared pytest setup: tiers are selected by marker (-m unit / -m e2e)."""

import shutil
import subprocess
from pathlib import Path

import pytest


def require_tools(*tools: str) -> None:
    """E2e prerequisite check: a missing tool FAILS the test with its name (never a skip)."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(
            f"required tools missing: {', '.join(missing)} (install them; see .ci/run)",
            pytrace=False,
        )


def make_keypair(tmp_path: Path, name: str = "id_ed25519") -> tuple[str, str]:
    """A throwaway OpenSSH keypair generated at run time: (public line, private key text).
    Tests never carry key material in git."""
    key = tmp_path / name
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "test", "-f", str(key)],
        check=True,
        timeout=30,
    )
    return Path(f"{key}.pub").read_text().strip(), key.read_text()
