"""Benchmark: firmware-to-schedulable of a compute VM, UEFI (OVMF, TCG) against the same VM
booted with a direct kernel, with the time of each phase.

    sudo .venv/bin/python bench/vm_firmware_boot.py --image output/local \
        [--boots uefi,kernel] [--accel tcg] [--timeout 900] [--json out.json]

A controller VM is booted once (UEFI) and stays up; then a compute VM is booted once per
boot mode, on a private qemu socket link to it, and timed from qemu's start:

* firmware_loader_s: qemu start to the kernel's start (wall time at SSH login minus the
  guest's uptime then): OVMF/SeaBIOS, shim and grub; ~0 for a direct kernel boot;
* kernel_s, userspace_s: `systemd-analyze` (the kernel's and systemd's own clocks; grub
  has no boot-loader interface, so firmware and loader are not in its figures);
* ssh_login_s: to a root login over SSH;
* agent steps: the agent's own durations (`nodeforge node status --json`);
* schedulable_s: until the controller reports the compute idle (`scontrol show node`).

Params reach both VMs as systemd credentials (SMBIOS for a firmware boot, the kernel
command line for a direct one): the same node.yaml either way.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from nodeforge.errors import NodeforgeError
from nodeforge.lab.vm import BOOT_MODES, VM, VMConfig, free_port

CTL_IP = "10.77.0.10"


def node_yaml(role: str, name: str, ip: str, key: str) -> str:
    return (
        f"role: {role}\ncluster_name: bench\nnode_name: {name}\nnode_address: {ip}\n"
        f"controller: {{host: ctl, address: {CTL_IP}}}\nmunge_key: {key}\nwait_timeout: 600\n"
    )


def seconds(text: str) -> float:
    """systemd-analyze's `1min 2.345s` / `850ms` as seconds."""
    total = 0.0
    for part in text.split():
        m = re.fullmatch(r"([0-9.]+)(min|ms|s)", part)
        if m:
            total += float(m.group(1)) * {"min": 60, "s": 1, "ms": 0.001}[m.group(2)]
    return round(total, 2)


def analyze(text: str) -> dict[str, float]:
    """kernel/userspace seconds from `systemd-analyze`'s first line."""
    out = {}
    for what in ("firmware", "loader", "kernel", "initrd", "userspace"):
        m = re.search(r"((?:[0-9.]+(?:min|ms|s) ?)+) \(" + what + r"\)", text)
        if m:
            out[f"{what}_s"] = seconds(m.group(1))
    return out


def wait_schedulable(ctl: VM, name: str, t0: float, limit: float) -> float:
    while time.monotonic() - t0 < limit:
        cp = ctl.ssh(f"scontrol show node {name} 2>&1", timeout=60, check=False)
        state = re.search(r"State=(\S+)", cp.stdout or "")
        if (
            state
            and state.group(1).split("+")[0] in ("IDLE", "MIXED", "ALLOCATED")
            and ("DRAIN" not in state.group(1))
        ):
            return round(time.monotonic() - t0, 1)
        time.sleep(2)
    raise NodeforgeError(f"{name} not schedulable after {limit:.0f}s")


def compute_run(args, i: int, boot: str, port: int, key: str, work: Path, ctl: VM) -> dict:
    # A new node name (and address) per run: the controller still lists the last one idle.
    name, ip = f"c{i + 1}", f"10.77.0.{11 + i}"
    cfg = VMConfig(
        image_dir=Path(args.image),
        workdir=work / f"{name}-{boot}",
        name=name,
        accel=args.accel,
        boot=boot,
        node_yaml=node_yaml("compute", name, ip, key),
        link_ip=f"{ip}/24",
        link_mac=f"52:54:00:4e:46:{0x11 + i:02x}",
        link_connect=port,
        boot_timeout=args.timeout,
        keep=True,
    )
    row: dict = {"boot": boot, "node": name}
    with VM(cfg) as vm:
        assert vm.started_at is not None
        t0 = vm.started_at
        row["ssh_login_s"] = round(vm.wait_ssh(), 1)
        uptime = float(vm.ssh("cut -d' ' -f1 /proc/uptime").stdout.strip() or 0)
        row["firmware_loader_s"] = round(max(0.0, row["ssh_login_s"] - uptime), 1)
        row["schedulable_s"] = wait_schedulable(ctl, name, t0, args.timeout)
        text = vm.ssh("systemd-analyze 2>&1 | head -1", check=False).stdout
        row.update(analyze(text))
        row["systemd_analyze"] = text.strip()
        st = vm.ssh("nodeforge node status --json", check=False).stdout
        try:
            steps = json.loads(st).get("steps", {})
            row["agent_steps_s"] = {k: v.get("duration") for k, v in steps.items()}
        except (ValueError, AttributeError):
            row["agent_steps_s"] = {"error": st.strip()[-200:]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--image", required=True)
    ap.add_argument("--boots", default="uefi,kernel")
    ap.add_argument("--accel", default="tcg", choices=("auto", "tcg", "kvm"))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json")
    args = ap.parse_args()
    boots = args.boots.split(",")
    bad = [b for b in boots if b not in BOOT_MODES]
    if bad:
        ap.error(f"--boots: {bad} not in {', '.join(BOOT_MODES)}")
    work = Path(tempfile.mkdtemp(prefix="nodeforge-bench-fw-"))
    key = base64.b64encode(os.urandom(32)).decode()  # throwaway cluster key
    port = free_port()
    ctl_cfg = VMConfig(
        image_dir=Path(args.image),
        workdir=work / "ctl",
        name="ctl",
        accel=args.accel,
        node_yaml=node_yaml("controller", "ctl", CTL_IP, key),
        link_ip=f"{CTL_IP}/24",
        link_mac="52:54:00:4e:46:10",
        link_listen=port,
        boot_timeout=args.timeout,
        keep=True,
    )
    rows = []
    with VM(ctl_cfg) as ctl:
        ctl.wait_ssh()
        ctl.wait_unit("nodeforge-init.service", timeout=args.timeout)
        print(f"controller ready at {ctl.elapsed():.1f}s", flush=True)
        for i, boot in enumerate(boots):
            try:
                row = compute_run(args, i, boot, port, key, work, ctl)
            except NodeforgeError as exc:
                row = {"boot": boot, "error": str(exc).splitlines()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"accel": args.accel, "runs": rows, "work": str(work)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
