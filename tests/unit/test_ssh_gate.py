"""The SSH gate of a pass started while its sandbox boots (images/ssh_gate.py): ssh's
connection waits for the sandbox's state, then reaches the sshd port directly (the gate hands
ssh the connected socket), or fails at once naming the failed boot."""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from nodeforge.images import ssh_gate

pytestmark = pytest.mark.unit


class FakeSshd:
    """A TCP listener on 127.0.0.1 that records when each connection arrived and answers
    with an SSH banner, then closes (ssh gets as far as the key exchange)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[float] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(20)
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self.accepted.append(time.monotonic())
        with conn:
            conn.sendall(b"SSH-2.0-FixtureNotAnSshd\r\n")
            conn.settimeout(5)
            try:
                conn.recv(256)  # ssh's own banner: it talks to us over the passed socket
                self.banner_seen = True
            except OSError:
                pass

    banner_seen = False

    def close(self) -> None:
        self.sock.close()


def _ssh(state: Path, port: int, timeout: float = 20) -> subprocess.Popen:
    ssh = shutil.which("ssh")
    if ssh is None:
        pytest.fail("the ssh client (openssh-client) is needed for this test")
    return subprocess.Popen(
        [
            ssh,
            *ssh_gate.ssh_options(state, port, timeout),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-p",
            str(port),
            "root@127.0.0.1",
            "true",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_ssh_waits_for_up_then_reaches_the_port_through_the_passed_socket(tmp_path):
    sshd = FakeSshd()
    state = tmp_path / "state with space %p"
    try:
        p = _ssh(state, sshd.port)
        time.sleep(1.0)
        assert sshd.accepted == [] and p.poll() is None  # held at the gate
        up_at = time.monotonic()
        state.write_text(ssh_gate.UP)
        _, err = p.communicate(timeout=30)
    finally:
        sshd.close()
    assert len(sshd.accepted) == 1 and sshd.accepted[0] >= up_at
    assert sshd.banner_seen, err  # ssh itself spoke over the socket the gate passed
    assert "ssh gate" not in err


def test_a_failed_boot_fails_the_connection_at_once_and_names_it(tmp_path):
    sshd = FakeSshd()
    state = tmp_path / "state"
    state.write_text(ssh_gate.FAILED)
    try:
        t0 = time.monotonic()
        p = _ssh(state, sshd.port)
        _, err = p.communicate(timeout=30)
    finally:
        sshd.close()
    assert p.returncode == 255 and time.monotonic() - t0 < 10
    assert "the build sandbox did not boot" in err and str(state) in err
    assert sshd.accepted == []


def test_no_state_within_the_timeout_fails_naming_the_file(tmp_path):
    clock = [0.0]
    with pytest.raises(TimeoutError, match="no sandbox state in .*/missing after 5s"):
        ssh_gate.wait_state(
            tmp_path / "missing",
            5,
            clock=lambda: clock[0],
            sleep=lambda s: clock.__setitem__(0, clock[0] + s),
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["s", "0", "5"],
        ["s", "65536", "5"],
        ["s", "22\n", "5"],
        ["s", "-1", "5"],
        ["s", "22", "nan"],
        ["s", "22", "0"],
        ["s", "22", "1e9"],
        ["", "22", "5"],
        ["s", "22"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    assert ssh_gate.main(argv) == 1
    assert "nodeforge ssh gate:" in capsys.readouterr().err


def test_the_proxy_command_survives_shell_and_ssh_token_expansion(tmp_path):
    state = tmp_path / "a b'c%h"
    opts = ssh_gate.ssh_options(state, 2222, 180, python="/usr/bin/python3")
    assert opts[:3] == ["-o", "ProxyUseFdpass=yes", "-o"]
    cmd = opts[3].removeprefix("ProxyCommand=").replace("%%", "%")
    assert shlex.split(cmd) == [
        "/usr/bin/python3",
        "-m",
        "nodeforge.images.ssh_gate",
        str(state),
        "2222",
        "180",
    ]
