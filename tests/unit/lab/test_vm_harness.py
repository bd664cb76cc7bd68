"""nodeforge.lab.vm: KVM probe decision, command line injection, boot timeout reporting (no root, no qemu)."""

from __future__ import annotations

import base64
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.errors import CommandError, NodeforgeError
from nodeforge.lab import vm as vmmod
from tests.helpers import process_running
from tests.unit.support import fake_vm_runner

pytestmark = pytest.mark.unit

GOOD = "[0.0] Linux version 6.12\n[1.2] Run /nodeforge-probe-init as init process\n[1.3] Kernel panic - not syncing"


@pytest.mark.parametrize(
    "usable,console,exited,timed_out,accel,why",
    [
        (False, "", False, False, "tcg", "absent"),
        (True, GOOD, True, False, "kvm", "reached userspace"),
        (True, "", False, True, "tcg", "no kernel output"),
        (True, "Linux version 6.12\n", False, True, "tcg", "stalled"),
        (True, "Linux version 6.12\nLinux version 6.12\n", True, False, "tcg", "reboot-looped"),
        (True, "", True, False, "tcg", "reset before"),
        (True, "Linux version 6.12\n", True, False, "tcg", "before reaching userspace"),
    ],
)
def test_decide_accel(usable, console, exited, timed_out, accel, why):
    d = vmmod.decide_accel(usable, console, exited, timed_out, 3.0)
    assert d.accel == accel and why in d.reason


def _fake_runner(console_text: str | None, hang: bool, calls: list):
    def run(argv, check=True, timeout=None, **kw):
        calls.append(list(argv))
        log = next(a for a in argv if str(a).startswith("file:"))[5:]
        if console_text is not None:
            Path(log).write_text(console_text)
        if hang:
            raise CommandError(list(argv), -1, "", hint=f"timed out after {timeout}s")

    return run


def test_probe_uses_kvm_when_guest_boots(tmp_path, monkeypatch):
    monkeypatch.delenv("NODEFORGE_VM_ACCEL", raising=False)
    calls: list = []
    d = vmmod.probe_accel(
        tmp_path / "vmlinuz",
        None,
        tmp_path,
        runner=_fake_runner(GOOD, False, calls),
        kvm_check=lambda: True,
        use_cache=False,
    )
    assert d.accel == "kvm"
    argv = calls[0]
    assert "-no-reboot" in argv and any("accel=kvm" in a for a in argv)
    assert "panic=-1" in argv[argv.index("-append") + 1]


def test_probe_falls_back_on_hang_and_caches(tmp_path, monkeypatch):
    monkeypatch.delenv("NODEFORGE_VM_ACCEL", raising=False)
    vmmod._ACCEL_CACHE.clear()
    calls: list = []
    k = tmp_path / "vmlinuz"
    r = _fake_runner("", True, calls)
    d1 = vmmod.probe_accel(k, None, tmp_path, runner=r, kvm_check=lambda: True)
    d2 = vmmod.probe_accel(k, None, tmp_path, runner=r, kvm_check=lambda: True)
    assert d1.accel == d2.accel == "tcg" and "hung" in d1.reason
    assert len(calls) == 1, "the probe result must be cached for the run"
    vmmod._ACCEL_CACHE.clear()


def test_probe_no_kvm_device_never_runs_qemu(tmp_path, monkeypatch):
    monkeypatch.delenv("NODEFORGE_VM_ACCEL", raising=False)
    calls: list = []
    d = vmmod.probe_accel(
        tmp_path / "k",
        None,
        tmp_path,
        runner=_fake_runner(GOOD, False, calls),
        kvm_check=lambda: False,
        use_cache=False,
    )
    assert d.accel == "tcg" and not calls


def test_probe_forced(tmp_path, monkeypatch):
    monkeypatch.setenv("NODEFORGE_VM_ACCEL", "tcg")
    d = vmmod.probe_accel(tmp_path / "k", None, tmp_path, runner=lambda *a, **k: pytest.fail("ran"))
    assert d.accel == "tcg" and "forced" in d.reason


def test_console_tail_strips_escapes(tmp_path):
    p = tmp_path / "c.log"
    p.write_bytes(
        b"\x1b[0;32m  OK  \x1b[0m] Started x\r\n" + b"".join(b"line %d\n" % i for i in range(100))
    )
    t = vmmod.console_tail(p, 5)
    assert t.splitlines() == [f"line {i}" for i in range(95, 100)]
    assert "no console" in vmmod.console_tail(tmp_path / "missing")


