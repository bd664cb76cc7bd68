"""SSH ProxyCommand that holds a connection until the build sandbox is up.

A pass over a cached layer is one `ansible-playbook` run whose controller needs ~2 s (imports,
playbook and role parsing) before its first connection: the build starts it while the sandbox
boots, with this gate as its ProxyCommand (images/local.py). The gate waits for the sandbox's
state file, then connects to the sandbox's sshd and hands the connected socket to ssh
(`ProxyUseFdpass=yes`: ssh receives the descriptor over its stdout and talks to sshd
directly; the gate exits, nothing is relayed).

    python -m nodeforge.images.ssh_gate STATE_FILE PORT TIMEOUT_SECONDS

STATE_FILE holds `up` once the sandbox answered SSH and systemd finished booting, or
`failed` when its boot failed (then the gate fails at once, and so does the pass). No state
within TIMEOUT_SECONDS: the gate fails, naming the file.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
import time
from pathlib import Path

UP, FAILED = "up", "failed"
POLL = 0.02  # s; a missing file costs one stat


def wait_state(state: Path, timeout: float, clock=time.monotonic, sleep=time.sleep) -> str:
    """UP or FAILED as soon as *state* says so; raises TimeoutError after *timeout*."""
    deadline = clock() + timeout
    while True:
        try:
            text = state.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text in (UP, FAILED):
            return text
        if clock() >= deadline:
            raise TimeoutError(f"no sandbox state in {state} after {timeout:.0f}s")
        sleep(POLL)


def pass_connection(port: int, out_fd: int = 1) -> None:
    """Connect to 127.0.0.1:*port* and send the socket over *out_fd* (the AF_UNIX socket
    ssh gives a ProxyUseFdpass command as its stdout): one byte with the descriptor, the
    message OpenSSH's receiver expects."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        with socket.socket(fileno=os.dup(out_fd)) as out:
            socket.send_fds(out, [b"\0"], [conn.fileno()])
    finally:
        conn.close()  # ssh holds its own copy now


def parse_args(argv: list[str]) -> tuple[Path, int, float]:
    if len(argv) != 3:
        raise ValueError("usage: ssh_gate STATE_FILE PORT TIMEOUT_SECONDS")
    state, port, timeout = argv
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise ValueError(f"port {port!r} is not a TCP port (1-65535)")
    if not re.fullmatch(r"[0-9]{1,4}(\.[0-9]{1,3})?", timeout) or float(timeout) <= 0:
        raise ValueError(f"timeout {timeout!r} is not a number of seconds (0 < s < 10000)")
    if not state or "\0" in state:
        raise ValueError("the state file path is empty")
    return Path(state), int(port), float(timeout)


def main(argv: list[str]) -> int:
    try:
        state, port, timeout = parse_args(argv)
        if wait_state(state, timeout) != UP:
            print(f"nodeforge ssh gate: the build sandbox did not boot ({state})", file=sys.stderr)
            return 1
        pass_connection(port)
    except (ValueError, OSError, TimeoutError) as e:
        print(f"nodeforge ssh gate: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def ssh_options(state: Path, port: int, timeout: float, python: str = sys.executable) -> list[str]:
    """ssh's options that route its connection to 127.0.0.1:*port* through this gate
    (one argv element each; the command is run by ssh through the shell, and `%` is
    ssh's token character, so both are escaped)."""
    cmd = shlex.join(
        [python, "-m", "nodeforge.images.ssh_gate", str(state), str(port), f"{timeout:g}"]
    )
    return ["-o", "ProxyUseFdpass=yes", "-o", "ProxyCommand=" + cmd.replace("%", "%%")]
