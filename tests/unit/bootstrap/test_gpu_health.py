"""`nodeforge node health`: parsers on FIXTURE nvidia-smi/kernel-log outputs, the decisions,
the drain/clear rules, the bound on a hanging check, and the reports."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.bootstrap import health
from nodeforge.bootstrap.host import Host
from nodeforge.bootstrap.paths import Paths
from nodeforge.errors import CommandError
from tests.unit.support import FakeGpuNode, gpu_fixture

pytestmark = pytest.mark.unit

fixture = gpu_fixture  # tests/fixtures/gpu (see README.md there)


def cfg(tmp_path: Path, expected: int | None = 8, **kw) -> health.Config:
    return health.Config(
        expected_gpus=expected,
        data_dirs=(tmp_path,),
        report_dir=tmp_path / "gang",
        xid_cursor=tmp_path / "cursor",
        **kw,
    )


def check(node: FakeGpuNode, tmp_path: Path, expected: int | None = 8, **kw) -> health.Report:
    rep = health.run_checks(
        Host(run=node.run), cfg(tmp_path, expected, **kw), "n1", now=lambda: 1_760_000_000.0
    )
    rep.action = health.HealthAction(
        Host(run=node.run), "n1", tmp_path / "none.conf", node.json
    ).apply(rep)
    return rep


# -- parsers --------------------------------------------------------------------------------
def test_parse_healthy_8_gpus():
    gpus = health.parse_nvidia_smi(fixture("nvidia-smi-healthy-8gpu.csv"))
    assert [g.index for g in gpus] == list(range(8))
    assert all(g.persistence and g.ecc_uncorrected == 0 for g in gpus)
    assert gpus[0].bus_id == "00000000:18:00.0" and gpus[0].name == "NVIDIA H100 80GB HBM3"


def test_parse_ecc_and_na():
    ecc = health.parse_nvidia_smi(fixture("nvidia-smi-ecc.csv"))
    assert [g.ecc_uncorrected for g in ecc] == [0, 0, 0, 2, 0, 0, 0, 0]
    assert {
        g.ecc_uncorrected for g in health.parse_nvidia_smi(fixture("nvidia-smi-no-ecc.csv"))
    } == {None}


@pytest.mark.parametrize(
    "line",
    [
        "0, 00000000:18:00.0, GPU-1, Enabled, 0",  # too few fields
        "x, 00000000:18:00.0, GPU-1, Enabled, 0, H100",
        "0, 18:00.0\n, GPU-1, Enabled, 0, H100",
        "0, 00000000:18:00.0, GPU-1, Maybe, 0, H100",
        "0, 00000000:18:00.0, GPU-1, Enabled, NaN, H100",
        "0, 00000000:18:00.0, GPU-1, Enabled, -1, H100",
        "0, 00000000:18:00.0, GPU-1, Enabled, 99999999999999999999, H100",
        "0, 00000000:18:00.0, GPU-1=x, Enabled, 0, H100",
    ],
)
def test_parse_rejects_malformed(line):
    with pytest.raises(health.HealthError):
        health.parse_nvidia_smi(line)


def test_parse_xids_app_vs_node():
    xids = health.parse_xids(fixture("kmsg-xid.txt"))
    assert [(x.code, x.node_fault) for x in xids] == [(13, False), (79, True)]
    assert xids[1].bus_id == "0000:5d:00"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parsers_never_crash_on_garbage(text):
    try:
        health.parse_nvidia_smi(text)
    except health.HealthError:
        pass
    health.parse_xids(text)


# -- decisions --------------------------------------------------------------------------------
def test_healthy_gpu_node_passes(tmp_path):
    node = FakeGpuNode()
    rep = check(node, tmp_path)
    assert rep.ok and rep.gpus == 8 and rep.action == health.NOTHING
    assert {c.name for c in rep.checks} == {
        "slurmd",
        "munge",
        "disk",
        "nvml",
        "gpu_count",
        "persistence",
        "ecc",
        "xid",
    }


def test_cpu_node_without_nvidia_smi_passes_without_gpu_checks(tmp_path):
    node = FakeGpuNode(smi=None)
    rep = check(node, tmp_path, expected=None)
    assert rep.ok and rep.gpus is None
    assert not any(c[0] == "nvidia-smi" for c in node.calls)


@pytest.mark.parametrize(
    "smi,rc,expected,what",
    [
        ("nvidia-smi-missing-gpu.csv", 0, 8, "nodeforge-health: gpu_count: 7 of 8 GPUs"),
        (
            "nvidia-smi-ecc.csv",
            0,
            8,
            "nodeforge-health: ecc: uncorrectable ECC errors 00000000:5d:00.0=2",
        ),
        (
            "nvidia-smi-persistence-off.csv",
            0,
            8,
            "nodeforge-health: persistence: persistence mode off on 00000000:18:00.0",
        ),
        (
            "nvidia-smi-no-driver.txt",
            9,
            8,
            "nodeforge-health: nvml: nvidia-smi: NVIDIA-SMI has failed because it couldn t communicate",
        ),
        (None, 0, 8, "nodeforge-health: nvml: nvidia-smi not installed"),
        ("TIMEOUT", 0, 8, "nodeforge-health: nvml: nvidia-smi timed out after 10s"),
    ],
)
def test_gpu_failures_drain_with_what_failed(tmp_path, smi, rc, expected, what):
    node = FakeGpuNode(smi=smi, smi_rc=rc)
    rep = check(node, tmp_path, expected)
    assert not rep.ok and rep.action == health.DRAINED
    assert rep.reason.startswith(what), rep.reason
    assert node.state == "IDLE+DRAIN" and node.reason == rep.reason
    assert "\n" not in rep.reason and '"' not in rep.reason and len(rep.reason) <= 200


def test_cpu_gpu_image_with_expected_8_drains(tmp_path):
    """The VM-tier case, as a unit: gpu image, no GPU, expected_gpus: 8."""
    rep = check(FakeGpuNode(smi="nvidia-smi-no-driver.txt", smi_rc=9), tmp_path, 8)
    assert rep.action == health.DRAINED and "nvml" in rep.reason


def test_new_node_level_xid_drains_and_app_xid_does_not(tmp_path):
    app_only = "\n".join(fixture("kmsg-xid.txt").splitlines()[:1])
    assert check(FakeGpuNode(kmsg=app_only), tmp_path).ok
    node = FakeGpuNode(kmsg=fixture("kmsg-xid.txt"))
    rep = check(node, tmp_path)
    assert rep.reason == "nodeforge-health: xid: XID 79@0000:5d:00"
    # The cursor: the next run asks only for XIDs since this run's start.
    node2 = FakeGpuNode()
    check(node2, tmp_path)
    jc = next(c for c in node2.calls if c[0] == "journalctl")
    assert "--since=@1760000000" in jc


def test_first_run_reads_this_boot(tmp_path):
    node = FakeGpuNode()
    check(node, tmp_path)
    assert "-b" in next(c for c in node.calls if c[0] == "journalctl")


def test_garbage_cursor_is_ignored(tmp_path):
    for junk in ("nan", "inf", "-5", "1e300", "12\n34", ""):
        (tmp_path / "cursor").write_text(junk)
        node = FakeGpuNode()
        check(node, tmp_path)
        assert "-b" in next(c for c in node.calls if c[0] == "journalctl"), junk


def test_service_down_drains(tmp_path):
    node = FakeGpuNode()
    node.active.discard("munge.service")
    rep = check(node, tmp_path, expected=None)
    assert rep.reason == "nodeforge-health: munge: munge.service is not active"


def test_full_disk_drains(tmp_path):
    rep = check(FakeGpuNode(), tmp_path, expected=None, max_used=0.0)
    assert rep.reason.startswith(f"nodeforge-health: disk: {tmp_path}")


# -- drain / clear rules ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "state,reason,healthy,action",
    [
        ("IDLE", "", True, health.NOTHING),
        ("IDLE+DRAIN", "nodeforge-health: gpu_count: 7 of 8 GPUs", True, health.CLEARED),
        ("IDLE+DRAIN", "nodeforge-health: xid: XID 79@0000:5d:00", True, health.NOTHING),  # sticky
        ("IDLE+DRAIN", "maintenance by ops", True, health.NOTHING),
        ("IDLE+DRAIN", "nodeforge: running hooks", True, health.NOTHING),  # the gate resumes
        ("IDLE+DRAIN", "maintenance by ops", False, health.LEFT),
        ("IDLE+DRAIN", "nodeforge: running hooks", False, health.DRAINED),
        ("IDLE", "", False, health.DRAINED),
        ("MIXED+DRAIN", "nodeforge-health: ecc: x", False, health.DRAINED),
    ],
)
def test_decide(state, reason, healthy, action):
    assert health.decide(state, reason, healthy) == action


def test_passing_run_clears_only_its_own_drain(tmp_path):
    node = FakeGpuNode(state="IDLE+DRAIN", reason="nodeforge-health: gpu_count: 7 of 8 GPUs")
    assert check(node, tmp_path).action == health.CLEARED and node.state == "IDLE"
    other = FakeGpuNode(state="IDLE+DRAIN", reason="RMA ticket 42")
    assert check(other, tmp_path).action == health.NOTHING
    assert other.reason == "RMA ticket 42"
    assert not any(c[1] == "update" for c in other.calls if c[0] == "scontrol")


def test_failing_run_never_overwrites_an_operators_drain(tmp_path):
    node = FakeGpuNode(smi="nvidia-smi-missing-gpu.csv", state="IDLE+DRAIN", reason="RMA ticket 42")
    assert check(node, tmp_path).action == health.LEFT and node.reason == "RMA ticket 42"


def test_hanging_check_is_bounded_and_drains_timed_out(tmp_path):
    node = FakeGpuNode()
    node.hang = threading.Event()
    try:
        rep = check(node, tmp_path, budget=0.3)
    finally:
        node.hang.set()
    assert rep.reason == "nodeforge-health: timeout: timed out after 0.3s (in nvml)"
    assert rep.action == health.DRAINED and rep.duration < 3


def test_crashing_check_fails_with_what_crashed(tmp_path):
    def boom(argv, **kw):
        raise ValueError("bad\nthing")

    rep = health.run_checks(Host(run=boom), cfg(tmp_path, None), "n1")
    assert not rep.ok and "check crashed: ValueError: bad thing" in rep.reason


def test_slurmctld_unreachable_is_reported(tmp_path):
    def run(argv, **kw):
        if argv[0] == "scontrol":
            raise CommandError(argv, -1, "", hint="timed out")
        return FakeGpuNode().run(argv, **kw)

    rep = health.run_checks(Host(run=run), cfg(tmp_path, None), "n1")
    for as_json in (True, False):
        slurm_node = health.HealthAction(Host(run=run), "n1", tmp_path / "c", as_json)
        assert slurm_node.apply(rep) == health.UNREACHABLE


# -- reports and the CLI entry ----------------------------------------------------------------
def write_features(paths: Paths, version: str) -> None:
    """What the image's slurm role writes at bake time (the Slurm version picks the reader)."""
    paths.slurm_features.parent.mkdir(parents=True, exist_ok=True)
    paths.slurm_features.write_text(json.dumps({"slurm_version": version, "sackd": True}))


