"""images/rootfs_tar.py: the one `tar -x` of a root filesystem (sandbox, lab cluster, benches)
extracts plain and zstd archives with the archive's numeric owners (issue 25: four copies)."""

import io
import os
import subprocess
import tarfile

import pytest

from nodeforge.images import rootfs_tar

pytestmark = pytest.mark.unit


def _archive(path, zstd: bool) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        data = b"nodeforge\n"
        info = tarfile.TarInfo("etc/hostname")
        info.size, info.uid, info.gid, info.mode = len(data), 4242, 4243, 0o640
        tf.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    if zstd:
        raw = subprocess.run(
            ["zstd", "-q", "-c"], input=raw, capture_output=True, check=True
        ).stdout
    path.write_bytes(raw)


@pytest.mark.parametrize("zstd", [False, True])
def test_untar_keeps_the_archives_numeric_owner(tmp_path, zstd):
    archive = tmp_path / ("rootfs.tar.zst" if zstd else "rootfs.tar")
    _archive(archive, zstd)
    tree = tmp_path / "tree"
    tree.mkdir()
    rootfs_tar.untar(archive, tree, zstd=zstd)
    f = tree / "etc/hostname"
    assert f.read_text() == "nodeforge\n"
    if os.geteuid() == 0:  # only root can give a file another owner
        assert (f.stat().st_uid, f.stat().st_gid) == (4242, 4243)


def test_a_broken_archive_is_an_error_naming_tar(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar")
    from nodeforge.errors import CommandError

    with pytest.raises(CommandError, match="tar"):
        rootfs_tar.untar(bad, tmp_path, xattrs=False)
