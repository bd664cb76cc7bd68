"""The one console script, `nodeforge`, with subcommands contributed by each package.

Each package exposes `register(subparsers)` in its `cli` module. Those modules import only
the standard library (and PyYAML) at import time, because the same CLI runs on booted nodes
where the build-host dependencies (rich, python-hcl2, ansible) are not installed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from . import __version__, redact
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


def version_text() -> str:
    """ "nodeforge X.Y.Z", plus the git revision when this runs from a source checkout."""
    from . import data

    text = f"nodeforge {__version__}"
    root = data.checkout()
    if root is not None:
        text += f" (checkout {root}, git {_git_revision(root) or 'revision unknown'})"
    return text


def _git_revision(root) -> str | None:
    from . import proc

    try:
        cp = proc.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=12"],
                      check=False, timeout=10)  # fmt: skip
    except NodeforgeError:  # no git on this host
        return None
    return cp.stdout.strip() or None if cp.returncode == 0 else None


class _VersionAction(argparse.Action):
    """--version, computed only when asked (the git call must not slow every command)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version (and the git revision of a checkout) and exit")  # fmt: skip

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


# Top-level commands served by one cli module, parsed with that module alone: `nodeforge node
# init` (the first-boot agent, on every boot's path to ready) and `nodeforge node health`
# (slurmd's HealthCheckProgram, which slurmd runs before it registers) skip importing and
# building every other package's subcommands (bench/README.md, "agent start-up").
_LIGHT_COMMANDS = {"node": "nodeforge.bootstrap.cli", "params": "nodeforge.bootstrap.cli"}


def light_module(argv: list[str]) -> str | None:
    """The one cli module that serves *argv*, or None (top-level --help/--version, another
    command, nothing): those build the full parser. Only -v/--verbose may come first."""
    for arg in argv:
        if arg in ("-v", "--verbose"):
            continue
        return _LIGHT_COMMANDS.get(arg)
    return None


class _Parser(argparse.ArgumentParser):
    """argparse, less one bug: `--opt=--` (or `-o--`) gives a one-value option the list `[]`
    without calling its type (CPython strips the `--` first), which no command expects and
    which crashed `versions lock --arch=--`. The value is the literal `--` (a kernel command
    line may hold one), typed and checked like any other. Subparsers inherit this class."""

    def _get_values(self, action, arg_strings):
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


def build_parser(modules: tuple[str, ...] = _CLI_MODULES) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="nodeforge",
        description="Bake sealed Slurm node images and bootstrap the nodes that boot from them.",
    )
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in modules:
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


# Exit statuses (README "Exit statuses"): argparse's own usage errors also exit 2, with a
# "usage:" line; both are the caller's input to fix.
EXIT_OK, EXIT_FAILURE, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141
EXIT_NOT_READY = 3  # asked "is it ready?" and it is not yet (nothing failed): `node status`


def main(argv: list[str] | None = None) -> int:
    light = light_module(sys.argv[1:] if argv is None else argv)
    parser = build_parser((light,)) if light else build_parser()
    args = parser.parse_args(argv)
    stderr_log = logging.StreamHandler()  # every line redacted (nodeforge/redact.py)
    stderr_log.setFormatter(redact.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, handlers=[stderr_log]
    )
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
    except NodeforgeError as exc:
        print(f"nodeforge: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("nodeforge: interrupted; cleaned up", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `nodeforge … | head`: the reader is gone; stop quietly, like a SIGPIPE'd program.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        # A path given on the command line that cannot be read: the message, not a traceback
        # (-v keeps the traceback for a bug report).
        if args.verbose or exc.filename is None:
            raise
        print(f"nodeforge: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_INPUT
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