@pytest.mark.parametrize("version,as_json", [("24.11.5", True), ("22.05.8", False)])
def test_reports_json_and_prometheus(tmp_path, version, as_json):
    paths = Paths.under(tmp_path)
    paths.params_json.parent.mkdir(parents=True)
    paths.params_json.write_text(json.dumps({"node": "gpu-001", "expected_gpus": 8}))
    write_features(paths, version)
    node = FakeGpuNode(smi="nvidia-smi-missing-gpu.csv", json=as_json)  # asserts the command
    rep = health.run(Host(run=node.run), paths)
    out = tmp_path / "var/lib/nodeforge/gang"
    body = json.loads((out / "health.json").read_text())
    assert body["ok"] is False and body["reason"] == "nodeforge-health: gpu_count: 7 of 8 GPUs"
    assert body["node"] == "gpu-001" and body["action"] == "drained" and body["gpus"] == 7
    prom = (out / "nodeforge_health.prom").read_text()
    assert (
        "nodeforge_health_ok 0\n" in prom
        and 'nodeforge_health_check_ok{check="gpu_count"} 0' in prom
    )
    assert "nodeforge_health_gpus 7\n" in prom
    assert rep.action == health.DRAINED
    upd = [c for c in node.calls if c[:2] == ["scontrol", "update"]]
    assert upd == [
        [
            "scontrol",
            "update",
            "NodeName=gpu-001",
            "State=DRAIN",
            "Reason=nodeforge-health: gpu_count: 7 of 8 GPUs",
        ]
    ]


