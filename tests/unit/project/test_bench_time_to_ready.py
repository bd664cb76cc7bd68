"""bench/time_to_ready.py's accounting of the agent's share when the agent starts before
basic.target (branch readyfloor): the munge step's wait for basic.target is systemd's boot
order, reported apart from the agent's own time."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import time_to_ready as ttr
from nodeforge.lab.localcluster import Node

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


# -- experiments: the smallest gates, a key in place before boot, files kept -----------------
def _node_root(tmp_path: Path) -> tuple[SimpleNamespace, Node]:
    """A node's root with what floor_prepare reads: passwd (munge = this test's own ids, so
    the chown works without root) and munge/slurmd units; the cluster's key beside it."""
    cdir = tmp_path / "cluster"
    cdir.mkdir()
    (cdir / "munge.key").write_bytes(b"k" * 32)
    node = Node("c001", "compute", 2, "10.77.0.2", "nfc-x-c001", str(tmp_path / "n"))
    m = node.merged
    (m / "etc/munge").mkdir(parents=True)
    (m / "etc/passwd").write_text(
        f"root:x:0:0::/root:/bin/sh\nmunge:x:{os.getuid()}:{os.getgid()}::/:/bin/false\n"
    )
    (m / "usr/lib/systemd/system").mkdir(parents=True)
    (m / "etc/systemd/system").mkdir(parents=True)
    for u in ("munge.service", "slurmd.service"):
        (m / "usr/lib/systemd/system" / u).write_text("[Service]\n")
    cluster = SimpleNamespace(dir=cdir, controller=SimpleNamespace(address="10.77.0.1"))
    return cluster, node


def _exec_start(unit_text: str) -> list[str]:
    line = next(ln for ln in unit_text.splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))  # systemd's quoting, for these words


@pytest.mark.parametrize("gate", sorted(ttr.GATES))
def test_a_gate_node_is_the_floor_with_munge_and_slurmd_started_by_its_unit(tmp_path, gate):
    cluster, node = _node_root(tmp_path)
    ttr.floor_prepare(cluster, ttr.GATES[gate])(node)
    sysd = node.merged / "etc/systemd/system"
    assert os.readlink(sysd / "nodeforge-init.service") == "/dev/null"  # no agent
    wants = sysd / "multi-user.target.wants"
    # systemd does not start munge or slurmd at boot: only the gate unit does
    assert sorted(p.name for p in wants.iterdir()) == ["nf-gate.service"]
    text = (sysd / "nf-gate.service").read_text()
    assert "After=network-online.target" in text  # the agent's place in the boot order
    assert _exec_start(text) == ttr.GATES[gate]
    assert ttr.GATES[gate][-1].endswith("check=True)") or ttr.GATES[gate] == ttr.GATE_START
    key = node.merged / "etc/munge/munge.key"
    assert key.read_bytes() == b"k" * 32 and (key.stat().st_mode & 0o777) == 0o400


def test_the_floor_itself_enables_munge_and_slurmd(tmp_path):
    cluster, node = _node_root(tmp_path)
    ttr.floor_prepare(cluster)(node)
    wants = node.merged / "etc/systemd/system/multi-user.target.wants"
    assert sorted(p.name for p in wants.iterdir()) == ["munge.service", "slurmd.service"]
    assert os.readlink(wants / "munge.service") == "/usr/lib/systemd/system/munge.service"


def test_munge_key_in_place_gives_a_baked_node_the_key_and_munge_enabled(tmp_path):
    cluster, node = _node_root(tmp_path)
    ttr.munge_key_in_place(cluster)(node)
    sysd = node.merged / "etc/systemd/system"
    assert not (sysd / "nodeforge-init.service").exists()  # the agent still runs
    assert (node.merged / "etc/munge/munge.key").read_bytes() == b"k" * 32
    assert [p.name for p in (sysd / "multi-user.target.wants").iterdir()] == ["munge.service"]


def test_gate_ratios_are_reported_against_the_floor(tmp_path):
    res = [
        {"variant": v, "ok": True, "seconds": s}
        for v, s in (("floor", 0.34), ("gate-python", 0.41), ("baked", 0.54))
    ]
    got = ttr.summarize(res, ["floor", "gate-python", "baked"], 0.05)
    assert got["ratios"] == {"gate-python_over_floor": 1.21, "baked_over_floor": 1.59}
    assert got["median_seconds"]["gate-python"] == 0.41


def test_an_unknown_variant_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["time_to_ready.py", "--variants", "floor,gate-bash"])
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SystemExit) as exc:
        ttr.main()
    assert "choose from floor, baked, lifecycle" in str(exc.value.code)


def test_keep_file_copies_a_regular_file_and_never_follows_a_link(tmp_path):
    _, node = _node_root(tmp_path)
    logd = node.merged / "var/log/nodeforge"
    logd.mkdir(parents=True)
    (logd / "importtime.log").write_text("import time: 1 | 1 | x\n")
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    (logd / "link.log").symlink_to(secret)  # the node's root is not trusted by the host
    (node.merged / "var/log/evil").symlink_to(secret.parent)  # nor a linked directory
    out = tmp_path / "out"
    ttr.keep_files(
        ["/var/log/nodeforge/importtime.log", "/var/log/nodeforge/link.log",
         "/var/log/evil/host-secret", "/var/log/nodeforge/missing.log"],
        out,
    )(node)  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["c001-importtime.log"]


def test_keep_file_is_not_refused_for_a_link_above_the_nodes_root(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked").symlink_to(real)  # the host's own layout, not the node's
    _, node = _node_root(tmp_path / "linked")
    (node.merged / "var/log").mkdir(parents=True)
    (node.merged / "var/log/a.log").write_text("a\n")
    out = tmp_path / "out"
    ttr.keep_files(["/var/log/a.log"], out)(node)
    assert (out / "c001-a.log").read_text() == "a\n"


@pytest.mark.parametrize(
    "path",
    ["var/log/a.log", "/var/../../etc/shadow", "/..", "/var/log/a\\nb", "/a=b", "/a 'b'", "/", ""],
)
def test_keep_file_path_outside_its_grammar_is_refused(path, monkeypatch, capsys):
    path = path.replace("\\n", "\n")  # a newline in the path itself
    monkeypatch.setattr(sys, "argv", ["time_to_ready.py", "--keep-file", path])
    with pytest.raises(SystemExit) as exc:
        ttr.main()
    assert exc.value.code == 2
    assert "--keep-file" in capsys.readouterr().err
