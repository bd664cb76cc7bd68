"""The one place nodeforge runs other programs.

Every command is logged before it runs; a failure raises CommandError with the exit status
and the tail of the output, so the operator never has to re-run with "verbose" to see why.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from .errors import CommandError, MissingToolError, NodeforgeError

log = logging.getLogger("nodeforge.proc")

# Tool -> Debian package that provides it (for "install it with" messages).
TOOL_PACKAGES: dict[str, str] = {
    "packer": "packer",
    "mmdebstrap": "mmdebstrap",
    "systemd-nspawn": "systemd-container",
    "qemu-img": "qemu-utils",
    "qemu-system-x86_64": "qemu-system-x86",
    "mkfs.ext4": "e2fsprogs",
    "debugfs": "e2fsprogs",
    "sfdisk": "fdisk",
    "fstrim": "util-linux",
    "mount": "mount",
    "setpriv": "util-linux",
    "ssh-keygen": "openssh-client",
    "ssh": "openssh-client",
    "ip": "iproute2",
    "dpkg-deb": "dpkg",
    "zstd": "zstd",
    "tar": "tar",
    "ansible-playbook": "python3 -m pip install 'ansible-core>=2.19,<2.20' (or: pip install -e .)",
    "logrotate": "logrotate",
    "mksquashfs": "squashfs-tools",
    "vagrant": "vagrant",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "scontrol": "slurm-client",
}


def require_tool(tool: str) -> str:
    """Return the absolute path of *tool* or raise an error that names the apt package."""
    path = shutil.which(tool)
    if path is None:
        # Tools installed in our venv (ansible-playbook) live next to the interpreter.
        import sys

        cand = Path(sys.executable).parent / tool
        if cand.exists():
            return str(cand)
        raise MissingToolError(tool, TOOL_PACKAGES.get(tool, tool))
    return path


def _fmt(argv: Sequence[str]) -> str:
    return " ".join(str(a) for a in argv)


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    check: bool = True,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: str | bytes | None = None,
    capture: bool = True,
    text: bool = True,
    hint: str = "",
    redact: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Run a command to completion. stderr is merged into stdout so errors keep their context.

    *redact* lists substrings (secrets) that must never reach a log line.
    """
    args = [str(a) for a in argv]
    shown = _fmt(args)
    for secret in redact:
        if secret:
            shown = shown.replace(secret, "***")
    log.debug("run: %s", shown)
    full_env = None
    if env is not None:
        full_env = dict(os.environ)
        full_env.update(env)
    try:
        cp = subprocess.run(
            args,
            check=False,
            timeout=timeout,
            env=full_env,
            cwd=cwd,
            input=input,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            text=text,
        )
    except FileNotFoundError as exc:
        raise MissingToolError(args[0], TOOL_PACKAGES.get(Path(args[0]).name, args[0])) from exc
    except subprocess.TimeoutExpired as exc:
        out = exc.output or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        raise CommandError(args, -1, out, hint=f"timed out after {timeout}s. {hint}".strip()) from exc
    if check and cp.returncode != 0:
        out = cp.stdout if capture else ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        for secret in redact:
            if secret and out:
                out = out.replace(secret, "***")
        raise CommandError([shown], cp.returncode, out or "", hint=hint)
    return cp


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
    log.info("run: %s", _fmt(args))
    logfile.write(f"$ {_fmt(args)}\n")
    logfile.flush()
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    try:
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise MissingToolError(args[0], TOOL_PACKAGES.get(Path(args[0]).name, args[0])) from exc
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
                raise CommandError(args, -1, "".join(tail), hint=f"timed out after {timeout}s. {hint}")
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


class GroupResult:
    """Outcome of `run_group`: exit status, or the signal, or a timeout."""

    __slots__ = ("duration", "returncode", "timed_out")

    def __init__(self, returncode: int, timed_out: bool, duration: float):
        self.returncode = returncode  # negative = killed by that signal (subprocess convention)
        self.timed_out = timed_out
        self.duration = duration

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 and not self.timed_out else None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"GroupResult(rc={self.returncode}, timed_out={self.timed_out}, {self.duration:.2f}s)"


