"""CLI: `nodeforge cluster up|add|replace|rollout|status|down|exec` — a local cluster of nspawn nodes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cluster", help="a local Slurm cluster of systemd-nspawn nodes from a built image"
    )
    cs = p.add_subparsers(dest="cluster_cmd", metavar="ACTION")
    cs.required = True
    # one phase per group of actions, in the order `cluster --help` lists them
    _add_up_and_add(cs)
    _add_replace(cs)
    _add_rollout(cs)
    _add_status_down_exec(cs)


def _node_options(sp: argparse.ArgumentParser, with_nodes: bool = True) -> None:
    """--name, and for the commands that start nodes the options of a new node."""
    sp.add_argument("--name", default="nf", help="cluster name (default: %(default)s)")
    if with_nodes:
        sp.add_argument(
            "--params",
            type=Path,
            metavar="FILE.yaml",
            help="extra node params merged into each new node's node.yaml",
        )
        sp.add_argument(
            "--copy",
            action="append",
            default=[],
            metavar="SRC:DEST",
            help="copy a host file into each new node before it boots",
        )
        sp.add_argument(
            "--join-interval",
            type=float,
            default=0.0,
            metavar="S",
            help="seconds between two joining computes",
        )
        sp.add_argument(
            "--timeout",
            type=float,
            default=300.0,
            help="bound for nodes to become ready (default: %(default)ss)",
        )
        sp.add_argument("--no-wait", action="store_true", help="return once nodes are started")
        sp.add_argument(
            "--json",
            action="store_true",
            help="print the final status as JSON (progress lines go to stderr)",
        )


def _add_up_and_add(cs: argparse._SubParsersAction) -> None:
    """`cluster up` and `cluster add`: start nodes."""
    s = cs.add_parser("up", help="start a controller and N computes")
    s.add_argument(
        "--image",
        type=Path,
        default=Path("output/local"),
        help="output directory of `nodeforge build` (default: %(default)s)",
    )
    s.add_argument(
        "--computes",
        type=int,
        default=2,
        help="compute nodes to start after the controller (default: %(default)s)",
    )
    _node_options(s)
    s.set_defaults(func=cmd_up)

    s = cs.add_parser("add", help="join K more computes to a running cluster")
    s.add_argument("count", type=int, help="how many nodes to join")
    s.add_argument(
        "--role",
        default="compute",
        choices=("compute", "login"),
        help="role of the new nodes (default: %(default)s)",
    )
    _node_options(s)
    s.set_defaults(func=cmd_add)


def _add_replace(cs: argparse._SubParsersAction) -> None:
    """`cluster replace`: a fresh machine under a node's name."""
    s = cs.add_parser(
        "replace",
        help="replace a compute with a fresh machine of the same name (new disk, new keys)",
        description=(
            "The node's machine is lost (its process, disk and namespace go) and a fresh one "
            "boots under the same NodeName, from the cluster's image or --image DIR; its agent "
            "replaces Slurm's old registration. An image whose slurmd the controller cannot "
            "talk to, or an unknown node, is refused before anything is touched."
        ),
    )
    s.add_argument("node", help="the compute to replace (c001, ...)")
    s.add_argument(
        "--image",
        type=Path,
        metavar="DIR",
        help="output directory of `nodeforge build` for the new machine (default: the cluster's)",
    )
    _node_options(s)
    s.set_defaults(func=cmd_replace)


