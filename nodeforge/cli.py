"""The one console script, `nodeforge`, with subcommands contributed by each package.

Each package exposes `register(subparsers)` in its `cli` module. Those modules import only
the standard library (and PyYAML) at import time, because the same CLI runs on booted nodes
where the build-host dependencies (rich, python-hcl2, ansible) are not installed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__
from .errors import NodeforgeError

# Packages whose cli module is optional on a node (the image's agent ships without images/
# and lab/, which run on build hosts).
_CLI_MODULES = (
    "nodeforge.images.cli",
    "nodeforge.bootstrap.cli",
    "nodeforge.gang.cli",
    "nodeforge.lab.cluster_cli",
    "nodeforge.lab.verify_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodeforge",
        description="Bake sealed Slurm node images and bootstrap the nodes that boot from them.",
    )
    parser.add_argument("--version", action="version", version=f"nodeforge {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _CLI_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only tolerate the module itself being absent (agent-only installs), never a
            # missing dependency inside it.
            if exc.name != name and not name.startswith(str(exc.name)):
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        rc = args.func(args)
    except NodeforgeError as exc:
        print(f"nodeforge: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("nodeforge: interrupted; cleaned up", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
