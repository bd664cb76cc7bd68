"""The layered build cache on real builds of the local target (default cache dir, like the
other build tests, so the session's first build has already made the layer).

Order matters (one module, run top to bottom): a build of its own output, then a no-change
rebuild of it, a configuration-only rebuild, and a rebuild over a corrupted layer.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from nodeforge.images import manifest as manifest_mod
from tests.helpers import E2E_ROOT, build_image

pytestmark = pytest.mark.e2e

CACHE = Path("/var/cache/nodeforge")
OUT = E2E_ROOT / "image-cache"
SLURMD = "usr/sbin/slurmd-wlm"  # a regular file (usr/sbin/slurmd is an alternatives link)


def _extract(archive: Path, member: str, dest: Path) -> str:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["tar", "-C", str(dest), "-I", "zstd", "-xf", str(archive), f"./{member}"],
        check=True,
        timeout=600,
    )
    return (dest / member).read_text()


@pytest.fixture(scope="module")
def cached_build(built_image, fixture_mirror, pinned_versions) -> dict:
    """A build into this module's own output (reusing the session build's layer when that
    build was made by this checkout)."""
    summary, _ = build_image(OUT, fixture_mirror, pinned_versions)
    return summary


def test_build_records_its_keys(cached_build):
    m = json.loads((OUT / "manifest.json").read_text())
    assert manifest_mod.check(m) == []
    assert len(m["cache"]["build_key"]) == 64 and len(m["cache"]["layer_key"]) == 64
    layer = CACHE / "layers" / m["cache"]["layer_key"]
    # lstat only: the tree's absolute symlinks (/usr/sbin/slurmd -> /etc/alternatives/...)
    # point into the HOST's filesystem when followed from outside the image.
    assert (layer / "layer.json").is_file()
    assert stat.S_ISREG(os.lstat(layer / "tree" / SLURMD).st_mode)


def test_no_change_rebuild_returns_the_published_build(
    cached_build, fixture_mirror, pinned_versions
):
    before = json.loads((OUT / "manifest.json").read_text())
    disk_mtime = (OUT / "disk.qcow2").stat().st_mtime_ns
    summary, secs = build_image(OUT, fixture_mirror, pinned_versions)
    assert summary["reused"] is True
    assert summary["artifacts"] == before["artifacts"]
    after = json.loads((OUT / "manifest.json").read_text())
    assert after == before  # the same build, not a new one with equal content
    assert (OUT / "disk.qcow2").stat().st_mtime_ns == disk_mtime
    (E2E_ROOT / "no-change-build.json").write_text(json.dumps({"seconds": secs}, indent=2))


def test_config_only_rebuild_reuses_the_layer_and_changes_only_the_config(
    cached_build, fixture_mirror, pinned_versions, tmp_path
):
    base = json.loads((OUT / "manifest.json").read_text())
    vf = tmp_path / "rotate.pkrvars.hcl"
    vf.write_text('ansible_vars = { logrotate_slurm_rotate = "9" }\n')
    out = E2E_ROOT / "image-cache-config"
    _summary, secs = build_image(out, fixture_mirror, pinned_versions, "--var-file", str(vf))
    m = json.loads((out / "manifest.json").read_text())
    assert manifest_mod.check(m) == []
    assert m["cache"]["layer_reused"] is True
    assert m["cache"]["layer_key"] == base["cache"]["layer_key"]
    # The var changes only logrotate; anything the module's own build re-applied over the
    # same layer (node_agent, when the checkout changed since the layer was made) again.
    before = base["cache"]["reapplied"]
    assert isinstance(before, list) and "logrotate" not in before
    assert sorted(m["cache"]["reapplied"]) == sorted([*before, "logrotate"])
    assert m["cache"]["build_key"] != base["cache"]["build_key"]
    assert m["packages"] == base["packages"]  # nothing installed or removed
    new = _extract(out / "rootfs.tar.zst", "etc/logrotate.d/nodeforge-slurm", tmp_path / "new")
    old = _extract(OUT / "rootfs.tar.zst", "etc/logrotate.d/nodeforge-slurm", tmp_path / "old")
    assert "rotate 9" in new and "rotate 9" not in old
    assert new.replace("rotate 9", "rotate 14") == old
    (E2E_ROOT / "config-only-build.json").write_text(json.dumps({"seconds": secs}, indent=2))
    subprocess.run(["rm", "-rf", str(out)], check=True)


def test_corrupted_layer_is_dropped_and_rebuilt(cached_build, fixture_mirror, pinned_versions):
    m0 = json.loads((OUT / "manifest.json").read_text())
    layer = CACHE / "layers" / m0["cache"]["layer_key"]
    victim = layer / "tree" / SLURMD
    # Never follow a link out of the tree: no linked parent, O_NOFOLLOW, a regular file.
    for parent in victim.relative_to(layer).parents:
        assert not (layer / parent).is_symlink(), parent
    fd = os.open(victim, os.O_RDWR | os.O_NOFOLLOW)
    try:
        assert stat.S_ISREG(os.fstat(fd).st_mode)
        size = os.fstat(fd).st_size
        original = os.pread(fd, 1, size // 2)
        os.pwrite(fd, bytes([original[0] ^ 0xFF]), size // 2)  # same size, one byte changed
    finally:
        os.close(fd)
    summary, _ = build_image(OUT, fixture_mirror, pinned_versions, "--force")
    m = json.loads((OUT / "manifest.json").read_text())
    assert summary["reused"] is False
    assert m["cache"]["layer_reused"] is False  # never used: rebuilt from the base
    assert "dropped, rebuilding" in (OUT / "build.log").read_text()
    fd = os.open(victim, os.O_RDONLY | os.O_NOFOLLOW)  # the rebuilt layer's own file
    try:
        assert os.pread(fd, 1, size // 2) == original
    finally:
        os.close(fd)
