"""Archives inside the image tree (issue 23, item 9): tar, gzip, zstd and their nestings are
opened and every member checked, within bounds that make a decompression bomb a finding in
bounded time and memory, never a stall, a crash or a pass."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import time
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeforge.images import scan, scan_archive, sealed_items
from nodeforge.images.scan_archive import Bounds
from tests.helpers import dpkg_ship, fake_image_tree

pytestmark = pytest.mark.unit

BEGIN = "-----BEGIN "
PRIV = "PRIVATE KEY-----"
KEY = f"{BEGIN}OPENSSH {PRIV}\nb3BlbnNzaC1rZXktdjEAAAAA\n".encode()


def _tar(members: dict[str, bytes], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _zst(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


def _plant(t: Path, rel: str, data: bytes) -> None:
    (t / rel).parent.mkdir(parents=True, exist_ok=True)
    (t / rel).write_bytes(data)


def _scan(t: Path, bounds: Bounds | None = None) -> list[tuple[str, str, str]]:
    return [(f.path, f.kind, f.member) for f in scan.scan(t, bounds=bounds)]


FORMS = {
    "tar": lambda m: _tar(m),
    "tar.gz": lambda m: _gz(_tar(m)),
    "tgz": lambda m: _gz(_tar(m)),
    "tar.zst": lambda m: _zst(_tar(m)),
    "gnu.tar.zst": lambda m: _zst(_tar(m, tarfile.GNU_FORMAT)),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_key_inside_each_archive_form(tmp_path, form):
    t = fake_image_tree(tmp_path)
    clean = {"./etc/motd": b"hello\n", "./opt/x/notes.txt": b"nothing here\n" * 100}
    _plant(t, f"root/backup.{form}", FORMS[form]({**clean, "./opt/x/deploy.pem": KEY}))
    _plant(t, f"root/clean.{form}", FORMS[form](clean))
    assert _scan(t) == [(f"/root/backup.{form}", "private-key", "./opt/x/deploy.pem")]


@pytest.mark.parametrize("wrap, suffix", [(_gz, "gz"), (_zst, "zst")])
def test_single_compressed_file(tmp_path, wrap, suffix):
    t = fake_image_tree(tmp_path)
    _plant(t, f"opt/site/tls.key.{suffix}", wrap(KEY))
    _plant(t, f"opt/site/readme.{suffix}", wrap(b"no key\n" * 1000))
    # the name inside is the file's without the suffix: config rules go by it
    _plant(t, f"etc/app/db.conf.{suffix}", wrap(b"[db]\npassword = s3cr3t-value\n"))
    found = scan.scan(t)
    assert {(f.path, f.kind) for f in found} == {
        (f"/opt/site/tls.key.{suffix}", "private-key"),
        (f"/etc/app/db.conf.{suffix}", "db-password"),
    }
    assert all("s3cr3t" not in str(f) for f in found)


def test_known_by_magic_not_name(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "var/lib/app/blob.dat", _zst(_gz(_tar({"k": KEY}))))
    assert _scan(t) == [("/var/lib/app/blob.dat", "private-key", "k")]


def test_nested_archives(tmp_path):
    t = fake_image_tree(tmp_path)
    inner = _gz(_tar({"home/ops/.aws/credentials": b"[default]\n"}))
    outer = _zst(_tar({"etc/motd": b"hi\n", "srv/inner.tgz": inner}))
    _plant(t, "root/site.tar.zst", outer)
    assert _scan(t) == [
        ("/root/site.tar.zst", "aws-credentials", "srv/inner.tgz!home/ops/.aws/credentials")
    ]


def test_secret_paths_in_a_backup_of_etc(tmp_path):
    """A tarball of /etc carries the cluster key whatever its bytes: the `archived` items of the
    sealed list judge members by path; identity and build state (tmp, logs) are not findings."""
    t = fake_image_tree(tmp_path)
    _plant(t, "root/etc-backup.tar.gz", _gz(_tar({"etc/munge/munge.key": os.urandom(64)})))
    _plant(t, "root/state.tar.gz", _gz(_tar({"tmp/x": b"scratch", "var/log/syslog.1": b"log"})))
    assert _scan(t) == [("/root/etc-backup.tar.gz", "munge-key", "etc/munge/munge.key")]


def test_packaged_archive_is_public(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "usr/share/doc/pkg/examples/keys.tar.gz", _gz(_tar({"test.pem": KEY})))
    dpkg_ship(t, "pkg", "usr/share/doc/pkg/examples/keys.tar.gz")
    assert _scan(t) == []


def test_utf16_key_inside_an_archive(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(
        t,
        "root/k.tar.zst",
        _zst(_tar({"win/key.pem": b"\xff\xfe" + KEY.decode().encode("utf-16-le")})),
    )
    assert _scan(t) == [("/root/k.tar.zst", "private-key", "win/key.pem")]


def test_member_names_are_printable_in_findings(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "root/a.tar", _tar({"x\n\x1b[31mevil\\": KEY}))
    (f,) = scan.scan(t)
    assert f.member == "x\\x0a\\x1b[31mevil\\x5c" and "\n" not in str(f) and "\x1b" not in str(f)


# -- bounds --------------------------------------------------------------------------------


def test_gzip_bomb_is_a_finding_in_bounded_time(tmp_path):
    t = fake_image_tree(tmp_path)
    bomb = _gz(b"\0" * (64 << 20))  # 64 KiB on disk
    _plant(t, "var/lib/app/bomb.gz", bomb)
    start = time.monotonic()
    found = _scan(t, Bounds(max_bytes=8 << 20))
    assert time.monotonic() - start < 5
    assert found == [("/var/lib/app/bomb.gz", "archive-over-bounds", "")]
    (f,) = scan.scan(t, bounds=Bounds(max_bytes=8 << 20))
    assert "8 MiB" in f.detail and "remove it" in f.detail


def test_member_count_bound(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "root/many.tar.zst", _zst(_tar({f"f{i}": b"" for i in range(50)})))
    assert _scan(t, Bounds(max_members=49))[0][1] == "archive-over-bounds"
    assert _scan(t, Bounds(max_members=50)) == []


def test_depth_bound(tmp_path):
    t = fake_image_tree(tmp_path)
    data = b"plain"
    for _ in range(4):
        data = _gz(data)
    _plant(t, "root/deep.gz", data)
    assert _scan(t, Bounds(max_depth=3)) == [("/root/deep.gz", "archive-over-bounds", "")]
    assert _scan(t, Bounds(max_depth=4)) == []


def test_huge_pax_header_is_refused_before_it_is_read(tmp_path):
    t = fake_image_tree(tmp_path)
    ti = tarfile.TarInfo("x")
    ti.pax_headers = {"comment": "a" * (2 << 20)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        tf.addfile(ti, io.BytesIO(b""))
    _plant(t, "root/pax.tar.gz", _gz(buf.getvalue()))
    assert _scan(t, Bounds(max_header=1 << 20))[0][1] == "archive-over-bounds"
    assert _scan(t) == [] or _scan(t, Bounds(max_header=4 << 20)) == []


def test_total_budget_over_the_whole_scan(tmp_path):
    t = fake_image_tree(tmp_path)
    for i in range(4):
        _plant(t, f"srv/a{i}.gz", _gz(b"x" * (3 << 20)))
    found = _scan(t, Bounds(total_bytes=10 << 20))
    assert [k for _, k, _ in found] == ["archive-over-bounds"]


@pytest.mark.parametrize(
    "data",
    [
        b"\x1f\x8b\x08\x00" + b"\xff" * 100,  # gzip magic, garbage
        _gz(_tar({"a": b"x" * 5000}))[:-40],  # truncated gzip
        b"\x28\xb5\x2f\xfd" + os.urandom(64),  # zstd magic, garbage
        _tar({"a": b"x" * 5000})[:1500],  # tar cut inside a member
        # a header tar cannot read, then more members: tar would stop there and call it the end
        _tar({"a": b"x"})[:1024] + b"\x01" * 512 + _tar({"b": KEY}),
    ],
    ids=["gzip-garbage", "gzip-truncated", "zstd-garbage", "tar-truncated", "tar-bad-header"],
)
def test_corrupt_archive_is_a_finding(tmp_path, data):
    t = fake_image_tree(tmp_path)
    _plant(t, "root/broken.bin", data)
    (f,) = scan.scan(t)
    assert (f.path, f.kind) == ("/root/broken.bin", "archive-unreadable")
    assert "remove or repair it" in f.detail


# -- property: any nesting, any bounds -------------------------------------------------------

LAYERS = st.lists(st.sampled_from(["gz", "zst", "tar"]), min_size=1, max_size=5)


def _wrap(layers: list[str], payload: bytes, filler: int) -> bytes:
    data = payload
    for layer in layers:
        if layer == "gz":
            data = _gz(data)
        elif layer == "zst":
            data = _zst(data)
        else:
            data = _tar({"pad.bin": b"\0" * filler, "inner": data})
    return data


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layers=LAYERS,
    filler=st.integers(0, 300_000),
    max_bytes=st.integers(1, 1 << 20),
    max_members=st.integers(1, 12),
    max_depth=st.integers(1, 6),
    planted=st.booleans(),
)
def test_archive_bounds_property(
    tmp_path_factory, layers, filler, max_bytes, max_members, max_depth, planted
):
    """Whatever the nesting and the bounds: the scan returns (no exception); a planted key is
    found or the archive is reported over its bounds (never a clean pass); a clean archive is
    clean or over bounds; and never more than the bound (+ the one byte that proves it crossed)
    is expanded."""
    t = fake_image_tree(tmp_path_factory.mktemp("p"))
    payload = KEY if planted else b"nothing to see\n"
    _plant(t, "srv/a.bin", _wrap(layers, payload, filler))
    bounds = Bounds(max_bytes=max_bytes, max_members=max_members, max_depth=max_depth)
    spent: list[int] = []
    real_archive = scan_archive.Budget.archive

    def tracked(self):
        s = real_archive(self)
        spent.append(0)
        orig_add = s.add

        def add(n: int) -> None:
            spent[-1] += n
            orig_add(n)

        s.add = add  # type: ignore[method-assign]
        return s

    scan_archive.Budget.archive = tracked  # type: ignore[method-assign]
    try:
        kinds = [f.kind for f in scan.scan(t, bounds=bounds)]
    finally:
        scan_archive.Budget.archive = real_archive  # type: ignore[method-assign]
    if planted:
        assert kinds in (["private-key"], ["archive-over-bounds"]), kinds
    else:
        assert kinds in ([], ["archive-over-bounds"]), kinds
    assert all(n <= max_bytes + 1 for n in spent), (spent, max_bytes)
    if (
        len(layers) <= max_depth
        and sum(spent) < max_bytes
        and layers.count("tar") * 2 <= max_members
    ):
        # everything fit: the verdict is the content's
        assert kinds == (["private-key"] if planted else [])


def test_bounds_load_no_state_between_scans(tmp_path):
    t = fake_image_tree(tmp_path)
    _plant(t, "srv/a.gz", _gz(b"x" * (2 << 20)))
    b = Bounds(total_bytes=3 << 20)
    assert _scan(t, b) == [] and _scan(t, b) == []  # each scan has its own budget
    assert sealed_items.load().items  # the list still loads with `archived`


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    magic=st.sampled_from([b"\x1f\x8b", b"\x1f\x8b\x08\x00", b"\x28\xb5\x2f\xfd", b""]),
    body=st.binary(max_size=2048),
    tar_at=st.booleans(),
)
def test_hostile_bytes_never_raise(tmp_path_factory, magic, body, tar_at):
    """Any bytes behind an archive's magic: a finding or none, never an exception."""
    t = fake_image_tree(tmp_path_factory.mktemp("h"))
    data = magic + body
    if tar_at:  # a tar magic at 257 over hostile header fields
        data = (data + b"\0" * 512)[:257] + b"ustar\x0000" + data[263:]
    _plant(t, "srv/x.bin", data)
    kinds = {f.kind for f in scan.scan(t)}
    assert kinds <= {"archive-unreadable", "archive-over-bounds", "private-key"}
