"""A hook attempt's containment: run a command with a hard timeout and stop everything it
started (`run_group`), kept in the best container of processes the node offers (`containment`:
a systemd scope, a cgroup v2 directory, or this process as child subreaper).

Node code only (the agent's hooks); the build never runs hooks.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from nodeforge.errors import MissingToolError
from nodeforge.proc import TOOL_PACKAGES, _fmt, _group_alive, proc_state, require_tool, stop_group

log = logging.getLogger("nodeforge.proc")


class GroupResult:
    """Outcome of `run_group`: exit status, or the signal, or a timeout."""

    __slots__ = ("containment", "dropped", "duration", "leftovers", "returncode", "timed_out")

    def __init__(
        self,
        returncode: int,
        timed_out: bool,
        duration: float,
        containment: str = "group",
        dropped: int = 0,
        leftovers: bool = False,
    ):
        self.returncode = returncode  # negative = killed by that signal (subprocess convention)
        self.timed_out = timed_out
        self.duration = duration
        self.containment = containment  # scope | cgroup | subreaper | group
        self.dropped = dropped  # output bytes left out by output_cap
        self.leftovers = leftovers  # something was still running after the leader exited

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 and not self.timed_out else None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (
            f"GroupResult(rc={self.returncode}, timed_out={self.timed_out}, {self.duration:.2f}s)"
        )


def run_group(
    argv: Sequence[str | os.PathLike[str]],
    *,
    timeout: float,
    output: IO | None = None,
    env: Mapping[str, str] | None = None,
    replace_env: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    grace: float = 5.0,
    contain: str | None = None,
    output_cap: int | None = None,
) -> GroupResult:
    """Run a command with a hard timeout and stop EVERYTHING it started; never raises on its exit.

    With *contain* (a name), the command runs in its own transient container of processes, the
    best this machine offers (see `containment`): a systemd scope (systemd is PID 1), else a
    cgroup v2 directory we create, else this process as child subreaper plus a process-tree
    sweep. A `setsid` daemon leaves its process group but not its cgroup or its reaper, so it
    is stopped too. Without *contain*, only the process group is (the old behaviour).
    On timeout, and when the leader exits, all of it gets SIGTERM, then SIGKILL after *grace* s.

    stdout and stderr go to *output*. With *output_cap* (bytes) they pass through a pipe and
    only the first and last output_cap/2 bytes are kept, with a marker saying how much was
    dropped. *replace_env* uses *env* as the whole environment instead of adding it to ours.
    """
    import time

    args = [str(a) for a in argv]
    kind = containment() if contain else "group"
    log.debug("run (%s, timeout %ss): %s", kind, timeout, _fmt(args))
    if replace_env:
        full_env = dict(env or {})
    else:
        full_env = dict(os.environ)
        full_env.update(env or {})
    box = _Box.make(kind, contain or "", grace, timeout)
    start = time.monotonic()
    copier = None
    try:
        proc = subprocess.Popen(
            box.wrap(args),
            stdin=subprocess.DEVNULL,
            stdout=(
                subprocess.PIPE
                if output_cap is not None
                else output
                if output is not None
                else subprocess.DEVNULL
            ),
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    except FileNotFoundError as exc:
        box.close()
        raise MissingToolError(args[0], TOOL_PACKAGES.get(Path(args[0]).name, args[0])) from exc
    except BaseException:
        box.close()
        raise
    if output_cap is not None:
        assert proc.stdout is not None
        copier = _CappedCopy(proc.stdout, output, output_cap)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    except BaseException:
        stop_group(proc, grace)
        box.stop(proc)
        raise
    left = proc.returncode is not None and box.alive(proc)
    stop_group(proc, grace)
    box.stop(proc)
    rc = proc.wait()
    dropped = copier.finish() if copier is not None else 0
    return GroupResult(rc, timed_out, time.monotonic() - start, box.kind, dropped, left)


# -- containment: where a hook's processes are kept so that all of them can be stopped -------
_SYSTEMD_RUN = "/run/systemd/system"  # exists when systemd is PID 1 (sd_booted)


def containment() -> str:
    """The strongest containment this process can use: scope, cgroup or subreaper."""
    if os.path.isdir(_SYSTEMD_RUN) and _scope_works():
        return "scope"
    if _cgroup_base() is not None:
        return "cgroup"
    return "subreaper"


def _own_unit() -> str | None:
    """The systemd service this process runs in (nodeforge-init.service on a node), if any."""
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        last = line.rsplit("/", 1)[-1]
        if re.fullmatch(r"[A-Za-z0-9:_.@-]+\.service", last):
            return last
    return None


def _scope_properties(grace: float, runtime_max: int) -> list[str]:
    props = [
        f"--property=TimeoutStopSec={max(1, int(grace))}s",
        f"--property=RuntimeMaxSec={runtime_max}s",
    ]
    unit = _own_unit()
    if unit:
        props.append(f"--property=PartOf={unit}")
    return props


@functools.cache
def _scope_works() -> bool:
    """systemd is PID 1 and answers `systemd-run --scope` with the properties we use (probed
    once per process: a failing systemd-run would otherwise look like the hook failing)."""
    if not (shutil.which("systemd-run") and shutil.which("systemctl")):
        return False
    try:
        cp = subprocess.run(
            [
                "systemd-run",
                "--scope",
                "--quiet",
                "--collect",
                *_scope_properties(1, 60),
                "--",
                "true",
            ],
            check=False,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("systemd-run --scope unusable (%s); hooks use a cgroup or subreaper", exc)
        return False
    if cp.returncode != 0:
        log.warning(
            "systemd-run --scope failed (%s); hooks use a cgroup or subreaper",
            cp.stdout.strip()[-200:],
        )
    return cp.returncode == 0


def _cgroup_base() -> Path | None:
    """Our own cgroup v2 directory if we may create children in it, else None."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        mine = next(
            ln.split("::", 1)[1]
            for ln in Path("/proc/self/cgroup").read_text().splitlines()
            if ln.startswith("0::")
        )
    except (OSError, StopIteration):
        return None
    for ln in mounts:
        left, _, right = ln.partition(" - ")
        if right.split(" ", 1)[0] != "cgroup2":
            continue
        root, mnt = left.split()[3], left.split()[4]
        rel = mine.strip()
        if root != "/" and rel.startswith(root):
            rel = rel[len(root) :]
        base = Path(mnt) / rel.lstrip("/")
        if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
            return base
    return None