def test_kernel_append_injects_key_params_and_limits(tmp_path):
    cfg = vmmod.VMConfig(
        image_dir=tmp_path,
        workdir=tmp_path / "w",
        node_yaml="role: compute\ncluster_name: t\n",
        compat_net=True,
        compat_keygen=True,
        cmdline_params={"features": ["gpu", "nvme"]},
    )
    v = vmmod.VM(cfg)
    text = v.kernel_append("ssh-ed25519 AAAA test")
    words = text.split()
    assert words[:3] == ["root=LABEL=nodeforge-root", "rw", "console=ttyS0"]
    cred = {
        w.split(":", 1)[0].split("=", 1)[1]: base64.b64decode(w.split(":", 1)[1])
        for w in words
        if w.startswith("systemd.set_credential_binary=")
    }
    assert cred["ssh.authorized_keys.root"] == b"ssh-ed25519 AAAA test\n"
    line = cred["tmpfiles.extra"].decode().strip()
    kind, path, mode, *_, b64 = line.split()
    assert (kind, path, mode) == ("f~", "/etc/nodeforge/node.yaml", "0600")
    assert base64.b64decode(b64) == b"role: compute\ncluster_name: t\n"
    assert b"DHCP=yes" in cred["network.network.50-nodeforge-vm"]
    assert b"ssh-keygen -A" in cred["systemd.extra-unit.nodeforge-vm-keygen.service"]
    assert "nodeforge.features=gpu,nvme" in words
    cfg.node_yaml = "x" * 3000
    with pytest.raises(NodeforgeError, match="kernel command line is"):
        v.kernel_append("k")


def test_cmdline_params_reject_mappings_and_spaces():
    with pytest.raises(NodeforgeError, match="controller"):
        vmmod.cmdline_from_params({"controller": {"address": "x"}})
    with pytest.raises(NodeforgeError, match="whitespace"):
        vmmod.cmdline_from_params({"cluster_name": "a b"})
    assert vmmod.cmdline_from_params({"role": "compute", "accounting": False}) == [
        "nodeforge.role=compute",
        "nodeforge.accounting=false",
    ]


FAKE_QEMU = r"""#!PYTHON
# Fake qemu: prints a few console lines to -serial file:, daemonizes like qemu and hangs.
import os, sys, time
a = sys.argv
console = a[a.index("-serial") + 1][5:]
pidfile = a[a.index("-pidfile") + 1]
if os.fork():
    sys.exit(0)
os.setsid()
with open(pidfile, "w") as f:
    f.write(str(os.getpid()))
with open(console, "w") as f:
    f.write("[    0.0] Linux version 6.12 (fake)\n")
    f.write("\x1b[0;1;31mFAILED\x1b[0m Failed to start ssh.service\n")
    f.write("vm login: \n")
os.close(0); os.close(1); os.close(2)
time.sleep(600)
"""


