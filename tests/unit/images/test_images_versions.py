"""The versions file: validation, pinning, mirror use, checksum and download errors."""

import re
import socket
from pathlib import Path

import pytest
import yaml

from nodeforge.errors import NodeforgeError
from nodeforge.images import versions
from tests.helpers import QuietHandler, http_server

pytestmark = pytest.mark.unit


def test_real_versions_file_loads_and_has_default_components():
    v = versions.load()
    assert v.default_base == "debian13"
    assert v.base(None).suite == "trixie" and v.base("debian12").suite == "bookworm"
    arts = {a.name: a for a in v.for_arch("amd64")}
    assert arts["enroot_deb"].version == "4.1.2" and arts["enroot_caps_deb"].file.startswith(
        "enroot+caps_"
    )
    assert arts["pyxis_src"].version == "0.24.0"
    for a in v.all_artifacts():
        # Never an invented checksum: either null (unpinned) or a well-formed sha256.
        assert a.sha256 is None or len(a.sha256) == 64


def _copy(tmp_path) -> Path:
    """The tests' own copy of the versions file, every artifact unpinned: the README's
    `nodeforge versions lock` pins the live file, and no test may depend on that."""
    dst = tmp_path / "versions.yaml"
    text = versions.VERSIONS_FILE.read_text()
    dst.write_text(re.sub(r"(?m)^(\s*sha256:\s*)\S+", r"\1null", text))
    return dst


def test_bad_sha_names_the_field(tmp_path):
    f = _copy(tmp_path)
    data = yaml.safe_load(f.read_text())
    data["artifacts"]["pyxis_src"]["arch"]["all"]["sha256"] = "abc"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(NodeforgeError, match=r"artifacts\.pyxis_src\.arch\.all\.sha256"):
        versions.load(f)


def test_unknown_base_lists_choices():
    with pytest.raises(NodeforgeError, match="unknown base 'centos'.*debian12, debian13"):
        versions.load().base("centos")


def test_unpinned_is_refused_with_how_to_pin(tmp_path):
    arts = versions.load(_copy(tmp_path)).for_arch("amd64")
    with pytest.raises(NodeforgeError, match="nodeforge versions lock.*--allow-unpinned"):
        versions.fetch(arts, tmp_path / "a")


def _mirror(tmp_path, arts):
    m = tmp_path / "mirror"
    m.mkdir()
    for a in arts:
        (m / a.file).write_bytes(f"content of {a.file}".encode())
    return m


def test_lock_from_mirror_pins_every_artifact_and_keeps_comments(tmp_path):
    f = _copy(tmp_path)
    v = versions.load(f)
    m = _mirror(tmp_path, v.all_artifacts())
    res = versions.lock(v, mirror=str(m))
    assert len(res) == len(v.all_artifacts())
    text = f.read_text()
    assert "Never write a checksum you did not compute" in text
    v2 = versions.load(f)
    assert all(a.pinned for a in v2.all_artifacts())
    a = v2.artifacts["pyxis_src"]["all"]
    assert a.sha256 == versions.sha256_file(m / a.file)
    # Pinned artifacts now fetch from the mirror with verification.
    got = versions.fetch(v2.for_arch("amd64"), tmp_path / "dl", mirror=str(m))
    assert got["pyxis_src"] == a.sha256


def test_checksum_mismatch_names_artifact_and_fix(tmp_path):
    f = _copy(tmp_path)
    v = versions.load(f)
    m = _mirror(tmp_path, v.all_artifacts())
    versions.lock(v, mirror=str(m))
    v2 = versions.load(f)
    (m / "enroot_4.1.2-1_amd64.deb").write_bytes(b"tampered")
    with pytest.raises(
        NodeforgeError, match=r"checksum mismatch for artifact enroot_deb.*--artifact-mirror"
    ):
        versions.fetch(v2.for_arch("amd64"), tmp_path / "dl", mirror=str(m))
    assert not (tmp_path / "dl" / "enroot_4.1.2-1_amd64.deb").exists()


def test_missing_file_in_mirror_dir(tmp_path):
    arts = versions.load(_copy(tmp_path)).for_arch("amd64")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NodeforgeError, match=r"enroot_deb.*not in the mirror directory"):
        versions.fetch(arts, tmp_path / "dl", mirror=str(empty), allow_unpinned=True)


