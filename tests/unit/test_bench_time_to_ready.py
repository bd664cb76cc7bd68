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


# The ratio goals are judged only where the polls can tell: each ready time is the first look
# at the controller that showed the node ready, so the true time is up to one poll earlier.
@pytest.mark.parametrize(
    "floor, baked, poll, verdict",
    [
        (0.53, 0.54, 0.25, None),  # this machine, 0.25 s poll: both on the same look (1.02x)
        (0.33, 0.52, 0.05, False),  # this machine, 0.05 s poll: 1.58x, missed at any true time
        (0.50, 0.55, 0.01, True),  # 1.1x, met at any true time
        (0.40, 0.52, 0.05, None),  # 1.3x measured: the polls cannot tell
        (0.05, 0.06, 0.05, None),  # the floor within one poll of zero
    ],
)
def test_baked_over_floor_verdict_accounts_for_the_poll(floor, baked, poll, verdict):
    res = [{"variant": "floor", "ok": True, "seconds": floor}]
    res += [{"variant": "baked", "ok": True, "seconds": baked}]
    got = ttr.summarize(res, ["floor", "baked"], poll)
    assert got["goals_met"]["baked_within_1.3x_floor"] is verdict
    assert got["ratios"]["baked_over_floor"] == round(baked / floor, 2)


@pytest.mark.parametrize(
    "baked, lifecycle, poll, verdict",
    [(0.54, 56.19, 0.25, True), (0.54, 2.6, 0.05, None), (0.54, 2.0, 0.05, False)],
)
def test_lifecycle_verdict_accounts_for_the_poll(baked, lifecycle, poll, verdict):
    assert ttr.ratio_verdict(lifecycle, baked, poll, 5.0, at_most=False) is verdict


@pytest.mark.parametrize("poll", ["0", "-1", "nan", "6"])
def test_poll_outside_its_range_is_refused(poll, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["time_to_ready.py", "--poll", poll])
    with pytest.raises(SystemExit) as exc:
        ttr.main()
    assert exc.value.code == 2
    assert "--poll must be > 0 and <= 5 seconds" in capsys.readouterr().err
