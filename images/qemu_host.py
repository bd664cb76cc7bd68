"""The build host's qemu helpers that the qemu build target uses: a free TCP port, the tail of
a serial console log, and the KVM-or-TCG probe.

They live with the build (images/) so the build does not import the test lab; `lab/vm.py`
uses them too and re-exports them for its callers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodeforge import proc
from nodeforge.errors import CommandError

log = logging.getLogger("nodeforge.images.qemu_host")

QEMU = "qemu-system-x86_64"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\r")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on *host* right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def console_tail(path: Path, lines: int = 40) -> str:
    """The last *lines* lines of a serial console log, without terminal escapes."""
    try:
        raw = path.read_bytes()[-200_000:]
    except OSError:
        return "(no console output: the log file does not exist)"
    text = _ANSI.sub("", raw.decode(errors="replace"))
    out = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    return "\n".join(out[-lines:]) if out else "(console log is empty)"


# ---------------------------------------------------------------------------- accel probe

# Markers of real progress on the console during the probe boot (see `probe_accel`).
_PROBE_USERSPACE = ("Run /nodeforge-probe-init as init process", "Freeing unused kernel")
_PROBE_PANIC = "Kernel panic"
_ACCEL_CACHE: dict[str, AccelDecision] = {}


@dataclasses.dataclass(frozen=True)
class AccelDecision:
    accel: str  # "kvm" or "tcg"
    reason: str
    probe_seconds: float = 0.0


def decide_accel(
    kvm_usable: bool, console: str, exited: bool, timed_out: bool, elapsed: float
) -> AccelDecision:
    """Pure decision from a probe boot's evidence.

    The probe boots the image's kernel under KVM with ``rdinit=`` pointing at a program that
    does not exist and ``panic=-1`` + ``-no-reboot``: a working guest prints the kernel banner,
    reaches "Run ... as init process", panics and qemu exits, all in a second or two. A guest
    that hangs (no exit within the bound) or resets before reaching userspace (qemu exits
    without the marker: the reboot-loop case) means KVM is not usable here.
    """
    if not kvm_usable:
        return AccelDecision("tcg", "/dev/kvm is absent or not openable read-write", elapsed)
    text = _ANSI.sub("", console)
    boots = text.count("Linux version")
    reached = any(m in text for m in _PROBE_USERSPACE)
    if timed_out:
        what = "no kernel output at all" if boots == 0 else "kernel started but stalled"
        return AccelDecision("tcg", f"KVM probe hung ({what}) for {elapsed:.0f}s", elapsed)
    if boots > 1:
        return AccelDecision("tcg", f"KVM guest reboot-looped ({boots} kernel banners)", elapsed)
    if exited and reached:
        return AccelDecision("kvm", f"KVM guest reached userspace in {elapsed:.1f}s", elapsed)
    if exited and boots == 0:
        return AccelDecision("tcg", "KVM guest reset before printing the kernel banner", elapsed)
    return AccelDecision("tcg", "KVM guest stopped before reaching userspace", elapsed)


def kvm_usable(dev: str = "/dev/kvm") -> bool:
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


Runner = Callable[..., Any]


def probe_accel(
    kernel: Path,
    initrd: Path | None,
    workdir: Path,
    *,
    bound: float = 20.0,
    runner: Runner | None = None,
    kvm_check: Callable[[], bool] = kvm_usable,
    use_cache: bool = True,
) -> AccelDecision:
    """Decide between KVM and TCG by booting *kernel* under KVM for at most *bound* seconds.

    ``NODEFORGE_VM_ACCEL=kvm|tcg`` skips the probe. *runner* is `proc.run` (tests pass a fake).
    """
    forced = os.environ.get("NODEFORGE_VM_ACCEL", "").strip().lower()
    if forced in ("kvm", "tcg"):
        return AccelDecision(forced, "forced by NODEFORGE_VM_ACCEL")
    key = str(Path(kernel).resolve())
    if use_cache and key in _ACCEL_CACHE:
        return _ACCEL_CACHE[key]
    run = runner or proc.run
    start = time.monotonic()
    if not kvm_check():
        d = decide_accel(False, "", False, False, 0.0)
    else:
        workdir.mkdir(parents=True, exist_ok=True)
        log_path = workdir / "kvm-probe-console.log"
        log_path.unlink(missing_ok=True)
        argv = [
            QEMU, "-machine", "q35,accel=kvm", "-cpu", "host", "-m", "512", "-smp", "1",
            "-nodefaults", "-display", "none", "-no-reboot",
            "-serial", f"file:{log_path}", "-kernel", str(kernel),
        ]  # fmt: skip
        if initrd:
            argv += ["-initrd", str(initrd)]
        argv += [
            "-append",
            "console=ttyS0 panic=-1 rdinit=/nodeforge-probe-init init=/nodeforge-probe-init",
        ]
        timed_out = False
        exited = False
        try:
            run(argv, check=False, timeout=bound)
            exited = True
        except CommandError:  # proc.run raises on timeout (the child is killed)
            timed_out = True
        elapsed = time.monotonic() - start
        try:
            console = log_path.read_text(errors="replace")
        except OSError:
            console = ""
        d = decide_accel(True, console, exited, timed_out, elapsed)
    log.info("accelerator: %s (%s)", d.accel, d.reason)
    if use_cache:
        _ACCEL_CACHE[key] = d
    return d
