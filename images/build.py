"""`nodeforge build`: checks the target can be built here, then dispatches.

The shared steps (inputs, extra vars, manifest skeleton, partial output and cleanup) are in
images/pipeline.py; the `local` target is images/local.py, `qemu` and `amazon-ebs` are
images/remote.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from nodeforge import proc
from nodeforge.errors import NodeforgeError

from . import cache
from .pipeline import (
    REPO_ROOT,
    BuildOptions,
    BuildResult,
    Phases,
    build_wheel,
    repo_paths,
    resolve_inputs,
)
from .template import TARGETS

__all__ = [
    "REPO_ROOT",
    "BuildOptions",
    "BuildResult",
    "Phases",
    "build_wheel",
    "preflight",
    "repo_paths",
    "run_build",
]

LOCAL_TOOLS = (
    "packer",
    "mmdebstrap",
    "systemd-nspawn",
    "mkfs.ext4",
    "qemu-img",
    "ssh-keygen",
    "ssh",
    "tar",
    "zstd",
    "dpkg-query",
    "ansible-playbook",
)


def preflight(opts: BuildOptions) -> None:
    if opts.target not in TARGETS:
        raise NodeforgeError(f"unknown target '{opts.target}'; choose one of: {', '.join(TARGETS)}")
    if opts.playbook is not None and not opts.playbook.is_file():
        raise NodeforgeError(f"--playbook {opts.playbook}: no such file")
    if opts.target == "qemu" and os.geteuid() != 0:
        raise NodeforgeError(
            "the qemu target needs root (the base disk is made with real ownership and the "
            "built disk is loop-mounted to seal it); run it with sudo"
        )
    if opts.target != "local":
        return  # remote.run_packer_target checks its own tools and credentials
    for tool in LOCAL_TOOLS:
        proc.require_tool(tool)
    if os.geteuid() != 0:
        raise NodeforgeError(
            "the local target needs root (mmdebstrap, systemd-nspawn and mkfs.ext4 -d with "
            "real ownership); run it with sudo"
        )


def run_build(
    opts: BuildOptions,
    reporter: Callable[[str, str], None],
    on_line: Callable[[str], None] | None = None,
) -> BuildResult:
    preflight(opts)
    inp = resolve_inputs(opts)
    if opts.target != "local":
        from .remote import check_target

        check_target(opts.target, inp.user_vars)  # tools and credentials before anything
    # One build per cache dir: layers, base tarballs and artifacts are shared state.
    with cache.locked(opts.cache_dir):
        if opts.target == "local":
            from .local import run_local

            return run_local(inp, reporter, on_line)
        from .remote import run_packer_target

        return run_packer_target(inp, reporter, on_line)
