"""CLI: `nodeforge build`, `render`, `validate`, `versions`. Heavy imports stay in handlers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGET_CHOICES = ("local", "qemu", "amazon-ebs")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="bake the node image (default target: local)")
    p.add_argument("--target", default="local", choices=TARGET_CHOICES,
                   help="where to build (default: %(default)s)")
    p.add_argument("--base", help="base from the versions file (default: debian13; also debian12)")
    p.add_argument("--var-file", action="append", default=[], type=Path, metavar="F.pkrvars.hcl",
                   help="Packer variables (repeatable)")
    p.add_argument("--artifact-mirror", metavar="DIR|URL",
                   help="serve the pinned artifacts from a directory or URL (air-gapped builds)")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="build even though some artifacts have no recorded sha256")
    p.add_argument("--output", type=Path, help="artifact directory (default: output/<target>)")
    p.add_argument("--cache-dir", type=Path, default=Path("/var/cache/nodeforge"),
                   help="base tarballs, apt archives and artifacts (default: %(default)s)")
    p.add_argument("--name", help="image name (default: nodeforge-<base>-<arch>)")
    p.add_argument("--versions-file", type=Path, help="alternative versions file")
    p.add_argument("--keep-work", action="store_true", help="keep the work tree (debugging)")
    p.add_argument("--playbook", type=Path,
                   help="provision with another playbook (default: images/site.yml); for "
                        "testing the build machinery, the result is not a node image")
    p.add_argument("--json", action="store_true", help="print the result summary as JSON")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("render", help="print the Packer template of a target")
    p.add_argument("--target", default="local", choices=TARGET_CHOICES,
                   help="the target (default: %(default)s)")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("validate", help="run `packer validate` on every target's template")
    p.add_argument("--target", action="append", choices=TARGET_CHOICES,
                   help="only this target (repeatable; default: all)")
    p.add_argument("--var-file", action="append", default=[], type=Path, metavar="F.pkrvars.hcl",
                   help="Packer variables to validate with (repeatable)")
    p.add_argument("--json", action="store_true", help="print {target: packer output} as JSON")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("versions", help="show or pin the artifacts of the versions file")
    vs = p.add_subparsers(dest="versions_cmd", metavar="ACTION")
    vs.required = True
    s = vs.add_parser("show", help="list artifacts and whether they are pinned")
    s.add_argument("--versions-file", type=Path, help="alternative versions file")
    s.add_argument("--json", action="store_true", help="print the artifacts as JSON")
    s.set_defaults(func=cmd_versions_show)
    s = vs.add_parser("lock", help="download every artifact and record its sha256")
    s.add_argument("--artifact-mirror", metavar="DIR|URL",
                   help="read the artifacts from a directory or URL instead of upstream")
    s.add_argument("--versions-file", type=Path, help="alternative versions file (edited in place)")
    s.add_argument("--only-missing", action="store_true", help="only artifacts without a sha256")
    s.add_argument("--json", action="store_true", help="print {url: sha256} and the file as JSON")
    s.set_defaults(func=cmd_versions_lock)


def cmd_build(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .build import BuildOptions, run_build

    err = Console(stderr=True, highlight=False)
    opts = BuildOptions(
        target=args.target, base=args.base, var_files=list(args.var_file),
        artifact_mirror=args.artifact_mirror, allow_unpinned=args.allow_unpinned,
        output=args.output, cache_dir=args.cache_dir, name=args.name,
        versions_file=args.versions_file, keep_work=args.keep_work,
        playbook=args.playbook.resolve() if args.playbook else None,
    )
    status = err.status("starting", spinner="dots") if err.is_terminal else None
    current = {"phase": ""}

    def report(phase: str, what: str) -> None:
        if what == "start":
            current["phase"] = phase
            if status:
                status.update(f"[bold]{phase}[/]")
            else:
                err.print(f"[{phase}] ...", markup=False)
        else:
            err.print(f"[{phase}] {what}", markup=False)

    def on_line(line: str) -> None:
        # Show Ansible's task headers as live progress; the full output is in build.log.
        if status and (line.lstrip().startswith(("TASK [", "PLAY [", "==>"))):
            status.update(f"[bold]{current['phase']}[/] {line.strip()[:100]}")

    if status:
        status.start()
    try:
        result = run_build(opts, report, on_line)
    finally:
        if status:
            status.stop()
    m = result.manifest
    if args.json:
        print(json.dumps({"output": str(result.output), "name": m["name"],
                          "phases": m["phases"], "artifacts": m["artifacts"],
                          "components": m.get("components", {})}, indent=2))
    else:
        total = sum(m["phases"].values())
        err.print(f"built {m['name']} in {total:.0f}s → {result.output}")
        for name, a in m["artifacts"].items():
            err.print(f"  {name:<18} {a['bytes'] / 2**20:9.1f} MiB  sha256:{a['sha256'][:16]}…")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from . import packer

    sys.stdout.write(packer.render(args.target))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from .validate import validate_targets

    results = validate_targets(args.target or list(TARGET_CHOICES), args.var_file)
    if args.json:
        print(json.dumps({t: {"valid": True, "output": out.strip()} for t, out in results.items()},
                         indent=2))  # fmt: skip
        return 0
    for target, out in results.items():
        print(f"{target}: valid{(' — ' + out.strip()) if out.strip() else ''}")
    return 0


def cmd_versions_show(args: argparse.Namespace) -> int:
    from . import versions

    v = versions.load(args.versions_file)
    rows = [
        {"artifact": a.name, "arch": a.arch, "version": a.version, "file": a.file,
         "url": a.url, "sha256": a.sha256, "pinned": a.pinned}
        for a in v.all_artifacts()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            pin = r["sha256"][:16] + "…" if r["pinned"] else "UNPINNED"
            print(f"{r['artifact']:<16} {r['arch']:<6} {r['version']:<8} {pin:<18} {r['url']}")
    return 0


def cmd_versions_lock(args: argparse.Namespace) -> int:
    from . import versions

    v = versions.load(args.versions_file)
    res = versions.lock(v, mirror=args.artifact_mirror, only_missing=args.only_missing)
    if args.json:
        print(json.dumps({"versions_file": str(v.path), "pinned": res}, indent=2))
        return 0
    for url, sha in res.items():
        print(f"{sha}  {url}")
    print(f"pinned {len(res)} artifacts in {v.path}", file=sys.stderr)
    return 0
