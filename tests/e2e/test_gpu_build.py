"""A real `nodeforge build --variant gpu` of the local target (HEAVY: the NVIDIA module is
compiled by DKMS). No GPU is needed: what is checked is the image, not the hardware.

The NVIDIA container toolkit and fabric manager are the FIXTURE stand-ins of
tests/fixtures/mirror.py (their upstream URLs are unreachable here); the driver, NVML, NCCL and
the DKMS module are Debian's real packages.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeforge.images import manifest as manifest_mod
from nodeforge.images import scan
from tests.helpers import E2E_ROOT, drop_outputs

pytestmark = pytest.mark.e2e

GPU_PACKAGES = (
    "nvidia-open-kernel-dkms",
    "nvidia-smi",
    "libnvidia-ml1",
    "nvidia-persistenced",
    "libcuda1",
    "firmware-nvidia-gsp",
    "slurm-wlm-nvml-plugin",
    "libnccl2",
    "rdma-core",
    "ibverbs-providers",
    "infiniband-diags",
    "libfabric1",
    "prometheus-node-exporter",
    "libnvidia-container1",
    "libnvidia-container-tools",
    "nvidia-container-toolkit",
    "nvidia-fabricmanager-550",
)


@pytest.fixture(scope="module")
def gpu_tree(gpu_image) -> Iterator[Path]:
    tree = E2E_ROOT / "tree-gpu"
    subprocess.run(["rm", "-rf", "--one-file-system", str(tree)], check=True)
    tree.mkdir(parents=True)
    subprocess.run(
        [
            "tar",
            "-C",
            str(tree),
            "--numeric-owner",
            "-I",
            "zstd",
            "-xf",
            str(gpu_image / "rootfs.tar.zst"),
        ],
        check=True,
    )
    yield tree
    drop_outputs(tree)  # the extracted tree (2.2 GiB): only this module reads it


def test_gpu_image_has_the_module_for_its_own_kernel(gpu_image, gpu_tree):
    t0 = time.monotonic()
    m = json.loads((gpu_image / "manifest.json").read_text())
    assert manifest_mod.check(m) == []
    assert m["variant"] == "gpu" and "-gpu-" in m["name"]
    g = m["gpu"]
    kernel = g["kernel_version"]
    # The image's own kernel, not the build host's.
    assert (gpu_tree / f"boot/vmlinuz-{kernel}").is_file()
    mods = list((gpu_tree / f"lib/modules/{kernel}/updates/dkms").glob("nvidia-current-open.ko*"))
    assert len(mods) == 1, mods
    # The image's own modinfo, by module name for the image's kernel (its modules.dep).
    info = {
        f: subprocess.run(
            ["chroot", str(gpu_tree), "modinfo", "-k", kernel, "-F", f, "nvidia-current-open"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for f in ("version", "vermagic")
    }
    assert info["version"] == g["module_version"] == "550.163.01"
    assert info["vermagic"].split()[0] == kernel
    assert m["packages"]["nvidia-smi"].startswith("550.163.01-")
    for pkg in GPU_PACKAGES:
        assert pkg in m["packages"], f"{pkg} not in the gpu image"
    assert "xserver-xorg-core" not in m["packages"]  # headless
    enabled = {
        p.name for w in (gpu_tree / "etc/systemd/system").glob("*.wants") for p in w.iterdir()
    }
    for unit in (
        "nvidia-persistenced.service",
        "nvidia-fabricmanager.service",
        "prometheus-node-exporter.service",
    ):
        assert unit in enabled, unit
    fm = (gpu_tree / "etc/systemd/system/nvidia-fabricmanager.service.d/nodeforge.conf").read_text()
    assert "ExecCondition=/usr/lib/nodeforge/nvidia-present nvswitch" in fm
    assert (
        gpu_tree / "etc/systemd/system/prometheus-node-exporter.service.d/nodeforge.conf"
    ).is_file()  # role metrics, as in every variant
    assert not (gpu_tree / "var/lib/dkms/mok.key").exists()
    assert scan.scan(gpu_tree) == []
    print(f"gpu image checks: {time.monotonic() - t0:.1f}s")