def _add_rollout(cs: argparse._SubParsersAction) -> None:
    """`cluster rollout`: a new image across the cluster."""
    s = cs.add_parser(
        "rollout",
        help="roll a new image across the cluster: canary, batches, controller last",
        description=(
            "Canary first (one compute), then batches of --batch computes, the controller "
            "last. Each step: drain in Slurm, let running jobs finish up to --drain-timeout "
            "then requeue them, replace the machines from --image, gate on health and "
            "`nodeforge verify`, resume. A failed step stops the rollout and is restored on "
            "the old image. An image without a manifest or whose slurmd the controller "
            "cannot talk to, an unknown node, or a batch below 1 is refused before anything "
            "is drained. The controller's state (StateSaveLocation, MariaDB's data, the munge "
            "key) is kept across its replacement."
        ),
    )
    s.add_argument("--name", default="nf", help="cluster name (default: %(default)s)")
    s.add_argument(
        "--image",
        type=Path,
        required=True,
        metavar="DIR",
        help="output directory of `nodeforge build` to roll out",
    )
    s.add_argument(
        "--batch", type=int, default=1, metavar="N", help="computes per batch after the canary"
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds running jobs may finish before they are requeued (default: %(default)s)",
    )
    s.add_argument(
        "--nodes",
        metavar="LIST",
        help="only these nodes, comma separated (default: every compute, then ctl)",
    )
    s.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="bound for a replaced node to become ready (default: %(default)ss)",
    )
    s.add_argument(
        "--params",
        type=Path,
        metavar="FILE.yaml",
        help="extra node params merged into each replaced node's node.yaml",
    )
    s.add_argument(
        "--copy",
        action="append",
        default=[],
        metavar="SRC:DEST",
        help="copy a host file into each replaced node before it boots",
    )
    s.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    s.add_argument(
        "--json", action="store_true", help="print the summary as JSON (progress on stderr)"
    )
    s.set_defaults(func=cmd_rollout)


