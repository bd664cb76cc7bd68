"""The e2e tier's disk discipline: a step that needs room says so first, outputs are dropped.

Stop 30's CI ran out of disk at `vagrant box add` ("Failure writing output to destination"),
99 % through the tier; these helpers make that a clear, early failure and keep the tier small.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from tests.helpers import GIB, drop_outputs, need_room

pytestmark = pytest.mark.unit

E2E = Path(__file__).resolve().parents[2] / "e2e"


def test_a_step_without_room_fails_first_naming_the_step_and_the_figures(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(pytest.fail.Exception) as e:
        need_room(tmp_path / "not" / "made" / "yet", free + 10 * GIB, "the Vagrant lab")
    msg = str(e.value)
    assert msg.startswith("the Vagrant lab needs ")
    assert f"{(free + 10 * GIB) / GIB:.1f} GiB free under {tmp_path}/not/made/yet" in msg
    assert "GiB is free" in msg and "nodeforge cache prune --max-size" in msg
    need_room(tmp_path / "missing", 1, "a tiny step")  # enough room: nothing happens


def test_drop_outputs_removes_trees_files_and_links_never_what_a_link_points_to(tmp_path):
    tree = tmp_path / "image"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "disk.qcow2").write_bytes(b"x" * 100)
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_text("y")
    link = tmp_path / "link"
    link.symlink_to(keep)
    f = tmp_path / "vars.hcl"
    f.write_text("z")
    drop_outputs(tree, link, f, tmp_path / "never-made")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    assert (keep / "precious").read_text() == "y"


def test_every_e2e_build_and_the_vagrant_lab_check_their_room():
    """A module that runs `nodeforge build` itself (not through build_image) checks room."""
    missing = []
    for mod in sorted(E2E.glob("test_*.py")):
        text = mod.read_text()
        calls = {
            n.func.id
            for n in ast.walk(ast.parse(text))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        builds_itself = '"build",' in text and "nodeforge" in calls
        if (builds_itself or "vagrant" in mod.name) and "need_room" not in calls:
            missing.append(mod.name)
    assert not missing, f"these e2e modules fill the disk without need_room first: {missing}"
