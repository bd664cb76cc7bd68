"""nodeforge.slurm_records' cached read (parse_jobs with a BlockCache, what the governor runs
every cycle): over any sequence of documents it gives exactly the records, or the error, of
the full parse, whatever users write into job text and however slurmctld reorders, adds,
drops or restamps jobs; unchanged jobs come back as the very same record objects."""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge import slurm_records as sr
from tests.unit.gang.gang_support import cached_job as job
from tests.unit.gang.gang_support import cached_node as node
from tests.unit.gang.gang_support import n24, render_nodes
from tests.unit.gang.gang_support import render_jobs as render

pytestmark = pytest.mark.unit

# A real capture (tests/fixtures/slurm/README.md): Slurm 24.11.5, 2026-12-03.
CAPTURE = Path(__file__).resolve().parents[2] / "fixtures/slurm/scontrol-show-job-24.11.json"
HOSTILE = st.text(
    alphabet=st.sampled_from(list("ab =\n\r\t\"'\\/[]{}|:;,JobIdNumNodes0123456789é")),
    max_size=40,
)


def as_form(data: bytes, form: str):
    """The document as the governor may hand it to the reader: text, bytes, or a memory map
    of a memory file (how gang.slurm_view.OutputBuffer reads the client's output)."""
    if form == "str":
        return data.decode()
    if form == "bytes":
        return data
    fd = os.memfd_create("t")
    os.write(fd, data)
    m = mmap.mmap(fd, len(data)) if data else b""
    os.close(fd)
    return m


def both(text: str | bytes, cache: sr.BlockCache, form: str = "str", parse=sr.parse_jobs):
    """(cached read of *text* in *form*, full read of its bytes): records or the error."""
    data = text.encode() if isinstance(text, str) else text
    out = []
    for c, f in ((cache, form), (None, "bytes")):
        try:
            out.append(parse(as_form(data, f), "t", c))
        except sr.SlurmDataError as exc:
            out.append(str(exc))
    return out


def stable(j: dict) -> str:
    v = j["last_sched_evaluation"]
    digits = len(str(v["number"] if isinstance(v, dict) else v))
    return json.dumps({**j, "last_sched_evaluation": digits}, sort_keys=True)


def delta_holds(cache: sr.BlockCache, before, out, expect: bool) -> None:
    """What the cache says changed, checked against the lists themselves: its items by id
    are exactly its entries; its delta, when it gives one for this read, has the list before
    and this one, the records added (new objects) and dropped (gone objects), and every
    other record kept in its order. *expect*: a read that kept the order must give one."""
    rid = {"nodes": sr._NODES, "job states": sr._STATES}.get(cache.kind, sr._JOBS).record_id
    if cache.ids is not None:
        assert {k: id(v) for k, v in cache.ids.items()} == {rid(e[3]): id(e) for e in cache.entries}
    if out is before or before is None:
        return
    d = cache.delta
    if d is None or d[1] is not out:
        assert not expect, "an ordered read gave no delta"
        return
    assert d[0] is before

    def values(x) -> list:
        return list(x.values()) if isinstance(x, dict) else list(x)

    b, o = values(before), values(out)
    added, dropped = {id(r) for r in d[2]}, {id(r) for r in d[3]}
    assert len(added) == len(d[2]) and len(dropped) == len(d[3])
    assert added == {id(r) for r in o} - {id(r) for r in b}
    assert dropped == {id(r) for r in b} - {id(r) for r in o}
    assert [id(r) for r in o if id(r) not in added] == [id(r) for r in b if id(r) not in dropped]


def apply_op(jobs: list, op: str, x: int, text: str, next_id: int, shape: str, bump: int) -> int:
    """One random cycle's change to the job list (what slurmctld would print next); returns
    the next unused job id. `restamp` is the scheduler's pass: every pending job's
    last_sched_evaluation moves by *bump*."""
    i = x % len(jobs) if jobs else 0
    if op == "restamp":
        for j in jobs:
            v = j["last_sched_evaluation"]
            j["last_sched_evaluation"] = (
                n24(v["number"] + bump) if isinstance(v, dict) else v + bump
            )
    elif op == "requeue" and jobs:
        jobs[i]["restart_cnt"] += 1
    elif op == "drop" and jobs:
        jobs.pop(i)
    elif op == "add":
        jobs.insert(i, job(next_id, shape, text))
        next_id += 1
    elif op == "move" and jobs:
        jobs.append(jobs.pop(i))
    elif op == "dup" and jobs:
        jobs.insert(i, dict(jobs[i]))  # a job id listed twice: an error either way
    elif op == "rename" and jobs:
        jobs[i] = {**jobs[i], "name": text}
    return next_id


