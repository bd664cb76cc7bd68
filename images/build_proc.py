"""The build host's process helpers beside the one runner (nodeforge.proc.run): stream a long
command's output to a log (`stream`), tie a detached child to this process (`stop_with_this_process`),
and the lab's power cut (`kill_now`). None of them runs on a node.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from nodeforge.errors import CommandError, MissingToolError, NodeforgeError
from nodeforge.proc import TOOL_PACKAGES, _fmt, require_tool, stop_group

log = logging.getLogger("nodeforge.proc")


def stream(
    argv: Sequence[str | os.PathLike[str]],
    *,
    logfile: IO[str],
    on_line: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    hint: str = "",
    stamp: bool = True,
    kill_grace: float = 10.0,
) -> None:
    """Run a long command, copying every output line to *logfile* (nothing hidden) and to *on_line*.

    The child runs in its own process group so an interrupt or timeout stops all of it; it gets
    *kill_grace* seconds after SIGTERM to clean up (Packer deletes its VM or EC2 instance).
    """
    import selectors
    import time

    args = [str(a) for a in argv]
    proc = _start(args, logfile, env, cwd)
    # Its own session keeps a Ctrl-C from reaching it before our cleanup does; the watcher
    # stops it if we die without cleaning up (SIGKILL).
    watcher = stop_with_this_process(proc.pid, kill_grace)
    tail: list[str] = []
    t0 = time.monotonic()
    deadline = None if timeout is None else t0 + timeout
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)

    def emit(raw: bytes) -> None:
        line = raw.decode(errors="replace") + "\n"
        # Elapsed-time prefix: shows in build.log which task or step took the time.
        logfile.write(f"[{time.monotonic() - t0:7.1f}s] {line}" if stamp else line)
        tail.append(line)
        del tail[:-60]
        if on_line:
            on_line(line.rstrip("\n"))

    # Raw reads, split here: a buffered readline() would sit on lines already read from the
    # pipe until more output came, and block on a partial line past the deadline.
    pending = b""
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                stop_group(proc, kill_grace)
                raise CommandError(
                    args, -1, "".join(tail), hint=f"timed out after {timeout}s. {hint}"
                )
            if not sel.select(timeout=1.0):
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                emit(raw)
        if pending:
            emit(pending)
        rc = proc.wait()
    except BaseException:
        stop_group(proc, kill_grace)
        raise
    finally:
        watcher.kill()
        watcher.wait(timeout=10)
        sel.close()
        proc.stdout.close()
        logfile.flush()
    if rc != 0:
        raise CommandError(args, rc, "".join(tail), hint=hint)


def _start(
    args: list[str],
    logfile: IO[str],
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike[str] | None,
) -> subprocess.Popen[bytes]:
    """stream()'s first phase: the command logged, then started in its own session with
    stdout and stderr on one pipe; a missing program names its package."""
    log.info("run: %s", _fmt(args))
    logfile.write(f"$ {_fmt(args)}\n")
    logfile.flush()
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    try:
        return subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise MissingToolError(args[0], TOOL_PACKAGES.get(Path(args[0]).name, args[0])) from exc


def kill_now(pid: int) -> None:
    """SIGKILL *pid* at once, without SIGTERM first: a fault injected on purpose (the lab's
    power cut of a node: its init dies, and the kernel kills its whole PID namespace). Not a
    way to stop anything: that is stop_group."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# Stops process $1 and its group (SIGTERM, then SIGKILL after $2 s) when the watcher gets
# SIGTERM; exits on its own once $1 is gone. `sleep & wait` keeps the trap responsive.
_WATCHER = r"""
pid=$1 grace=$2
trap 'kill -s TERM -- "-$pid" 2>/dev/null || kill -s TERM "$pid" 2>/dev/null; i=0
      while kill -0 "$pid" 2>/dev/null && [ $i -lt "$grace" ]; do sleep 1; i=$((i+1)); done
      kill -s KILL -- "-$pid" 2>/dev/null || kill -s KILL "$pid" 2>/dev/null; exit 0' TERM
echo ready; exec >/dev/null
while kill -0 "$pid" 2>/dev/null; do sleep 1 & wait $!; done
"""


def stop_with_this_process(pid: int, grace: float = 10.0) -> subprocess.Popen:
    """A watcher that stops *pid* when this process dies, even by SIGKILL.

    For children that detach (qemu -daemonize) and so cannot be tied to their parent: the
    kernel signals the watcher when we die (PR_SET_PDEATHSIG, set by setpriv). It runs in its
    own session so a Ctrl-C reaches only us (our cleanup then stops *pid* in order).
    Kill the returned watcher (SIGKILL) once *pid* has been stopped normally.
    """
    import select

    argv = [
        require_tool("setpriv"),
        "--pdeathsig",
        "TERM",
        "--",
        "sh",
        "-c",
        _WATCHER,
        "nodeforge-watcher",
        str(pid),
        str(max(1, int(grace))),
    ]
    log.info("run: %s (watcher of pid %s)", _fmt(argv[:4]), pid)
    w = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # Wait for "ready": the watcher's trap is set. A death signal before that would kill the
    # shell without stopping *pid* (seen under load when the caller died right away).
    assert w.stdout is not None
    ready = select.select([w.stdout], [], [], 30)[0] and w.stdout.readline().strip() == b"ready"
    w.stdout.close()
    if not ready:
        w.kill()
        w.wait(timeout=10)
        raise NodeforgeError(
            f"the watcher of pid {pid} did not start (setpriv/sh); "
            "is util-linux's setpriv working here?"
        )
    return w
