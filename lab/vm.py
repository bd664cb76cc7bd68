"""Boot a built nodeforge disk in qemu, reachable over SSH on a loopback port.

What this module guarantees:

* The artifact is never touched: the VM runs on a copy-on-write overlay
  (``qemu-img create -f qcow2 -b disk.qcow2 -F qcow2``) in its own work directory.
* Networking is qemu user-mode (slirp) with ``hostfwd=tcp:127.0.0.1:<free port>-:22``: only
  the loopback address is ever opened on the host, and the guest reaches nothing of ours.
* Optionally (`VMConfig.metadata`, a `CloudNet`) the user network boots a VM as a cloud does:
  ``net=169.254.169.0/24`` with ``guestfwd`` rules that map guest addresses (the metadata
  service at 169.254.169.254:80, an S3 endpoint ...) to server processes listening on
  loopback, and ``restrict=on``: the guest reaches nothing but those forwards, so no packet to
  them ever leaves qemu. qemu accepts a guestfwd address only inside the user network's own
  range. Each guest connection spawns `lab/relay.py` (guestfwd ``cmd:``), which connects to
  the listener: the ``tcp:`` form would share ONE connection, made at qemu start, for all.
* The serial console goes to ``<workdir>/console.log``; a VM that fails to come up reports
  the console tail and how long it waited.
* KVM is used only when a guest actually boots under it (`probe_accel`): on the project's
  machines /dev/kvm opens but nested guests hang or reboot-loop, so presence proves nothing.
  The probe result is cached for the life of the process.
* Every wait is bounded; `VM.stop()` (also on context exit, interpreter exit and SIGTERM when
  used as a context manager) kills qemu and deletes the overlay.

Boot modes (`VMConfig.boot`): ``uefi`` (OVMF, the default), ``bios`` (SeaBIOS, qemu's
own), ``uefi-secureboot`` (OVMF's Secure Boot build with Microsoft's keys enrolled, q35 +
SMM: the disk's signed shim, grub and kernel must verify) and ``kernel`` (qemu ``-kernel``
with the vmlinuz/initrd beside the disk). The firmware modes boot the disk's own loader.
The machine (`VMConfig.machine`) is q35 unless the caller asks for ``pc`` (i440fx, the
machine libvirt gives a domain that names none, as vagrant-libvirt boots a box).

Injection (the sealed image has no authorized_keys and may carry no params): systemd
credentials, nothing is written into the disk. With a firmware boot they are SMBIOS type 11
strings (``io.systemd.credential.binary:NAME=BASE64``, imported by PID 1 in a VM, systemd
>= 254); with ``kernel`` they go on the kernel command line. What is injected:

* root's SSH key as the systemd credential ``ssh.authorized_keys.root`` (systemd >= 252 ships
  tmpfiles.d/provision.conf, which writes /root/.ssh/authorized_keys from it);
* node params as /etc/nodeforge/node.yaml (the agent's first params source), written by
  systemd-tmpfiles from the ``tmpfiles.extra`` credential (``f~`` line, base64 content)
  before any service starts; or, alternatively, ``nodeforge.*`` keys (the agent's kernel
  command line source) via `VMConfig.cmdline_params`;
* optionally (``compat_net``) a systemd-networkd DHCP config for images that do not ship one,
  as the ``network.network.*`` credential plus ``systemd.wants=systemd-networkd.service``;
* optionally (``compat_keygen``) a ``ssh-keygen -A`` unit (``systemd.extra-unit.*`` credential,
  systemd >= 256) for images without their own first-boot host-key unit. Debian's
  sshd-keygen.service is no help: it has ConditionFirstBoot=yes, which is false here.

A unit the harness pulls in is ``systemd.wants=`` on a kernel command line, and a
``systemd.unit-dropin.multi-user.target`` credential (``Wants=``, systemd >= 256) with a
firmware boot. Kernel command line params (`VMConfig.cmdline_params`, ``extra_append``)
exist only with ``boot="kernel"``: a firmware boot refuses them.

Params may instead come as a platform hands them over without a metadata service
(`VMConfig.seed`): a NoCloud seed (vfat, label ``cidata``) or an OpenStack config drive
(ISO 9660, label ``config-2``), built by lab/seed_media.py and attached read-only as a second
virtio disk, for the agent's seed-device source (bootstrap/params_seed.py).

A debugfs -w edit was considered and rejected: debugfs cannot write through a qcow2 overlay
(only raw images), and converting the overlay to raw copies the whole disk.
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import hashlib
import ipaddress
import json
import logging
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nodeforge import proc
from nodeforge.errors import CommandError, NodeforgeError
from nodeforge.images import build_proc
from nodeforge.images.bootdisk import FS_LABEL

# The qemu helpers the build shares with the lab live in images/ (the build must not import
# the lab); re-exported here for the lab's callers, benches and tests.
from nodeforge.images.qemu_host import (  # noqa: F401
    _ACCEL_CACHE,
    QEMU,
    AccelDecision,
    Runner,
    console_tail,
    decide_accel,
    free_port,
    kvm_usable,
    probe_accel,
)
from nodeforge.images.ssh_args import throwaway_ssh_argv
from nodeforge.lab import seed_media

log = logging.getLogger("nodeforge.lab.vm")

# x86 COMMAND_LINE_SIZE; the kernel silently truncates beyond it.
CMDLINE_MAX = 2048
BOOT_MODES = ("uefi", "bios", "uefi-secureboot", "kernel")
# qemu machine types: q35 (the VM tier's default) and pc (i440fx: what libvirt, and so
# vagrant-libvirt, gives a domain that names no machine type).
MACHINES = ("q35", "pc")
# What a guest's reset does: "warm" resets the machine inside the running qemu (qemu's own
# default); "exit" (-no-reboot) ends qemu, and the caller starts the same machine again
# (VM.restart_after_reset), as KubeVirt's reboot policy Terminate and Firecracker do. Under
# TCG qemu's warm reset hung twice in about ten reboots here (nothing after the kernel's "reboot:
# machine restart", or after OVMF's "BdsDxe: starting Boot0001"); a cold start never did.
RESETS = ("warm", "exit")
REBOOT_LINE = "reboot: Restarting system"  # the guest kernel's last words before a reset
# Debian's ovmf package: (code, vars template) per firmware boot mode. The 4M builds; the
# secure-boot code needs SMM, its ".ms" vars have Microsoft's keys (Debian's shim is signed
# by Microsoft's UEFI CA) with Secure Boot on.
OVMF_DIR = Path("/usr/share/OVMF")
FIRMWARE = {
    "uefi": ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd"),
    "uefi-secureboot": ("OVMF_CODE_4M.secboot.fd", "OVMF_VARS_4M.ms.fd"),
}
# SMBIOS type 11 strings: qemu takes them on its command line, where ',' must be doubled;
# base64 has none. Bounded so a runaway credential fails here, not in the firmware.
SMBIOS_CREDENTIAL_MAX = 48 * 1024

# ---------------------------------------------------------------------------- small helpers


def ssh_banner(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> str | None:
    """The SSH identification string if an sshd answers on host:port within *timeout*, else None.

    With slirp the TCP connect always succeeds (qemu accepts), so only the banner proves
    that sshd inside the guest is up.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            data = b""
            while b"\n" not in data and len(data) < 256:
                chunk = s.recv(256)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    line = data.decode(errors="replace").strip()
    return line if line.startswith("SSH-") else None