def _fake_image_and_qemu(tmp_path: Path) -> tuple[Path, Path]:
    img = tmp_path / "img"
    img.mkdir()
    for n in ("disk.qcow2", "vmlinuz", "initrd.img"):
        (img / n).write_bytes(b"x")
    fake = tmp_path / "qemu-system-x86_64"
    fake.write_text(FAKE_QEMU.replace("PYTHON", sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return img, fake


def test_boot_timeout_reports_console_tail_and_wait(tmp_path, monkeypatch):
    img, fake = _fake_image_and_qemu(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    monkeypatch.setattr(vmmod.proc, "require_tool", lambda t: t)
    cfg = vmmod.VMConfig(
        image_dir=img,
        workdir=tmp_path / "w",
        accel="tcg",
        boot_timeout=3,
        qemu=str(fake),
        keep=True,
    )
    v = vmmod.VM(cfg, runner=fake_vm_runner)
    t = time.monotonic()
    with pytest.raises(vmmod.BootTimeout) as ei, v:
        v.wait_ssh()
    msg = str(ei.value)
    assert time.monotonic() - t < 30
    assert "after waiting 3s" in msg or "after waiting 4s" in msg, msg
    assert "Failed to start ssh.service" in msg and "\x1b" not in msg
    assert "vm login:" in msg
    assert v.pid is None and not v.overlay.exists(), "qemu and the overlay must be cleaned up"


HARNESS = r"""
from pathlib import Path
from nodeforge.lab import vm as vmmod
from tests.unit.support import fake_vm_runner

cfg = vmmod.VMConfig(image_dir=Path(IMG), workdir=Path(WORK), accel="tcg", qemu=QEMU, keep=True)
v = vmmod.VM(cfg, runner=fake_vm_runner)
v.start()
print(v.pid, flush=True)
import time
time.sleep(600)
"""


def test_sigkilled_harness_leaves_no_vm(tmp_path):
    """qemu is detached (-daemonize); the watcher stops it when the harness is SIGKILLed."""
    import subprocess

    img, fake = _fake_image_and_qemu(tmp_path)
    script = (
        HARNESS.replace("IMG", repr(str(img)))
        .replace("WORK", repr(str(tmp_path / "w")))
        .replace("QEMU", repr(str(fake)))
    )
    # the checkout is the working directory: `-c` puts it first on the path (tests.unit...)
    h = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                         cwd=Path(__file__).resolve().parents[3])  # fmt: skip
    try:
        pid = int(h.stdout.readline())
        os.kill(pid, 0)  # the fake VM runs, detached from the harness
        h.kill()
        h.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and process_running(pid):
            time.sleep(0.2)
        if process_running(pid):
            os.kill(pid, 9)
            pytest.fail("the VM outlived its SIGKILLed harness")
    finally:
        if h.poll() is None:
            h.kill()


def _cloud_vm(tmp_path, **kw):
    cfg = vmmod.VMConfig(
        image_dir=tmp_path, workdir=tmp_path / "w", accel="tcg", boot="kernel", **kw
    )
    v = vmmod.VM(cfg)
    v.accel = vmmod.AccelDecision("tcg", "test")
    v.port = 2222
    return v


def test_metadata_wires_guestfwd_restricted_user_net_and_no_key_on_cmdline(tmp_path):
    net = vmmod.CloudNet({"169.254.169.254:80": 41000, "169.254.169.10:443": 41001})
    v = _cloud_vm(tmp_path, metadata=net, inject_key=False)
    argv = v.qemu_argv("ssh-ed25519 AAAA test")
    netdev = argv[argv.index("-netdev") + 1].split(",")
    assert netdev[:3] == ["user", "id=n0", "hostfwd=tcp:127.0.0.1:2222-:22"]
    assert "net=169.254.169.0/24" in netdev and "restrict=on" in netdev
    relay = f"{sys.executable} {vmmod.RELAY}"
    assert f"guestfwd=tcp:169.254.169.254:80-cmd:{relay} 41000" in netdev
    assert f"guestfwd=tcp:169.254.169.10:443-cmd:{relay} 41001" in netdev
    assert "ssh.authorized_keys.root" not in v.kernel_append("ssh-ed25519 AAAA test")


def test_without_metadata_the_netdev_is_unchanged(tmp_path):
    v = _cloud_vm(tmp_path)
    argv = v.qemu_argv("k")
    assert argv[argv.index("-netdev") + 1] == "user,id=n0,hostfwd=tcp:127.0.0.1:2222-:22"
    assert "ssh.authorized_keys.root" in v.kernel_append("k")


@pytest.mark.parametrize(
    "forwards,net,why",
    [
        ({"10.0.2.254:80": 1}, "169.254.169.0/24", "outside the user network"),
        ({"169.254.169.254": 1}, "169.254.169.0/24", "ADDRESS:PORT"),
        ({"169.254.169.254:0": 1}, "169.254.169.0/24", "ADDRESS:PORT"),
        ({"host.example:80": 1}, "169.254.169.0/24", "not an IPv4"),
        ({"169.254.169.254:80": 70000}, "169.254.169.0/24", "host port"),
        ({"169.254.169.254:80": 1}, "169.254.169.0/30", "/8../29"),
    ],
)
def test_metadata_forward_refused(tmp_path, forwards, net, why):
    with pytest.raises(NodeforgeError, match=why):
        vmmod.CloudNet(forwards, net).netdev_options()


def test_relay_carries_a_request_per_connection_to_the_loopback_server():
    """lab/relay.py as qemu runs it: the guest connection on stdin/stdout (a socketpair)."""
    import socket
    import subprocess

    from nodeforge.lab.imds import IMDS, Instance

    svc = IMDS(Instance(user_data=b"hello"))
    with svc.serve() as srv:
        for _ in range(2):  # two guest connections, one after the other: each its own relay
            guest, qemu_side = socket.socketpair()
            with guest:
                with qemu_side:  # the relay holds its own copy; EOF comes when it exits
                    p = subprocess.Popen(
                        [sys.executable, str(vmmod.RELAY), str(srv.port), "10"],
                        stdin=qemu_side.fileno(),
                        stdout=qemu_side.fileno(),
                    )
                guest.sendall(
                    b"PUT /latest/api/token HTTP/1.1\r\nHost: x\r\n"
                    b"X-aws-ec2-metadata-token-ttl-seconds: 60\r\nConnection: close\r\n\r\n"
                )
                guest.settimeout(10)
                data = b""
                while chunk := guest.recv(4096):
                    data += chunk
                assert data.startswith(b"HTTP/1.1 200")
                assert p.wait(timeout=10) == 0
    assert [s for _, _, s in svc.log] == [200, 200]


def _ovmf(tmp_path: Path) -> Path:
    d = tmp_path / "ovmf"
    d.mkdir()
    for code, vars_ in vmmod.FIRMWARE.values():
        (d / code).write_bytes(b"code")
        (d / vars_).write_bytes(b"vars-" + vars_.encode())
    return d


def _smbios_creds(argv: list[str]) -> dict[str, bytes]:
    out = {}
    for i, a in enumerate(argv):
        if a == "-smbios":
            kind, _, text = argv[i + 1].partition(",value=")
            assert kind == "type=11"
            name, _, b64 = text.removeprefix("io.systemd.credential.binary:").partition("=")
            out[name] = base64.b64decode(b64)
    return out


@pytest.mark.parametrize("boot", ["uefi", "uefi-secureboot", "bios"])
def test_firmware_boot_has_no_kernel_and_injects_by_smbios(tmp_path, boot):
    """A firmware boot: no -kernel/-append; the key, node.yaml and link config reach the
    guest as SMBIOS type 11 credentials; OVMF's vars are this VM's own copy; Secure Boot
    has SMM and the secure flash."""
    img, _ = _fake_image_and_qemu(tmp_path)
    cfg = vmmod.VMConfig(
        image_dir=img,
        workdir=tmp_path / "w",
        boot=boot,
        ovmf_dir=_ovmf(tmp_path),
        node_yaml="role: compute\n",
        link_ip="10.77.0.11/24",
        compat_keygen=True,
    )
    v = vmmod.VM(cfg)
    v.workdir.mkdir()
    v.accel, v.port = vmmod.AccelDecision("tcg", "test"), 2222
    argv = v.qemu_argv("ssh-ed25519 AAAA k")
    assert not {"-kernel", "-initrd", "-append"} & set(argv)
    creds = _smbios_creds(argv)
    assert creds["ssh.authorized_keys.root"] == b"ssh-ed25519 AAAA k\n"
    assert b"/etc/nodeforge/node.yaml" in creds["tmpfiles.extra"]
    assert b"Address=10.77.0.11/24" in creds["network.network.05-nodeforge-link"]
    assert creds["systemd.unit-dropin.multi-user.target"] == (
        b"[Unit]\nWants=systemd-network-generator.service nodeforge-vm-keygen.service\n"
    )
    flash = [a for a in argv if a.startswith("if=pflash")]
    machine = argv[argv.index("-machine") + 1]
    if boot == "bios":
        assert flash == [] and "smm" not in machine
        return
    code, vars_ = vmmod.FIRMWARE[boot]
    assert flash[0].endswith(f"file={cfg.ovmf_dir / code},readonly=on")
    assert flash[1] == f"if=pflash,format=raw,unit=1,file={v.workdir / 'OVMF_VARS.fd'}"
    assert (v.workdir / "OVMF_VARS.fd").read_bytes() == b"vars-" + vars_.encode()
    secure = "driver=cfi.pflash01,property=secure,value=on" in argv
    assert secure == (boot == "uefi-secureboot") and ("smm=on" in machine) == secure


def test_firmware_boot_refuses_kernel_command_line_params(tmp_path):
    img, _ = _fake_image_and_qemu(tmp_path)
    for extra in ({"cmdline_params": {"role": "compute"}}, {"extra_append": ["quiet"]}):
        cfg = vmmod.VMConfig(image_dir=img, workdir=tmp_path / "w", boot="bios", **extra)
        with pytest.raises(NodeforgeError, match="kernel command line.*boot='kernel'"):
            vmmod.VM(cfg).check_inputs()


def test_boot_mode_and_firmware_files_are_checked(tmp_path):
    img, _ = _fake_image_and_qemu(tmp_path)
    cfg = vmmod.VMConfig(image_dir=img, workdir=tmp_path / "w", boot="pxe")
    with pytest.raises(NodeforgeError, match="boot mode 'pxe' is not one of uefi, bios"):
        vmmod.VM(cfg).check_inputs()
    cfg = vmmod.VMConfig(
        image_dir=img, workdir=tmp_path / "w", boot="uefi-secureboot", ovmf_dir=tmp_path
    )
    with pytest.raises(NodeforgeError, match="OVMF_CODE_4M.secboot.fd is missing.*ovmf"):
        vmmod.VM(cfg).check_inputs()
    (img / "vmlinuz").unlink()  # a firmware boot needs no kernel beside the disk
    cfg = vmmod.VMConfig(
        image_dir=img, workdir=tmp_path / "w", boot="uefi", ovmf_dir=_ovmf(tmp_path)
    )
    vmmod.VM(cfg).check_inputs()
    cfg.boot = "kernel"
    with pytest.raises(NodeforgeError, match="vmlinuz is missing"):
        vmmod.VM(cfg).check_inputs()


def test_machine_is_q35_unless_pc_is_asked_for(tmp_path):
    """machine="pc" boots the i440fx machine libvirt (so vagrant-libvirt) gives by default;
    anything else, or Secure Boot without q35 (its OVMF needs SMM), is refused by name."""
    img, _ = _fake_image_and_qemu(tmp_path)

    def argv_for(**kw):
        v = vmmod.VM(vmmod.VMConfig(image_dir=img, workdir=tmp_path / "w", boot="bios", **kw))
        v.workdir.mkdir(exist_ok=True)
        v.check_inputs()
        v.accel, v.port = vmmod.AccelDecision("tcg", "test"), 2222
        argv = v.qemu_argv("k")
        return argv[argv.index("-machine") + 1]

    assert argv_for() == "q35,accel=tcg"
    assert argv_for(machine="pc") == "pc,accel=tcg"
    with pytest.raises(NodeforgeError, match="machine 'isapc' is not one of q35, pc"):
        argv_for(machine="isapc")
    cfg = vmmod.VMConfig(
        image_dir=img,
        workdir=tmp_path / "w",
        boot="uefi-secureboot",
        machine="pc",
        ovmf_dir=_ovmf(tmp_path),
    )
    with pytest.raises(NodeforgeError, match="uefi-secureboot needs machine q35"):
        vmmod.VM(cfg).check_inputs()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_smbios_credential_names_are_a_grammar(name):
    """Any name: a credential argument that qemu splits only where we mean it, or a refusal
    that names it."""
    try:
        argv = vmmod.smbios_credential(name, b"v,alue\n")
    except NodeforgeError as e:
        assert "credential name" in str(e)
        return
    assert argv[0] == "-smbios" and "," not in argv[1].removeprefix("type=11,")
    assert all(c.isalnum() or c in "._@~-" for c in name)


def test_rtc_offset_starts_the_vm_clock_skewed_and_is_checked(tmp_path):
    """rtc_offset_s: the guest's RTC (its wall clock at boot) is that far from the host's;
    0 leaves qemu's default (the host's UTC); a non-int or absurd offset is refused."""
    import datetime as dt
    import time

    assert "-rtc" not in _cloud_vm(tmp_path).qemu_argv("k")
    argv = _cloud_vm(tmp_path, rtc_offset_s=1200).qemu_argv("k")
    base = argv[argv.index("-rtc") + 1].removeprefix("base=")
    t = dt.datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.UTC).timestamp()
    assert abs(t - (time.time() + 1200)) < 5
    for bad in (1.5, True, 10**10):
        with pytest.raises(NodeforgeError, match="rtc_offset_s"):
            _cloud_vm(tmp_path, rtc_offset_s=bad).check_inputs()


def _firmware_vm(tmp_path, monkeypatch, **kw) -> vmmod.VM:
    """A UEFI VM on the fake qemu (it daemonizes, writes a console and hangs)."""
    img, fake = _fake_image_and_qemu(tmp_path)
    monkeypatch.setattr(vmmod.proc, "require_tool", lambda t: t)
    cfg = vmmod.VMConfig(
        image_dir=img, workdir=tmp_path / "w", accel="tcg", boot="uefi",
        ovmf_dir=_ovmf(tmp_path), qemu=str(fake), keep=True, **kw,
    )  # fmt: skip
    return vmmod.VM(cfg, runner=fake_vm_runner)


def test_power_cycle_is_a_new_qemu_on_the_same_disk_vars_and_port(tmp_path, monkeypatch):
    """A power cycle: the old qemu is gone, a new one runs with the same overlay (what the
    guest wrote stays), the vars the firmware wrote, the same SSH port; the console so far
    is kept beside the new one."""
    v = _firmware_vm(tmp_path, monkeypatch)
    with v:
        first, port = v.pid, v.port
        v.overlay.write_bytes(b"the guest wrote this")
        (v.workdir / "OVMF_VARS.fd").write_bytes(b"BootOrder the firmware wrote")
        v.power_cycle()
        assert v.pid != first and v.alive() and not process_running(first)
        assert v.port == port and v.restarts == 1
        assert v.overlay.read_bytes() == b"the guest wrote this"
        assert (v.workdir / "OVMF_VARS.fd").read_bytes() == b"BootOrder the firmware wrote"
        assert "vm login:" in (v.workdir / "console.1.log").read_text()
        assert "vm login:" in v.console.read_text()  # the new run's own console
        second = v.pid
    assert not process_running(second) and v.pid is None


def test_power_cycle_before_start_is_refused(tmp_path):
    img, _ = _fake_image_and_qemu(tmp_path)
    v = vmmod.VM(vmmod.VMConfig(image_dir=img, workdir=tmp_path / "w"))
    with pytest.raises(NodeforgeError, match="power_cycle before start"):
        v.power_cycle()


def _guest_ends(v: vmmod.VM, last_words: str) -> None:
    """What qemu under -no-reboot does when the guest resets: the console's last lines, then
    the process ends."""
    with open(v.console, "a") as f:
        f.write(last_words)
    assert v.pid is not None
    os.kill(v.pid, signal.SIGKILL)


def test_reset_exit_runs_qemu_with_no_reboot_and_warm_does_not(tmp_path):
    v = _cloud_vm(tmp_path, reset="exit")
    assert "-no-reboot" in v.qemu_argv("k")
    v.cfg.reset = "warm"
    assert "-no-reboot" not in v.qemu_argv("k")
    for bad in ("cold", "", "exit;reboot"):
        v.cfg.reset = bad
        with pytest.raises(NodeforgeError, match="reset .* is not one of warm, exit"):
            v.check_inputs()


def test_a_guest_reboot_starts_the_same_machine_again(tmp_path, monkeypatch):
    """reset="exit": the guest's reboot ended qemu; restart_after_reset starts a new qemu on
    the same overlay, vars and SSH port, and keeps the console of the boot before."""
    v = _firmware_vm(tmp_path, monkeypatch, reset="exit")
    with v:
        first, port = v.pid, v.port
        v.overlay.write_bytes(b"the guest wrote this")
        _guest_ends(v, "[  153.8] reboot: Restarting system\n[  153.8] reboot: machine restart\n")
        v.restart_after_reset(timeout=30)
        assert v.pid != first and v.alive() and v.port == port and v.restarts == 1
        assert v.overlay.read_bytes() == b"the guest wrote this"
        assert "reboot: machine restart" in (v.workdir / "console.1.log").read_text()
        assert "-no-reboot" in Path(f"/proc/{v.pid}/cmdline").read_text()
    assert v.pid is None


def test_qemu_ending_without_the_guests_reboot_is_an_error_naming_the_console(
    tmp_path, monkeypatch
):
    v = _firmware_vm(tmp_path, monkeypatch, reset="exit")
    with v:
        _guest_ends(v, "[   12.0] Kernel panic - not syncing: Attempted to kill init!\n")
        with pytest.raises(NodeforgeError, match="qemu ended, but the guest did not reboot") as e:
            v.restart_after_reset(timeout=30)
        assert str(v.console) in str(e.value) and "Kernel panic" in str(e.value)
        assert v.restarts == 0  # nothing started again


def test_a_guest_that_never_resets_fails_at_the_bound(tmp_path, monkeypatch):
    v = _firmware_vm(tmp_path, monkeypatch, reset="exit")
    with v:
        t0 = time.monotonic()
        with pytest.raises(vmmod.BootTimeout, match="qemu still running after the guest's"):
            v.restart_after_reset(timeout=2)
        assert 2 <= time.monotonic() - t0 < 10


def test_restart_after_reset_needs_a_started_vm_that_exits_on_reset(tmp_path, monkeypatch):
    v = _firmware_vm(tmp_path, monkeypatch, reset="exit")
    with pytest.raises(NodeforgeError, match="needs a started VM with reset='exit'"):
        v.restart_after_reset(timeout=1)
    v.cfg.reset = "warm"
    with v, pytest.raises(NodeforgeError, match="needs a started VM with reset='exit'"):
        v.restart_after_reset(timeout=1)
