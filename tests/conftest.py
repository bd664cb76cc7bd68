"""Shared pytest setup: tiers are selected by marker (-m unit / -m e2e)."""

import shutil
import subprocess
import time
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


def wait_for(what: str, pred, timeout: float = 120.0, every: float = 1.0):
    """*pred()*'s first truthy value, polled every *every* s; past *timeout*, the test fails
    naming *what* and the last value seen (every e2e wait is bounded)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(every)
    pytest.fail(
        f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})", pytrace=False
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


@pytest.fixture(autouse=True)
def _unit_network_scope(request, monkeypatch):
    """The unit tier reaches only loopback: a name or address anywhere else fails resolution
    here, as it would on an offline node, instead of asking this machine's resolver."""
    if request.node.get_closest_marker("unit") is None:
        return
    import ipaddress
    import socket

    real = socket.getaddrinfo

    def loopback_only(host, *a, **kw):
        name = host.decode() if isinstance(host, bytes) else host
        if name not in (None, "localhost"):
            try:
                ok = ipaddress.ip_address(name.strip("[]").split("%")[0]).is_loopback
            except ValueError:
                ok = False
            if not ok:
                raise socket.gaierror(
                    socket.EAI_NONAME, f"unit tier: no network beyond loopback ({name})"
                )
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