# ---------------------------------------------------------------------------- injection


def tmpfiles_write_line(path: str, content: bytes, mode: str = "0600") -> str:
    """A tmpfiles.d line that creates *path* with *content* (``f~``: argument is base64)."""
    if any(c.isspace() for c in path):
        raise NodeforgeError(f"VM injection: path {path!r} must not contain whitespace")
    return f"f~ {path} {mode} root root - {base64.b64encode(content).decode()}"


def credential_arg(name: str, value: bytes) -> str:
    return f"systemd.set_credential_binary={name}:{base64.b64encode(value).decode()}"


VM_NETWORK = b"""[Match]
Virtualization=!container
Name=en* eth*

[Network]
DHCP=yes
"""


# For images without a first-boot host key unit (systemd >= 256 reads systemd.extra-unit.*).
VM_KEYGEN_UNIT = b"""[Unit]
Description=nodeforge VM harness: generate missing SSH host keys
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key
Before=ssh.service ssh.socket
After=local-fs.target

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A
"""


_CRED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@~-]{0,200}")


def smbios_credential(name: str, value: bytes) -> list[str]:
    """qemu arguments that hand *name*=*value* to the guest's systemd as a credential."""
    if not _CRED_NAME.fullmatch(name):
        raise NodeforgeError(f"VM credential name {name!r} is not [A-Za-z0-9._@~-]")
    text = f"io.systemd.credential.binary:{name}={base64.b64encode(value).decode()}"
    if len(text) > SMBIOS_CREDENTIAL_MAX:
        raise NodeforgeError(
            f"VM credential {name} is {len(value)} bytes, over the SMBIOS limit of "
            f"{SMBIOS_CREDENTIAL_MAX} encoded: shorten node_yaml / extra_files"
        )
    return ["-smbios", f"type=11,value={text}"]