class _Box:
    """One attempt's container. `wrap` the argv, `alive` after the leader exits, `stop` at the end."""

    kind = "group"

    def __init__(self, name: str, grace: float, timeout: float = 0.0):
        import secrets

        safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in name)[:60] or "cmd"
        self.name = f"nodeforge-{safe}-{os.getpid()}-{secrets.token_hex(3)}"
        self.grace = grace
        self.timeout = timeout

    @staticmethod
    def make(kind: str, name: str, grace: float, timeout: float = 0.0) -> _Box:
        if kind == "scope":
            return _Scope(name, grace, timeout)
        if kind == "cgroup":
            try:
                return _Cgroup(name, grace)
            except OSError as exc:
                log.warning("cannot create a cgroup (%s); using a child subreaper instead", exc)
                return _Reaper(name, grace)
        if kind == "subreaper":
            return _Reaper(name, grace)
        return _Box(name, grace)

    def wrap(self, argv: list[str]) -> list[str]:
        return argv

    def alive(self, proc: subprocess.Popen) -> bool:
        return _group_alive(proc.pid)

    def stop(self, proc: subprocess.Popen) -> None:
        pass

    def close(self) -> None:
        pass


class _Scope(_Box):
    """A transient systemd scope: `systemctl stop` kills the whole cgroup (TERM, then KILL)."""

    kind = "scope"

    def wrap(self, argv: list[str]) -> list[str]:
        # RuntimeMaxSec: systemd itself ends the scope even if we die (SIGKILL) meanwhile;
        # PartOf: stopping the agent's unit stops the hook too (the scope is not inside it).
        limit = int(self.timeout + 2 * self.grace) + 30
        return [
            require_tool("systemd-run"),
            "--scope",
            "--quiet",
            "--collect",
            f"--unit={self.name}",
            *_scope_properties(self.grace, limit),
            "--",
            *argv,
        ]

    def alive(self, proc: subprocess.Popen) -> bool:
        # The scope's own processes, not its unit state: right after the leader exits, systemd
        # may not yet have seen the cgroup empty, and `is-active` then still says active (a
        # hook that left nothing was reported as having left processes running).
        if not Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return self._active()  # a legacy hierarchy: the unit state is all there is
        cp = subprocess.run(
            ["systemctl", "show", "--property=ControlGroup", "--value", f"{self.name}.scope"],
            check=False,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )
        cgroup = cp.stdout.strip()
        if cp.returncode != 0 or not cgroup:
            return False  # the scope is gone: nothing of it is left
        procs = Path("/sys/fs/cgroup") / cgroup.lstrip("/") / "cgroup.procs"
        try:
            pids = [int(p) for p in procs.read_text().split()]
        except FileNotFoundError:
            return False  # the cgroup was removed meanwhile: nothing is left
        except (OSError, ValueError):
            return self._active()
        return any(not _zombie(p) for p in pids)

    def _active(self) -> bool:
        cp = subprocess.run(
            ["systemctl", "is-active", "--quiet", f"{self.name}.scope"],
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
        return cp.returncode == 0

    def stop(self, proc: subprocess.Popen) -> None:
        # A scope whose processes all exited is already gone: "not loaded" is fine here.
        subprocess.run(
            ["systemctl", "stop", "--quiet", f"{self.name}.scope"],
            check=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=self.grace + 30,
        )


# Moves itself into the cgroup, then becomes the command: nothing it starts can be outside.
_ENTER_CGROUP = (
    'echo $$ > "$0/cgroup.procs" || { echo "nodeforge: cannot enter $0" >&2; exit 125; }; exec "$@"'
)


class _Cgroup(_Box):
    kind = "cgroup"

    def __init__(self, name: str, grace: float):
        super().__init__(name, grace)
        base = _cgroup_base()
        if base is None:
            raise OSError("no writable cgroup v2 directory")
        self.path = base / self.name
        self.path.mkdir()

    def wrap(self, argv: list[str]) -> list[str]:
        return ["/bin/sh", "-c", _ENTER_CGROUP, str(self.path), *argv]

    def _pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def alive(self, proc: subprocess.Popen) -> bool:
        proc.poll()
        return bool(self._pids())

    def stop(self, proc: subprocess.Popen) -> None:
        import time

        pids = self._pids()
        for pid in pids:
            _kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + (self.grace if pids else 0)
        while self._pids() and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.05)
        end = time.monotonic() + 10
        while self._pids() and time.monotonic() < end:
            if (self.path / "cgroup.kill").exists():
                (self.path / "cgroup.kill").write_text("1")
            else:  # kernels before 5.14
                for pid in self._pids():
                    _kill(pid, signal.SIGKILL)
            proc.poll()
            time.sleep(0.02)
        self.close()

    def close(self) -> None:
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s: %s", self.path, exc)


