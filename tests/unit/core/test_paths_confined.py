"""Paths are confined (issue 23, item 5): one helper (nodeforge.fsutil.confined) joins a base
and an untrusted name; a versions file's `file`, a mirror, a hook name and an S3 key never
reach outside their directory. A property: no name the helper accepts resolves outside its
base, even with symlinks planted in it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import UnsafeName, confined, safe_name
from nodeforge.images import versions

pytestmark = pytest.mark.unit

# What a hostile versions file, mirror listing or S3 listing can hold: separators, dots, the
# characters of the grammar, and some that are not (NUL, newline, backslash, %, ~, space).
_ALPHABET = "ab./-_+=@,~%\\ \n\x00é"
_NAMES = st.one_of(
    st.text(_ALPHABET, max_size=24),
    st.lists(
        st.sampled_from(["..", ".", "", "a", "out", "loop", "in", "x.d", "/"]), max_size=6
    ).map("/".join),
)


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, Path]:
    """A base holding links out of it (absolute and relative), a link inside it and a loop."""
    top = tmp_path_factory.mktemp("confine")
    base = top / "base"
    (base / "in").mkdir(parents=True)
    (top / "secret").write_text("outside")
    (base / "out").symlink_to(top)  # absolute, out
    (base / "in" / "up").symlink_to("../..")  # relative, out
    (base / "inner").symlink_to("in")  # stays inside
    (base / "loop").symlink_to("loop")
    return top, base


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=_NAMES, nested=st.booleans())
def test_no_accepted_name_resolves_outside_its_base(planted, name, nested):
    _, base = planted
    try:
        p = confined(base, name, what="f", nested=nested)
    except UnsafeName as exc:
        assert str(exc).startswith("f: ")  # the field is named, never a traceback
        return
    real, root = p.resolve(), base.resolve()
    assert real != root and real.is_relative_to(root)
    assert p.is_relative_to(base) and ".." not in p.relative_to(base).parts


@pytest.mark.parametrize(
    "name, nested",
    [("../x", False), ("/etc/passwd", False), ("a/b", False), ("", False), (".", False),
     ("..", True), ("a//b", True), ("a/", True), ("/a", True), ("x\n", False), ("a\\..", False),
     ("out/secret", True), ("in/up/secret", True), ("loop", False), ("%2e%2e", False)],
)  # fmt: skip
def test_hostile_names_refused(planted, name, nested):
    _, base = planted
    with pytest.raises(UnsafeName, match="^f: "):
        confined(base, name, what="f", nested=nested)


def test_plain_names_accepted(planted):
    _, base = planted
    assert confined(base, "enroot+caps_4.1.2-1_amd64.deb", what="f") == base / (
        "enroot+caps_4.1.2-1_amd64.deb"
    )
    assert confined(base, "inner/x.sh", what="f", nested=True) == base / "inner" / "x.sh"
    assert safe_name("a/b.sh", what="f", nested=True) == ["a", "b.sh"]


# -- the versions file ---------------------------------------------------------------------------
def _versions(tmp_path: Path, file: str) -> Path:
    text = versions.VERSIONS_FILE.read_text()
    data = yaml.safe_load(text)
    for art in data["artifacts"].values():
        for e in art["arch"].values():
            e["sha256"] = None
    data["artifacts"]["pyxis_src"]["arch"]["all"]["file"] = file
    f = tmp_path / "v" / "versions.yaml"
    f.parent.mkdir()
    f.write_text(yaml.safe_dump(data))
    return f


@pytest.mark.parametrize("file", ["/ABS/victim", "../victim", "../../victim", "a/b.tgz", "x\ny"])
def test_versions_file_with_a_path_for_file_is_refused_at_load(tmp_path, file):
    f = _versions(tmp_path, file.replace("/ABS", str(tmp_path)))
    with pytest.raises(NodeforgeError, match=r"artifacts\.pyxis_src\.arch\.all\.file: .* bare"):
        versions.load(f)


def test_lock_never_replaces_or_deletes_a_file_outside_its_directory(tmp_path):
    """The defect: `file: /abs/victim` made `versions lock` write the download over the victim
    and then unlink it. An Artifact that did not come through load() is refused at use too."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    v = versions.load(_versions(tmp_path, "pyxis-0.24.0.tar.gz"))
    for a in v.all_artifacts():
        (mirror / a.file).write_bytes(b"artifact")
    v.artifacts["pyxis_src"]["all"] = dataclasses.replace(
        v.artifacts["pyxis_src"]["all"], file=str(victim)
    )
    before = v.path.read_text()
    with pytest.raises(NodeforgeError, match=r"artifact pyxis_src \(all\) file: .*not a safe"):
        versions.lock(v, mirror=str(mirror))
    assert victim.read_text() == "precious"
    assert v.path.read_text() == before
    with pytest.raises(NodeforgeError, match="not a safe"):
        versions.fetch(
            [v.artifacts["pyxis_src"]["all"]], tmp_path / "dl", mirror=str(mirror),
            allow_unpinned=True,
        )  # fmt: skip
    assert victim.read_text() == "precious"


def test_mirror_file_that_is_a_link_out_of_the_mirror_is_refused(tmp_path):
    (tmp_path / "outside.tgz").write_bytes(b"not from the mirror")
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "pyxis-0.24.0.tar.gz").symlink_to(tmp_path / "outside.tgz")
    v = versions.load(_versions(tmp_path, "pyxis-0.24.0.tar.gz"))
    art = v.artifacts["pyxis_src"]["all"]
    with pytest.raises(NodeforgeError, match="leads out of"):
        versions.fetch([art], tmp_path / "dl", mirror=str(mirror), allow_unpinned=True)
    assert not (tmp_path / "dl" / art.file).exists()


def test_url_mirror_gets_only_the_bare_name(tmp_path):
    v = versions.load(_versions(tmp_path, "pyxis-0.24.0.tar.gz"))
    art = dataclasses.replace(v.artifacts["pyxis_src"]["all"], file="../../admin?x=1")
    with pytest.raises(NodeforgeError, match="not a safe relative name"):
        versions.fetch([art], tmp_path / "dl", mirror="http://127.0.0.1:9/m", allow_unpinned=True)
    assert not os.path.exists(tmp_path / "dl" / "admin")
