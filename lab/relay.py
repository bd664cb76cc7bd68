"""Relay one guest connection to a loopback port: qemu's ``guestfwd=…-cmd:`` program.

qemu's ``guestfwd=tcp:ADDR:PORT-tcp:HOST:PORT`` form opens ONE chardev connection when qemu
starts and feeds every guest connection into that same stream: a server that closes it (an
idle timeout, ``Connection: close``) leaves the guest address dead for the rest of the boot, and
two guest connections would interleave. The ``cmd:`` form spawns a program per guest
connection with the connection on its stdin/stdout; this is that program. It connects to
127.0.0.1:PORT and copies both ways until either side ends, bounded by a deadline.

Run as a file (``python3 relay.py PORT [DEADLINE]``), stdlib only: it starts once per guest
connection, so it imports nothing else.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import time

CHUNK = 65536


def relay(fd_in: int, fd_out: int, port: int, deadline: float) -> int:
    try:
        up = socket.create_connection(("127.0.0.1", port), timeout=10)
    except OSError as exc:
        print(f"relay: cannot connect to 127.0.0.1:{port}: {exc}", file=sys.stderr)
        return 1
    end = time.monotonic() + deadline
    up.setblocking(False)
    guest_open = True
    with up:
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return 2
            watch = [up] + ([fd_in] if guest_open else [])
            ready, _, _ = select.select(watch, [], [], min(left, 5.0))
            if fd_in in ready:
                data = os.read(fd_in, CHUNK)
                if not data:
                    guest_open = False
                    try:
                        up.shutdown(socket.SHUT_WR)
                    except OSError:
                        return 0
                else:
                    _send_all(up, data, end)
            if up in ready:
                try:
                    data = up.recv(CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    return 0
                _write_all(fd_out, data)


def _send_all(sock: socket.socket, data: bytes, end: float) -> None:
    view = memoryview(data)
    while view:
        if time.monotonic() > end:
            raise TimeoutError("relay deadline")
        select.select([], [sock], [], 5.0)
        try:
            n = sock.send(view)
        except BlockingIOError:
            continue
        view = view[n:]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or not argv[1].isdigit():
        print("usage: relay.py PORT [DEADLINE_SECONDS]", file=sys.stderr)
        return 64
    deadline = float(argv[2]) if len(argv) == 3 else 300.0
    try:
        return relay(0, 1, int(argv[1]), deadline)
    except (OSError, TimeoutError) as exc:
        print(f"relay: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
