"""The base root filesystem: mmdebstrap minbase + what systemd-nspawn, sshd and Ansible need.

Cached by a content key (suite, mirror, arch, package list, mmdebstrap version), so a second
build with the same inputs reuses the tarball instead of bootstrapping again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from nodeforge import proc
from nodeforge.fsutil import atomic_output, write_atomic
from nodeforge.images import build_proc

from .versions import Base

log = logging.getLogger("nodeforge.base")

# Only what the sandbox needs to boot and be provisioned, plus the kernel for the disk
# image; everything else is installed by the roles so it is visible in the playbook.
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "udev",
    "kmod",
    "openssh-server",
    "python3",
    "python3-apt",
    "ca-certificates",
    "iproute2",
    "sudo",
    "zstd",
    "initramfs-tools",
)
KERNEL_PACKAGE = {"amd64": "linux-image-amd64", "arm64": "linux-image-arm64"}
# Archive components per image variant: the NVIDIA driver stack, NCCL and the NVML Slurm
# plugin are in contrib/non-free (firmware-nvidia-gsp in non-free-firmware).
COMPONENTS = {"cpu": ("main",), "gpu": ("main", "contrib", "non-free", "non-free-firmware")}


@dataclass(frozen=True)
class BaseSpec:
    suite: str
    mirror: str
    arch: str
    variant: str
    packages: tuple[str, ...]
    mmdebstrap: str  # version, part of the key: a new mmdebstrap may produce a different tree
    components: tuple[str, ...] = ("main",)

    def key(self) -> str:
        d = asdict(self)
        if self.components == ("main",):
            del d["components"]  # main-only (cpu) keeps the key it had before variants existed
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def host_arch() -> str:
    return proc.run(["dpkg", "--print-architecture"]).stdout.strip()


def spec_for(base: Base, arch: str, variant: str = "cpu") -> BaseSpec:
    mm = proc.require_tool("mmdebstrap")
    version = proc.run([mm, "--version"]).stdout.strip().split()[-1]
    pkgs = tuple(sorted(BASE_PACKAGES + (KERNEL_PACKAGE[arch],)))
    return BaseSpec(base.suite, base.mirror, arch, "minbase", pkgs, version, COMPONENTS[variant])


def ensure_base(
    spec: BaseSpec, cache_dir: Path, keyring: str, logfile: IO[str]
) -> tuple[Path, bool]:
    """Return (path of the base tarball, whether it came from the cache)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    tar = cache_dir / f"base-{spec.suite}-{spec.arch}-{spec.key()}.tar"
    if tar.is_file():
        log.info("base cache hit: %s", tar)
        logfile.write(f"base: reusing cached {tar}\n")
        return tar, True
    # mmdebstrap picks the output format from the extension, so the temp name ends in .tar.
    with atomic_output(tar, tmp_name=f".part-{os.getpid()}-{tar.name}") as tmp:
        argv = [
            proc.require_tool("mmdebstrap"),
            f"--variant={spec.variant}",
            f"--architectures={spec.arch}",
            f"--include={','.join(spec.packages)}",
            f"--keyring={keyring}",
            # Written into the image's sources.list too, so the roles' apt sees these components.
            f"--components={','.join(spec.components)}",
            # Recommends stay off for a lean image; roles add what they need by name.
            '--aptopt=APT::Install-Recommends "false"',
            spec.suite,
            str(tmp),
            spec.mirror,
        ]
        build_proc.stream(
            argv,
            logfile=logfile,
            timeout=1800,
            hint=f"mmdebstrap could not bootstrap {spec.suite} ({','.join(spec.components)}) "
            f"from {spec.mirror}; a mirror for a gpu build must carry contrib, "
            "non-free and non-free-firmware",
        )
        write_atomic(tar.with_suffix(".json"), json.dumps(asdict(spec), indent=2))
    return tar, False
