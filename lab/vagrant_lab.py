"""Run the repository's Vagrant lab on this machine: a private libvirtd, a box from a build.

Used by the e2e tier (tests/e2e/test_vm_vagrant.py) and usable by hand. What it guarantees:

* `vagrant_driver`: the vagrant-libvirt domain type. ``NODEFORGE_VAGRANT_DRIVER`` (``kvm`` or
  ``qemu``, full match) wins; otherwise ``kvm`` only when a guest really boots under KVM
  (`images.qemu_host.probe_accel`: /dev/kvm opening proves nothing on nested hosts), else
  ``qemu`` (TCG).
* `write_box`: a libvirt box from a build's output directory (disk.qcow2): metadata.json,
  the disk as box.img, and images/box/Vagrantfile (the disk boots from firmware): the same
  three files the qemu target's box carries.
* `Libvirtd`: libvirtd and virtlogd started by us, without systemd, libvirtd's sockets in
  our own directory (``qemu:///system?socket=...``). It refuses to start beside a running
  libvirtd or virtlogd (their state would be shared), and stops both on `stop()`, on
  interpreter exit, and when this process dies (`build_proc.stop_with_this_process` watchers).
* `Libvirtd.remove`: every domain, network and pool named, destroyed and undefined (with
  their volumes), and `Libvirtd.leftovers` lists what is still there.
"""

from __future__ import annotations

import atexit
import json
import math
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.images import build_proc
from nodeforge.images.packer_build import BOX_VAGRANTFILE
from nodeforge.images.qemu_host import AccelDecision

DRIVER_ENV = "NODEFORGE_VAGRANT_DRIVER"
DRIVERS = ("kvm", "qemu")
# libvirt object names the lab may create or remove (no shell or XML metacharacters).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# The daemons' own names in /proc/PID/comm.
DAEMONS = ("libvirtd", "virtlogd")


def vagrant_driver(env: Mapping[str, str], accel: Callable[[], AccelDecision]) -> str:
    """``kvm`` or ``qemu`` for vagrant-libvirt's ``driver``; *accel* is called only when the
    environment does not choose."""
    raw = env.get(DRIVER_ENV, "")
    if raw:
        if raw not in DRIVERS:
            raise NodeforgeError(
                f"{DRIVER_ENV}={raw!r} is not valid: say kvm (hardware) or qemu (TCG), or "
                "leave it unset to probe KVM"
            )
        return raw
    return "kvm" if accel().accel == "kvm" else "qemu"


def box_metadata(virtual_bytes: int) -> dict[str, object]:
    """vagrant-libvirt's metadata.json: virtual_size is whole GiB, rounded up."""
    if virtual_bytes <= 0:
        raise NodeforgeError(f"box: disk virtual size {virtual_bytes} is not positive")
    return {
        "provider": "libvirt",
        "format": "qcow2",
        "virtual_size": math.ceil(virtual_bytes / 2**30),
    }


