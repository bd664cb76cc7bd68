"""Every Slurm command the governor issues names exactly the job it decided about
(gang.slurm_view.job_address): an array task as ArrayJobId_TaskId (also the task that carries the
array's own JobId, which as a bare id names the whole array), an array's pending tasks as
ArrayJobId_[ids], a het component as Leader+Offset, the governor's het gang by the leader's
id, a plain job by its id. The commands themselves (governor -> scontrol argv) are checked
through a recording runner, for every action kind."""

from __future__ import annotations

import argparse
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge import slurm_records as sr
from nodeforge.gang import config as gcfg
from nodeforge.gang.governor import Governor
from nodeforge.gang.slurm_view import job_address, parse_jobs
from tests.unit.gang.gang_support import Recorder
from tests.unit.gang.gang_support import array_het_job as job
from tests.unit.gang.gang_support import jobs_doc as doc

pytestmark = pytest.mark.unit


def records(*jobs):
    return {r.key: r for r in sr.parse_jobs(doc(*jobs))}


SHAPES = ("22.05", "24.11")


@pytest.mark.parametrize("shape", SHAPES)
def test_address_of_every_kind(shape):
    r = records(
        job(7, shape=shape),  # plain
        job(100, shape=shape, array=100, task=1),  # the task carrying the array's own id
        job(101, shape=shape, array=100, task=0),
        job(200, shape=shape, array=200, task=None, tasks="2-9%2", job_state="PENDING"),
        job(300, shape=shape, het=300, off=0),
        job(301, shape=shape, het=300, off=1),
    )
    assert {k: job_address(v) for k, v in r.items()} == {
        "7": "7",
        "100_1": "100_1",  # never "100": that names every task of array 100
        "100_0": "100_0",
        "200": "200_[2-9]",  # the pending tasks only (the run limit is not an id)
        "300": "300+0",
        "301": "300+1",
    }
    # the governor's het gang: the whole het job, by the leader's id; only the leader's
    # record names it so
    assert job_address(r["300"], whole_het=True) == "300"
    assert job_address(r["301"], whole_het=True) == "300+1"


@pytest.mark.parametrize("shape", SHAPES)
def test_observations_carry_the_address_not_the_numeric_id(shape):
    obs = {
        o.job_id: o
        for o in parse_jobs(
            doc(
                job(100, shape=shape, array=100, task=1),
                job(101, shape=shape, array=100, task=0),
                job(300, shape=shape, het=300, off=0, nodes="gn1", node_count=1),
                job(301, shape=shape, het=300, off=1, nodes="gn2", node_count=1),
                job(9, shape=shape),
            )
        )
    }
    assert {k: (o.address, o.slurm_id) for k, o in obs.items()} == {
        "100_1": ("100_1", 100),
        "100_0": ("100_0", 101),
        "300": ("300", 300),  # one gang: the leader's id names both components
        "9": ("9", 9),
    }


@pytest.mark.parametrize(
    "value",
    ["", "1-3%", "%2", "1--3", "a-b", "1-3,", "\u0663", "1-3; scontrol", "1_2", None, 5, ["1"]],
)
def test_pending_array_without_a_known_task_list_has_no_address(value):
    (r,) = sr.parse_jobs(doc(job(200, array=200, task=None, tasks="", job_state="PENDING")))
    (r,) = sr.parse_jobs(
        doc(job(200, array=200, task=None, array_task_string=value, job_state="PENDING"))
    )
    assert r.array_tasks == "" and job_address(r) is None


def test_22_05_no_val_task_id_is_the_pending_record():
    (r,) = sr.parse_jobs(
        doc(
            job(
                200,
                shape="22.05",
                array=200,
                task=0xFFFFFFFE,
                tasks="0-3",
                job_state="PENDING",
            )
        )
    )
    assert r.key == "200" and job_address(r) == "200_[0-3]"


_ADDRESS = re.compile(r"[0-9]+(?:_[0-9]+|_\[[0-9,:\-]+\]|\+[0-9]+)?")