def wants_dropin(units: Sequence[str]) -> bytes:
    """A multi-user.target drop-in that pulls *units* in (firmware boot: no systemd.wants=)."""
    return ("[Unit]\nWants=" + " ".join(units) + "\n").encode()


def cmdline_from_params(params: dict[str, Any]) -> list[str]:
    """``nodeforge.<key>=<value>`` words for the agent's kernel command line source."""
    words = []
    for k, v in params.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, (list, tuple)):
            v = ",".join(str(x) for x in v)
        elif isinstance(v, dict):
            raise NodeforgeError(
                f"VM params: {k}: mappings cannot go on the kernel command line; use node_yaml"
            )
        v = str(v)
        if any(c.isspace() for c in v):
            raise NodeforgeError(f"VM params: {k}: value {v!r} contains whitespace")
        words.append(f"nodeforge.{k}={v}")
    return words


# ---------------------------------------------------------------------------- VM


@dataclasses.dataclass(frozen=True)
class CloudNet:
    """qemu user-network wiring for a cloud-style boot (see the module docstring).

    *forwards* maps a guest ``address:port`` (inside *net*) to a loopback port on the host.
    """

    forwards: dict[str, int]
    net: str = "169.254.169.0/24"

    def netdev_options(self) -> list[str]:
        net = ipaddress.ip_network(self.net)
        if net.version != 4 or net.prefixlen > 29:
            raise NodeforgeError(f"VM metadata net {self.net}: give an IPv4 /8../29 network")
        out = [f"net={net}", "restrict=on"]
        for guest, port in self.forwards.items():
            addr, sep, gport = guest.rpartition(":")
            if not sep or not gport.isdigit() or not 0 < int(gport) < 65536:
                raise NodeforgeError(f"VM metadata forward {guest!r}: give ADDRESS:PORT")
            try:
                ip = ipaddress.ip_address(addr)
            except ValueError:
                raise NodeforgeError(
                    f"VM metadata forward {guest!r}: not an IPv4 address"
                ) from None
            if ip not in net:
                raise NodeforgeError(
                    f"VM metadata forward {guest!r}: {ip} is outside the user network {net} "
                    "(qemu refuses a guestfwd there)"
                )
            if not isinstance(port, int) or not 0 < port < 65536:
                raise NodeforgeError(f"VM metadata forward {guest!r}: host port {port!r}")
            # cmd: (a relay per guest connection), not tcp: (ONE chardev connection opened at
            # qemu start that every guest connection shares; lab/relay.py says why).
            out.append(f"guestfwd=tcp:{ip}:{int(gport)}-cmd:{relay_command(port)}")
        return out


RELAY = Path(__file__).resolve().parent / "relay.py"


def relay_command(port: int) -> str:
    """`python3 lab/relay.py PORT`: words without commas (qemu's option separator)."""
    words = [sys.executable, str(RELAY), str(port)]
    for w in words:
        if not w or "," in w or any(c.isspace() for c in w):
            raise NodeforgeError(f"VM metadata relay: {w!r} has a comma or a space; qemu's "
                                 "guestfwd cmd: cannot carry it (move the checkout)")  # fmt: skip
    return " ".join(words)