def run_group(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    output: IO | None = None,
    env: Mapping[str, str] | None = None,
    replace_env: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    grace: float = 5.0,
) -> GroupResult:
    """Run a command in its own process group with a hard timeout; never raises on its exit.

    stdout and stderr go to *output* (a real file, so a grandchild that keeps the descriptor
    open cannot block us). On timeout the WHOLE group gets SIGTERM, then SIGKILL after
    *grace* seconds. When the leader exits, anything it left in its group is stopped the same
    way, so a command cannot leave strays behind. *replace_env* uses *env* as the whole
    environment instead of adding it to ours.
    """
    import time

    args = [str(a) for a in argv]
    log.debug("run (group, timeout %ss): %s", timeout, _fmt(args))
    if replace_env:
        full_env = dict(env or {})
    else:
        full_env = dict(os.environ)
        full_env.update(env or {})
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=output if output is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        raise MissingToolError(args[0], TOOL_PACKAGES.get(Path(args[0]).name, args[0])) from exc
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    except BaseException:
        stop_group(proc, grace)
        raise
    stop_group(proc, grace)
    rc = proc.wait()
    return GroupResult(rc, timed_out, time.monotonic() - start)


KILL_WAIT = 10.0  # after SIGKILL: how long to wait for the kernel to remove the processes


def stop_group(target: subprocess.Popen | int, grace: float = 10.0, *, group: bool = True) -> bool:
    """The one process stopper: SIGTERM, up to *grace* seconds to exit, then SIGKILL.

    *target* is our child (a Popen, reaped here) or a pid: a detached qemu, an nspawn started by
    an earlier command. With *group* (the child was started with start_new_session, so its pid
    is its group id) the whole group is signalled and waited for, so nothing it started is left
    behind; without it, only that process (qemu -daemonize leaves its group). Returns True when
    SIGKILL was needed.
    """
    import time

    popen = target if isinstance(target, subprocess.Popen) else None
    pid = target.pid if isinstance(target, subprocess.Popen) else int(target)
    send = os.killpg if group else os.kill

    def gone() -> bool:
        if group:
            dead = not _group_alive(pid)  # zombies do not count
        else:
            dead = (popen.poll() is not None) if popen is not None else not _pid_alive(pid)
        # Reap what exited (our child), after the check: one that exits in between is
        # still reaped on the next call.
        if popen is not None:
            popen.poll()
        else:
            _reap(pid)
        return dead

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not gone():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    if gone():
        return False
    try:
        send(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if wait(grace):
        return False
    log.warning("pid %s did not exit %ss after SIGTERM; sending SIGKILL", pid, grace)
    try:
        send(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    wait(KILL_WAIT)
    return True


def _reap(pid: int) -> None:
    """Reap *pid* if it is our exited child (a pid without its Popen); no-op otherwise."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _group_alive(pgid: int) -> bool:
    """A process of group *pgid* still runs (zombies do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg also reaches zombies: exited, but not reaped (an orphan's parent is PID 1, which
    # does not reap in some containers). Only a member that is not a zombie is alive.
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


# Stops process $1 and its group (SIGTERM, then SIGKILL after $2 s) when the watcher gets
# SIGTERM; exits on its own once $1 is gone. `sleep & wait` keeps the trap responsive.
_WATCHER = r'''
pid=$1 grace=$2
trap 'kill -s TERM -- "-$pid" 2>/dev/null || kill -s TERM "$pid" 2>/dev/null; i=0
      while kill -0 "$pid" 2>/dev/null && [ $i -lt "$grace" ]; do sleep 1; i=$((i+1)); done
      kill -s KILL -- "-$pid" 2>/dev/null || kill -s KILL "$pid" 2>/dev/null; exit 0' TERM
echo ready; exec >/dev/null
while kill -0 "$pid" 2>/dev/null; do sleep 1 & wait $!; done
'''


def stop_with_this_process(pid: int, grace: float = 10.0) -> subprocess.Popen:
    """A watcher that stops *pid* when this process dies, even by SIGKILL.

    For children that detach (qemu -daemonize) and so cannot be tied to their parent: the
    kernel signals the watcher when we die (PR_SET_PDEATHSIG, set by setpriv). It runs in its
    own session so a Ctrl-C reaches only us (our cleanup then stops *pid* in order).
    Kill the returned watcher (SIGKILL) once *pid* has been stopped normally.
    """
    import select

    argv = [require_tool("setpriv"), "--pdeathsig", "TERM", "--", "sh", "-c", _WATCHER,
            "nodeforge-watcher", str(pid), str(max(1, int(grace)))]
    log.info("run: %s (watcher of pid %s)", _fmt(argv[:4]), pid)
    w = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    # Wait for "ready": the watcher's trap is set. A death signal before that would kill the
    # shell without stopping *pid* (seen under load when the caller died right away).
    assert w.stdout is not None
    ready = select.select([w.stdout], [], [], 30)[0] and w.stdout.readline().strip() == b"ready"
    w.stdout.close()
    if not ready:
        w.kill()
        w.wait(timeout=10)
        raise NodeforgeError(f"the watcher of pid {pid} did not start (setpriv/sh); "
                             "is util-linux's setpriv working here?")
    return w
