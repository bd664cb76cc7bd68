"""images/base.py: the mmdebstrap command line of the base tarball (no bootstrap is run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeforge.errors import NodeforgeError
from nodeforge.images import base as base_mod
from nodeforge.images.versions import Base

pytestmark = pytest.mark.unit


def _spec(monkeypatch, arch="amd64", variant="cpu") -> base_mod.BaseSpec:
    monkeypatch.setattr(base_mod.proc, "require_tool", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(
        base_mod.proc,
        "run",
        lambda argv, **kw: type("R", (), {"stdout": "mmdebstrap 1.3.5\n"})(),
    )
    b = Base(
        name="debian13",
        suite="trixie",
        mirror="http://deb.debian.org/debian",
        slurm="24.11",
        keyring="/usr/share/keyrings/debian-archive-keyring.gpg",
    )
    return base_mod.spec_for(b, arch, variant)


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_kernel_is_installed_by_a_late_apt_run_not_with_the_other_packages(monkeypatch, arch):
    """One apt run with the kernel and udev/kmod/klibc-utils makes the initramfs twice; the
    kernel in a customize hook (after the rest) makes it once."""
    spec = _spec(monkeypatch, arch)
    kernel = base_mod.KERNEL_PACKAGE[arch]
    assert spec.kernel == kernel
    argv = base_mod.mmdebstrap_argv(spec, "/k.gpg", Path("/tmp/out.tar"))
    include = next(a for a in argv if a.startswith("--include="))
    assert kernel not in include.split("=", 1)[1].split(",")
    hooks = [a for a in argv if a.startswith("--customize-hook=")]
    assert hooks == [
        '--customize-hook=chroot "$1" apt-get install --yes --no-install-recommends ' + kernel
    ]
    # Everything the sandbox and the disk image need is still in the base.
    for pkg in ("systemd", "openssh-server", "python3-apt", "initramfs-tools", "udev", "kmod"):
        assert pkg in include, pkg
    assert argv[-3:] == ["trixie", "/tmp/out.tar", "http://deb.debian.org/debian"]
    assert '--aptopt=APT::Install-Recommends "false"' in argv


def test_base_key_covers_the_kernel_and_the_components(monkeypatch):
    cpu = _spec(monkeypatch)
    gpu = _spec(monkeypatch, variant="gpu")
    arm = _spec(monkeypatch, arch="arm64")
    assert len({cpu.key(), gpu.key(), arm.key()}) == 3
    import dataclasses

    assert dataclasses.replace(cpu, kernel="linux-image-cloud-amd64").key() != cpu.key()


@pytest.mark.parametrize("bad", ["linux-image; rm -rf /", "linux image", "$(x)", "Linux", "-q"])
def test_a_kernel_name_that_is_not_a_package_name_is_refused(monkeypatch, bad):
    import dataclasses

    spec = dataclasses.replace(_spec(monkeypatch), kernel=bad)
    with pytest.raises(NodeforgeError, match="kernel package name"):
        base_mod.mmdebstrap_argv(spec, "/k.gpg", Path("/tmp/out.tar"))
