"""The layered build cache on real builds of the local target, in this module's own cache
dir (E2E_ROOT/build-cache; its base tarball, apt archives and artifacts are copied from the
default cache when there are any, so the first build here is a layer miss, not a cold one).

Order matters (one module, run top to bottom): a build that makes both role-group layers,
a no-change rebuild of it, a configuration-only rebuild, an install-affecting rebuild that
resumes after the Slurm stack, and rebuilds over a corrupted runtime and Slurm-stack layer.
The overlayfs test at the end needs no build.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeforge.images import cache
from nodeforge.images import manifest as manifest_mod
from tests.helpers import E2E_ROOT, build_image, build_turn, drop_outputs, nodeforge

pytestmark = pytest.mark.e2e

DEFAULT_CACHE = Path("/var/cache/nodeforge")  # read only: seeds this module's cache
CACHE = E2E_ROOT / "build-cache"
OUT = E2E_ROOT / "image-cache"
OUT_INSTALL = E2E_ROOT / "image-cache-install"
SLURMD = "usr/sbin/slurmd-wlm"  # a regular file (usr/sbin/slurmd is an alternatives link)
INSTALL_AFFECTING = 'ansible_vars = { docker_source = "debian" }\n'  # the bench's change


def _extract(archive: Path, member: str, dest: Path) -> str:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["tar", "-C", str(dest), "-I", "zstd", "-xf", str(archive), f"./{member}"],
        check=True,
        timeout=600,
    )
    return (dest / member).read_text()


def _build(out: Path, mirror: Path, versions: Path, *extra: str) -> tuple[dict, float]:
    return build_image(out, mirror, versions, "--cache-dir", str(CACHE), *extra)


def _manifest(out: Path) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    assert manifest_mod.check(m) == []
    return m


def _flip_byte(root: Path, rel: str) -> tuple[Path, int, bytes]:
    """Change one byte in the middle of the regular file *rel* under *root*, never
    following a link out of the tree; (file, offset, original byte)."""
    victim = root / rel
    for parent in victim.relative_to(root).parents:
        assert not (root / parent).is_symlink(), parent
    fd = os.open(victim, os.O_RDWR | os.O_NOFOLLOW)
    try:
        assert stat.S_ISREG(os.fstat(fd).st_mode)
        at = os.fstat(fd).st_size // 2
        original = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([original[0] ^ 0xFF]), at)  # same size, one byte changed
    finally:
        os.close(fd)
    return victim, at, original


def _byte(path: Path, at: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return os.pread(fd, 1, at)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def cached_build(fixture_mirror, pinned_versions) -> Iterator[dict]:
    """A build into this module's own output and cache: it makes both groups' layers."""
    drop_outputs(CACHE, OUT, OUT_INSTALL)  # an earlier run's
    CACHE.mkdir(parents=True)
    with build_turn("copying the shared build cache"):  # no build writes it meanwhile
        for d in ("base", "apt-archives", "artifacts"):
            if (DEFAULT_CACHE / d).is_dir():
                shutil.copytree(DEFAULT_CACHE / d, CACHE / d, symlinks=True)
    summary, _ = _build(OUT, fixture_mirror, pinned_versions)
    yield summary
    # This module's own cache and outputs (~9 GiB) are read by no later module.
    drop_outputs(CACHE, OUT, OUT_INSTALL, E2E_ROOT / "image-cache-config")


def test_build_stores_one_layer_per_role_group_each_over_the_previous(cached_build):
    m = _manifest(OUT)
    c = m["cache"]
    assert len(c["build_key"]) == 64 and len(c["layer_key"]) == 64
    assert c["prefix_reused"] is None and c["layer_reused"] is False
    assert [(x["group"], x["reused"]) for x in c["layers"]] == [
        ("slurm_stack", False),
        ("runtime", False),
    ]
    stack, runtime = (CACHE / "layers" / x["key"] for x in c["layers"])
    assert runtime.name == c["layer_key"]
    meta = [json.loads((p / "layer.json").read_text()) for p in (stack, runtime)]
    assert meta[0]["parent"] is None and meta[1]["parent"] == stack.name
    # lstat only: the tree's absolute symlinks (/usr/sbin/slurmd -> /etc/alternatives/...)
    # point into the HOST's filesystem when followed from outside the image.
    assert stat.S_ISREG(os.lstat(stack / "tree" / SLURMD).st_mode)
    # the runtime layer is a diff: what its roles added, not the Slurm stack again
    assert not os.path.lexists(runtime / "tree" / SLURMD)
    assert os.path.lexists(runtime / "tree/usr/bin/enroot")
    assert meta[1]["bytes"] < meta[0]["bytes"] / 2
    ls = nodeforge("cache", "ls", "--cache-dir", str(CACHE), "--json", timeout=60)
    parents = {r["key"]: r.get("parent") for r in json.loads(ls.stdout) if r["kind"] == "layer"}
    assert parents == {stack.name: None, runtime.name: stack.name}


def test_no_change_rebuild_returns_the_published_build(
    cached_build, fixture_mirror, pinned_versions
):
    before = json.loads((OUT / "manifest.json").read_text())
    disk_mtime = (OUT / "disk.qcow2").stat().st_mtime_ns
    summary, secs = _build(OUT, fixture_mirror, pinned_versions)
    assert summary["reused"] is True
    assert summary["artifacts"] == before["artifacts"]
    after = json.loads((OUT / "manifest.json").read_text())
    assert after == before  # the same build, not a new one with equal content
    assert (OUT / "disk.qcow2").stat().st_mtime_ns == disk_mtime
    (E2E_ROOT / "no-change-build.json").write_text(json.dumps({"seconds": secs}, indent=2))


def test_config_only_rebuild_reuses_the_layer_and_changes_only_the_config(
    cached_build, fixture_mirror, pinned_versions, tmp_path
):
    base = _manifest(OUT)
    vf = tmp_path / "rotate.pkrvars.hcl"
    vf.write_text('ansible_vars = { logrotate_slurm_rotate = "9" }\n')
    out = E2E_ROOT / "image-cache-config"
    _summary, secs = _build(out, fixture_mirror, pinned_versions, "--var-file", str(vf))
    m = _manifest(out)
    assert m["cache"]["layer_reused"] is True and m["cache"]["prefix_reused"] == "runtime"
    assert m["cache"]["layer_key"] == base["cache"]["layer_key"]
    assert m["cache"]["reapplied"] == ["logrotate"]
    assert m["cache"]["build_key"] != base["cache"]["build_key"]
    assert m["packages"] == base["packages"]  # nothing installed or removed
    new = _extract(out / "rootfs.tar.zst", "etc/logrotate.d/nodeforge-slurm", tmp_path / "new")
    old = _extract(OUT / "rootfs.tar.zst", "etc/logrotate.d/nodeforge-slurm", tmp_path / "old")
    assert "rotate 9" in new and "rotate 9" not in old
    assert new.replace("rotate 9", "rotate 14") == old
    record = {"seconds": secs, "phases": m["phases"], "steps": m["steps"]}
    (E2E_ROOT / "config-only-build.json").write_text(json.dumps(record, indent=2))
    subprocess.run(["rm", "-rf", str(out)], check=True)


def test_install_affecting_rebuild_resumes_after_the_slurm_stack(
    cached_build, fixture_mirror, pinned_versions, tmp_path
):
    base = _manifest(OUT)
    vf = tmp_path / "docker.pkrvars.hcl"
    vf.write_text(INSTALL_AFFECTING)
    _summary, secs = _build(OUT_INSTALL, fixture_mirror, pinned_versions, "--var-file", str(vf))
    m = _manifest(OUT_INSTALL)
    c, c0 = m["cache"], base["cache"]
    assert c["prefix_reused"] == "slurm_stack" and c["layer_reused"] is False
    assert c["layers"][0] == c0["layers"][0] | {"reused": True}  # the same Slurm-stack layer
    assert c["layers"][1]["key"] != c0["layers"][1]["key"]  # a new runtime layer over it
    new_meta = json.loads((CACHE / "layers" / c["layer_key"] / "layer.json").read_text())
    assert new_meta["parent"] == c0["layers"][0]["key"]
    assert "provision.slurm_stack" not in m["steps"] and "provision.runtime" in m["steps"]
    # docker_source=debian is the role's default: a build from the base installs exactly
    # these packages, so the resumed build must hold the same ones, version for version
    assert m["packages"] == base["packages"]
    record = {"seconds": secs, "phases": m["phases"], "steps": m["steps"]}
    (E2E_ROOT / "install-affecting-build.json").write_text(json.dumps(record, indent=2))


def test_corrupted_runtime_layer_is_dropped_and_rebuilt_over_the_stack(
    cached_build, fixture_mirror, pinned_versions
):
    m0 = _manifest(OUT)
    runtime = CACHE / "layers" / m0["cache"]["layer_key"] / "tree"
    victim, at, original = _flip_byte(runtime, "usr/bin/enroot")
    summary, _ = _build(OUT, fixture_mirror, pinned_versions, "--force")
    m = _manifest(OUT)
    assert summary["reused"] is False
    assert m["cache"]["prefix_reused"] == "slurm_stack"  # the stack was fine: kept
    assert m["cache"]["layer_key"] == m0["cache"]["layer_key"]
    assert "dropped, rebuilding" in (OUT / "build.log").read_text()
    assert _byte(victim, at) == original  # the rebuilt layer's own file
    assert m["packages"] == m0["packages"]


def test_corrupted_slurm_stack_layer_is_dropped_with_the_layers_over_it(
    cached_build, fixture_mirror, pinned_versions, tmp_path
):
    resumed = _manifest(OUT_INSTALL)
    stack = CACHE / "layers" / resumed["cache"]["layers"][0]["key"]
    over = [CACHE / "layers" / x for x in cache.LayerStore(CACHE).descendants(stack.name)]
    assert len(over) == 2  # the default build's runtime layer and the docker_source one
    victim, at, original = _flip_byte(stack / "tree", SLURMD)
    vf = tmp_path / "docker.pkrvars.hcl"
    vf.write_text(INSTALL_AFFECTING)
    summary, _ = _build(
        OUT_INSTALL, fixture_mirror, pinned_versions, "--var-file", str(vf), "--force"
    )
    m = _manifest(OUT_INSTALL)
    assert summary["reused"] is False
    assert m["cache"]["prefix_reused"] is None  # never used: rebuilt from the base
    log = (OUT_INSTALL / "build.log").read_text()
    assert "dropped, rebuilding" in log and "was made over it; dropped with it" in log
    assert not any(p.exists() and p.name != m["cache"]["layer_key"] for p in over)
    assert _byte(victim, at) == original  # the rebuilt layer's own file
    # the full build of the same inputs holds what the resumed one held
    assert m["packages"] == resumed["packages"]


# -- overlayfs upper dirs as layers ---------------------------------------------------------


def _mount(lowers: list[Path], upper: Path, work: Path, merged: Path) -> None:
    for d in (upper, work, merged):
        d.mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={':'.join(map(str, lowers))},upperdir={upper},workdir={work}"
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", f"{opts},index=off,metacopy=off", merged],
        check=True,
        timeout=60,
    )


def _umount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=True, timeout=60)


def test_upper_dir_layer_with_whiteouts_and_opaque_dirs_is_verified(root_required, tmp_path):
    """A later group's layer is an overlayfs upper dir: a removed file is a 0/0 character
    device (whiteout), a directory made anew is opaque (trusted.overlay.opaque). Both are
    in its digest, and stacked over its parent they hide the parent's entries."""
    store = cache.LayerStore(tmp_path / "cache")
    lower = tmp_path / "lower"
    (lower / "etc/old.d").mkdir(parents=True)
    (lower / "etc/old.d/a.conf").write_text("a\n")
    (lower / "etc/gone").write_text("gone\n")
    inputs = cache.PrefixInputs("g", "b", {}, {}, {}, {})
    key_a, key_b = "a" * 64, "b" * 64
    parent = store.store(key_a, lower, inputs)
    merged = tmp_path / "merged"
    _mount([parent.tree], tmp_path / "upper", tmp_path / "work", merged)
    try:
        (merged / "etc/gone").unlink()
        shutil.rmtree(merged / "etc/old.d")
        (merged / "etc/old.d").mkdir()
        (merged / "etc/old.d/b.conf").write_text("b\n")
    finally:
        _umount(merged)
    upper = tmp_path / "upper"
    wh = os.lstat(upper / "etc/gone")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert os.getxattr(upper / "etc/old.d", "trusted.overlay.opaque") == b"y"
    child = store.store(key_b, upper, inputs, parent=key_a)
    assert store.verify(child) == ""
    # stacked: the child's whiteout and opaque dir hide the parent's entries
    _mount([child.tree, parent.tree], tmp_path / "u2", tmp_path / "w2", tmp_path / "m2")
    try:
        assert not (tmp_path / "m2/etc/gone").exists()
        assert sorted(os.listdir(tmp_path / "m2/etc/old.d")) == ["b.conf"]
    finally:
        _umount(tmp_path / "m2")
    # the opaque mark and the whiteout are content: losing either fails verification
    os.removexattr(child.tree / "etc/old.d", "trusted.overlay.opaque")
    assert "content digest does not match" in store.verify(child)
    os.setxattr(child.tree / "etc/old.d", "trusted.overlay.opaque", b"y")
    assert store.verify(child) == ""
    (child.tree / "etc/gone").unlink()
    assert "content digest does not match" in store.verify(child)
    os.mknod(child.tree / "etc/gone", wh.st_mode, os.makedev(0, 1))
    assert "content digest does not match" in store.verify(child)  # not a whiteout: 0/1