@pytest.mark.parametrize(
    "params,msg",
    [
        ({}, "node: missing"),
        ({"node": "a b"}, "node: missing or not a node name"),
        ({"node": "n1", "expected_gpus": 65}, "expected_gpus"),
        ({"node": "n1", "expected_gpus": True}, "expected_gpus"),
        ({"node": "n1", "expected_gpus": "8"}, "expected_gpus"),
    ],
)
def test_node_config_rejects_bad_params_json(tmp_path, params, msg):
    from nodeforge.errors import NodeforgeError

    paths = Paths.under(tmp_path)
    paths.params_json.parent.mkdir(parents=True)
    paths.params_json.write_text(json.dumps(params))
    with pytest.raises(NodeforgeError, match=msg):
        health.node_config(paths)


def test_health_wrapper_runs_the_cli(tmp_path):
    paths = Paths.under(tmp_path)
    assert health.install_wrapper(paths)
    w = tmp_path / "usr/local/sbin/nodeforge-health"
    assert w.stat().st_mode & 0o777 == 0o755
    assert "exec /usr/local/bin/nodeforge node health --quiet" in w.read_text()


@pytest.mark.parametrize("bavail,ok", [(5, True), (4, False)])
def test_disk_use_is_dfs_use_percent(tmp_path, monkeypatch, bavail, ok):
    import os as _os

    fake = _os.statvfs_result((4096, 4096, 100, 10, bavail, 0, 0, 0, 0, 255))
    monkeypatch.setattr(health.os, "statvfs", lambda p: fake)
    # 90 blocks used, `bavail` available to users: 90/95 = 94.7 % vs 90/94 = 95.7 %
    assert health.Checker(Host(run=FakeGpuNode().run), cfg(tmp_path, None)).disks().ok is ok
