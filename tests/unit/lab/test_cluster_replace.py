"""`nodeforge cluster replace`: what is refused before a machine is touched (no root needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.errors import NodeforgeError
from nodeforge.lab.localcluster import Cluster, check_image_for, image_slurm
from nodeforge.slurm_facts import releases, talks_to

pytestmark = pytest.mark.unit


def _image(d: Path, slurmd: object) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "manifest.json").write_text(json.dumps({"packages": {"slurmd": slurmd}}))
    return d


def _cluster(tmp_path: Path, slurmd: str) -> Cluster:
    return Cluster("t", str(_image(tmp_path / "running", slurmd)), "", "nfc-t", 0.0)


@pytest.mark.parametrize(
    ("running", "new", "ok"),
    [
        ("24.11.5-4+deb13u1", "24.11.5-4+deb13u1", True),
        ("24.11.5-4+deb13u1", "24.05.1-1", True),
        ("24.11.5-4+deb13u1", "23.11.4-1", True),
        ("24.11.5-4+deb13u1", "23.02.7-1", False),  # three releases older
        ("24.11.5-4+deb13u1", "22.05.8-4+deb12u3", False),
        ("22.05.8-4+deb12u3", "24.11.5-4+deb13u1", False),  # newer than the controller
    ],
)
def test_an_image_the_controller_cannot_talk_to_is_refused_naming_both(tmp_path, running, new, ok):
    cluster = _cluster(tmp_path, running)
    image = _image(tmp_path / "new", new)
    if ok:
        check_image_for(cluster, image)
        return
    with pytest.raises(NodeforgeError) as e:
        check_image_for(cluster, image)
    assert new in str(e.value) and running in str(e.value) and "Nothing was drained" in str(e.value)


@pytest.mark.parametrize(
    ("slurmd", "says"),
    [(None, "manifest.json: missing"), (42, "is not a Slurm version"),
     ("24.11 $(reboot)", "is not a Slurm version"), ("", "is not a Slurm version")],
)  # fmt: skip
def test_image_without_a_usable_manifest_is_refused(tmp_path, slurmd, says):
    d = tmp_path / "img"
    d.mkdir()
    if slurmd is not None:
        _image(d, slurmd)
    with pytest.raises(NodeforgeError, match=r"manifest\.json") as e:
        image_slurm(d)
    assert says in str(e.value)


@given(st.text(max_size=20), st.text(max_size=20))
@settings(max_examples=300, deadline=None)
def test_talks_to_answers_any_pair_of_version_texts(a, b):
    why = talks_to(a, b)
    assert why is None or (isinstance(why, str) and why)


def test_talks_to_follows_the_release_train():
    for i, c in enumerate(releases()):
        for j, d in enumerate(releases()):
            ok = talks_to(f"{c[0]}.{c[1]:02d}.1", f"{d[0]}.{d[1]:02d}.3") is None
            assert ok == (0 <= i - j <= 2), (c, d)