@settings(max_examples=200, deadline=None)
@given(
    jid=st.integers(1, 2**32 - 3),
    array=st.one_of(st.none(), st.integers(1, 2**32 - 3)),
    task=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    tasks=st.text(max_size=12),
    het=st.one_of(st.none(), st.integers(1, 2**32 - 3)),
    off=st.integers(0, 64),
    shape=st.sampled_from(SHAPES),
)
def test_address_is_always_one_job_in_scontrol_grammar(jid, array, task, tasks, het, off, shape):
    """Whatever Slurm's record holds: an address is exactly one job (or one array's pending
    tasks) in the grammar scontrol parses, or None; never a bare array id."""
    d = job(jid, shape=shape, array=array, task=task, tasks=tasks, het=het, off=off)
    try:
        (r,) = sr.parse_jobs(doc(d))
    except sr.SlurmDataError:
        return
    a = job_address(r)
    if a is None:
        assert r.array_job_id is not None and r.array_task_id is None
        return
    assert _ADDRESS.fullmatch(a), a
    if r.array_job_id is not None:
        assert a.startswith(f"{r.array_job_id}_")
    elif r.het_job_id is not None:
        assert a == f"{r.het_job_id}+{r.het_job_offset}"
    else:
        assert a == str(r.job_id)


# ---- the governor's commands, as argv -----------------------------------------------------


def job_commands(argv: list[list[str]]) -> list[list[str]]:
    return [a for a in argv if a[:3] != ["scontrol", "show", "job"]]


def named(argv: list[str]) -> str:
    """The job a command names: `JobId=X` of update, else the last word."""
    for w in argv:
        if w.startswith("JobId="):
            return w[len("JobId=") :]
    return argv[-1]


def _gov(tmp_path, slurm, **kw):
    data = {
        "timeout": 10,
        "requeuing": {"jitter": 0},
        "state_file": str(tmp_path / "state.json"),
        "event_log": str(tmp_path / "events.jsonl"),
        "metrics_file": str(tmp_path / "metrics.prom"),
    }
    data.update(kw)
    return Governor(gcfg.from_dict(data, "t"), slurm, clock=lambda: 1000.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("kw", "kinds"),
    [
        ({}, {"requeue", "update"}),  # requeue, AdminComment, StartTime
        ({"requeuing": {"jitter": 0, "backoff_limit_count": 0}}, {"requeuehold", "hold"}),
        ({"block_admission": True}, {"requeuehold", "hold", "update"}),
        ({"not_requeueable": "cancel"}, {"update"}),  # (a requeueable job: requeued)
    ],
)
def test_every_command_names_the_task_not_the_array(tmp_path, shape, kw, kinds):
    """An array of 2-node gangs: the task carrying the array's id (100_1) and the sibling
    (100_0, JobId 101) were admitted at the same time; only 100_1 is not ready at its
    timeout (Reason=Prolog). Every command goes to 100_1 by that name: `100` alone would
    requeue (hold, update) the sibling as well."""
    d = doc(
        job(100, shape=shape, array=100, task=1, start_time=980, state_reason="Prolog"),
        job(101, shape=shape, array=100, task=0, start_time=980),
    )
    slurm = Recorder(d)
    g = _gov(tmp_path, slurm, **kw)
    acts = g.cycle()
    assert {a.job_id for a in acts if a.kind != "note"} == {"100_1"}, acts
    cmds = job_commands(slurm.argv)
    assert {c[1] for c in cmds} >= kinds, cmds
    assert cmds and {named(c) for c in cmds} == {"100_1"}, cmds


@pytest.mark.parametrize("shape", SHAPES)
def test_cancel_and_release_name_the_task(tmp_path, shape):
    """scancel (not_requeueable: cancel) and scontrol release (block_admission) too."""
    d = doc(
        job(100, shape=shape, array=100, task=1, start_time=980, state_reason="Prolog"),
        job(101, shape=shape, array=100, task=0, start_time=980, requeue=False),
    )
    d2 = doc(
        job(
            100,
            shape=shape,
            array=100,
            task=1,
            job_state="PENDING",
            state_reason="JobHeldAdmin",
            priority=0,
            nodes="",
            admin_comment="nfg-gang:n=0,phase=waiting_admission",
        ),
        job(101, shape=shape, array=100, task=0, job_state="COMPLETED"),
    )
    slurm = Recorder(d.replace('"requeue": true', '"requeue": false'))
    _gov(tmp_path / "a", slurm, not_requeueable="cancel").cycle()
    cancels = [c for c in job_commands(slurm.argv) if c[0] == "scancel"]
    assert cancels == [["scancel", "100_1"]], slurm.argv
    slurm = Recorder(d2)
    _gov(tmp_path / "b", slurm, block_admission=True).cycle()
    assert [c for c in job_commands(slurm.argv) if c[1] == "release"] == [
        ["scontrol", "release", "100_1"]
    ], slurm.argv