def ops_of(*names: str):
    """1-12 random cycles: (what changes, where, hostile text for it)."""
    return st.lists(
        st.tuples(st.sampled_from(names), st.integers(0, 50), HOSTILE), min_size=1, max_size=12
    )


OPS = ops_of("restamp", "requeue", "drop", "add", "move", "dup", "rename")


@settings(max_examples=150, deadline=None)
@given(
    names=st.lists(HOSTILE, min_size=0, max_size=6),
    ops=OPS,
    shape=st.sampled_from(["22", "24"]),
    forms=st.lists(st.sampled_from(["str", "bytes", "mmap"]), min_size=12, max_size=12),
)
def test_cached_read_is_the_full_parse_over_random_cycles(names, ops, shape, forms):
    jobs = [job(10 + i, shape, n) for i, n in enumerate(names)]
    cache = sr.BlockCache()
    prev: dict[int, tuple[str, sr.JobRecord]] = {}
    next_id = 100
    for cycle, (op, x, text) in enumerate(ops):
        bump = 10**x if x < 12 else 1  # sometimes more digits
        next_id = apply_op(jobs, op, x, text, next_id, shape, bump)
        doc = render(jobs, shape)
        before = cache.out
        cached, full = both(doc, cache, forms[cycle])
        assert cached == full
        if not isinstance(full, str):
            delta_holds(cache, before, cached, op not in ("move", "dup") and bool(jobs))
        if isinstance(full, str):
            assert "listed twice" in full
            jobs = [
                j for k, j in enumerate(jobs) if j["job_id"] not in {x["job_id"] for x in jobs[:k]}
            ]
            continue
        # a job whose text is unchanged but for the digits of its volatile number (as many)
        # is the same object
        for j, r in zip(jobs, cached, strict=True):
            if j["job_id"] in prev and prev[j["job_id"]][0] == stable(j):
                assert r is prev[j["job_id"]][1]
        prev = {j["job_id"]: (stable(j), r) for j, r in zip(jobs, cached, strict=True)}


@pytest.mark.parametrize("shape", ["22", "24"])
@pytest.mark.parametrize(
    "value",
    # (the cached number has 10 digits: the odd ones of that length test the digit check)
    ["0123456789", "١٧٩٦٢٩٠١٩١", "179629019a", "0123", "12a", "-5", "1e5", "1.5", '"x"']
    + ["null", "", "  7", "1796290191 ", "-179629019"],
)
def test_odd_volatile_value_reads_as_the_full_parse(shape, value):
    """Only ASCII digits of the same count replace the cached number on the fast path;
    anything else is parsed (and refused when it is not JSON), as the full parse does."""
    cache = sr.BlockCache()
    jobs = [job(1, shape), job(2, shape)]
    text = render(jobs, shape)
    both(text, cache)
    number = "1796290190"
    assert text.count(number) == 2
    odd = text.replace(number, value, 1)
    cached, full = both(odd, cache)
    assert cached == full
    same = text.replace(number, "1796290191")  # same digit count: from the cache
    cached, full = both(same, cache)
    assert cached == full


def test_real_2411_capture_reads_back_exactly_and_restamped_jobs_come_from_the_cache():
    text = CAPTURE.read_text()
    cache = sr.BlockCache()
    recs = sr.parse_jobs(text, "scontrol show job --json", cache)
    assert recs == sr.parse_jobs(text)
    assert [(r.job_id, r.state, r.num_nodes, r.nodes) for r in recs] == [
        (1, "RUNNING", 2, ("gn1", "gn2")),
        (2, "PENDING", 2, ()),
        (3, "PENDING", 1, ()),
        (4, "PENDING", 1, ()),
    ]
    assert recs[0].name == 'train NumNodes=1 "x" {"job_id": 999}'
    assert recs[0].comment == 'c\nJobId=999 JobState=RUNNING NumNodes=2 "},{"job_id":999'
    # slurmctld's next scheduler pass restamps every job's last_sched_evaluation
    restamped = re.sub(
        r'("last_sched_evaluation": \{\n\s+"set": true,\n\s+"infinite": false,\n\s+"number": )'
        r"(\d+)",
        lambda m: m.group(1) + str(int(m.group(2)) + 7),
        text,
    )
    assert restamped != text
    again = sr.parse_jobs(restamped, "scontrol show job --json", cache)
    assert again == recs and all(a is b for a, b in zip(again, recs, strict=True))
    # a requeue by Slurm (restart_cnt) is read anew; the others still come from the cache
    requeued = restamped.replace('"restart_cnt": 0', '"restart_cnt": 1', 1)
    third = sr.parse_jobs(requeued, "scontrol show job --json", cache)
    assert third == sr.parse_jobs(requeued)
    assert third[0].restarts == 1 and third[0] is not recs[0]
    assert all(a is b for a, b in zip(third[1:], recs[1:], strict=True))


