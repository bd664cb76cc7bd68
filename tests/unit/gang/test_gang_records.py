"""nodeforge.slurm_records and gang.slurm_view: Slurm JSON (22.05 and >= 23.02 shapes) into typed
records; hostile job text (names, comments, work dirs) never moves or adds a field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge import slurm_records as sr
from nodeforge.gang import config as gcfg
from nodeforge.gang.policy import decide
from nodeforge.gang.slurm_view import parse_jobs, start_spec
from nodeforge.gang.state import GovState
from tests.unit.gang.gang_support import job22, job24
from tests.unit.gang.gang_support import jobs_doc as doc

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shape", [job22, job24])
def test_both_schema_generations_read_the_same(shape):
    (j,) = sr.parse_jobs(doc(shape()))
    assert (j.job_id, j.state, j.num_nodes, j.nodes) == (1, "RUNNING", 2, ("gn1", "gn2"))
    assert (j.start_time, j.submit_time, j.priority, j.restarts) == (
        1796290186,
        1796290183,
        4294901759,
        0,
    )
    assert j.requeue and j.batch and j.key == "1"


def test_forged_name_does_not_change_node_count():
    """Issue case: a job named `train NumNodes=1` on 2 nodes must still be a 2-node gang."""
    (j,) = parse_jobs(doc(job22(name="train NumNodes=1")))
    assert j.num_nodes == 2 and j.name == "train NumNodes=1"


def test_forged_workdir_adds_no_phantom_job():
    """Issue case: a WorkDir holding `\\nJobId=999 JobState=RUNNING NumNodes=2` (and a forged
    StartTime) is data of job 7, not a job 999."""
    wd = "/w\nJobId=999 JobState=RUNNING NumNodes=2 StartTime=2020-01-01T00:00:00"
    jobs = parse_jobs(doc(job22(7, current_working_directory=wd, comment=wd, name=wd)))
    assert [j.job_id for j in jobs] == ["7"]
    c = gcfg.from_dict({"timeout": 10}, "t")
    st, acts = decide(c, GovState(), _snap(jobs), 1796290186 + 100)
    assert set(st.jobs) == {"7"} and all(a.job_id == "7" for a in acts)


def _snap(jobs):
    from nodeforge.gang.slurm_view import Snapshot

    return Snapshot(jobs=jobs, nodes={"gn1": frozenset({"ALLOCATED"})})


def test_duplicate_job_id_is_an_error():
    with pytest.raises(sr.SlurmDataError, match="job 3 is listed twice"):
        sr.parse_jobs(doc(job22(3), job22(3)))


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"job_state": "RUN NING"}, "job_state"),
        ({"job_state": []}, "job_state"),
        ({"node_count": -1}, "node_count"),
        ({"node_count": 2**70}, "node_count"),
        ({"node_count": True}, "node_count"),
        ({"restart_cnt": "1"}, "restart_cnt"),
        ({"start_time": 1.5}, "start_time"),
        ({"nodes": "gn1\nJobId=9"}, "nodes"),
        ({"partition": "main JobId=9"}, "partition"),
        ({"state_reason": "None\nJobId=9"}, "state_reason"),
        ({"job_id": 0}, "job_id"),
        ({"comment": "a\x00b"}, "comment"),
    ],
)
def test_out_of_grammar_field_is_an_error_naming_it(patch, field):
    with pytest.raises(sr.SlurmDataError, match=repr(field)):
        sr.parse_jobs(doc(job22(**patch)))


@pytest.mark.parametrize("bad", ["{", "", '{"jobs": 3}', '{"jobs": [], "errors": ["x"]}'])
def test_truncated_or_foreign_document_is_an_error(bad):
    with pytest.raises(sr.SlurmDataError):
        sr.parse_jobs(bad)


def test_hostlist_checked_and_bounded():
    assert sr.expand_hostlist("n[01-03,7],x") == ("n01", "n02", "n03", "n7", "x")
    assert sr.expand_hostlist("") == ()
    for bad in ("n[1-999999999]", "n[3-1]", "n[1-2", "a b", "n[[1]]"):
        with pytest.raises(sr.SlurmDataError):
            sr.expand_hostlist(bad)


def test_states_flags_and_batchflag():
    (j,) = sr.parse_jobs(doc(job24(job_state=["PENDING", "REQUEUED"])))
    assert j.base_state == "PENDING" and j.state == "REQUEUED"
    (j,) = sr.parse_jobs(doc(job24(job_state=["RUNNING", "CONFIGURING"])))
    assert (j.base_state, j.state) == ("RUNNING", "CONFIGURING")
    (j,) = sr.parse_jobs(doc(job22(job_state="COMPLETING")))
    assert j.state == "COMPLETING"
    # 22.05 right after requeuehold and other transitions: one flag word, no base state
    for word in ("REQUEUE_HOLD", "REQUEUED", "RESV_DEL_HOLD", "STOPPED", "SPECIAL_EXIT"):
        (j,) = sr.parse_jobs(doc(job22(job_state=word)))
        assert (j.state, j.base_state) == (word, "")
    (j,) = sr.parse_jobs(doc(job22(batch_flag=2)))  # after Slurm's launch-failure requeue
    assert j.batch
    (j,) = sr.parse_jobs(doc(job22(batch_flag=0)))
    assert not j.batch


def test_array_task_and_het_identity():
    jobs = parse_jobs(
        doc(
            job22(11, array_job_id=10, array_task_id=3),
            job22(20, het_job_id=20, het_job_offset=0, nodes="gn1", node_count=1),
            job22(
                21,
                het_job_id=20,
                het_job_offset=1,
                nodes="gn3",
                node_count=1,
                job_state="CONFIGURING",
            ),
        )
    )
    by = {j.job_id: j for j in jobs}
    assert set(by) == {"10_3", "20"}
    assert by["10_3"].address == "10_3" and by["10_3"].slurm_id == 11
    het = by["20"]
    assert (het.nodes, het.num_nodes, het.state, het.address, het.components) == (
        ("gn1", "gn3"),
        2,
        "CONFIGURING",
        "20",
        2,
    )


def test_nodes_22_and_24_shapes():
    n22 = {
        "name": "gc1",
        "state": "idle",
        "state_flags": ["DRAIN", "NOT_RESPONDING"],
        "reason": "x",
    }
    n24 = {"name": "gc1", "state": ["IDLE", "DRAIN", "NOT_RESPONDING"], "reason": "x"}
    for n in (n22, n24):
        got = sr.parse_nodes(json.dumps({"nodes": [n], "errors": []}))["gc1"]
        assert got.flags == {"IDLE", "DRAIN", "NOT_RESPONDING"} and got.reason == "x"
    with pytest.raises(sr.SlurmDataError, match="listed twice"):
        sr.parse_nodes(json.dumps({"nodes": [n22, n22]}))
    # 22.05 prints "?" for a flag bit missing from its own table: skipped, not fatal
    odd = {"name": "gc1", "state": "idle", "state_flags": ["DRAIN", "?"], "reason": ""}
    assert sr.parse_nodes(json.dumps({"nodes": [odd]}))["gc1"].flags == {"IDLE", "DRAIN"}


def test_version_and_commands():
    assert sr.parse_version("slurm 22.05.8\n") == (22, 5)
    assert sr.parse_version("slurm 24.11.1") == (24, 11)
    assert sr.json_commands((22, 5))[0][0] == "squeue"
    assert sr.json_commands((24, 11)) == (
        ["scontrol", "show", "job", "--json"],
        ["scontrol", "show", "node", "--json"],
    )
    with pytest.raises(sr.SlurmDataError):
        sr.parse_version("slurm 22.05.8\nJobId=1")


def test_start_time_is_an_offset_not_local_time():
    assert start_spec(1000.2, 990.0) == "now+11"
    assert start_spec(5.0, 10.0) == "now+0"


HOSTILE = st.text(
    alphabet=st.sampled_from(list("ab =\n\r\t\"'\\[]{}|:;,JobIdNumNodes0123456789é")),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    names=st.lists(HOSTILE, min_size=1, max_size=5),
    comments=st.lists(HOSTILE, min_size=1, max_size=5),
    workdirs=st.lists(HOSTILE, min_size=1, max_size=5),
    shape=st.sampled_from([job22, job24]),
)
def test_hostile_text_parses_back_exactly(names, comments, workdirs, shape):
    n = min(len(names), len(comments), len(workdirs))
    src = [
        shape(
            100 + i,
            name=names[i],
            comment=comments[i],
            admin_comment=comments[i],
            current_working_directory=workdirs[i],
            standard_output=workdirs[i] + "/%j.out",
        )
        for i in range(n)
    ]
    recs = sr.parse_jobs(doc(*src))
    # the same through the block cache (pretty-printed like 22.05's squeue): equal records,
    # and a second read reuses them
    pretty = json.dumps({"meta": {}, "errors": [], "jobs": src}, indent=2)
    cache = sr.BlockCache()
    assert sr.parse_jobs(pretty, cache=cache) == recs
    again = sr.parse_jobs(pretty, cache=cache)
    assert again == recs and all(
        a is b for a, b in zip(again, sr.parse_jobs(pretty, cache=cache), strict=True)
    )
    # exactly the jobs that were written, no phantom, every text back byte for byte
    assert [r.job_id for r in recs] == [100 + i for i in range(n)]
    for i, r in enumerate(recs):
        assert (r.name, r.comment, r.admin_comment) == (names[i], comments[i], comments[i])
        assert (r.num_nodes, r.nodes, r.state, r.start_time) == (
            2,
            ("gn1", "gn2"),
            "RUNNING",
            1796290186,
        )


def test_block_cache_is_not_fooled_by_a_separator_in_job_text():
    sep = '\n    },\n    {\n      "job_id": 999,'
    src = [job22(5, name=sep, comment=sep, current_working_directory=sep), job22(6)]
    pretty = json.dumps({"meta": {}, "errors": [], "jobs": src}, indent=2)
    cache = sr.BlockCache()
    recs = sr.parse_jobs(pretty, cache=cache)
    assert [r.job_id for r in recs] == [5, 6] and recs[0].name == sep
    # a changed job is parsed again; an unchanged one comes from the cache
    src[1]["restart_cnt"] = 1
    recs2 = sr.parse_jobs(
        json.dumps({"meta": {}, "errors": [], "jobs": src}, indent=2), cache=cache
    )
    assert recs2[0] is recs[0] and recs2[1].restarts == 1


def test_block_cache_falls_back_on_another_layout_and_keeps_errors():
    compact = doc(job22(5))
    assert [r.job_id for r in sr.parse_jobs(compact, cache=sr.BlockCache())] == [5]
    bad = json.dumps({"meta": {}, "errors": ["boom"], "jobs": [job22(5)]}, indent=2)
    with pytest.raises(sr.SlurmDataError, match="errors"):
        sr.parse_jobs(bad, cache=sr.BlockCache())
    dup = json.dumps({"meta": {}, "errors": [], "jobs": [job22(5), job22(5)]}, indent=2)
    with pytest.raises(sr.SlurmDataError, match="listed twice"):
        sr.parse_jobs(dup, cache=sr.BlockCache())


def test_block_cache_reads_any_layout_exactly_as_the_full_parse():
    """22.05 puts the jobs list last (its end is searched from the back), 24.11 first; a
    list of objects after it, or a second "jobs" list, must not shift a block: whatever the
    layout, the cached read gives the records of the full parse (or falls back to it)."""
    jobs = [job22(5), job22(6, name="x\n  ]\n}")]  # structure-like text in a name
    w = [{"description": "w1"}, {"description": "w2"}]
    last = json.dumps({"meta": {}, "errors": [], "jobs": jobs}, indent=2)
    first = json.dumps({"jobs": jobs, "last_update": {"number": 5}, "errors": []}, indent=2)
    objs_after = json.dumps({"jobs": jobs, "meta": {}, "warnings": w}, indent=2)
    j7 = json.dumps({"jobs": [job22(7)]}, indent=2).split('"jobs": [\n', 1)[1]
    second = last[: last.rindex("\n  ]")] + '\n  ],\n  "jobs": [\n' + j7
    objs_before = json.dumps({"meta": {}, "warnings": w, "jobs": jobs}, indent=2)
    one = json.dumps({"meta": {}, "jobs": jobs[:1]}, indent=2)
    for text in (last, first, objs_before, one):
        assert sr._walk(text.encode(), sr.BlockCache(), sr._JOBS) is not None
    for text in (last, first, objs_after, second, objs_before, one):
        cache = sr.BlockCache()
        for _ in range(2):  # cold, then through the cache
            assert sr.parse_jobs(text, cache=cache) == sr.parse_jobs(text)
    assert [(r.job_id, r.name) for r in sr.parse_jobs(last, cache=sr.BlockCache())] == [
        (5, "train"),
        (6, "x\n  ]\n}"),
    ]