@pytest.mark.parametrize("shape", SHAPES)
def test_het_gang_commands_name_the_whole_het_job(tmp_path, shape):
    d = doc(
        job(300, shape=shape, het=300, off=0, nodes="gn1", node_count=1, start_time=980),
        job(
            301,
            shape=shape,
            het=300,
            off=1,
            nodes="gn2",
            node_count=1,
            start_time=980,
            state_reason="Prolog",
        ),
    )
    slurm = Recorder(d)
    _gov(tmp_path, slurm).cycle()
    cmds = job_commands(slurm.argv)
    assert {c[1] for c in cmds} == {"requeue", "update"}, cmds
    assert {named(c) for c in cmds} == {"300"}, cmds


def test_pending_array_record_is_held_by_its_task_list(tmp_path):
    """block_admission holds a gang at submit: an array's pending record by its task ids,
    not the array id (which would reach its running tasks too)."""
    d = doc(
        job(
            200,
            array=200,
            task=None,
            tasks="1-3%1",
            job_state="PENDING",
            state_reason="None",
            nodes="",
            start_time=0,
        ),
        job(201, array=200, task=0, start_time=990),
    )
    slurm = Recorder(d)
    _gov(tmp_path, slurm, block_admission=True).cycle()
    holds = [c for c in job_commands(slurm.argv) if c[1] == "hold"]
    assert holds == [["scontrol", "hold", "200_[1-3]"]], slurm.argv


def test_a_record_without_an_address_gets_no_command_and_an_event(tmp_path):
    d = doc(job(200, array=200, task=None, tasks="", job_state="PENDING", nodes="", start_time=0))
    slurm = Recorder(d)
    g = _gov(tmp_path, slurm, block_admission=True)
    g.cycle()
    assert job_commands(slurm.argv) == []
    from nodeforge.gang.events import read_events

    (ev,) = [e for e in read_events(g.cfg.event_log, "200") if e["action"] == "hold"]
    assert "names no single job" in ev["error"] and "address" not in ev


def test_gang_ready_marks_its_own_task_not_the_array(monkeypatch, tmp_path):
    """`nodeforge gang ready` in the task that carries the array's id (SLURM_JOB_ID=100):
    Slurm lists the whole array for that id; the task is picked by its numeric id and marked
    by its address."""
    from nodeforge.gang import cli

    d = doc(
        job(100, array=100, task=1, restart_cnt=2),
        job(101, array=100, task=0, restart_cnt=0),
    )
    slurm = Recorder(d)
    monkeypatch.setattr("nodeforge.gang.slurm_view.SlurmCli", lambda **kw: slurm)
    monkeypatch.setattr("nodeforge.proc.run", lambda *a, **kw: None)  # the srun step
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    cfg = tmp_path / "gang.yaml"
    cfg.write_text("{}\n")
    assert cli._ready(argparse.Namespace(config=str(cfg), local=False, timeout=None)) == 0
    (cmd,) = job_commands(slurm.argv)
    assert cmd == ["scontrol", "update", "JobId=100_1", "Comment=nfg-ready=2"]


@pytest.mark.parametrize("value", ["", "abc", "1_2", "100+1", "-1", "\u0661\u0660", "9" * 11])
def test_gang_ready_refuses_a_job_id_that_is_not_digits(monkeypatch, tmp_path, value):
    from nodeforge.errors import NodeforgeError
    from nodeforge.gang import cli

    monkeypatch.setenv("SLURM_JOB_ID", value)
    monkeypatch.setattr("nodeforge.proc.run", lambda *a, **kw: None)
    cfg = tmp_path / "gang.yaml"
    cfg.write_text("{}\n")
    with pytest.raises(NodeforgeError, match="SLURM_JOB_ID"):
        cli._ready(argparse.Namespace(config=str(cfg), local=False, timeout=None))
