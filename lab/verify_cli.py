"""`nodeforge verify`: run the testinfra suites against nodes. Imports only stdlib at module load."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check booted nodes with the testinfra suites (tests/infra)",
        description=(
            "Run the operator checks (services by role, secrets' modes, versions against "
            "/etc/nodeforge/image.json, pyxis, enroot, docker, logrotate, host keys, a 2-node "
            "job) on each host. Host specs: ssh://user@host:port[?key=PATH&name=LABEL], "
            "nsenter://PID, nspawn://CLUSTER[/NODE], vm://IMAGE_DIR[?role=…&params=node.yaml]."
        ),
    )
    p.add_argument(
        "--hosts",
        action="append",
        required=True,
        metavar="SPEC[,SPEC…]",
        help="hosts to check (repeatable; schemes above)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the results as JSON on stdout instead of the text report",
    )
    p.add_argument(
        "--junitxml",
        type=Path,
        metavar="FILE",
        help="also write the results as JUnit XML (for CI systems)",
    )
    p.add_argument("--ssh-key", help="private key for ssh:// hosts without ?key=")
    p.add_argument("-k", dest="select", metavar="EXPR", help="only checks matching (pytest -k)")
    p.add_argument("--boot-timeout", type=float, default=480.0, help="vm://: seconds to SSH login")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="vm://: seconds for nodeforge-init to finish after login")  # fmt: skip
    p.add_argument("--keep-vm", action="store_true", help="vm://: keep the work dir (console log)")
    p.add_argument(
        "-v", dest="verbose_pytest", action="store_true", help="show pytest's own output"
    )
    p.set_defaults(func=_verify)


def _verify(args: argparse.Namespace) -> int:
    from . import verify

    specs = verify.parse_host_specs(args.hosts, args.ssh_key)
    _require_verify_extra(any(s.scheme == "ssh" for s in specs))
    _check_vm_params(specs)
    resolved: list[verify.HostSpec] = []
    vms = []
    try:
        for s in specs:
            if s.scheme == "nspawn":
                resolved += verify.expand_nspawn(s)
            elif s.scheme == "vm":
                vm = _boot_vm(s, args)
                vms.append(vm)
                resolved.append(verify.parse_host_spec(vm.host_spec))
            else:
                resolved.append(s)
        unreachable = [(s.label, why) for s in resolved if (why := verify.preflight(s))]
        for label, why in unreachable:
            print(f"UNREACHABLE  host={label}: cannot run commands there: {why}", file=sys.stderr)
        if unreachable:
            _write_reports(args, [], unreachable, 0.0)
            return 1
        t = time.monotonic()
        rc, results = verify.run_suite(resolved, select=args.select, quiet=not args.verbose_pytest)
        total = time.monotonic() - t
        _write_reports(args, results, [], total)
        if not args.json:
            print(verify.format_report(results))
            print(f"suite runtime: {total:.1f}s for {len(resolved)} host(s)")
        bad = any(r.outcome in ("failed", "error") for r in results)
        if rc not in (0, 1, 5) or (rc == 1 and not bad) or not results:
            # pytest itself failed (collection, usage, internal error): its output is above.
            print(f"verify: ERROR: the suite did not run (pytest exit {rc}); see the output above",
                  file=sys.stderr)  # fmt: skip
            return 1
        return 1 if bad else 0
    finally:
        for vm in vms:
            vm.stop()


def _write_reports(args: argparse.Namespace, results, unreachable, seconds: float) -> None:
    import dataclasses
    import json

    from . import verify

    if args.junitxml:
        from nodeforge.fsutil import write_atomic

        write_atomic(args.junitxml, verify.junit_xml(results, unreachable), skip_unchanged=False)
    if args.json:
        bad = sum(1 for r in results if r.outcome in ("failed", "error")) + len(unreachable)
        print(json.dumps({
            "ok": bad == 0 and bool(results),
            "seconds": round(seconds, 2),
            "unreachable": [{"host": h, "reason": why} for h, why in unreachable],
            "results": [dataclasses.asdict(r) for r in results],
        }, indent=2))  # fmt: skip


def _check_vm_params(specs) -> None:
    """vm://IMAGE_DIR?params=FILE: the image and the file must be there before any VM boots."""
    from nodeforge.errors import NodeforgeError

    for s in specs:
        if s.scheme != "vm":
            continue
        params = s.option("params")
        if params:
            try:
                Path(params).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise NodeforgeError(
                    f"host spec {s.label}: params={params}: cannot read it ({why}); give the "
                    "path of a node.yaml (vm://IMAGE_DIR?params=node.yaml)"
                ) from None
        image = Path(s.image_dir or "").expanduser()
        missing = [f for f in ("manifest.json", "disk.qcow2") if not (image / f).is_file()]
        if missing:
            raise NodeforgeError(
                f"host spec {s.label}: {image} has no {' or '.join(missing)}; give the "
                "output directory of `nodeforge build` (vm://output/local)"
            )


def _require_verify_extra(ssh: bool) -> None:
    """pytest and testinfra (paramiko for ssh://) are the `verify` extra, not core dependencies."""
    import importlib.util

    from nodeforge.errors import NodeforgeError

    mods = ("pytest", "testinfra", *(("paramiko",) if ssh else ()))
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        raise NodeforgeError(
            f"nodeforge verify needs {', '.join(missing)}, which this install lacks; "
            "install the verify extra: pip install 'nodeforge[verify]'"
        )


def _boot_vm(spec, args: argparse.Namespace):
    from .vm import VM, VMConfig

    image = Path(spec.image_dir or "").expanduser()
    params = spec.option("params")
    role = spec.option("role")
    node_yaml = None
    if params:
        node_yaml = Path(params).read_text()
    elif role:
        node_yaml = f"role: {role}\ncluster_name: {spec.option('cluster', 'verify')}\n"
    name = spec.option("name") or role or "vm"
    work = Path(tempfile.mkdtemp(prefix=f"nodeforge-vm-{name}-"))
    cfg = VMConfig(
        image_dir=image, workdir=work, name=name, node_yaml=node_yaml,
        accel=spec.option("accel", "auto") or "auto",
        compat_net=spec.option("compat_net") in ("1", "yes", "true"),
        compat_keygen=spec.option("compat_keygen") in ("1", "yes", "true"),
        boot_timeout=args.boot_timeout, keep=args.keep_vm,
    )  # fmt: skip
    vm = VM(cfg)
    try:
        vm.start()
        waited = vm.wait_ssh()
        print(f"{spec.label}: SSH login after {waited:.1f}s ({vm.accel.accel}: {vm.accel.reason})",
              file=sys.stderr)  # fmt: skip
        state = vm.wait_unit("nodeforge-init.service", timeout=args.ready_timeout)
        print(
            f"{spec.label}: nodeforge-init.service {state} after {vm.elapsed():.1f}s",
            file=sys.stderr,
        )
    except BaseException:
        vm.stop()
        raise
    return vm