def test_forged_item_end_in_job_text_cannot_end_a_job():
    """Text that looks like the list's layout (`    }`, `    {`, `"jobs": [`) inside a name
    or path is escaped by the serializer: same records as the full parse, no phantom job."""
    forged = '\n    },\n    {\n      "job_id": 999,\n  ]\n  "jobs": [\n    {\n'
    jobs = [job(5, "24", forged), job(6, "24")]
    text = render(jobs, "24")
    cache = sr.BlockCache()
    for _ in range(2):
        recs = sr.parse_jobs(text, "t", cache)
        assert recs == sr.parse_jobs(text) and [r.job_id for r in recs] == [5, 6]
        assert recs[0].name == forged


def test_errors_and_truncation_are_the_full_parse_errors():
    jobs = [job(1, "24"), job(2, "24")]
    text = render(jobs, "24")
    cache = sr.BlockCache()
    sr.parse_jobs(text, "t", cache)
    with_errors = text.replace('"errors": []', '"errors": [{"error": "boom"}]')
    with pytest.raises(sr.SlurmDataError, match="boom"):
        sr.parse_jobs(with_errors, "t", cache)
    for cut in (len(text) // 2, len(text) - 3):
        with pytest.raises(sr.SlurmDataError, match="not JSON"):
            sr.parse_jobs(text[:cut], "t", cache)
    assert sr.parse_jobs(text, "t", cache) == sr.parse_jobs(text)


@pytest.mark.parametrize("form", ["bytes", "mmap"])
@pytest.mark.parametrize(
    "bad",
    # not UTF-8 (a cut sequence, an encoded surrogate, an overlong '/'), same byte count
    [b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf"],
)
def test_bytes_that_are_not_utf8_are_the_full_parse_error_wherever_they_are(form, bad):
    """The reader decodes strictly, as the full parse does: a changed job, the last job, or
    the text around the list holding bytes that are not UTF-8 is an error, never a record
    read from the cache."""
    jobs = [job(1, "24", "x" * 3), job(2, "24", "y" * 3), job(3, "24", "z" * 3)]
    good = render(jobs, "24").encode()
    for where in (b'"xxx"', b'"zzz"', b'"errors"'):
        cache = sr.BlockCache()
        assert both(good, cache, form)[0] == sr.parse_jobs(good.decode())
        doc = good.replace(where, where[:1] + bad + where[1 + len(bad) :], 1)
        assert len(doc) == len(good)
        cached, full = both(doc, cache, form)
        assert isinstance(full, str) and "not UTF-8" in full and cached == full
        assert both(good, cache, form)[0] == sr.parse_jobs(good.decode())


def test_a_view_cut_short_by_the_end_is_no_match():
    """`bytes.startswith(view)` is true for any prefix: the reader's comparison at an offset
    tests the length first, so a document that ends inside a cached job's text never
    matches it (the walk would fail later anyway: the list's end and the rest of the
    document must still parse)."""
    mv = memoryview(b'  "a": 1\n    }')
    assert sr._at(mv, 0, b'  "a": 1') and sr._at(mv, 8, sr._ITEM_END)
    assert not sr._at(mv, 9, sr._ITEM_END + b",") and not sr._at(mv, 12, b"  }\n")
    for cut in range(1, 20):
        text = render([job(1, "24"), job(2, "24")], "24").encode()
        cache = sr.BlockCache()
        sr.parse_jobs(text, "t", cache)
        short = text[: text.index(b'"job_id": 2') + cut]
        assert sr._walk(short, cache, sr._JOBS) is None


@settings(max_examples=100, deadline=None)
@given(
    names=st.lists(HOSTILE, min_size=0, max_size=6),
    ops=OPS,
    shape=st.sampled_from(["22", "24"]),
    slack=st.sampled_from([0, 2, 1024]),
)
def test_governor_observations_from_its_cache_are_the_uncached_ones(names, ops, shape, slack):
    """gang.slurm_view's record -> observation cache (only changed records are added; entries of
    records no longer listed are dropped when they outnumber the listed ones): over random
    cycles the observations equal an uncached read, an unchanged job's observation is the
    same object as last cycle's, and the cache stays bounded."""
    from nodeforge.gang import slurm_view as gs

    jobs = [job(10 + i, shape, n) for i, n in enumerate(names)]
    cache = gs.JobCache()
    prev: dict[str, tuple[str, gs.JobObs]] = {}
    next_id = 100
    saved, gs.CACHE_SLACK = gs.CACHE_SLACK, slack
    try:
        for op, x, text in ops:
            # (the reader's own test covers duplicates and moves: here they restamp)
            op = "restamp" if op in ("dup", "move") else op
            next_id = apply_op(jobs, op, x, text, next_id, shape, 1)
            doc = render(jobs, shape)
            cached = gs.parse_jobs(doc, "t", cache)
            assert cached == gs.parse_jobs(doc, "t")
            assert len(cache.obs) <= 2 * len(cached) + slack
            for j, o in zip(jobs, cached, strict=True):
                if str(j["job_id"]) in prev and prev[str(j["job_id"])][0] == stable(j):
                    assert o is prev[str(j["job_id"])][1]
            prev = {str(j["job_id"]): (stable(j), o) for j, o in zip(jobs, cached, strict=True)}
    finally:
        gs.CACHE_SLACK = saved


# -- the governor's observations, patched by place (gang.slurm_view.JobCache) ---------------

RECORD_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["same", "restart", "swap", "drop", "add", "het", "het1", "task", "fresh", "dup"]
        ),
        st.integers(0, 30),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(0, 12), ops=RECORD_OPS, slack=st.sampled_from([0, 1, 1024]))