@dataclasses.dataclass
class VMConfig:
    image_dir: Path  # holds disk.qcow2, vmlinuz, initrd.img (the `nodeforge build` output)
    workdir: Path  # overlay, console log, pid file, key (created; removed on stop unless keep)
    name: str = "vm"
    memory_mb: int = 2048
    cpus: int = 2
    accel: str = "auto"  # auto | kvm | tcg
    boot: str = "uefi"  # uefi | bios | uefi-secureboot | kernel (BOOT_MODES)
    machine: str = "q35"  # q35 | pc (MACHINES)
    reset: str = "warm"  # warm | exit (RESETS)
    # The overlay's size when larger than the image's disk (a cloud's bigger volume): the
    # image grows root into it at first boot. None: the image's own size.
    disk_size_mib: int | None = None
    ovmf_dir: Path = OVMF_DIR
    node_yaml: str | None = None  # written as /etc/nodeforge/node.yaml
    cmdline_params: dict[str, Any] | None = None  # nodeforge.* kernel command line params
    authorized_key: str | None = None  # None: generate a key pair in workdir
    compat_net: bool = False  # inject a networkd DHCP config (image without one)
    compat_keygen: bool = False  # pull in sshd-keygen.service (image without a keygen unit)
    # Private link between VMs of one test (qemu socket netdev: one VM listens on a loopback
    # port, the others connect). A static address is set by a networkd credential matched by MAC.
    link_listen: int | None = None  # 127.0.0.1 port this VM listens on
    link_connect: int | None = None  # 127.0.0.1 port of the listening VM
    link_ip: str | None = None  # e.g. "10.77.0.10/24"
    link_mac: str = "52:54:00:4e:46:10"
    # Cloud-style boot: the user network carries the metadata service (and any other forward).
    metadata: CloudNet | None = None
    inject_key: bool = True  # False: root's key is not put on the command line (cloud path)
    extra_append: Sequence[str] = ()
    extra_files: dict[str, bytes] = dataclasses.field(default_factory=dict)  # path -> content
    boot_timeout: float = 420.0  # to SSH login
    probe_bound: float = 20.0
    keep: bool = False  # keep the work dir (console log) after stop
    # Seconds the VM's RTC (its wall clock at boot: no time server is reachable from the lab)
    # is ahead of (or, negative, behind) the host's: a skewed machine. 0: the host's time.
    rtc_offset_s: int = 0
    # User-data on a seed device: ("nocloud" | "configdrive", text) -> a read-only virtio disk
    # (lab/seed_media.py). None: no seed device.
    seed: tuple[str, str] | None = None
    qemu: str = QEMU

    @property
    def disk(self) -> Path:
        return self.image_dir / "disk.qcow2"

    @property
    def kernel(self) -> Path:
        return self.image_dir / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.image_dir / "initrd.img"


class BootTimeout(NodeforgeError):
    """The VM did not become reachable; carries the console tail and the time waited."""


_LIVE: set[VM] = set()


def _stop_all() -> None:
    for vm in list(_LIVE):
        try:
            vm.stop()
        except Exception:  # noqa: BLE001, S110 - best effort at interpreter exit
            pass


atexit.register(_stop_all)


