"""`nodeforge build`: checks the target can be built here, then dispatches.

The shared steps (inputs, extra vars, manifest skeleton, partial output and cleanup) are in
images/pipeline.py; the `local` target is images/nspawn_build.py, `qemu` and `amazon-ebs` are
images/packer_build.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from nodeforge import proc
from nodeforge.errors import NodeforgeError

from . import cache, targets
from .pipeline import (
    REPO_ROOT,
    BuildOptions,
    BuildResult,
    Phases,
    build_wheel,
    repo_paths,
    resolve_inputs,
)

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
    target = targets.get(opts.target)
    if opts.playbook is not None and not opts.playbook.is_file():
        raise NodeforgeError(f"--playbook {opts.playbook}: no such file")
    if target.packer_builder:
        if target.root_why and os.geteuid() != 0:
            raise NodeforgeError(target.root_why)
        return  # packer_build.run_packer_target checks its own tools and credentials
    for tool in LOCAL_TOOLS:
        proc.require_tool(tool)
    if target.root_why and os.geteuid() != 0:
        raise NodeforgeError(target.root_why)


def run_build(
    opts: BuildOptions,
    reporter: Callable[[str, str], None],
    on_line: Callable[[str], None] | None = None,
) -> BuildResult:
    preflight(opts)
    inp = resolve_inputs(opts)
    packer_builder = targets.get(opts.target).packer_builder
    if packer_builder:
        from .packer_build import check_target

        check_target(opts.target, inp.user_vars)  # tools and credentials before anything
    # One build per cache dir: layers, base tarballs and artifacts are shared state.
    with cache.locked(opts.cache_dir):
        if not packer_builder:
            from .nspawn_build import run_local

            return run_local(inp, reporter, on_line)
        from .packer_build import run_packer_target

        return run_packer_target(inp, reporter, on_line)