_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _ppids() -> dict[int, int]:
    out: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


class _Reaper(_Box):
    """No cgroup to use: this process becomes child subreaper while the command runs, so what
    the command orphans (a setsid daemon) is re-parented to us; the sweep stops that tree."""

    kind = "subreaper"

    def __init__(self, name: str, grace: float):
        super().__init__(name, grace)
        self.before = {pid for pid, pp in _ppids().items() if pp == os.getpid()}
        _set_subreaper(True)

    def _tree(self, proc: subprocess.Popen) -> list[int]:
        pp = _ppids()
        me = os.getpid()
        roots = {
            pid
            for pid, parent in pp.items()
            if parent == me and pid not in self.before and pid != proc.pid
        }
        if proc.returncode is None:
            roots.add(proc.pid)
        tree, todo = set(), list(roots)
        while todo:
            pid = todo.pop()
            if pid in tree:
                continue
            tree.add(pid)
            todo.extend(c for c, parent in pp.items() if parent == pid)
        return sorted(tree)

    def alive(self, proc: subprocess.Popen) -> bool:
        proc.poll()
        return bool([p for p in self._tree(proc) if not _zombie(p)])

    def stop(self, proc: subprocess.Popen) -> None:
        import time

        try:
            proc.poll()
            if not self._tree(proc):
                return  # the common case: nothing left (one /proc scan, not five)
            for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 10.0)):
                pids = [p for p in self._tree(proc) if p != proc.pid or proc.returncode is None]
                for pid in pids:
                    _kill(pid, sig)
                deadline = time.monotonic() + (wait if pids else 0)
                while time.monotonic() < deadline:
                    self._reap(proc)
                    if not [p for p in self._tree(proc) if not _zombie(p)]:
                        break
                    time.sleep(0.05)
            self._reap(proc)
        finally:
            self.close()

    def _reap(self, proc: subprocess.Popen) -> None:
        # Orphans re-parented to us are our children now: reap them (not the leader, Popen does).
        proc.poll()
        for pid in self._tree(proc):
            if pid == proc.pid:
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def close(self) -> None:
        _set_subreaper(False)


def _zombie(pid: int) -> bool:
    return proc_state(pid) in ("Z", None)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _CappedCopy:
    """Copies a pipe to *out*, keeping the first and the last cap/2 bytes (a thread)."""

    def __init__(self, pipe: IO[bytes], out: IO | None, cap: int):
        import threading

        self.pipe, self.out = pipe, out
        self.head_left = cap // 2
        self.tail_max = cap - cap // 2
        self.tail = bytearray()
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _write(self, data: bytes) -> None:
        if self.out is None or not data:
            return
        if hasattr(self.out, "buffer"):
            self.out.flush()
            self.out.buffer.write(data)
            self.out.buffer.flush()
        else:
            self.out.write(data)

    def _run(self) -> None:
        fd = self.pipe.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            if self.head_left:
                head, chunk = chunk[: self.head_left], chunk[self.head_left :]
                self.head_left -= len(head)
                self._write(head)
            if chunk:
                self.tail += chunk
                over = len(self.tail) - self.tail_max
                if over > 0:
                    self.dropped += over
                    del self.tail[:over]

    def finish(self) -> int:
        self.thread.join(timeout=30)
        self.pipe.close()
        if self.dropped:
            self._write(
                f"\n[... {self.dropped} bytes of output dropped here (per-attempt cap) "
                "...]\n".encode()
            )
        self._write(bytes(self.tail))
        return self.dropped