def write_box(
    image_dir: Path, out: Path, *, run: Callable[..., subprocess.CompletedProcess] = proc.run
) -> Path:
    """A libvirt box (*out*, an uncompressed tar) from the build output in *image_dir*."""
    disk = image_dir / "disk.qcow2"
    if not disk.is_file():
        raise NodeforgeError(f"box: {disk} is missing: point at a build's output directory")
    info = json.loads(run(["qemu-img", "info", "--output=json", str(disk)], timeout=60).stdout)
    if info.get("format") != "qcow2" or not isinstance(info.get("virtual-size"), int):
        raise NodeforgeError(
            f"box: {disk} is not a qcow2 image (qemu-img info: {info.get('format')!r})"
        )
    stage = out.parent / (out.name + ".d")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        (stage / "metadata.json").write_text(json.dumps(box_metadata(info["virtual-size"])) + "\n")
        shutil.copyfile(BOX_VAGRANTFILE, stage / "Vagrantfile")
        (stage / "box.img").symlink_to(disk.resolve())  # tar -h stores the disk, not the link
        tmp = out.with_name(out.name + ".part")
        run(
            ["tar", "-chf", str(tmp), "-C", str(stage), "metadata.json", "Vagrantfile", "box.img"],
            timeout=600,
        )
        tmp.replace(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def running(names: Iterable[str] = DAEMONS) -> list[tuple[int, str]]:
    """(pid, name) of live processes whose command name is one of *names*."""
    want = set(names)
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (c := _comm(int(d.name))) in want and proc.pid_alive(int(d.name)):
            found.append((int(d.name), c))
    return sorted(found)


def libvirtd_conf(sock_dir: Path, log_file: Path) -> str:
    """libvirtd.conf: sockets in *sock_dir* (root only), no auth on them, errors to *log_file*."""
    return (
        f'unix_sock_dir = "{sock_dir}"\n'
        'unix_sock_group = "root"\n'
        'unix_sock_rw_perms = "0700"\n'
        'unix_sock_ro_perms = "0700"\n'
        'auth_unix_rw = "none"\n'
        'auth_unix_ro = "none"\n'
        f'log_outputs = "3:file:{log_file}"\n'
    )


@dataclass
class Libvirtd:
    """A libvirtd (and its virtlogd) of our own, rooted in *workdir*."""

    workdir: Path
    pids: dict[str, int] = field(default_factory=dict)
    _watchers: list[subprocess.Popen] = field(default_factory=list)

    @property
    def sock_dir(self) -> Path:
        return self.workdir / "run"

    @property
    def uri(self) -> str:
        return f"qemu:///system?socket={self.sock_dir}/libvirt-sock"

    @property
    def log(self) -> Path:
        return self.workdir / "libvirtd.log"

    def start(self, timeout: float = 60.0) -> None:
        others = running()
        if others:
            raise NodeforgeError(
                "a libvirtd/virtlogd already runs here ("
                + ", ".join(f"{n} pid {p}" for p, n in others)
                + "): the lab starts its own; stop that one first"
            )
        # Autostarted objects would start with our daemon and outlive it (bridges, dnsmasq).
        auto = sorted(str(f) for d in AUTOSTART_DIRS if d.is_dir() for f in d.iterdir())
        if auto:
            raise NodeforgeError(
                f"libvirt autostarts {', '.join(auto)}: they would start with the lab's libvirtd "
                "and outlive it; disable them (virsh net-autostart --disable NAME, "
                "virsh autostart --disable NAME)"
            )
        for tool in ("libvirtd", "virtlogd", "virsh"):
            proc.require_tool(tool)
        self.sock_dir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "libvirtd.conf"
        conf.write_text(libvirtd_conf(self.sock_dir, self.log))
        atexit.register(self.stop)
        for name, argv in (
            ("virtlogd", ["virtlogd", "-d", "-p", str(self.workdir / "virtlogd.pid")]),
            (
                "libvirtd",
                ["libvirtd", "-d", "--config", str(conf), "-p", str(self.workdir / "libvirtd.pid")],
            ),
        ):
            proc.run(argv, timeout=30, hint=f"see {self.log}")
            pid = int((self.workdir / f"{name}.pid").read_text().strip())
            self.pids[name] = pid
            self._watchers.append(build_proc.stop_with_this_process(pid))
        self.virsh("version", timeout=timeout)

    def virsh(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess:
        return proc.run(["virsh", "-c", self.uri, *args], check=check, timeout=timeout)

    def names(self, kind: str) -> list[str]:
        """Defined objects of *kind* (``list``, ``net-list``, ``pool-list``): all, by name."""
        out = self.virsh(kind, "--all", "--name").stdout
        return [n.strip() for n in out.splitlines() if n.strip()]

    def remove(
        self, domains: Iterable[str] = (), networks: Iterable[str] = (), pools: Iterable[str] = ()
    ) -> None:
        """Destroy and undefine what is named (with storage and NVRAM); absent names are fine."""
        for n in [*domains, *networks, *pools]:
            if not _NAME.fullmatch(n):
                raise NodeforgeError(f"libvirt object name {n!r} is not [A-Za-z0-9_.-]")
        have = set(self.names("list"))
        for d in domains:
            if d in have:
                self.virsh("destroy", d, check=False)
                self.virsh("undefine", d, "--nvram", "--remove-all-storage", check=False)
        have = set(self.names("net-list"))
        for n in networks:
            if n in have:
                self.virsh("net-destroy", n, check=False)
                self.virsh("net-undefine", n, check=False)
        have = set(self.names("pool-list"))
        for p in pools:
            if p in have:
                vols = self.virsh("vol-list", p, "--name", check=False).stdout or ""
                for v in (v.strip() for v in vols.splitlines()):
                    if v:
                        self.virsh("vol-delete", v, "--pool", p, check=False)
                self.virsh("pool-destroy", p, check=False)
                self.virsh("pool-undefine", p, check=False)

    def leftovers(self) -> dict[str, list[str]]:
        """What libvirt still has: domains, networks, pools (by name)."""
        return {k: self.names(k) for k in ("list", "net-list", "pool-list")}

    def stop(self, grace: float = 20.0) -> None:
        """Stop libvirtd, then virtlogd (SIGTERM, then SIGKILL past *grace*)."""
        for name in ("libvirtd", "virtlogd"):
            pid = self.pids.pop(name, None)
            if pid is not None and _comm(pid) == name:
                proc.stop_group(pid, grace, group=False)
        for w in self._watchers:
            w.kill()
            w.wait(timeout=10)
        self._watchers.clear()
        for sock in self.sock_dir.glob("*sock*") if self.sock_dir.exists() else ():
            sock.unlink(missing_ok=True)

    def clean_host(
        self, firewall_before: Iterable[str], networks: Iterable[str], domains: Iterable[str]
    ) -> None:
        """After `stop`: what libvirtd leaves on the host for *networks* and *domains* (their
        dnsmasq files, the domains' qemu logs, moved into workdir) and the firewall chains it
        made (LIBVIRT_*) that were not in *firewall_before* (``iptables -S`` lines)."""
        if running():
            raise NodeforgeError("clean_host: libvirtd/virtlogd still run; stop them first")
        for n in networks:
            for f in DNSMASQ_DIR.glob(f"{n}.*"):
                f.unlink()
        for f in DNSMASQ_DIR.glob("*.status") if DNSMASQ_DIR.exists() else ():
            if not (Path("/sys/class/net") / f.stem).exists():  # a bridge that is gone
                f.unlink()
                Path(str(f)[: -len(".status")] + ".macs").unlink(missing_ok=True)
        for f in DNSMASQ_DIR.glob("*.macs") if DNSMASQ_DIR.exists() else ():
            if not (Path("/sys/class/net") / f.stem).exists():
                f.unlink()
        for d in domains:
            log_file = QEMU_LOG_DIR / f"{d}.log"
            if log_file.exists():
                shutil.move(log_file, self.workdir / log_file.name)
        drop_firewall(set(firewall_before))


DNSMASQ_DIR = Path("/var/lib/libvirt/dnsmasq")
AUTOSTART_DIRS = (Path("/etc/libvirt/qemu/autostart"), Path("/etc/libvirt/qemu/networks/autostart"),
                  Path("/etc/libvirt/storage/autostart"))  # fmt: skip
QEMU_LOG_DIR = Path("/var/log/libvirt/qemu")


def bridges() -> list[str]:
    """Names of the host's bridge interfaces."""
    return sorted(p.parent.name for p in Path("/sys/class/net").glob("*/bridge"))


def firewall_undo(before: set[str], after: list[str]) -> list[list[str]]:
    """iptables arguments that remove libvirt's rules and chains (LIBVIRT_*) in *after*
    (``iptables -S`` lines) that *before* does not have: rules first, then chains."""
    new = [line for line in after if line not in before and "LIBVIRT_" in line]
    rules = [["-D", *line.split()[1:]] for line in new if line.startswith("-A ")]
    chains = [line.split()[1] for line in new if line.startswith("-N ")]
    return rules + [["-F", c] for c in chains] + [["-X", c] for c in chains]


def drop_firewall(before: set[str], tables: Iterable[str] = ("filter", "nat", "mangle")) -> None:
    """Remove libvirt's firewall rules and chains that were not there *before* (``iptables
    -S`` lines of each table, each prefixed with ``TABLE:``; an unprefixed line is filter's)."""
    for tool in ("iptables", "ip6tables"):
        for table in tables:
            after = proc.run([tool, "-t", table, "-S"], timeout=30).stdout.splitlines()
            mine = {line.split(":", 1)[1] for line in before if line.startswith(f"{tool}:{table}:")}
            for args in firewall_undo(mine, after):
                proc.run([tool, "-t", table, *args], timeout=30, check=False)


def firewall_state(tables: Iterable[str] = ("filter", "nat", "mangle")) -> list[str]:
    """Every iptables/ip6tables rule as ``TOOL:TABLE:LINE`` (for `drop_firewall`)."""
    return [
        f"{tool}:{table}:{line}"
        for tool in ("iptables", "ip6tables")
        for table in tables
        for line in proc.run([tool, "-t", table, "-S"], timeout=30).stdout.splitlines()
    ]