def test_patched_observations_are_the_whole_pass(size, ops, slack):
    """JobCache.observe over random record lists (the reader's: the same objects for
    unchanged jobs; a running job restarts, another job takes a place, jobs leave and come,
    het components and array tasks appear): the observations equal jobs_from_records of the
    list with no cache, an unchanged record's observation is the same object as last
    cycle's, the cache stays bounded, and the patch (an alignment with the last list) is
    taken whenever a list with no het job changed in a few places."""
    from nodeforge.gang import slurm_view as gs
    from nodeforge.slurm_records import JobRecord

    def rec(jid: int, **kw) -> JobRecord:
        return JobRecord(jid, "RUNNING", "RUNNING", frozenset(), "None", 2, ("a1", "a2"), **kw)

    records = [rec(i) for i in range(1, size + 1)]
    cache = gs.JobCache()
    patches: list[bool] = []
    real = gs._patch

    def spy(*a):
        out = real(*a)
        patches.append(out is not None)
        return out

    saved, gs.CACHE_SLACK, gs._patch = gs.CACHE_SLACK, slack, spy
    try:
        for op, x in ops:
            records = list(records)  # (the reader's: a new list when anything changed)
            i = x % len(records) if records else 0
            new_id = max((r.job_id for r in records), default=0) + 1
            if op == "restart" and records:
                records[i] = replace(records[i], restarts=records[i].restarts + 1)
            elif op == "swap" and records:  # another job in this place
                records[i] = rec(new_id)
            elif op == "drop" and records:
                records.pop(i)
            elif op == "add":
                records.insert(i, rec(new_id))
            elif op == "het" and records:  # a het job's two components
                records[i : i + 1] = [
                    rec(new_id, het_job_id=new_id, het_job_offset=0),
                    rec(new_id + 1, het_job_id=new_id, het_job_offset=1),
                ]
            elif op == "het1" and records:  # this job now a het job's one component
                r = records[i]
                records[i] = replace(r, het_job_id=r.job_id, het_job_offset=0)
            elif op == "dup" and len(records) > 1:  # a job listed twice (never by slurmctld)
                records[i] = replace(records[(i + 1) % len(records)])
            elif op == "task" and records:  # an array task in this place
                records[i] = rec(new_id, array_job_id=new_id, array_task_id=x)
            elif op == "fresh" and records:  # an equal record, a new object
                records[i] = replace(records[i])
            last = cache.last
            n_before = len(patches)
            try:
                want = gs.jobs_from_records(records)
            except sr.SlurmDataError as exc:  # the same error from the cache, then no list
                with pytest.raises(sr.SlurmDataError, match=re.escape(str(exc))):
                    cache.observe(records)
                records.pop(i)
                continue
            got = cache.observe(records)
            assert got == want
            assert len(cache.obs) <= 2 * len(records) + slack
            if cache.keys is not None:  # (the patch's keys: the observations')
                assert cache.keys == {o.job_id for o in got}
            if last is None or last[0] is records:
                continue
            if last[2] and not any(r.het_job_id is not None for r in records):
                # an unchanged record: last cycle's very observation (one per place)
                before = {id(r): o for r, o in zip(last[0], last[1], strict=True)}
                for r, o in zip(records, got, strict=True):
                    if id(r) in before:
                        assert o is before[id(r)]
                # one change a cycle (a job left, came, changed, or took another's place):
                # patched, no whole pass
                assert patches[n_before:] == [True]
    finally:
        gs.CACHE_SLACK, gs._patch = saved, real


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(0, 300),
    cycles=st.lists(
        st.lists(
            st.tuples(st.sampled_from(["drop", "add", "append", "change", "swap"]), st.integers()),
            max_size=6,
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_a_queue_where_jobs_leave_and_come_is_patched_by_alignment(size, cycles):
    """A long queue (runs longer than _same_run's first windows) where several jobs leave,
    come (anywhere, and at the end as slurmctld lists new jobs), change or are replaced each
    cycle: the patched observations equal the whole pass, each unchanged record keeps its
    very observation, and with a few changes no whole pass is taken."""
    from nodeforge.gang import slurm_view as gs
    from nodeforge.slurm_records import JobRecord

    def rec(jid: int, **kw) -> JobRecord:
        return JobRecord(jid, "PENDING", "PENDING", frozenset(), "Priority", 2, (), **kw)

    records = [rec(i) for i in range(1, size + 1)]
    top = size
    cache = gs.JobCache()
    cache.observe(records)
    real, used = gs._patch, []

    def spy(*a):
        out = real(*a)
        used.append(out is not None)
        return out

    gs._patch = spy
    try:
        for edits in cycles:
            last, last_obs = records, cache.observe(records)
            records = list(records)
            for op, x in edits:
                i = x % len(records) if records else 0
                if op == "drop" and records:
                    records.pop(i)
                elif op in ("add", "append"):
                    top += 1
                    records.insert(i if op == "add" else len(records), rec(top))
                elif op == "change" and records:
                    records[i] = replace(records[i], restarts=records[i].restarts + 1)
                elif op == "swap" and records:
                    top += 1
                    records[i] = rec(top)
            del used[:]
            got = cache.observe(records)
            assert got == gs.jobs_from_records(records)
            before = {id(r): o for r, o in zip(last, last_obs, strict=True)}
            assert all(
                o is before[id(r)] for r, o in zip(records, got, strict=True) if id(r) in before
            )
            if records is not last and 2 * len(edits) <= gs.PATCH_MIN:
                assert used == [True]
    finally:
        gs._patch = real


def test_same_run_is_the_first_place_that_differs():
    from nodeforge.gang import slurm_view as gs

    a = [object() for _ in range(500)]
    for n in (0, 1, 31, 32, 33, 95, 96, 97, 499, 500):
        b = a[:n] + [object()] + a[n + 1 :]
        assert gs._same_run(a, 0, b, 0) == n
        assert gs._same_run(a, 3, b, 3) == (n - 3 if n >= 3 else 497)
    assert gs._same_run(a, 10, a, 10) == 490 and gs._same_run(a, 0, a[:7], 0) == 7
    assert gs._same_run(a, 1, a, 0) == 0


# -- nodes: the same cached read for the node list (the governor's node map every cycle) --

NODE_CAPTURE = CAPTURE.with_name("scontrol-show-node-24.11.json")


def both_nodes(text: str | bytes, cache: sr.BlockCache, form: str = "str"):
    return both(text, cache, form, sr.parse_nodes)


NODE_OPS = ops_of("ping", "drain", "drop", "add", "move", "dup", "rename")


@settings(max_examples=150, deadline=None)
@given(
    reasons=st.lists(HOSTILE, min_size=0, max_size=6),
    ops=NODE_OPS,
    shape=st.sampled_from(["22", "24"]),
    forms=st.lists(st.sampled_from(["str", "bytes", "mmap"]), min_size=12, max_size=12),
)
def test_cached_node_read_is_the_full_parse_over_random_cycles(reasons, ops, shape, forms):
    """Operators drain and resume nodes with any reason text, slurmd pings move load and
    free memory, dynamic nodes come and go: the cached read gives exactly the full parse's
    nodes (or its error), and a node whose text did not change is the same record."""
    nodes = [node(f"c{i:03d}", shape, r, drained=bool(r)) for i, r in enumerate(reasons)]
    cache = sr.BlockCache()
    prev: dict[str, tuple[str, sr.NodeRecord]] = {}
    serial = 100
    for cycle, (op, x, text) in enumerate(ops):
        i = x % len(nodes) if nodes else 0
        if op == "ping" and nodes:
            nodes[i] = {**nodes[i], "cpu_load": nodes[i]["cpu_load"] + 1}
        elif op == "drain" and nodes:
            drained = "DRAIN" not in json.dumps(nodes[i]["state"]) + str(
                nodes[i].get("state_flags")
            )
            name = nodes[i]["name"]
            nodes[i] = node(name, shape, text if drained else "", drained, nodes[i]["cpu_load"])
        elif op == "drop" and nodes:
            nodes.pop(i)
        elif op == "add":
            nodes.insert(i, node(f"c{serial}", shape, text, drained=bool(text)))
            serial += 1
        elif op == "move" and nodes:
            nodes.append(nodes.pop(i))
        elif op == "dup" and nodes:
            nodes.insert(i, dict(nodes[i]))  # a node listed twice: an error either way
        elif op == "rename" and nodes:
            nodes[i] = {**nodes[i], "name": f"r{serial}"}
            serial += 1
        before = cache.out
        cached, full = both_nodes(render_nodes(nodes, shape), cache, forms[cycle])
        assert cached == full
        if not isinstance(full, str):
            delta_holds(cache, before, cached, op not in ("move", "dup") and bool(nodes))
        if isinstance(full, str):
            assert "listed twice" in full
            seen: set[str] = set()
            nodes = [n for n in nodes if not (n["name"] in seen or seen.add(n["name"]))]
            continue
        for n in nodes:
            key = json.dumps(n, sort_keys=True)
            if n["name"] in prev and prev[n["name"]][0] == key:
                assert cached[n["name"]] is prev[n["name"]][1]
        prev = {n["name"]: (json.dumps(n, sort_keys=True), cached[n["name"]]) for n in nodes}


def test_real_2411_node_capture_reads_back_exactly_and_a_ping_reparses_one_node():
    text = NODE_CAPTURE.read_text()
    cache = sr.BlockCache()
    recs = sr.parse_nodes(text, "scontrol show node --json", cache)
    assert recs == sr.parse_nodes(text)
    assert recs["c002"].reason == "maint\nState=IDLE Reason=nodeforge: running hooks"
    assert recs["c002"].flags == {"IDLE", "DRAIN", "DYNAMIC_NORM"}
    assert "NOT_RESPONDING" in recs["c003"].flags
    # slurmd's next ping moves c001's load: only c001 is read again
    pinged = text.replace('"cpu_load": 3', '"cpu_load": 4', 1)
    assert pinged != text
    again = sr.parse_nodes(pinged, "scontrol show node --json", cache)
    assert again == sr.parse_nodes(pinged)
    assert [n for n in again if again[n] is not recs[n]] == ["c001"]


def test_forged_layout_in_a_node_reason_cannot_end_or_add_a_node():
    forged = '\n    },\n    {\n      "name": "evil",\n  ]\n  "nodes": [\n    {\n'
    text = render_nodes([node("c1", "24", forged, True), node("c2", "24")], "24")
    cache = sr.BlockCache()
    for _ in range(2):
        recs = sr.parse_nodes(text, "t", cache)
        assert recs == sr.parse_nodes(text) and list(recs) == ["c1", "c2"]
        assert recs["c1"].reason == forged


def test_a_cache_of_the_other_list_is_not_used():
    """A job cache handed to the node reader (or the reverse) starts empty: an item is only
    ever matched against items of its own list."""
    cache = sr.BlockCache()
    sr.parse_jobs(render([job(1, "24")], "24"), "t", cache)
    assert cache.kind == "jobs" and cache.entries
    nodes_text = render_nodes([node("c1", "24")], "24")
    assert sr.parse_nodes(nodes_text, "t", cache) == sr.parse_nodes(nodes_text)
    assert cache.kind == "nodes"
    jobs_text = render([job(1, "24")], "24")
    assert sr.parse_jobs(jobs_text, "t", cache) == sr.parse_jobs(jobs_text)
    assert cache.kind == "jobs"
    # a job's very text in a node list is no node (the full parse's error), never the
    # cached JobRecord
    as_nodes = jobs_text.replace('\n  "jobs": [', '\n  "nodes": [', 1)
    cached, full = both_nodes(as_nodes, cache)
    assert isinstance(full, str) and "state" in full and cached == full


def test_node_errors_and_truncation_are_the_full_parse_errors():
    text = render_nodes([node("c1", "24"), node("c2", "24")], "24")
    cache = sr.BlockCache()
    sr.parse_nodes(text, "t", cache)
    with_errors = text.replace('"errors": []', '"errors": [{"error": "boom"}]')
    with pytest.raises(sr.SlurmDataError, match="boom"):
        sr.parse_nodes(with_errors, "t", cache)
    for cut in (len(text) // 2, len(text) - 3):
        with pytest.raises(sr.SlurmDataError, match="not JSON"):
            sr.parse_nodes(text[:cut], "t", cache)
    bad = text.encode().replace(b'"c2"', b'"c\xc3"', 1)
    cached, full = both_nodes(bad, cache, "bytes")
    assert isinstance(full, str) and "not UTF-8" in full and cached == full
    assert sr.parse_nodes(text, "t", cache) == sr.parse_nodes(text)


# -- runs of unchanged items compared at once (BlockCache.blob, slurm_records._run): the
# state listing, the nodes, and jobs without a volatile number --

LISTING_OPS = ops_of("state", "drop", "add", "move", "dup", "task", "forge", "same")


def _listing_doc(items: list) -> str:
    # 24.11's squeue --only-job-state: jobs first, then meta and the other lists
    return json.dumps({"jobs": items, "meta": {}, "errors": [], "warnings": []}, indent=2)


def _apply_listing_op(items: list, op: str, x: int, text: str, serial: int) -> int:
    """One random cycle's change to a state listing; *text* is hostile text a forged
    document carries (squeue writes none: the reader must still read it exactly)."""
    i = x % len(items) if items else 0
    if op == "state" and items:
        s = items[i]["state"]
        items[i] = {**items[i], "state": ["RUNNING"] if s == ["PENDING"] else ["PENDING"]}
    elif op == "drop" and items:
        items.pop(i)
    elif op == "add":
        items.insert(i, {"job_id": str(serial), "state": ["PENDING"]})
        serial += 1
    elif op == "move" and items:
        items.append(items.pop(i))
    elif op == "dup" and items:
        items.insert(i, dict(items[i]))  # a job listed twice: an error either way
    elif op == "task" and items:
        items[i] = {**items[i], "job_id": f"{serial}_{x}"}
        serial += 1
    elif op == "forge" and items:
        # another job's whole text inside this one's: escaped, so never that job's item
        other = json.dumps(items[(i + 1) % len(items)], indent=2)
        items[i] = {**items[i], "x": text + other + "\n    },\n    {\n"}
    return serial


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 40),
    ops=LISTING_OPS,
    forms=st.lists(st.sampled_from(["str", "bytes", "mmap"]), min_size=12, max_size=12),
)
def test_cached_listing_read_is_the_full_parse_over_random_cycles(n, ops, forms):
    """The state listing (no volatile number: runs of unchanged jobs are compared at once):
    exactly the full parse's jobs or its error over any sequence of listings; a job whose
    text is unchanged is the same object, a changed one never is, and a listing unchanged
    byte for byte is the very list of the last read."""
    items = [{"job_id": str(10 + i), "state": ["PENDING"]} for i in range(n)]
    cache = sr.BlockCache()
    prev: dict[str, tuple[str, sr.JobState]] = {}
    last: tuple[str, list] | None = None
    serial = 1000
    for cycle, (op, x, text) in enumerate(ops):
        serial = _apply_listing_op(items, op, x, text, serial)
        doc = _listing_doc(items)
        before = cache.out
        cached, full = both(doc, cache, forms[cycle], sr.parse_job_states)
        assert cached == full
        if not isinstance(full, str):
            delta_holds(cache, before, cached, op not in ("move", "dup") and bool(items))
        if isinstance(full, str):
            assert "listed twice" in full
            seen: set[str] = set()
            items = [j for j in items if not (j["job_id"] in seen or seen.add(j["job_id"]))]
            last = None
            continue
        for j, r in zip(items, cached, strict=True):
            t = json.dumps(j, sort_keys=True)
            if j["job_id"] in prev:
                assert (r is prev[j["job_id"]][1]) == (prev[j["job_id"]][0] == t)
        if last is not None and last[0] == doc and items:  # (an empty list: the full parse)
            assert cached is last[1]
        prev = {
            j["job_id"]: (json.dumps(j, sort_keys=True), r)
            for j, r in zip(items, cached, strict=True)
        }
        last = (doc, cached)


def _flat(j: dict) -> dict:
    """A job without last_sched_evaluation (a running job's shape): no volatile number."""
    return {k: v for k, v in j.items() if k != "last_sched_evaluation"}


@settings(max_examples=150, deadline=None)
@given(
    names=st.lists(HOSTILE, min_size=0, max_size=8),
    ops=ops_of("requeue", "drop", "add", "move", "dup", "rename", "stamp", "same"),
    shape=st.sampled_from(["22", "24"]),
    forms=st.lists(st.sampled_from(["str", "bytes", "mmap"]), min_size=12, max_size=12),
)
def test_cached_read_of_jobs_without_a_volatile_number_is_the_full_parse(names, ops, shape, forms):
    """Jobs compared in runs (no item has a volatile number until `stamp` gives one a
    last_sched_evaluation: then item by item again): the full parse's records or error; an
    unchanged job is the same object, a changed one never."""
    jobs = [_flat(job(10 + i, shape, n)) for i, n in enumerate(names)]
    cache = sr.BlockCache()
    prev: dict[int, tuple[str, sr.JobRecord]] = {}
    next_id = 100
    for cycle, (op, x, text) in enumerate(ops):
        if op == "stamp" and jobs:
            jobs[x % len(jobs)] = job(jobs[x % len(jobs)]["job_id"], shape, text)
        elif op != "same":
            next_id = apply_op(jobs, op, x, text, next_id, shape, 1)
            if op == "add":
                jobs = [_flat(j) if j["job_id"] == next_id - 1 else j for j in jobs]
        before = cache.out
        cached, full = both(render(jobs, shape), cache, forms[cycle])
        assert cached == full
        if not isinstance(full, str):
            delta_holds(cache, before, cached, op not in ("move", "dup") and bool(jobs))
        if isinstance(full, str):
            jobs = [
                j for k, j in enumerate(jobs) if j["job_id"] not in {x["job_id"] for x in jobs[:k]}
            ]
            continue
        for j, r in zip(jobs, cached, strict=True):
            if j["job_id"] in prev:
                assert (r is prev[j["job_id"]][1]) == (prev[j["job_id"]][0] == stable_any(j))
        prev = {j["job_id"]: (stable_any(j), r) for j, r in zip(jobs, cached, strict=True)}


def stable_any(j: dict) -> str:
    return stable(j) if "last_sched_evaluation" in j else json.dumps(j, sort_keys=True)


def test_a_run_stops_at_the_first_changed_byte_and_at_the_end_of_the_document():
    """_run: the longest run of cached items at their place, whatever its length; a document
    that ends inside the run is no match."""
    items = [{"job_id": str(i), "state": ["PENDING"]} for i in range(1, 40)]
    cache = sr.BlockCache()
    sr.parse_job_states(_listing_doc(items), "t", cache)
    assert cache.blob is not None and len(cache.offs) == len(items) + 1
    data = _listing_doc(items).encode()
    start = data.index(b'"job_id"') - 6
    for changed in (0, 1, 2, 17, 31, 37):
        other = [dict(j) for j in items]
        other[changed]["state"] = ["RUNNING"]
        doc = memoryview(_listing_doc(other).encode())
        assert sr._run(doc, start, cache.blob, cache.offs, 0, len(items)) == changed
    # the last item is followed by the list's end, not the next item: never in a run
    assert sr._run(memoryview(data), start, cache.blob, cache.offs, 0, len(items)) == 38
    cut = memoryview(data[: start + cache.offs[20] - 1])
    assert sr._run(cut, start, cache.blob, cache.offs, 0, len(items)) == 19
