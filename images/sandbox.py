"""The local build sandbox: the base tree booted with systemd-nspawn, reachable over SSH.

The sandbox shares the host network namespace (no systemd on the host to wire a veth), so its
sshd listens on a free port on 127.0.0.1 only, with a throwaway key made for this build.
Everything it adds for build access (sshd drop-in, host keys, authorized_keys) is removed
by the post-stop seal (images/seal.py). Used as a context manager so an interrupt always stops
the container and releases its mounts.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.images import build_proc, rootfs_tar
from nodeforge.images.qemu_host import free_port
from nodeforge.images.ssh_args import throwaway_ssh_argv

log = logging.getLogger("nodeforge.sandbox")

BUILD_SSHD_CONF = "etc/ssh/sshd_config.d/00-nodeforge-build.conf"
BUILD_HOST_KEY = "etc/ssh/ssh_host_ed25519_key"
# How often the boot wait tries the sandbox's SSH port (a refused connect costs nothing).
SSH_POLL = 0.1
BOOT_TIMEOUT = 180.0
STOP_TIMEOUT = 90.0


def extract(tarball: Path, tree: Path) -> None:
    tree.mkdir(parents=True, exist_ok=False)
    rootfs_tar.untar(tarball, tree)


def session_key(key: Path, comment: str) -> Path:
    """A fresh passphrase-less ed25519 key pair for one build's SSH access; returns the .pub.
    A stale pair from an interrupted build is replaced, never reused."""
    pub = Path(f"{key}.pub")
    key.unlink(missing_ok=True)
    pub.unlink(missing_ok=True)
    proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", key])
    return pub


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below *path*, deepest first (from /proc/self/mountinfo)."""
    root = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mp = line.split()[4].replace("\\040", " ")
            if mp == root or mp.startswith(root + "/"):
                found.append(mp)
    return sorted(found, key=len, reverse=True)


def release_mounts(path: Path, *, below_only: bool = False) -> None:
    """Unmount everything at or below *path* (*below_only*: keep *path*'s own mount, e.g.
    the overlay a cached build layer is mounted as)."""
    own = str(path.resolve())
    for mp in mounts_under(path):
        if not (below_only and mp == own):
            proc.run(["umount", "--lazy", mp], check=False)


@dataclass
class SandboxAccess:
    host: str
    port: int
    user: str
    key_file: Path


class Sandbox:
    def __init__(
        self,
        tree: Path,
        workdir: Path,
        logfile: IO[str],
        *,
        name: str,
        binds: list[tuple[Path, str]] | None = None,
    ):
        self.tree = tree
        self.workdir = workdir
        self.logfile = logfile
        self.name = name
        self.binds = binds or []
        self.port = free_port()
        self.key_file = workdir / "build_ed25519"
        self._proc: subprocess.Popen | None = None
        self._watcher: subprocess.Popen | None = None

    # -- build access -------------------------------------------------------------------
    def prepare(self) -> SandboxAccess:
        t = self.tree
        pub = session_key(self.key_file, "nodeforge-build")
        (t / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
        (t / BUILD_SSHD_CONF).write_text(
            "# nodeforge build access; removed before the image is sealed\n"
            f"Port {self.port}\nListenAddress 127.0.0.1\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            f"HostKey /{BUILD_HOST_KEY}\n"
        )
        # One host key for the build session only (the seal step deletes it): `ssh-keygen -A`
        # would also make an RSA key, a second of CPU on every sandbox boot. With this key
        # present the image's first-boot keygen unit (roles/ssh) is skipped in the sandbox.
        if not (t / BUILD_HOST_KEY).exists():
            proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", t / BUILD_HOST_KEY])
        ssh_dir = t / "root/.ssh"
        ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        ak = ssh_dir / "authorized_keys"
        ak.write_text(pub.read_text())
        ak.chmod(0o600)
        return SandboxAccess("127.0.0.1", self.port, "root", self.key_file)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        argv = [
            proc.require_tool("systemd-nspawn"),
            "--quiet",
            "-D",
            str(self.tree),
            "--boot",
            "--register=no",  # the host has no systemd-machined
            "--keep-unit",
            f"--machine={self.name}",
            "--link-journal=no",
            "--resolv-conf=copy-host",
            "--console=read-only",
            # Plain console text in build.log (no ANSI colour codes).
            "--setenv=SYSTEMD_COLORS=0",
        ]
        for src, dst in self.binds:
            argv.append(f"--bind={src}:{dst}")
        log.info("run: %s", " ".join(argv))
        self.logfile.write(f"$ {' '.join(argv)}\n")
        self.logfile.flush()
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self.logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # A SIGKILLed build runs no cleanup: the watcher powers the sandbox off then.
        self._watcher = build_proc.stop_with_this_process(self._proc.pid, STOP_TIMEOUT)
        self._wait_ssh()

    def ssh_argv(self, *cmd: str) -> list[str]:
        # The sandbox's host key is throwaway; don't record it in the operator's file.
        return throwaway_ssh_argv(self.key_file, port=self.port, connect_timeout=5, command=cmd)

    def _wait_ssh(self) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT
        last = ""
        refused = True
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise NodeforgeError(
                    f"build sandbox {self.name} exited with {self._proc.returncode} while booting; "
                    f"see the build log for systemd-nspawn's output"
                )
            try:
                refused = True
                with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                    pass
                refused = False
                cp = proc.run(
                    self.ssh_argv("systemctl", "is-system-running", "--wait"),
                    check=False,
                    timeout=120,
                )
                state = cp.stdout.strip()
                if state in ("running", "degraded"):
                    if state == "degraded":
                        failed = proc.run(
                            self.ssh_argv("systemctl", "--failed", "--no-legend"),
                            check=False,
                            timeout=30,
                        ).stdout
                        self.logfile.write(f"sandbox booted degraded; failed units:\n{failed}\n")
                    return
                last = state
            except OSError as exc:
                last = str(exc)
            # A refused connect is retried soon; an SSH attempt that failed costs a process.
            time.sleep(SSH_POLL if refused else 1.0)
        raise NodeforgeError(
            f"build sandbox {self.name} did not answer SSH on 127.0.0.1:{self.port} within "
            f"{BOOT_TIMEOUT:.0f}s (last: {last}); see the build log"
        )

    def stop(self) -> None:
        p = self._proc
        # SIGTERM makes nspawn ask the container's systemd to power off cleanly.
        if p is not None and proc.stop_group(p, STOP_TIMEOUT):
            log.warning("sandbox %s did not power off in %ss; killed", self.name, STOP_TIMEOUT)
        self._proc = None
        if self._watcher is not None:
            self._watcher.kill()
            self._watcher.wait(timeout=10)
            self._watcher = None
        release_mounts(self.tree, below_only=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