def test_failed_download_names_artifact_and_mirror_option(tmp_path):
    # A loopback port we opened and closed again: nothing listens there.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    arts = versions.load(_copy(tmp_path)).for_arch("amd64")
    sleeps: list[float] = []
    with pytest.raises(
        NodeforgeError, match=r"download of artifact enroot_deb .*--artifact-mirror"
    ) as e:
        versions.fetch(
            arts,
            tmp_path / "dl",
            mirror=f"http://127.0.0.1:{port}",
            allow_unpinned=True,
            sleep=sleeps.append,
        )
    assert sleeps == [2.0, 4.0]  # retried with backoff before giving up
    assert e.value.exit_code == 1  # a failure, not bad input (README's exit statuses)


def test_http_mirror(tmp_path):
    arts = versions.load(_copy(tmp_path)).for_arch("amd64")
    m = _mirror(tmp_path, arts)

    with http_server(_dir_handler(m)) as url:
        got = versions.fetch(arts, tmp_path / "dl", mirror=f"{url}/", allow_unpinned=True)
    assert set(got) == {a.name for a in arts}
    assert (
        tmp_path / "dl" / "pyxis-0.24.0.tar.gz"
    ).read_bytes() == b"content of pyxis-0.24.0.tar.gz"


# -- downloads through nodeforge.download (issue 9 item 6) -------------------------------------
def _dir_handler(directory, truncate=()):
    """A loopback HTTP mirror of *directory*; files named in *truncate* promise more bytes than sent."""

    class H(QuietHandler):
        def do_GET(self):
            f = Path(directory) / self.path.rsplit("/", 1)[-1]  # the mirror is flat
            if not f.is_file():
                return self.send(404, close=True)
            data = f.read_bytes()
            extra = 100 if f.name in truncate else 0
            self.send(200, data, length=len(data) + extra, close=True)

    return H


def test_lock_refuses_a_truncated_body_and_leaves_the_file_unchanged(tmp_path):
    f = _copy(tmp_path)
    before = f.read_text()
    v = versions.load(f)
    m = _mirror(tmp_path, v.all_artifacts())
    sleeps: list[float] = []
    with (
        http_server(_dir_handler(m, truncate={"pyxis-0.24.0.tar.gz"})) as url,
        pytest.raises(NodeforgeError, match=r"pyxis_src .*truncated body: got 30 of 130 bytes"),
    ):
        versions.lock(v, mirror=url, sleep=sleeps.append)
    assert sleeps == [2.0, 4.0]
    assert f.read_text() == before  # nothing pinned from a partial download


def test_lock_arch_pins_only_what_the_mirror_holds(tmp_path):
    f = _copy(tmp_path)
    v = versions.load(f)
    amd64 = versions.lock_targets(v, arch="amd64")  # every variant's amd64 entry
    m = _mirror(tmp_path, amd64)  # the mirror has no arm64 files
    with http_server(_dir_handler(m)) as url:
        res = versions.lock(v, mirror=url, arch="amd64")
    assert set(res) == {a.url for a in amd64}
    v2 = versions.load(f)
    for a in v2.all_artifacts():
        assert a.pinned == (a.arch in ("amd64", "all")), a
    assert any(a.arch == "arm64" and not a.pinned for a in v2.all_artifacts())
    with pytest.raises(NodeforgeError, match=r"architecture 'sparc'.*known: amd64, arm64"):
        versions.lock(v2, mirror=str(m), arch="sparc")


def test_lock_arch_cli_says_what_stays_unpinned(tmp_path, capsys):
    from nodeforge.cli import main

    f = _copy(tmp_path)
    m = _mirror(tmp_path, versions.lock_targets(versions.load(f), arch="amd64"))
    assert (
        main(
            [
                "versions",
                "lock",
                "--versions-file",
                str(f),
                "--artifact-mirror",
                str(m),
                "--arch",
                "amd64",
                "--variant",
                "all",  # every variant's amd64 files are in this mirror
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "still unpinned" in out.err and "enroot_deb [arm64]" in out.err
    assert "[amd64]" not in out.err.split("still unpinned", 1)[1]


def test_fetch_reports_progress_for_each_artifact(tmp_path):
    f = _copy(tmp_path)
    v = versions.load(f)
    m = _mirror(tmp_path, v.all_artifacts())
    versions.lock(v, mirror=str(m))
    seen: list[tuple[int, int | None]] = []
    versions.fetch(
        versions.load(f).for_arch("amd64"),
        tmp_path / "dl",
        mirror=str(m),
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen and all(total is not None and 0 < done <= total for done, total in seen)
