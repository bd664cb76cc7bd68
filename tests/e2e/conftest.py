"""E2e fixtures: one real `nodeforge build` of the local target per test session.

The build uses the tests' own FIXTURE artifact mirror (tests/fixtures/mirror.py): upstream
Enroot/Pyxis are unreachable on test machines. The versions file is copied and pinned to the
fixture files with `nodeforge versions lock`, so the build runs the real pinned path
(download from the mirror, sha256 verification). Set NODEFORGE_E2E_IMAGE=<output dir> to
reuse an image built earlier: a developer's speed-up, and how scripts/test.sh hands the build
lane's image to the lanes that run after it (tests/e2e/lanes.txt); CI always builds.

The gang modules' `clean` and `gov` fixtures are here too: they stand on the module's own
`lab` fixture (the 22.05 netns lab or a local cluster from the image).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require_tools
from tests.e2e.gang_support import Gov
from tests.helpers import BUILD_TOOLS, E2E_ROOT, REPO, build_image, nodeforge


@pytest.fixture(scope="session")
def root_required():
    if os.geteuid() != 0:
        pytest.fail("the e2e tier needs root (run: sudo scripts/test.sh)", pytrace=False)


@pytest.fixture(scope="session")
def fixture_mirror(root_required) -> Path:
    """FIXTURE Enroot/Pyxis stand-ins for every architecture in the versions file."""
    from tests.fixtures.mirror import make_mirror

    require_tools("dpkg-deb")
    m = E2E_ROOT / "mirror"
    if m.exists():
        shutil.rmtree(m)
    m.mkdir(parents=True)
    for arch in ("amd64", "arm64"):
        make_mirror(m, arch=arch)
    return m


@pytest.fixture(scope="session")
def pinned_versions(fixture_mirror) -> Path:
    """A copy of images/versions.yaml pinned to the fixture files by `nodeforge versions lock`."""
    v = E2E_ROOT / "versions.yaml"
    shutil.copyfile(REPO / "images/versions.yaml", v)
    # every variant and architecture: the mirror has them all, and the gpu build uses this copy
    nodeforge(
        "versions", "lock", "--artifact-mirror", str(fixture_mirror), "--versions-file", str(v),
        "--variant", "all", "--arch", "all",
    )  # fmt: skip
    return v


@pytest.fixture(scope="session")
def built_image(fixture_mirror, pinned_versions) -> Path:
    """Output directory of a real local build (rootfs.tar.zst, disk.qcow2, manifest.json …)."""
    reuse = os.environ.get("NODEFORGE_E2E_IMAGE")
    if reuse:
        return Path(reuse)
    require_tools(*BUILD_TOOLS)
    out = E2E_ROOT / "image"
    summary, secs = build_image(out, fixture_mirror, pinned_versions)
    (E2E_ROOT / "cold-build.json").write_text(json.dumps({"seconds": secs, **summary}, indent=2))
    return out


@pytest.fixture(scope="session")
def image_tree(built_image) -> Path:
    """The built root filesystem archive, extracted (read-only use)."""
    tree = E2E_ROOT / "tree"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    subprocess.run(
        [
            "tar",
            "-C",
            str(tree),
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "-I",
            "zstd",
            "-xf",
            str(built_image / "rootfs.tar.zst"),
        ],
        check=True,
    )
    return tree


@pytest.fixture
def clean(lab):
    """The module's lab, prologs re-armed before and the cluster reset after the test."""
    lab.rearm_prologs()
    yield lab
    lab.reset()


@pytest.fixture
def gov(clean, tmp_path):
    """`gov(**overrides)` makes a `Gov` on the clean lab; every one made is stopped after."""
    govs: list[Gov] = []

    def make(**kw) -> Gov:
        g = Gov(clean, tmp_path, **kw)
        govs.append(g)
        return g

    yield make
    for g in govs:
        g.stop()


@pytest.fixture(scope="session")
def gpu_image(request) -> Path:
    """The gpu variant's build, once a session (test_gpu_build.py checks it, test_gpu_vm.py
    boots it)."""
    reuse = os.environ.get("NODEFORGE_E2E_GPU_IMAGE")  # a gpu build output (developer speed-up)
    if reuse:
        return Path(reuse)
    fixture_mirror = request.getfixturevalue("fixture_mirror")
    pinned_versions = request.getfixturevalue("pinned_versions")
    require_tools(*BUILD_TOOLS, "chroot")
    out = E2E_ROOT / "image-gpu"
    summary, secs = build_image(out, fixture_mirror, pinned_versions, "--variant", "gpu")
    (E2E_ROOT / "gpu-build.json").write_text(json.dumps({"seconds": secs, **summary}, indent=2))
    return out
