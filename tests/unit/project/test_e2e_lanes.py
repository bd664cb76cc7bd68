"""The e2e tier's lanes (tests/e2e/lanes.txt, run side by side by scripts/test.sh) and the build
turn that queues their builds on the one build cache.

A module left out of every lane would never run, and one listed twice would run twice at once
against itself; a build that did not wait its turn would fail at once on the cache's lock.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from pathlib import Path

import pytest

from tests import helpers

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
LINE = re.compile(r"([a-z0-9-]+): (\S+(?: \S+)*)")


def _lanes() -> dict[str, list[str]]:
    lanes: dict[str, list[str]] = {}
    for n, line in enumerate((REPO / "tests/e2e/lanes.txt").read_text().splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        m = LINE.fullmatch(line)
        assert m, f"tests/e2e/lanes.txt line {n} is not `NAME: path ...`: {line!r}"
        assert m[1] not in lanes, f"lane {m[1]} is named twice"
        lanes[m[1]] = m[2].split()
    return lanes


def test_every_e2e_module_is_in_exactly_one_lane():
    listed = [p for paths in _lanes().values() for p in paths]
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests/e2e").glob("test_*.py"))
    assert sorted(p for p in listed if p != "tests/unit") == modules
    # the unit folder's e2e-marked tests (they read the built tree) run in one lane
    assert listed.count("tests/unit") == 1


def test_the_build_lane_runs_first_and_builds_the_image_the_others_boot():
    lanes = _lanes()
    assert next(iter(lanes)) == "build" and len(lanes) >= 2
    assert "tests/e2e/test_build.py" in lanes["build"]  # its built_image is the session's build
    script = (REPO / "scripts/test.sh").read_text()
    assert "LANES=tests/e2e/lanes.txt" in script and "$(lane_paths build)" in script


@pytest.fixture
def lock(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "build.lock"
    monkeypatch.setattr(helpers, "BUILD_LOCK", path)
    return path


def _hold(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_build_waits_its_turn_then_holds_it(lock):
    fd = _hold(lock)  # another lane's build
    threading.Timer(1.0, os.close, (fd,)).start()
    t0 = time.monotonic()
    with helpers.build_turn("the gpu build", wait_s=30):
        waited = time.monotonic() - t0
        assert 0.9 <= waited < 10, waited
        other = os.open(lock, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # held now: the next build waits for us
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    fd = _hold(lock)  # released at the end of the turn
    os.close(fd)


def test_a_turn_never_given_fails_naming_the_build_and_the_lock(lock):
    fd = _hold(lock)
    try:
        t0 = time.monotonic()
        with pytest.raises(pytest.fail.Exception) as e, helpers.build_turn("the qemu build", 2.0):
            pytest.fail("the turn was given while held")
        assert 2.0 <= time.monotonic() - t0 < 10
    finally:
        os.close(fd)
    msg = str(e.value)
    assert msg.startswith("the qemu build: another e2e lane held the build turn")
    assert f"({lock}) for 2s" in msg