class VM:
    """One qemu guest. Use as a context manager; `start()` then `wait_ssh()`."""

    def __init__(self, cfg: VMConfig, *, runner: Runner | None = None):
        self.cfg = cfg
        self.run = runner or proc.run
        self.workdir = Path(cfg.workdir)
        self.overlay = self.workdir / f"{cfg.name}.qcow2"
        self.console = self.workdir / "console.log"
        self.pidfile = self.workdir / "qemu.pid"
        self.key = self.workdir / "id_ed25519"
        self.port: int | None = None
        self.pid: int | None = None
        self._watcher: Any = None  # build_proc.stop_with_this_process() of the qemu pid
        self.accel: AccelDecision | None = None
        self.started_at: float | None = None  # monotonic, when qemu was started
        self.started_wall: float | None = None
        self.ready_after: float | None = None  # seconds from start to SSH login
        self._prev_term = None
        self.seed_image: Path | None = None  # built by start() when cfg.seed is set
        self._argv: list[str] | None = None  # qemu's argv, made by start()
        self.restarts = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> VM:
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._prev_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._prev_term is not None:
            signal.signal(signal.SIGTERM, self._prev_term)

    def check_inputs(self) -> None:
        cfg = self.cfg
        if cfg.boot not in BOOT_MODES:
            raise NodeforgeError(f"VM boot mode {cfg.boot!r} is not one of {', '.join(BOOT_MODES)}")
        if cfg.machine not in MACHINES:
            raise NodeforgeError(
                f"VM {cfg.name}: machine {cfg.machine!r} is not one of {', '.join(MACHINES)}"
            )
        if cfg.reset not in RESETS:
            raise NodeforgeError(
                f"VM {cfg.name}: reset {cfg.reset!r} is not one of {', '.join(RESETS)}"
            )
        if cfg.boot == "uefi-secureboot" and cfg.machine != "q35":
            # OVMF's Secure Boot build keeps its variables in SMM, which needs q35.
            raise NodeforgeError(f"VM {cfg.name}: boot uefi-secureboot needs machine q35")
        if cfg.boot != "kernel" and (cfg.cmdline_params or cfg.extra_append):
            raise NodeforgeError(
                f"VM {cfg.name}: cmdline_params/extra_append go on a kernel command line, "
                f"which a {cfg.boot} boot does not take: use boot='kernel', or node_yaml"
            )
        if type(cfg.rtc_offset_s) is not int or abs(cfg.rtc_offset_s) > 10 * 365 * 86400:
            raise NodeforgeError(
                f"VM {cfg.name}: rtc_offset_s {cfg.rtc_offset_s!r} must be an int of at most "
                "10 years either way"
            )
        if cfg.seed is not None:
            seed_media.check(cfg.seed)
        for tool in (cfg.qemu, "qemu-img"):
            proc.require_tool(tool)
        need = [cfg.disk] + ([cfg.kernel, cfg.initrd] if cfg.boot == "kernel" else [])
        for p in need:
            if not p.is_file():
                raise NodeforgeError(
                    f"VM image: {p} is missing; point at a `nodeforge build` output directory "
                    "(disk.qcow2, vmlinuz, initrd.img)"
                )
        for name in FIRMWARE.get(cfg.boot, ()):
            if not (cfg.ovmf_dir / name).is_file():
                raise NodeforgeError(
                    f"VM boot {cfg.boot}: firmware {cfg.ovmf_dir / name} is missing; "
                    "install Debian's ovmf package (apt-get install ovmf)"
                )

    def start(self) -> None:
        cfg = self.cfg
        self.check_inputs()
        self.workdir.mkdir(parents=True, exist_ok=True)
        _LIVE.add(self)
        if cfg.accel == "auto" and cfg.kernel.is_file():
            self.accel = probe_accel(cfg.kernel, cfg.initrd, self.workdir, bound=cfg.probe_bound)
        elif cfg.accel == "auto":
            self.accel = AccelDecision("tcg", "no kernel beside the disk to probe KVM with")
        else:
            self.accel = AccelDecision(cfg.accel, "chosen by the caller")
        size = [f"{cfg.disk_size_mib}M"] if cfg.disk_size_mib else []
        self.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(cfg.disk.resolve()),
             "-F", "qcow2", str(self.overlay), *size],
            timeout=60,
        )  # fmt: skip
        if cfg.seed is not None:
            self.seed_image = seed_media.build(cfg.seed, self.workdir, cfg.name, self.run)
        pub = self.ensure_key()
        self.port = free_port()
        self.console.unlink(missing_ok=True)
        self.pidfile.unlink(missing_ok=True)
        self._argv = self.qemu_argv(pub)
        self._launch()

    def _launch(self) -> None:
        """Start qemu with this VM's argv (the overlay, OVMF's vars copy and the SSH port
        stay this machine's across a power cycle)."""
        cfg = self.cfg
        assert self._argv is not None and self.accel is not None
        self.started_at = time.monotonic()
        self.started_wall = time.time()
        # -daemonize: qemu returns once the guest is set up (errors such as a bad disk come
        # back here with their message); the pid file lets stop() end it.
        self.run(self._argv, timeout=60, hint="qemu could not start the VM")
        try:
            self.pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError) as exc:
            raise NodeforgeError(f"qemu started but wrote no pid file {self.pidfile}") from exc
        # qemu 7.2 cannot exit with its parent, and -daemonize detaches it: without this a
        # SIGKILLed harness would leave the VM running.
        self._watcher = build_proc.stop_with_this_process(self.pid)
        (self.workdir / "vm.json").write_text(json.dumps(self.describe(), indent=2) + "\n")
        log.info("VM %s: qemu pid %s, ssh 127.0.0.1:%s, accel %s", cfg.name, self.pid,
                 self.port, self.accel.accel)  # fmt: skip

    def ensure_key(self) -> str:
        """Root's public key for this VM (a key pair in the work dir unless the caller gave one)."""
        cfg = self.cfg
        if cfg.authorized_key is not None:
            return cfg.authorized_key.strip()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.key.exists():
            self.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                      f"nodeforge-vm-{cfg.name}", "-f", str(self.key)], timeout=30)  # fmt: skip
        return (self.key.with_suffix(".pub")).read_text().strip()

    def injection(self, pubkey: str) -> tuple[list[tuple[str, bytes]], list[str]]:
        """(credentials, units to pull in) for the guest's systemd, whatever carries them."""
        cfg = self.cfg
        creds = []
        if cfg.inject_key:  # a cloud-style boot takes the key from IMDS public-keys instead
            creds.append(("ssh.authorized_keys.root", (pubkey + "\n").encode()))
        wants: list[str] = []
        lines = []
        if cfg.node_yaml is not None:
            lines.append(tmpfiles_write_line("/etc/nodeforge/node.yaml", cfg.node_yaml.encode()))
        for path, content in cfg.extra_files.items():
            lines.append(tmpfiles_write_line(path, content))
        if lines:
            creds.append(("tmpfiles.extra", ("\n".join(lines) + "\n").encode()))
        if cfg.compat_net:
            creds.append(("network.network.50-nodeforge-vm", VM_NETWORK))
            # systemd-network-generator copies network.network.* credentials to /run/systemd/network.
            wants += ["systemd-network-generator.service", "systemd-networkd.service"]
        if cfg.link_ip:
            net = f"[Match]\nMACAddress={cfg.link_mac}\n\n[Network]\nAddress={cfg.link_ip}\n"
            creds.append(("network.network.05-nodeforge-link", net.encode()))
            if not cfg.compat_net:
                wants.append("systemd-network-generator.service")
        if cfg.compat_keygen:
            creds.append(("systemd.extra-unit.nodeforge-vm-keygen.service", VM_KEYGEN_UNIT))
            wants.append("nodeforge-vm-keygen.service")
        return creds, wants

    def kernel_append(self, pubkey: str) -> str:
        cfg = self.cfg
        words = [f"root=LABEL={FS_LABEL}", "rw", "console=ttyS0"]
        creds, wants = self.injection(pubkey)
        words += [credential_arg(name, value) for name, value in creds]
        words += [f"systemd.wants={u}" for u in wants]
        if cfg.cmdline_params:
            words += cmdline_from_params(cfg.cmdline_params)
        words += list(cfg.extra_append)
        text = " ".join(words)
        if len(text) >= CMDLINE_MAX:
            raise NodeforgeError(
                f"VM kernel command line is {len(text)} bytes (limit {CMDLINE_MAX - 1}): "
                "shorten node_yaml / extra_files"
            )
        return text

    def firmware_argv(self, pubkey: str, *, fresh: bool = True) -> list[str]:
        """The firmware (OVMF flash: read-only code, this VM's own copy of the vars) and
        the credentials as SMBIOS type 11 strings. *fresh*: copy the vars anew from the
        template (False: a power cycle keeps what the machine wrote there)."""
        cfg = self.cfg
        argv: list[str] = []
        if cfg.boot in FIRMWARE:
            code, vars_template = (cfg.ovmf_dir / n for n in FIRMWARE[cfg.boot])
            vars_copy = self.workdir / "OVMF_VARS.fd"
            if fresh or not vars_copy.exists():
                shutil.copyfile(vars_template, vars_copy)
            if cfg.boot == "uefi-secureboot":
                argv += ["-global", "driver=cfi.pflash01,property=secure,value=on"]
            argv += [
                "-drive", f"if=pflash,format=raw,unit=0,file={code},readonly=on",
                "-drive", f"if=pflash,format=raw,unit=1,file={vars_copy}",
            ]  # fmt: skip
        creds, wants = self.injection(pubkey)
        if wants:
            creds.append(("systemd.unit-dropin.multi-user.target", wants_dropin(wants)))
        for name, value in creds:
            argv += smbios_credential(name, value)
        return argv

    def qemu_argv(self, pubkey: str, *, fresh: bool = True) -> list[str]:
        cfg = self.cfg
        assert self.accel is not None and self.port is not None
        accel = self.accel.accel
        # Secure Boot's OVMF keeps its variables in SMM: the machine needs it.
        smm = ",smm=on" if cfg.boot == "uefi-secureboot" else ""
        argv = [
            cfg.qemu, "-name", cfg.name,
            "-machine", f"{cfg.machine},accel={accel}{smm}", "-cpu", "host" if accel == "kvm" else "max",
            "-m", str(cfg.memory_mb), "-smp", str(cfg.cpus),
            "-nodefaults", "-display", "none", "-vga", "none",
            "-serial", f"file:{self.console}",
        ]  # fmt: skip
        if cfg.boot == "kernel":
            argv += ["-kernel", str(cfg.kernel), "-initrd", str(cfg.initrd),
                     "-append", self.kernel_append(pubkey)]  # fmt: skip
        else:
            argv += self.firmware_argv(pubkey, fresh=fresh)
        argv += [
            "-drive", f"file={self.overlay},if=virtio,format=qcow2,cache=unsafe",
            *(["-drive", f"file={self.seed_image},if=virtio,format=raw,readonly=on"]
              if self.seed_image else []),
            "-netdev", ",".join(["user", "id=n0", f"hostfwd=tcp:127.0.0.1:{self.port}-:22",
                                 *(cfg.metadata.netdev_options() if cfg.metadata else [])]),
            "-device", "virtio-net-pci,netdev=n0",
            "-device", "virtio-rng-pci",
        ]  # fmt: skip
        if cfg.link_listen or cfg.link_connect:
            how = (f"listen=127.0.0.1:{cfg.link_listen}" if cfg.link_listen
                   else f"connect=127.0.0.1:{cfg.link_connect}")  # fmt: skip
            argv += ["-netdev", f"socket,id=n1,{how}",
                     "-device", f"virtio-net-pci,netdev=n1,mac={cfg.link_mac}"]  # fmt: skip
        if cfg.rtc_offset_s:
            base = time.gmtime(time.time() + cfg.rtc_offset_s)
            argv += ["-rtc", "base=" + time.strftime("%Y-%m-%dT%H:%M:%S", base)]
        if cfg.reset == "exit":
            argv.append("-no-reboot")
        argv += [
            "-daemonize", "-pidfile", str(self.pidfile),
        ]  # fmt: skip
        return argv

    def alive(self) -> bool:
        return proc.pid_alive(self.pid)

    def _end_qemu(self, grace: float) -> None:
        if self.pid and self.alive():
            # Only qemu itself: -daemonize took it out of any group we could signal.
            proc.stop_group(self.pid, grace, group=False)
        self.pid = None
        if self._watcher is not None:
            self._watcher.kill()
            self._watcher.wait(timeout=10)
            self._watcher = None

    def power_cycle(self) -> None:
        """Pull the plug and start the same machine again, as a cloud's stop/start does: the
        same disk overlay, firmware variables and SSH port; a new qemu process, so the
        firmware starts cold (a warm reset keeps the process). The console so far is kept
        as console.N.log (qemu's -serial file: starts its file anew)."""
        if self._argv is None:
            raise NodeforgeError(f"VM {self.cfg.name}: power_cycle before start")
        self._end_qemu(grace=5.0)
        log.warning("VM %s: power cycle", self.cfg.name)
        self._start_again()

    def restart_after_reset(self, timeout: float) -> None:
        """With reset="exit": wait, bounded, for qemu to end on the guest's own reset, check
        that the guest asked for it (the kernel's "reboot: Restarting system" on the console,
        not a crash or a power-off), then start the same machine again (as power_cycle)."""
        if self._argv is None or self.cfg.reset != "exit":
            raise NodeforgeError(
                f"VM {self.cfg.name}: restart_after_reset needs a started VM with reset='exit'"
            )
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                raise self.boot_failure("qemu still running after the guest's reboot", timeout)
            time.sleep(1)
        said = console_tail(self.console, lines=80)
        if REBOOT_LINE not in said:
            raise NodeforgeError(
                f"VM {self.cfg.name}: qemu ended, but the guest did not reboot (no "
                f"{REBOOT_LINE!r} on its console {self.console}); last lines:\n{said}"
            )
        self._end_qemu(grace=0.0)  # (its watcher)
        log.info("VM %s: the guest reset; qemu started again", self.cfg.name)
        self._start_again()

    def _start_again(self) -> None:
        assert self._argv is not None
        self.restarts += 1
        if self.console.exists():
            self.console.rename(self.console.with_name(f"console.{self.restarts}.log"))
        self.pidfile.unlink(missing_ok=True)
        # Made again (an -rtc base follows the wall clock), keeping the vars the firmware wrote.
        self._argv = self.qemu_argv(self.ensure_key(), fresh=False)
        self._launch()

    def stop(self, grace: float = 10.0) -> None:
        """Kill qemu (SIGTERM, then SIGKILL) and remove the overlay. Idempotent."""
        self._end_qemu(grace)
        self.overlay.unlink(missing_ok=True)
        if not self.cfg.keep and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)
        _LIVE.discard(self)

    # -- readiness ---------------------------------------------------------------------------
    def elapsed(self) -> float:
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    def boot_failure(self, what: str, waited: float, limit: float | None = None) -> BootTimeout:
        accel = self.accel.accel if self.accel else "?"
        limit = self.cfg.boot_timeout if limit is None else limit
        return BootTimeout(
            f"VM {self.cfg.name} ({accel}): {what} after waiting {waited:.0f}s "
            f"(limit {limit:.0f}s); console log {self.console}, last lines:\n"
            + console_tail(self.console)
        )

    def ssh_argv(self, *command: str, connect_timeout: int = 10) -> list[str]:
        assert self.port is not None
        return throwaway_ssh_argv(
            self.key, port=self.port, connect_timeout=connect_timeout, no_config=True,
            command=command,
        )  # fmt: skip

    def ssh(self, command: str, timeout: float = 120, check: bool = True):
        """Run a shell command in the guest as root; returns the CompletedProcess."""
        return self.run(self.ssh_argv(command), timeout=timeout, check=check,
                        hint=f"(in VM {self.cfg.name})")  # fmt: skip

    def wait_ssh(self, timeout: float | None = None) -> float:
        """Wait until root can log in over SSH; returns the seconds since qemu started."""
        limit = self.cfg.boot_timeout if timeout is None else timeout
        assert self.started_at is not None and self.port is not None
        deadline = self.started_at + limit
        last = ""
        while True:
            if not self.alive():
                raise self.boot_failure("qemu exited", self.elapsed())
            if time.monotonic() > deadline:
                raise self.boot_failure(f"no SSH login on 127.0.0.1:{self.port} ({last})",
                                        self.elapsed())  # fmt: skip
            banner = ssh_banner(self.port, timeout=min(5.0, max(1.0, deadline - time.monotonic())))
            if banner is None:
                last = "sshd never answered"
                time.sleep(2)
                continue
            try:
                cp = self.ssh("true", timeout=30, check=False)
            except CommandError as exc:
                last = f"ssh login timed out: {exc.output[-200:]}"
                continue
            if cp.returncode == 0:
                self.ready_after = self.elapsed()
                return self.ready_after
            last = f"sshd answers ({banner}) but login fails: {(cp.stdout or '').strip()[-200:]}"
            time.sleep(2)

    def wait_unit(self, unit: str, timeout: float = 300) -> str:
        """Wait until *unit* leaves activating/inactive-with-pending-job; return its state."""
        start = time.monotonic()
        deadline = start + timeout
        state = "unknown"
        while time.monotonic() < deadline:
            cp = self.ssh(f"systemctl show -P ActiveState {unit}; systemctl list-jobs --no-legend {unit}",
                          timeout=60, check=False)  # fmt: skip
            lines = (cp.stdout or "").strip().splitlines()
            state = lines[0].strip() if lines else "unknown"
            pending = len(lines) > 1
            if state in ("active", "failed") or (state == "inactive" and not pending):
                return state
            time.sleep(3)
        raise self.boot_failure(f"unit {unit} still {state}", time.monotonic() - start, timeout)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.cfg.name,
            "pid": self.pid,
            "ssh": f"ssh://root@127.0.0.1:{self.port}",
            "port": self.port,
            "key": str(self.key) if self.cfg.authorized_key is None else None,
            "accel": self.accel.accel if self.accel else None,
            "accel_reason": self.accel.reason if self.accel else None,
            "boot": self.cfg.boot,
            "console": str(self.console),
            "overlay": str(self.overlay),
            "image_dir": str(self.cfg.image_dir),
        }

    @property
    def host_spec(self) -> str:
        return f"ssh://root@127.0.0.1:{self.port}?key={self.key}&name={self.cfg.name}"


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def image_id(image_dir: Path) -> str:
    """Short id of an image (for work dir names): sha256 prefix of its manifest or disk path."""
    m = Path(image_dir) / "manifest.json"
    data = m.read_bytes() if m.exists() else str(Path(image_dir).resolve()).encode()
    return hashlib.sha256(data).hexdigest()[:10]
