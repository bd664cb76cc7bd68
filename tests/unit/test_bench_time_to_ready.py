"""bench/time_to_ready.py's accounting of the agent's share when the agent starts before
basic.target (branch readyfloor): the munge step's wait for basic.target is systemd's boot
order, reported apart from the agent's own time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import time_to_ready as ttr

pytestmark = pytest.mark.unit


def test_systemd_us_utc_timestamp_is_read_to_the_microsecond():
    t = ttr.parse_us_utc("ActiveEnterTimestamp=Thu 2026-12-03 22:33:36.123456 UTC\n")
    assert t == pytest.approx(1796337216.123456, abs=1e-6)


@pytest.mark.parametrize(
    "text", ["ActiveEnterTimestamp=\n", "ActiveEnterTimestamp=n/a", "", "Thu 2026-12-03 UTC"]
)
def test_unset_or_odd_timestamps_are_none(text):
    assert ttr.parse_us_utc(text) is None


@pytest.mark.parametrize(
    "basic, wait",
    [
        (99.0, 0.0),  # old ordering: basic.target before the step: nothing to take off
        (100.2, 0.2),  # early start: the step waited 0.2 s for basic.target
        (101.0, 0.3),  # (cannot happen: munge.service follows basic.target) capped at the step
    ],
)
def test_boot_wait_is_the_munge_step_before_basic_target(basic, wait):
    st = {"steps": {"munge": {"started": 100.0, "ended": 100.3}}}
    assert ttr.boot_wait(st, basic) == pytest.approx(wait)


def test_boot_wait_without_a_munge_record_is_zero():
    assert ttr.boot_wait({}, 5.0) == 0.0
    assert ttr.boot_wait({"steps": {"munge": {"started": None}}}, 5.0) == 0.0
