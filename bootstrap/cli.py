"""CLI for the first-boot agent: `nodeforge node init|status` and `nodeforge params check`.

Imports only the standard library at import time; the agent runs on nodes with python3,
python3-yaml and python3-jinja2 only.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    node = subparsers.add_parser("node", help="first-boot agent on this node (init, status)")
    nsub = node.add_subparsers(dest="node_command", metavar="ACTION")
    nsub.required = True

    p = nsub.add_parser(
        "init",
        help="turn this booted image into a controller/compute/login node (idempotent, resumable)",
    )
    p.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)
    p.add_argument(
        "--no-imds",
        action="store_true",
        help="do not ask the EC2 metadata service for user-data",
    )
    p.add_argument(
        "--imds-url", default=None, help="IMDS base URL (default http://169.254.169.254)"
    )
    p.set_defaults(func=_init)

    g = nsub.add_parser(
        "gave-up",
        help="record a first boot systemd stopped restarting (run by nodeforge-init-gave-up.service)",
        description="Run by nodeforge-init.service's OnFailure=: when systemd gave up restarting "
        "the agent (killed 4 times in one boot), fail the step that was running with that "
        "reason, drain the node with it and write the metric. Does nothing otherwise.",
    )
    g.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)
    g.set_defaults(func=_gave_up)
    _register_rejoin(nsub)

    s = nsub.add_parser("status", help="steps, durations, time-to-ready and the last error")
    s.add_argument("--json", action="store_true", help="print state.json")
    s.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)
    s.set_defaults(func=_status)

    h = nsub.add_parser("health", help="check this node (Slurm HealthCheckProgram); drain if sick")
    h.add_argument("--json", action="store_true", help="print the report as JSON")
    h.add_argument("--quiet", action="store_true", help="print nothing (reports are still written)")
    h.add_argument("--no-slurm", action="store_true", help="check only; do not drain or resume")
    h.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)
    h.set_defaults(func=_health)
    # `nodeforge cluster up/add/status/down` (local nspawn cluster) registers here later.

    params = subparsers.add_parser("params", help="node params: check them offline")
    psub = params.add_subparsers(dest="params_command", metavar="ACTION")
    psub.required = True
    c = psub.add_parser(
        "check",
        help="validate node params offline (exit 0 valid, 2 invalid) and print them, secrets redacted",
        description="Validate node params with the agent's own rules, without a node or a "
        "network. Exit 0: valid (the resolved params are printed, secrets redacted); exit 2: "
        "the error names the file, the field and the fix.",
    )
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--node-yaml", type=Path, metavar="FILE", help="a node.yaml")
    src.add_argument("--user-data", type=Path, metavar="FILE", help="an EC2 user-data file")
    src.add_argument("--cmdline", metavar="STRING", help="a kernel command line")
    src.add_argument("--cmdline-file", type=Path, metavar="FILE", help="a file holding one")
    src.add_argument(
        "--hyperpod",
        type=Path,
        metavar="DIR",
        help="a directory with resource_config.json + provisioning_parameters.json (with --address)",
    )
    c.add_argument(
        "--address",
        action="append",
        default=[],
        help="with --hyperpod: this node's address (repeatable)",
    )
    c.add_argument("--hostname", default="", help="with --hyperpod: this node's hostname")
    c.add_argument(
        "--imds-guarded",
        action="store_true",
        help="with --user-data: the image blocks non-root IMDS access (node_agent_imds_root_only),"
        " so secrets in user-data are acceptable",
    )
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=_params_check)


def _register_rejoin(nsub: argparse._SubParsersAction) -> None:
    r = nsub.add_parser(
        "rejoin",
        help="start the agent again once slurmctld answers (run by nodeforge-rejoin.timer)",
        description="Run every 30 s by nodeforge-rejoin.timer: when this node's first boot "
        "failed because slurmctld did not answer within wait_timeout, and slurmctld answers "
        "now, start nodeforge-init.service again (it resumes). Does nothing otherwise.",
    )
    r.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)
    r.set_defaults(func=_rejoin)


def _rejoin(args: argparse.Namespace) -> int:
    from .host import Host
    from .rejoin import rejoin

    paths = _paths(args.root)
    agent_logging(paths)
    _action, why = rejoin(paths, Host())
    print(f"nodeforge: {why}")
    return 0


def _paths(root: Path):
    from .paths import Paths

    return Paths() if root == Path("/") else Paths.under(root)


def _init(args: argparse.Namespace) -> int:
    from .agent import Agent, StepFailed, Stopped, stop_on_sigterm
    from .params_sources import IMDS_URL, SourceConfig

    paths = _paths(args.root)
    agent_logging(paths)
    imds = None if args.no_imds else (args.imds_url or IMDS_URL)
    agent = Agent(paths=paths, sources=SourceConfig(paths, imds_url=imds))
    try:
        with stop_on_sigterm():
            state = agent.init()
    except (StepFailed, Stopped) as exc:
        print(f"nodeforge: node init failed: {exc}", file=sys.stderr)
        print(
            "nodeforge: `nodeforge node status` shows the steps; fix and rerun `nodeforge node init`",
            file=sys.stderr,
        )
        return 1
    print(
        f"nodeforge: {state.node} ready as {state.role} of {state.cluster} "
        f"(time-to-ready {state.time_to_ready or 0:.1f}s)"
    )
    return 0


def _gave_up(args: argparse.Namespace) -> int:
    from .gave_up import record, settled_unit
    from .host import Host

    paths = _paths(args.root)
    agent_logging(paths)
    host = Host()
    what = record(paths, host, settled_unit(host))
    print(f"nodeforge: {what}" if what else "nodeforge: nothing to record")
    return 0


def agent_logging(paths) -> list[logging.Handler]:
    """The agent's log: agent.log (root-only, 0600 in a 0700 directory) and stderr (journald),
    both through the redacting formatter. Returns the handlers it added."""
    from nodeforge import fsutil, redact

    paths.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fsutil.restrict_mode(paths.log_dir, 0o700)
    log_file = paths.log_dir / "agent.log"
    try:  # created 0600 (or narrowed) before logging opens it; never through a symlink
        fsutil.open_private_append(log_file).close()
    except OSError as exc:
        from nodeforge.errors import NodeforgeError

        raise NodeforgeError(
            f"{log_file}: cannot open the agent's log ({exc.strerror}); it must be a regular "
            "file or absent (a symlink is refused)"
        ) from None
    handler = logging.FileHandler(log_file)
    handler.setFormatter(redact.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root_log = logging.getLogger("nodeforge")
    root_log.addHandler(handler)
    root_log.setLevel(logging.DEBUG)
    root_log.propagate = False
    console = logging.StreamHandler(sys.stderr)  # journald when run by nodeforge-init.service
    console.setLevel(logging.INFO)
    console.setFormatter(redact.Formatter("nodeforge: %(message)s"))
    root_log.addHandler(console)
    return [handler, console]


def _params_check(args: argparse.Namespace) -> int:
    from . import params_check as pc
    from .params import ParamsError

    if args.hyperpod is not None:
        if not args.address and not args.hostname:
            raise ParamsError(
                "--hyperpod: give this node's --address (or --hostname) to pick its instance"
            )
        checked = pc.check_hyperpod(args.hyperpod, args.address, args.hostname)
    elif args.address or args.hostname:
        raise ParamsError("--address/--hostname go with --hyperpod DIR")
    elif args.node_yaml is not None:
        checked = pc.check_node_yaml(args.node_yaml)
    elif args.user_data is not None:
        checked = pc.check_user_data(args.user_data, args.imds_guarded)
    elif args.cmdline is not None:
        from .params_sources import cmdline_bytes

        # argparse turns `--cmdline=--` into [] (it drops a "--" value): give it back.
        text = args.cmdline if isinstance(args.cmdline, str) else "--"
        checked = pc.check_cmdline(cmdline_bytes(text), "kernel command line (--cmdline)")
    else:
        from .params_sources import read_cmdline

        try:
            raw = read_cmdline(args.cmdline_file)
        except OSError as exc:
            raise ParamsError(f"{args.cmdline_file}: cannot read: {exc.strerror}") from None
        checked = pc.check_cmdline(raw, f"kernel command line ({args.cmdline_file})")
    sys.stdout.write(pc.render(checked, args.json))
    return 0


def _health(args: argparse.Namespace) -> int:
    import json
    from dataclasses import asdict

    from .health import run
    from .host import Host

    rep = run(Host(), _paths(args.root), slurm=not args.no_slurm)
    if args.json:
        print(json.dumps(asdict(rep) | {"ok": rep.ok, "reason": rep.reason}, indent=2))
    elif not args.quiet:
        for c in rep.checks:
            print(f"{'ok  ' if c.ok else 'FAIL'} {c.name:<12} {c.detail}")
        print(f"{'healthy' if rep.ok else rep.reason} ({rep.duration:.2f}s; slurm: {rep.action})")
    return 0 if rep.ok else 1


def _status(args: argparse.Namespace) -> int:
    from nodeforge.cli import EXIT_FAILURE, EXIT_NOT_READY, EXIT_OK

    from .state import State
    from .status import as_json, as_text

    paths = _paths(args.root)
    if not paths.state_file.exists() and not paths.image_json.exists():
        print(
            f"nodeforge: this machine is not a nodeforge node: no {paths.state_file} and no "
            f"{paths.image_json}; `node status` reports on a machine booted from a nodeforge "
            "image",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    state = State.load(paths.state_file)
    sys.stdout.write(as_json(state) + "\n" if args.json else as_text(state))
    if state.status == "ready":
        return EXIT_OK
    return EXIT_NOT_READY if state.status in ("new", "running") else EXIT_FAILURE
