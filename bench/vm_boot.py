"""Benchmark: VM boot-to-ready (SSH login) under TCG and, where it works, KVM; suite runtime.

    sudo .venv/bin/python bench/vm_boot.py --image output/local [--runs 1] [--accel auto|tcg|kvm]
        [--role controller] [--suite] [--compat-net] [--compat-keygen] [--json out.json]

For each accelerator: start qemu on an overlay, time to the first SSH banner, to a root login,
and (with a node role) to nodeforge-init.service finishing; then optionally the testinfra
suite's runtime for that host. The KVM probe's verdict and duration are reported too: on
machines where nested KVM hangs, "kvm" is reported as unavailable with the probe's reason.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from nodeforge.errors import NodeforgeError
from nodeforge.lab import verify
from nodeforge.lab.vm import VM, VMConfig, probe_accel, ssh_banner


def one(args: argparse.Namespace, accel: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"nodeforge-bench-{accel}-"))
    node_yaml = None
    if args.role:
        # A throwaway cluster key: the agent refuses to start munge without one.
        key = base64.b64encode(os.urandom(32)).decode()
        node_yaml = (
            f"role: {args.role}\ncluster_name: bench\nnode_name: bench\n"
            "controller: {host: bench, address: 127.0.0.1}\n"
            f"munge_key: {key}\n"
        )
    cfg = VMConfig(
        image_dir=Path(args.image),
        workdir=work,
        name=f"bench-{accel}",
        accel=accel,
        node_yaml=node_yaml,
        compat_net=args.compat_net,
        compat_keygen=args.compat_keygen,
        boot_timeout=args.timeout,
        keep=args.keep,
    )
    row: dict = {"accel": accel}
    with VM(cfg) as vm:
        t0 = vm.started_at
        assert t0 is not None and vm.port is not None
        while ssh_banner(vm.port, timeout=3) is None:
            if not vm.alive() or time.monotonic() - t0 > args.timeout:
                raise vm.boot_failure("no SSH banner", vm.elapsed())
            time.sleep(1)
        row["ssh_banner_s"] = round(time.monotonic() - t0, 1)
        row["ssh_login_s"] = round(vm.wait_ssh(), 1)
        row["guest_uptime_at_login_s"] = float(
            vm.ssh("cut -d' ' -f1 /proc/uptime").stdout.strip() or 0
        )
        if args.role:
            row["init_state"] = vm.wait_unit("nodeforge-init.service", timeout=args.timeout)
            row["init_done_s"] = round(vm.elapsed(), 1)
        if args.suite:
            spec = verify.parse_host_spec(vm.host_spec)
            t = time.monotonic()
            _, results = verify.run_suite([spec])
            row["suite_s"] = round(time.monotonic() - t, 1)
            row["suite"] = {
                k: sum(1 for r in results if r.outcome == k)
                for k in ("passed", "failed", "skipped", "error")
            }
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--image", required=True)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--accel", default="auto", choices=("auto", "tcg", "kvm", "both"))
    ap.add_argument("--role")
    ap.add_argument("--suite", action="store_true")
    ap.add_argument("--compat-net", action="store_true")
    ap.add_argument("--compat-keygen", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    image = Path(args.image)
    probe = probe_accel(
        image / "vmlinuz", image / "initrd.img", Path(tempfile.mkdtemp(prefix="nodeforge-probe-"))
    )
    print(f"KVM probe: {probe.accel} ({probe.reason}; {probe.probe_seconds:.1f}s)")
    accels = {"auto": [probe.accel], "both": ["tcg", "kvm"], "tcg": ["tcg"], "kvm": ["kvm"]}[
        args.accel
    ]
    if "kvm" in accels and probe.accel != "kvm":
        print(f"kvm: not measured, the probe says it does not boot guests here ({probe.reason})")
        accels = [a for a in accels if a != "kvm"] or ["tcg"]
    rows = []
    for accel in accels:
        for i in range(args.runs):
            try:
                row = one(args, accel)
            except NodeforgeError as exc:
                row = {"accel": accel, "error": str(exc).splitlines()[0]}
            row["run"] = i + 1
            rows.append(row)
            print(json.dumps(row))
    out = {"probe": probe.__dict__, "runs": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
