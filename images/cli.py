"""CLI: `nodeforge build`, `render`, `validate`, `versions`. Heavy imports stay in handlers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .targets import DEFAULT_TARGET, DEFAULT_VARIANT, TARGETS, VARIANTS


def _variant_option(p: argparse.ArgumentParser, help: str) -> None:
    """One --variant for build, render and validate: same choices, same default."""
    p.add_argument("--variant", default=DEFAULT_VARIANT, choices=VARIANTS, help=help)


def register(sub: argparse._SubParsersAction) -> None:
    # one phase per command, in the order `nodeforge --help` lists them
    _add_build(sub)
    _add_cache(sub)
    _add_render_and_validate(sub)
    _add_versions(sub)


def _add_build(sub: argparse._SubParsersAction) -> None:
    """`nodeforge build`."""
    p = sub.add_parser("build", help="bake the node image (default target: local)")
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        choices=TARGETS,
        help="where to build (default: %(default)s)",
    )
    p.add_argument("--base", help="base from the versions file (default: debian13; also debian12)")
    _variant_option(
        p,
        "image variant: cpu (default) or gpu (NVIDIA driver, NVML, NCCL, container toolkit; "
        "needs contrib/non-free in the Debian mirror)",
    )
    p.add_argument(
        "--var-file",
        action="append",
        default=[],
        type=Path,
        metavar="F.pkrvars.hcl",
        help="Packer variables (repeatable)",
    )
    p.add_argument(
        "--artifact-mirror",
        metavar="DIR|URL",
        help="serve the pinned artifacts from a directory or URL (air-gapped builds)",
    )
    p.add_argument(
        "--allow-unpinned",
        action="store_true",
        help="build even though some artifacts have no recorded sha256",
    )
    p.add_argument("--output", type=Path, help="artifact directory (default: output/<target>)")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("/var/cache/nodeforge"),
        help="base tarballs, apt archives and artifacts (default: %(default)s)",
    )
    p.add_argument("--name", help="image name (default: nodeforge-<base>-<arch>)")
    p.add_argument("--versions-file", type=Path, help="alternative versions file")
    p.add_argument("--keep-work", action="store_true", help="keep the work tree (debugging)")
    p.add_argument(
        "--playbook",
        type=Path,
        help="provision with another playbook (default: images/site.yml); for "
        "testing the build machinery, the result is not a node image",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild even when no input changed since the build in --output",
    )
    p.add_argument(
        "--cache-max-size",
        default="20G",
        metavar="SIZE",
        help="cap of the layer cache; least recently used layers beyond it are "
        "pruned (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the result summary as JSON")
    p.set_defaults(func=cmd_build)


def _add_cache(sub: argparse._SubParsersAction) -> None:
    """`nodeforge cache ls|prune`."""
    p = sub.add_parser("cache", help="list or prune the layered build cache")
    cs = p.add_subparsers(dest="cache_cmd", metavar="ACTION")
    cs.required = True
    s = cs.add_parser("ls", help="list the cached layers and base tarballs")
    s.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("/var/cache/nodeforge"),
        help="the build cache (default: %(default)s)",
    )
    s.add_argument("--json", action="store_true", help="print the list as JSON")
    s.set_defaults(func=cmd_cache_ls)
    s = cs.add_parser("prune", help="remove unfinished entries and layers beyond a size")
    s.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("/var/cache/nodeforge"),
        help="the build cache (default: %(default)s)",
    )
    s.add_argument(
        "--max-size",
        default="20G",
        metavar="SIZE",
        help="keep at most this much, most recently used first (default: %(default)s)",
    )
    s.add_argument("--all", action="store_true", help="remove every layer")
    s.set_defaults(func=cmd_cache_prune)


def _add_render_and_validate(sub: argparse._SubParsersAction) -> None:
    """`nodeforge render` and `validate`: the Packer templates."""
    p = sub.add_parser("render", help="print the Packer template of a target")
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        choices=TARGETS,
        help="the target (default: %(default)s)",
    )
    _variant_option(p, "the image variant the template is for, as for build")
    p.set_defaults(func=cmd_render)

    p = sub.add_parser("validate", help="run `packer validate` on every target's template")
    p.add_argument(
        "--target",
        action="append",
        choices=TARGETS,
        help="only this target (repeatable; default: all)",
    )
    p.add_argument(
        "--var-file",
        action="append",
        default=[],
        type=Path,
        metavar="F.pkrvars.hcl",
        help="Packer variables to validate with (repeatable)",
    )
    _variant_option(
        p, "validate the templates of this variant, as for build (gpu: the local target's)"
    )
    p.add_argument("--json", action="store_true", help="print {target: packer output} as JSON")
    p.set_defaults(func=cmd_validate)


def _add_versions(sub: argparse._SubParsersAction) -> None:
    """`nodeforge versions show|lock`."""
    p = sub.add_parser("versions", help="show or pin the artifacts of the versions file")
    vs = p.add_subparsers(dest="versions_cmd", metavar="ACTION")
    vs.required = True
    s = vs.add_parser("show", help="list artifacts and whether they are pinned")
    s.add_argument("--versions-file", type=Path, help="alternative versions file")
    s.add_argument("--json", action="store_true", help="print the artifacts as JSON")
    s.set_defaults(func=cmd_versions_show)
    s = vs.add_parser("lock", help="download every artifact and record its sha256")
    s.add_argument(
        "--artifact-mirror",
        metavar="DIR|URL",
        help="read the artifacts from a directory or URL instead of upstream",
    )
    s.add_argument("--versions-file", type=Path, help="alternative versions file (edited in place)")
    s.add_argument("--only-missing", action="store_true", help="only artifacts without a sha256")
    s.add_argument(
        "--variant",
        default="cpu",
        choices=(*VARIANTS, "all"),
        help="pin what a build of this variant needs (default: %(default)s, as for build; "
        "a mirror without the gpu variant's NVIDIA files pins the cpu build); all: every variant",
    )
    s.add_argument(
        "--arch",
        metavar="ARCH",
        help="pin this architecture's artifacts (default: the build host's, as for build); "
        "all: every architecture. The others stay unpinned",
    )
    s.add_argument(
        "--json",
        action="store_true",
        help="print {url: sha256}, the file and what stays unpinned as JSON",
    )
    s.set_defaults(func=cmd_versions_lock)


def cmd_build(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .build import BuildOptions, run_build
    from .cache import parse_size

    err = Console(stderr=True, highlight=False)
    opts = BuildOptions(
        force=args.force,
        cache_max_bytes=parse_size(args.cache_max_size),
        target=args.target,
        base=args.base,
        var_files=list(args.var_file),
        artifact_mirror=args.artifact_mirror,
        allow_unpinned=args.allow_unpinned,
        output=args.output,
        cache_dir=args.cache_dir,
        name=args.name,
        versions_file=args.versions_file,
        keep_work=args.keep_work,
        playbook=args.playbook.resolve() if args.playbook else None,
        variant=args.variant,
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
        print(
            json.dumps(
                {
                    "output": str(result.output),
                    "name": m["name"],
                    "phases": m["phases"],
                    "steps": m.get("steps", {}),
                    "artifacts": m["artifacts"],
                    "variant": m.get("variant", "cpu"),
                    "gpu": m.get("gpu"),
                    "components": m.get("components", {}),
                    "reused": result.reused,
                    "cache": m.get("cache", {}),
                },
                indent=2,
            )
        )
    elif result.reused:
        err.print(f"unchanged: {m['name']} built {m['created']} → {result.output}")
    else:
        total = sum(m["phases"].values())
        err.print(f"built {m['name']} in {total:.0f}s → {result.output}")
        for name, a in m["artifacts"].items():
            err.print(f"  {name:<18} {a['bytes'] / 2**20:9.1f} MiB  sha256:{a['sha256'][:16]}…")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from . import packer

    sys.stdout.write(packer.render(args.target, variant=args.variant))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from .targets import variant_targets
    from .validate import validate_targets

    # Without --target: every target that builds the variant (gpu: local only).
    targets = args.target or list(variant_targets(args.variant))
    results = validate_targets(targets, args.var_file, args.variant)
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
        {
            "artifact": a.name,
            "arch": a.arch,
            "version": a.version,
            "file": a.file,
            "url": a.url,
            "sha256": a.sha256,
            "pinned": a.pinned,
        }
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
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from . import versions

    v = versions.load(args.versions_file)
    err = Console(stderr=True, highlight=False)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )

    def progress(art: versions.Artifact):
        task = bar.add_task(f"{art.file} ({art.arch})", total=None)

        def update(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        return update

    arch = None if args.arch == "all" else args.arch
    if arch is None and args.arch is None:
        from .base import host_arch

        arch = host_arch()
    with bar:
        res = versions.lock(
            v,
            mirror=args.artifact_mirror,
            only_missing=args.only_missing,
            arch=arch,
            variant=None if args.variant == "all" else args.variant,
            progress=progress,
        )
    left = [a for a in versions.load(v.path).all_artifacts() if not a.pinned]
    if args.json:
        unpinned = [{"artifact": a.name, "arch": a.arch, "variant": a.variant or "every"}
                    for a in left]  # fmt: skip
        print(json.dumps({"versions_file": str(v.path), "pinned": res, "unpinned": unpinned},
                         indent=2))  # fmt: skip
        return 0
    for url, sha in res.items():
        print(f"{sha}  {url}")
    print(f"pinned {len(res)} artifacts in {v.path}", file=sys.stderr)
    if left:
        # One line per variant, so a CPU-only mirror's user sees that only the gpu build
        # still needs pins, and with which command.
        print(f"still unpinned ({len(left)}):", file=sys.stderr)
        for variant in (None, *versions.VARIANTS):
            mine = [a for a in left if a.variant == variant]
            for a_arch in sorted({a.arch for a in mine}):
                names = ", ".join(f"{a.name} [{a.arch}]" for a in mine if a.arch == a_arch)
                who = f"the {variant} variant" if variant else "every variant"
                cmd = "nodeforge versions lock" + (f" --variant {variant}" if variant else "")
                cmd += f" --arch {a_arch}" if a_arch != "all" else ""
                print(f"  {who}: {names}; pin with '{cmd}' (add --artifact-mirror DIR|URL "
                      "for a mirror that holds them)", file=sys.stderr)  # fmt: skip
    return 0


def cmd_cache_ls(args: argparse.Namespace) -> int:
    import datetime as dt

    from .cache import LayerStore

    layers = LayerStore(args.cache_dir).entries()
    bases = (
        sorted((args.cache_dir / "base").glob("base-*.tar"))
        if (args.cache_dir / "base").is_dir()
        else []
    )
    rows: list[dict[str, Any]] = [
        {
            "kind": "layer",
            "key": i.key,
            "bytes": i.bytes,
            "entries": i.entries,
            "last_used": dt.datetime.fromtimestamp(i.last_used, dt.UTC).isoformat(
                timespec="seconds"
            ),
            # the layer this one is a diff over (a later role group's); None: a whole tree
            "parent": i.parent,
        }
        for i in layers
    ]
    rows += [{"kind": "base", "key": b.name, "bytes": b.stat().st_size} for b in bases]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        over = f"  over {r['parent'][:16]}" if r.get("parent") else ""
        print(
            f"{r['kind']:<6} {r['key'][:40]:<40} {r['bytes'] / 2**20:9.1f} MiB"
            f"  {r.get('last_used', '')}{over}"
        )
    total = sum(r["bytes"] for r in rows)
    print(f"{len(rows)} entries, {total / 2**30:.2f} GiB in {args.cache_dir}", file=sys.stderr)
    return 0


def cmd_cache_prune(args: argparse.Namespace) -> int:
    from .cache import LayerStore, locked, parse_size

    cap = 0 if args.all else parse_size(args.max_size)
    with locked(args.cache_dir):
        removed = LayerStore(args.cache_dir).prune(cap)
    for r in removed:
        print(f"removed {r}")
    print(f"pruned {len(removed)} entries from {args.cache_dir}", file=sys.stderr)
    return 0
