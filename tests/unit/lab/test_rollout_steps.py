"""`nodeforge cluster rollout`: its plan (canary, batches, controller last), what is refused
before anything is drained, and the phases with an injected clock (no root, no cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.cli import build_parser
from nodeforge.errors import NodeforgeError
from nodeforge.lab import rollout as ro
from nodeforge.lab.localcluster import Cluster, LocalCluster, Node
from nodeforge.lab.rollout_plan import BATCH, CANARY, CONTROLLER, describe, plan

pytestmark = pytest.mark.unit

names = st.lists(
    st.integers(min_value=1, max_value=999).map(lambda i: f"c{i:03d}"), unique=True, max_size=40
)


@settings(max_examples=300, deadline=None)
@given(computes=names, batch=st.integers(min_value=1, max_value=12), ctl=st.booleans())
def test_every_compute_once_canary_first_controller_last(computes, batch, ctl):
    steps = plan(computes, batch, "ctl" if ctl else None)
    flat = [n for s in steps for n in s.nodes if s.kind != CONTROLLER]
    assert sorted(flat) == sorted(computes) and len(flat) == len(set(flat))
    assert [s.number for s in steps] == list(range(1, len(steps) + 1))
    if computes:
        assert steps[0].kind == CANARY and len(steps[0].nodes) == 1
    assert all(
        s.kind == BATCH and 1 <= len(s.nodes) <= batch for s in steps[1:] if s.kind != CONTROLLER
    )
    kinds = [s.kind for s in steps]
    assert kinds.count(CONTROLLER) == (1 if ctl else 0)
    if ctl:
        assert steps[-1].kind == CONTROLLER and steps[-1].nodes == ("ctl",)


def test_plan_of_eight_in_twos():
    steps = plan([f"c{i:03d}" for i in range(8, 0, -1)], 2, "ctl")
    assert [s.nodes for s in steps] == [
        ("c001",), ("c002", "c003"), ("c004", "c005"), ("c006", "c007"), ("c008",), ("ctl",),
    ]  # fmt: skip
    assert describe(steps, "old", "new")[0] == "rollout plan: 6 step(s), image old -> new"


@pytest.mark.parametrize("batch", [0, -1, 1025, True, 1.5, "2"])
def test_a_batch_below_one_or_not_whole_is_refused(batch):
    with pytest.raises(NodeforgeError, match="--batch"):
        plan(["c001"], batch, None)


@pytest.mark.parametrize(
    ("computes", "ctl", "msg"),
    [
        (["c001", "c001"], None, "listed twice"),
        (["c001", "ctl"], "ctl", "as the controller"),
        (["C001"], None, "not a cluster node name"),
        (["c001;rm"], None, "not a cluster node name"),
    ],
)
def test_plan_refuses_odd_node_lists(computes, ctl, msg):
    with pytest.raises(NodeforgeError, match=msg):
        plan(computes, 1, ctl)


@given(st.text(max_size=60))
def test_job_id_parser_takes_ids_or_refuses(text):
    try:
        ids = ro.parse_job_ids(text)
    except NodeforgeError as exc:
        assert "where a job id was expected" in str(exc)
        return
    assert all(i.isascii() and i.isdigit() for i in ids)
    assert ids == sorted(set(ids), key=int)


def test_verify_failure_names_host_and_check():
    rep = {"ok": False, "unreachable": [], "results": [
        {"host": "t/c001", "check": "test_compute.py::test_node_registered", "outcome": "passed"},
        {"host": "t/c002", "check": "test_common.py::test_agent_ready", "outcome": "failed",
         "message": "agent is failed\nmore"},
    ]}  # fmt: skip
    out = "a warning line {not json}\n" + json.dumps(rep, indent=2)
    assert ro.verify_failure(1, out) == (
        "verify: host t/c002 check test_common.py::test_agent_ready: agent is failed"
    )
    ok = json.dumps({"ok": True, "unreachable": [], "results": [rep["results"][0]]}, indent=2)
    assert ro.verify_failure(0, ok) is None
    assert "without a report" in ro.verify_failure(1, "Traceback (most recent call last)")
    assert ro.verify_counts(out) == "1 failed, 1 passed in ?s"
    assert ro.verify_counts("no report") == "no checks in ?s"
    gone = json.dumps({"ok": False, "unreachable": [{"host": "t/c001", "reason": "no pid"}],
                       "results": []}, indent=2)  # fmt: skip
    assert ro.verify_failure(1, gone) == "verify: host t/c001 unreachable: no pid"


class FakeClock:
    """FIXTURE: time that moves only when slept."""

    def __init__(self):
        self.t = 0.0

    def now(self):
        return self.t

    def sleep(self, s):
        assert s >= 0
        self.t += s


def test_wait_jobs_lets_jobs_finish_then_stops_at_the_bound():
    clock = FakeClock()
    seen = []

    def jobs_finishing_at_7s(_cluster, nodes):
        seen.append(clock.t)
        return ["12"] if clock.t < 7 else []

    c = ro.Clock(clock.now, clock.sleep)
    assert ro.wait_jobs(None, ["c001"], 30, c, jobs_finishing_at_7s) == []
    assert 7 <= clock.t < 7 + ro.POLL
    clock.t = 0.0
    left = ro.wait_jobs(None, ["c001"], 5, c, lambda _c, _n: ["12", "13"])
    assert left == ["12", "13"] and clock.t == 5  # bounded: never past the bound


def _image(d: Path, slurmd="24.11.5-4+deb13u1", rootfs=True, sha="a" * 64) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    doc = {"packages": {"slurmd": slurmd}, "artifacts": {"rootfs.tar.zst": {"sha256": sha}}}
    (d / "manifest.json").write_text(json.dumps(doc))
    if rootfs:
        (d / "rootfs.tar.zst").write_bytes(b"")
    return d


@pytest.fixture
def cluster_state(tmp_path, monkeypatch):
    """FIXTURE: a saved cluster record (no processes) under a temporary state root."""
    from nodeforge.lab import localcluster

    monkeypatch.setattr(localcluster, "STATE_ROOT", tmp_path / "clusters")
    c = Cluster("t", str(_image(tmp_path / "old")), "", "nfc-t", 0.0)
    for i, (name, role) in enumerate([("ctl", "controller"), ("c001", "compute"),
                                      ("c002", "compute"), ("login001", "login")]):  # fmt: skip
        c.nodes.append(Node(name, role, i + 2, f"10.213.0.{i + 2}", f"nfc-t-{name}", "/nope"))
    c.dir.mkdir(parents=True)
    c.save()
    return tmp_path


def _rollout(image: Path, **kw) -> ro.Rollout:
    def must_not_run(*_a):
        raise AssertionError("verify ran during a refusal")

    return ro.Rollout(LocalCluster("t", progress=lambda m: None), image, verify=must_not_run, **kw)


@pytest.mark.parametrize(
    ("kw", "image", "msg"),
    [
        ({"batch": 0}, "new", "--batch 0"),
        ({"nodes": ["c001", "c999"]}, "new", "has no node 'c999'"),
        ({"nodes": ["login001"]}, "new", "a login node is replaced by hand"),
        ({}, "empty", "manifest.json: missing"),
        ({}, "nosha", "artifacts.rootfs.tar.zst.sha256"),
        ({}, "norootfs", "rootfs.tar.zst not found"),
        ({}, "old2205", "slurmd 22.05.8-4 cannot join cluster t, whose slurmctld is 24.11.5"),
        ({"drain_timeout": -1}, "new", "--drain-timeout -1"),
        # An older release onto the controller: its slurmctld would not take newer slurmds.
        ({}, "old2405", "slurmctld 24.05.1-1 cannot take over cluster t, whose computes run"),
        ({"nodes": ["c001"]}, "old2405", "dry run: nothing was drained"),
    ],
)
def test_refused_before_anything_is_drained(cluster_state, kw, image, msg):
    d = cluster_state / image
    if image == "new":
        _image(d, sha="b" * 64)
    elif image == "empty":
        d.mkdir()
    elif image == "nosha":
        _image(d, sha="xyz")
    elif image == "norootfs":
        _image(d, rootfs=False)
    elif image == "old2405":
        _image(d, slurmd="24.05.1-1")
    elif image == "old2205":
        _image(d, slurmd="22.05.8-4")
    if msg.startswith("dry run"):  # computes only: an older slurmd is fine
        assert _rollout(d, **kw).dry_run()[-1].startswith(msg)
        return
    with pytest.raises(NodeforgeError, match=msg.replace("(", r"\(")):
        _rollout(d, **kw).dry_run()


def test_dry_run_prints_the_plan_with_digests(cluster_state):
    new = _image(cluster_state / "new", sha="b" * 64)
    lines = _rollout(new, batch=2, drain_timeout=30).dry_run()
    text = "\n".join(lines)
    assert lines[0].startswith("rollout plan: 3 step(s), image ")
    assert f"rootfs sha256 {'a' * 16}" in text and f"rootfs sha256 {'b' * 16}" in text
    steps = [ln.split() for ln in lines if ln.strip().startswith("step ")]
    assert steps == [
        ["step", "1/3", "canary", "c001"],
        ["step", "2/3", "batch", "c002"],
        ["step", "3/3", "controller", "ctl"],
    ]
    assert "controller: slurmctld, slurmdbd and MariaDB stopped" in text
    assert lines[-1] == "dry run: nothing was drained or replaced"


def test_the_cli_parses_rollout():
    args = build_parser().parse_args(
        ["cluster", "rollout", "--name", "x", "--image", "out", "--batch", "2", "--dry-run"]
    )
    assert args.batch == 2 and args.dry_run and args.image == Path("out")


class Recorder:
    """FIXTURE: the phases of a step recorded instead of run (what order, which nodes)."""

    def __init__(self, monkeypatch, fail_replace_for=None, verify_fails=False):
        self.calls: list[tuple] = []
        self.fail_replace_for = fail_replace_for
        self.verify_fails = verify_fails
        monkeypatch.setattr(ro.Cluster, "load", classmethod(lambda cls, name: name))
        monkeypatch.setattr(ro, "drain", lambda c, nodes, reason: self.calls.append(("drain", tuple(nodes), reason)))  # fmt: skip
        monkeypatch.setattr(ro, "running_jobs", lambda c, nodes: [])
        monkeypatch.setattr(ro, "requeue", lambda c, ids, p: self.calls.append(("requeue", tuple(ids))))  # fmt: skip
        monkeypatch.setattr(ro, "resume", lambda lc, c, nodes: self.calls.append(("resume", tuple(nodes))) or [])  # fmt: skip
        monkeypatch.setattr(ro, "replace_nodes", self.replace)
        monkeypatch.setattr(ro, "replace_controller", self.replace_controller)

    def replace(self, lc, nodes, image, timeout, params, copies):
        self.calls.append(("replace", tuple(nodes), image.name))
        if self.fail_replace_for and image.name == "new" and self.fail_replace_for in nodes:
            raise NodeforgeError(f"node {self.fail_replace_for} is drained: nodeforge: hook x")

    def replace_controller(self, lc, image, timeout, params, copies):
        self.calls.append(("replace_controller", image.name))
        if self.fail_replace_for == "ctl" and image.name == "new":
            raise NodeforgeError("nodes not ready after 300s: ctl (slurmctld starting)")

    def reaches(self, lc):
        self.calls.append(("reaches",))
        if self.fail_replace_for == "reach":
            raise NodeforgeError("the new controller cannot run a job on c001: srun: error")
        return "a job ran on c001"

    def verify(self, cluster, nodes):
        self.calls.append(("verify", tuple(nodes)))
        if self.verify_fails:
            return "verify: host t/c002 check test_x: boom", "1 failed in 1s"
        return None, "3 passed in 1s"


def _step_rollout(monkeypatch, rec: Recorder, tmp_path: Path) -> tuple[ro.Rollout, ro.Image]:
    monkeypatch.setattr(LocalCluster, "slurm_nodes", lambda self, c: {})
    r = ro.Rollout(LocalCluster("t", progress=lambda m: None), tmp_path / "new",
                   verify=rec.verify, reaches=rec.reaches,
                   clock=ro.Clock(FakeClock().now, FakeClock().sleep))  # fmt: skip
    return r, ro.Image(tmp_path / "old", "24.11.5", "a" * 64)


def test_a_step_drains_replaces_verifies_and_resumes_in_order(monkeypatch, tmp_path):
    rec = Recorder(monkeypatch)
    r, old = _step_rollout(monkeypatch, rec, tmp_path)
    new = ro.Image(tmp_path / "new", "24.11.5", "b" * 64)
    res = r.step(plan(["c001", "c002"], 1, None)[1], 2, old, new)
    assert [c[0] for c in rec.calls] == ["drain", "replace", "verify", "resume"]
    assert rec.calls[0][2] == f"nodeforge-rollout: step 2/2 to {'b' * 16}"
    assert res.requeued == [] and res.finished_in_bound


@pytest.mark.parametrize("how", ["health", "verify"])
def test_a_failed_step_is_restored_on_the_old_image_and_named(monkeypatch, tmp_path, how):
    rec = Recorder(monkeypatch, fail_replace_for="c002" if how == "health" else None,
                   verify_fails=how == "verify")  # fmt: skip
    r, old = _step_rollout(monkeypatch, rec, tmp_path)
    new = ro.Image(tmp_path / "new", "24.11.5", "b" * 64)
    with pytest.raises(ro.RolloutError) as ei:
        r.step(plan(["c001", "c002"], 1, None)[1], 2, old, new)
    msg = str(ei.value)
    assert msg.startswith("rollout stopped at step 2/2 (batch: c002): ")
    assert ("is drained: nodeforge: hook x" if how == "health" else "check test_x: boom") in msg
    assert f"c002 restored on the old image {tmp_path / 'old'}" in msg
    assert ("replace", ("c002",), "old") in rec.calls
    assert ei.value.exit_code == 1


def test_the_controller_step_replaces_it_last_and_restores_it(monkeypatch, tmp_path):
    rec = Recorder(monkeypatch)
    r, old = _step_rollout(monkeypatch, rec, tmp_path)
    new = ro.Image(tmp_path / "new", "24.11.5", "b" * 64)
    ctl_step = plan(["c001"], 1, "ctl")[-1]
    r.step(ctl_step, 2, old, new)
    assert rec.calls == [("replace_controller", "new"), ("reaches",), ("verify", ("ctl",))]
    rec = Recorder(monkeypatch, fail_replace_for="ctl")
    r, old = _step_rollout(monkeypatch, rec, tmp_path)
    with pytest.raises(ro.RolloutError, match=r"step 2/2 \(controller: ctl\): nodes not ready"):
        r.step(ctl_step, 2, old, new)
    assert rec.calls == [("replace_controller", "new"), ("replace_controller", "old")]


def test_a_controller_that_cannot_reach_the_computes_is_restored(monkeypatch, tmp_path):
    """Saved node states look schedulable until SlurmdTimeout: the job through the new
    controller is what fails the step (and the old controller comes back)."""
    rec = Recorder(monkeypatch, fail_replace_for="reach")
    r, old = _step_rollout(monkeypatch, rec, tmp_path)
    new = ro.Image(tmp_path / "new", "24.11.5", "b" * 64)
    with pytest.raises(ro.RolloutError, match=r"controller: ctl\): the new controller cannot"):
        r.step(plan(["c001"], 1, "ctl")[-1], 2, old, new)
    assert rec.calls == [("replace_controller", "new"), ("reaches",), ("replace_controller", "old")]


class _Node:
    def __init__(self, name, role):
        self.name, self.role = name, role


@pytest.mark.parametrize(
    "states, ran, line",
    [
        (
            {"c001": "IDLE", "c002": "MIXED"},
            ["-N", "1", "-w", "c001"],
            "a job ran on c001 (c002 busy)",
        ),
        (
            {"c001": "IDLE", "c002": "IDLE"},
            ["-N", "2", "-w", "c001,c002"],
            "a job ran on c001,c002",
        ),
        (
            {"c001": "ALLOCATED"},
            None,
            "no idle compute to run a job on (c001,c002 busy or not ready)",
        ),
    ],
)
def test_the_round_trip_job_runs_on_the_idle_computes(monkeypatch, states, ran, line):
    from nodeforge.bootstrap.readiness import NodeState
    from nodeforge.lab.localcluster import SlurmNode

    cluster = type("C", (), {"nodes": [_Node("ctl", "controller"), _Node("c002", "compute"),
                                       _Node("c001", "compute")]})()  # fmt: skip
    monkeypatch.setattr(ro.Cluster, "load", classmethod(lambda cls, name: cluster))
    sn = {n: SlurmNode(NodeState(b), b.lower()) for n, b in states.items()}
    monkeypatch.setattr(LocalCluster, "slurm_nodes", lambda self, c: sn)
    seen = []
    monkeypatch.setattr(ro, "slurm", lambda c, argv, timeout=30: seen.append(argv) or "")
    assert ro.controller_reaches(LocalCluster("t", progress=lambda m: None)) == line
    if ran is None:
        assert seen == []
    else:
        assert seen[0][:5] == ["srun", *ran] and seen[0][-1] == "true"


def test_a_job_that_does_not_run_names_the_nodes(monkeypatch):
    from nodeforge.bootstrap.readiness import NodeState
    from nodeforge.lab.localcluster import SlurmNode

    cluster = type("C", (), {"nodes": [_Node("c001", "compute")]})()
    monkeypatch.setattr(ro.Cluster, "load", classmethod(lambda cls, name: cluster))
    monkeypatch.setattr(LocalCluster, "slurm_nodes",
                        lambda self, c: {"c001": SlurmNode(NodeState("IDLE"), "idle")})  # fmt: skip

    def refuse(c, argv, timeout=30):
        raise NodeforgeError("`srun ...` on ctl exited 1: srun: error: Task launch failed")

    monkeypatch.setattr(ro, "slurm", refuse)
    with pytest.raises(NodeforgeError, match=r"cannot run a job on c001: .*Task launch failed"):
        ro.controller_reaches(LocalCluster("t", progress=lambda m: None))