def _add_status_down_exec(cs: argparse._SubParsersAction) -> None:
    """`cluster status`, `down` and `exec`: the running cluster."""
    s = cs.add_parser("status", help="role, Slurm state, reason and time-to-ready of each node")
    s.add_argument("--name", default="nf", help="cluster name (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.set_defaults(func=cmd_status)

    s = cs.add_parser("down", help="remove every node, namespace, bridge and mount")
    s.add_argument("--name", default="nf", help="cluster name (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print what was removed as JSON")
    s.set_defaults(func=cmd_down)

    s = cs.add_parser("exec", help="run a command inside a node")
    s.add_argument("--name", default="nf", help="cluster name (default: %(default)s)")
    s.add_argument("node", help="node name (ctl, c001, ...)")
    s.add_argument("argv", nargs=argparse.REMAINDER, help="the command (after --)")
    s.set_defaults(func=cmd_exec)


def _inputs(args):
    import yaml

    from nodeforge import fsutil, strict_yaml
    from nodeforge.bootstrap.params_sources import _yaml_problem
    from nodeforge.errors import NodeforgeError

    params = None
    if args.params:
        try:
            params = strict_yaml.load(args.params.read_bytes()) or {}
        except OSError as exc:
            raise NodeforgeError(f"--params {args.params}: {exc.strerror}") from None
        except strict_yaml.StrictYAMLError as exc:  # names the key and rule, never a value
            raise NodeforgeError(f"--params {args.params}: {exc}") from None
        except yaml.YAMLError as exc:  # PyYAML's own text quotes the line: it may hold a key
            raise NodeforgeError(f"--params {args.params}: {_yaml_problem(exc)}") from None
        if not isinstance(params, dict):
            raise NodeforgeError(f"--params {args.params}: expected a mapping of node params")
    copies = []
    for c in args.copy:
        src, sep, dest = c.partition(":")
        if not sep or not dest.startswith("/"):
            raise NodeforgeError(f"--copy '{c}': expected SRC:/absolute/dest")
        # the destination lands inside a node's root: no '..' may lead out to the host
        fsutil.safe_name(dest.lstrip("/"), what=f"--copy '{c}' destination", nested=True)
        if not Path(src).is_file():
            raise NodeforgeError(f"--copy '{c}': {src} is not a file")
        copies.append((Path(src), dest))
    return params, copies


def _print_status(st: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(st, indent=2))
        return
    print(f"cluster {st['cluster']}  image {st['image']}")
    print(
        f"{'NODE':<10} {'ROLE':<11} {'ADDRESS':<13} {'AGENT':<9} {'SLURM':<14} {'READY_S':>8}  REASON"
    )
    # READY_S: nspawn start -> first seen ready (IDLE/MIXED with no flag such as `*`)
    for n in st["nodes"]:
        ttr = f"{n['time_to_ready_s']:.1f}" if n["time_to_ready_s"] is not None else "-"
        print(
            f"{n['name']:<10} {n['role']:<11} {n['address']:<13} {n['agent']:<9} "
            f"{n['slurm_state']:<14} {ttr:>8}  {n['reason']}"
        )
    from nodeforge.bootstrap import failures

    summary = [failures.StepSummary(s["step"], tuple(s["nodes"]), s["first_node"], s["first_error"])
               for s in st.get("bootstrap_failures", [])]  # fmt: skip
    for line in failures.lines(summary):
        print(line)


def _progress(msg: str) -> None:
    """One line per node event (started, ready) on stderr; stdout stays the table/JSON."""
    import time

    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cmd_up(args) -> int:
    from .localcluster import LocalCluster

    params, copies = _inputs(args)
    lc = LocalCluster(args.name, progress=_progress)
    lc.up(
        args.image,
        args.computes,
        join_interval=args.join_interval,
        params=params,
        copies=copies,
        wait=not args.no_wait,
        timeout=args.timeout,
    )
    _print_status(lc.status(), args.json)
    return 0


def cmd_add(args) -> int:
    from .localcluster import LocalCluster

    params, copies = _inputs(args)
    lc = LocalCluster(args.name, progress=_progress)
    lc.add(
        args.count,
        join_interval=args.join_interval,
        params=params,
        copies=copies,
        wait=not args.no_wait,
        timeout=args.timeout,
        role=args.role,
    )
    _print_status(lc.status(), args.json)
    return 0


def cmd_replace(args) -> int:
    from .localcluster import LocalCluster

    params, copies = _inputs(args)
    lc = LocalCluster(args.name, progress=_progress)
    _node, secs = lc.replace(
        args.node, image=args.image, params=params, copies=copies,
        wait=not args.no_wait, timeout=args.timeout,
    )  # fmt: skip
    if secs is not None:
        _progress(f"{args.node}: replaced; schedulable {secs:.1f}s after the old machine was lost")
    _print_status(lc.status(), args.json)
    return 0


def cmd_rollout(args) -> int:
    from .localcluster import LocalCluster
    from .rollout import Rollout

    params, copies = _inputs(args)
    nodes = None
    if args.nodes is not None:
        nodes = [n.strip() for n in args.nodes.split(",")]
        if not all(nodes):
            from nodeforge.errors import NodeforgeError

            raise NodeforgeError(f"--nodes {args.nodes!r}: give node names separated by commas")
    ro = Rollout(
        LocalCluster(args.name, progress=_progress),
        args.image,
        batch=args.batch,
        drain_timeout=args.drain_timeout,
        ready_timeout=args.timeout,
        nodes=nodes,
        params=params,
        copies=copies,
    )
    if args.dry_run:
        print("\n".join(ro.dry_run()))
        return 0
    summary = ro.run()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for st in summary["steps"]:
            print(f"step {st['step']} {st['kind']:<10} {','.join(st['nodes']):<24} "
                  f"{st['seconds']:>7.1f}s  requeued: {','.join(st['requeued']) or '-'}")  # fmt: skip
        print(f"total {summary['seconds']:.1f}s; capacity {summary['capacity_node_seconds']:.0f} "
              f"of {summary['ideal_node_seconds']:.0f} node-seconds")  # fmt: skip
    return 0


def cmd_status(args) -> int:
    from .localcluster import LocalCluster

    _print_status(LocalCluster(args.name).status(), args.json)
    return 0


def cmd_down(args) -> int:
    from .localcluster import LocalCluster

    removed = LocalCluster(args.name).down()
    if args.json:
        print(json.dumps({"cluster": args.name, "removed": removed}, indent=2))
    print(
        f"removed cluster {args.name}: {', '.join(removed) or 'nothing was running'}",
        file=sys.stderr,
    )
    return 0


def cmd_exec(args) -> int:
    from .localcluster import Cluster, node_exec

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    cp = node_exec(
        Cluster.load(args.name).node(args.node), argv or ["sh"], check=False, timeout=600
    )
    sys.stdout.write(cp.stdout)
    return cp.returncode
