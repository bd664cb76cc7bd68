"""The one place nodeforge runs other programs.

Every command is logged before it runs; a failure raises CommandError with the exit status
and the tail of the output, so the operator never has to re-run with "verbose" to see why.

This is the core that ships to nodes: the one runner (`run`), the tool catalog its
missing-tool message reads (on a node too: scontrol names slurm-client), the one process
stopper and the one pid check. A hook's containment is node-only (bootstrap/contain.py);
streaming a long build command and the detached-child watcher are build-host only
(images/build_proc.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from .errors import CommandError, MissingToolError

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
    "losetup": "mount",
    "partx": "util-linux",
    "blkid": "util-linux",
    "mkfs.vfat": "dosfstools",
    "mcopy": "mtools",
    "mmd": "mtools",
    "xorriso": "xorriso",
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
    output_file: IO[bytes] | None = None,
) -> subprocess.CompletedProcess:
    """Run a command to completion. stderr is merged into stdout so errors keep their context.

    *redact* lists substrings (secrets) that must never reach a log line.
    *output_file* (an open binary file) receives stdout and stderr instead of a pipe:
    `cp.stdout` is then None, and a failure's message holds no output (the caller has it).
    For large outputs read every cycle (the gang governor's job list, ~90 MB on Slurm
    24.11): no 32 kB pipe reads through a selector, no decoding.
    """
    args = [str(a) for a in argv]
    shown = _redact(_fmt(args), redact)
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
            stdout=output_file if output_file is not None else subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture or output_file is not None else None,
            text=text,
        )
    except FileNotFoundError as exc:
        raise MissingToolError(args[0], TOOL_PACKAGES.get(Path(args[0]).name, args[0])) from exc
    except subprocess.TimeoutExpired as exc:
        out = exc.output or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        err = CommandError(
            [shown], -1, _redact(out, redact), hint=f"timed out after {timeout}s. {hint}".strip()
        )
        if redact:  # the cause holds the raw argv and output: do not chain it
            raise err from None
        raise err from exc
    if check and cp.returncode != 0:
        out = cp.stdout if capture else ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        raise CommandError([shown], cp.returncode, _redact(out or "", redact), hint=hint)
    return cp


def _redact(text: str, secrets: Sequence[str]) -> str:
    """*text* with every secret (longest first, so a prefix cannot leave a tail) as ***."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


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
            dead = (popen.poll() is not None) if popen is not None else not pid_alive(pid)
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


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, Z …), None when there is no such process.
    The command name is in parentheses and may hold spaces and ')': the state is the first
    field after the LAST ')'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int | None) -> bool:
    """The one "is this process alive" check: it exists and is not a zombie (exited, not yet
    reaped by its parent). Right for any process name (`split()[2]` broke on spaces)."""
    if not pid or pid < 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    state = proc_state(pid)
    return state is not None and state != "Z"


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
