"""Per-job deadlines within operator bounds (gang/deadlines.py) and retry limits by time as
well as count (policy.over_limit): grammar, bounds, refusals the user sees, a forged value
that widens no other job's deadline; an injected clock (decide's `now`) throughout."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from nodeforge.gang import config as gcfg
from nodeforge.gang import deadlines as dl
from nodeforge.gang.policy import decide, over_limit
from nodeforge.gang.slurm_view import JobObs, Snapshot
from nodeforge.gang.state import GangRecord, GovState
from tests.unit.gang.gang_support import gang_cfg as policy_cfg

pytestmark = pytest.mark.unit

T0 = 1_000_000.0
OK = frozenset({"ALLOCATED"})


def cfg(**kw):
    """test_gang_policy's config, with per-job deadlines on (comment, 5..120 s)."""
    own = {"field": "comment", "min_seconds": 5, "max_seconds": 120, **kw.pop("deadlines", {})}
    return policy_cfg(deadlines=own, **kw)


def job(jid="1", state="RUNNING", start=T0, restarts=0, **kw):
    return JobObs(
        job_id=jid,
        state=state,
        reason=kw.pop("reason", "Prolog"),  # not ready: the clock runs to the deadline
        nodes=("a", "b") if state != "PENDING" else (),
        num_nodes=2,
        start_time=start if state != "PENDING" else None,
        submit_time=T0 - 100,
        restarts=restarts,
        partition="main",
        **kw,
    )


def snap(*jobs):
    return Snapshot(jobs=list(jobs), nodes={"a": OK, "b": OK})


# ---- grammar ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "secs"),
    [
        ("90s", 90),
        ("0s", 0),
        ("5", 300),  # Slurm: minutes
        ("5:30", 330),  # M:S
        ("1:02:03", 3723),  # H:M:S
        ("2-3", 2 * 86400 + 3 * 3600),  # D-H
        ("1-0:30", 86400 + 1800),  # D-H:M
        ("1-0:0:5", 86405),  # D-H:M:S
        ("999999999s", 999999999),
    ],
)
def test_time_grammar(text, secs):
    assert dl.parse_time(text) == secs


@pytest.mark.parametrize(
    "text",
    [
        "",
        "nan",
        "NaN",
        "inf",
        "-5",
        "-5s",
        "1e3",
        "1e309s",
        "5.5",
        "5m",
        "5 s",
        " 5",
        "5:60",
        "1:2:3:4",
        "1-24",
        "1-2:3:4:5",
        "9999999999",  # huge: more digits than any field takes
        "\u0663s",  # an Arabic-Indic digit
        "5s;rm",
        "0x10",
        "+5",
    ],
)
def test_time_grammar_refuses(text):
    assert dl.parse_time(text) is None


# ---- requests -----------------------------------------------------------------------------


def req(c, **fields):
    return dl.request(c.deadlines, c.timeout, job(**fields))


def test_no_request_is_no_decision():
    assert req(cfg(), comment="gang other=1") is None
    assert req(cfg(deadlines={"field": "none"}), comment="") is None


def test_request_in_bounds_sets_the_timeout():
    d = req(cfg(), comment="gang nfg-timeout=1:00")
    assert (d.verdict, d.why, d.timeout) == (dl.Verdict.SET, dl.Why.OK, 60)
    assert dl.admin_token(d, 60) == "nfg-deadline:set,t=60,why=ok"
    d = req(cfg(deadlines={"field": "extra"}), extra="nfg-timeout=30s")
    assert d.timeout == 30


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"comment": "nfg-timeout=abc"}, dl.Why.MALFORMED),
        ({"comment": "nfg-timeout=nan"}, dl.Why.MALFORMED),
        ({"comment": "nfg-timeout=-60s"}, dl.Why.MALFORMED),
        ({"comment": "nfg-timeout=99999999999999999999"}, dl.Why.MALFORMED),
        ({"comment": "nfg-timeout="}, dl.Why.MALFORMED),
        ({"comment": "nfg-timeout=1s"}, dl.Why.BELOW_MIN),
        ({"comment": "nfg-timeout=1-0"}, dl.Why.ABOVE_MAX),
        ({"comment": "nfg-timeout=30s,nfg-timeout=40s"}, dl.Why.DUPLICATE),
        ({"name": "nfg-timeout=30s"}, dl.Why.FIELD),
        ({"extra": "nfg-timeout=30s"}, dl.Why.FIELD),
        ({"comment": "nfg-timeout=30s", "extra": "nfg-timeout=100s"}, dl.Why.FIELD),
    ],
)
def test_refused_requests_keep_the_default_with_a_reason(fields, why):
    d = req(cfg(), **fields)
    assert (d.verdict, d.why, d.timeout) == (dl.Verdict.REFUSED, why, None)
    assert "the default timeout 10s applies" in d.detail
    assert dl.admin_token(d, 10) == f"nfg-deadline:refused,t=10,why={why}"


def test_off_refuses_any_request():
    d = req(cfg(deadlines={"field": "none"}), comment="nfg-timeout=30s")
    assert (d.verdict, d.why, d.timeout) == (dl.Verdict.REFUSED, dl.Why.OFF, None)


def test_clamp_is_the_operators_choice():
    c = cfg(deadlines={"out_of_bounds": "clamp"})
    assert req(c, comment="nfg-timeout=1s").timeout == 5
    d = req(c, comment="nfg-timeout=1-0")
    assert (d.verdict, d.why, d.timeout) == (dl.Verdict.CLAMPED, dl.Why.ABOVE_MAX, 120)
    # malformed is refused whatever the bounds policy
    assert req(c, comment="nfg-timeout=nan").verdict == dl.Verdict.REFUSED


def test_refused_value_is_shown_back_bounded_and_escaped():
    d = req(cfg(), comment="nfg-timeout=" + "\u202e\x1b[31m" + "x" * 500)
    assert len(d.detail) < 300 and "\x1b" not in d.detail and "\u202e" not in d.detail


@settings(max_examples=300, deadline=None)
@given(
    comment=hst.text(max_size=80),
    extra=hst.text(max_size=40),
    name=hst.text(max_size=40),
    value=hst.one_of(
        hst.text(max_size=20),
        hst.integers(-(10**12), 10**12).map(str),
        hst.floats(allow_nan=True, allow_infinity=True).map(str),
        hst.integers(0, 10**9).map(lambda n: f"{n}s"),
    ),
    field=hst.sampled_from(["none", "comment", "extra"]),
    oob=hst.sampled_from(["refuse", "clamp"]),
)
def test_any_request_is_bounded_or_refused(comment, extra, name, value, field, oob):
    """No text in any field raises, and the timeout that applies is the default or inside
    the operator's bounds: nothing a user writes widens a deadline past max_seconds."""
    c = cfg(deadlines={"field": field, "out_of_bounds": oob})
    d = req(c, comment=f"{comment} nfg-timeout={value}", extra=extra, name=name)
    assert d is not None
    if d.timeout is not None:
        assert math.isfinite(d.timeout) and 5 <= d.timeout <= 120
        assert d.verdict in (dl.Verdict.SET, dl.Verdict.CLAMPED)
    else:
        assert d.verdict == dl.Verdict.REFUSED


# ---- in the policy ------------------------------------------------------------------------


def _kinds(acts):
    return [(a.kind, a.job_id) for a in acts]


def test_own_deadline_applies_to_that_job_only():
    """Job 1 asks for 60 s; job 2 names job 1's token in its name only, job 3 asks nothing:
    both keep the default 10 s (a forged value never widens another job's deadline)."""
    c = cfg()
    j1 = job("1", comment="nfg-timeout=60s")
    j2 = job("2", name="nfg-timeout=60s job 1")
    j3 = job("3", comment="for job 1: nfg-timeout=60s is what I want")  # its own comment!
    st, acts = decide(c, GovState(), snap(j1, j2, j3), T0 + 1)
    dls = {a.job_id: a for a in acts if a.kind == "deadline"}
    assert (dls["1"].reason, dls["1"].timeout, dls["1"].admin) == (
        "DeadlineSet",
        60,
        "nfg-deadline:set,t=60,why=ok",
    )
    assert (dls["2"].reason, dls["2"].timeout) == ("DeadlineRefused", 10)
    assert dls["2"].admin == "nfg-deadline:refused,t=10,why=field_not_allowed"
    assert dls["3"].timeout == 60  # job 3's own comment: its own deadline, not job 1's
    st, acts = decide(c, st, snap(j1, j2, j3), T0 + 10)
    assert sorted(a.job_id for a in acts if a.kind == "requeue") == ["2"]
    st, acts = decide(c, st, snap(j1, j2, j3), T0 + 59.9)
    assert not [a for a in acts if a.kind == "requeue" and a.job_id == "1"]
    st, acts = decide(c, st, snap(j1, j2, j3), T0 + 60)
    req1 = [a for a in acts if a.kind == "requeue" and a.job_id == "1"]
    assert req1 and req1[0].deadline == T0 + 60


def test_deadline_is_read_at_admission_and_kept_for_the_run():
    c = cfg()
    st, acts = decide(c, GovState(), snap(job(comment="nfg-timeout=30s")), T0 + 1)
    assert st.jobs["1"].timeout == 30
    # the owner edits the Comment while the job runs: the running deadline does not move
    st, acts = decide(c, st, snap(job(comment="nfg-timeout=2:00")), T0 + 2)
    assert not [a for a in acts if a.kind == "deadline"] and st.jobs["1"].timeout == 30
    st, acts = decide(c, st, snap(job(comment="nfg-timeout=2:00")), T0 + 30)
    assert [a.kind for a in acts if a.kind == "requeue"] == ["requeue"]
    # the next run (after the backoff) reads it again
    nxt = job(comment="nfg-timeout=2:00", restarts=1, start=T0 + 40)
    st, acts = decide(c, st, snap(nxt), T0 + 41)
    assert [(a.kind, a.timeout) for a in acts if a.kind == "deadline"] == [("deadline", 120)]


def test_refused_request_is_still_governed_with_the_default():
    c = cfg()
    j = job(comment="nfg-timeout=NaN")
    st, acts = decide(c, GovState(), snap(j), T0 + 1)
    (d,) = [a for a in acts if a.kind == "deadline"]
    assert d.reason == "DeadlineRefused" and "not a time" in d.detail
    st, acts = decide(c, st, snap(j), T0 + 10)
    assert [a.kind for a in acts if a.kind == "requeue"] == ["requeue"]


def test_next_deadline_wakes_for_the_jobs_own_timeout():
    from nodeforge.gang.policy import next_deadline

    c = cfg()
    st, _ = decide(c, GovState(), snap(job(comment="nfg-timeout=45s")), T0 + 1)
    assert next_deadline(c, st, T0 + 2) == T0 + 45


# ---- retry limits by time -----------------------------------------------------------------


def _to_timeout(c, st, t, restarts):
    """Admitted at *t*, not ready: the cycle at its deadline. -> (state, the eviction)."""
    j = job(start=t, restarts=restarts)
    st, _ = decide(c, st, snap(j), t)
    st, acts = decide(c, st, snap(j), t + c.timeout)
    (a,) = [a for a in acts if a.kind in ("requeue", "requeuehold")]
    return st, a


def test_time_limit_deactivates_after_t_seconds_since_first_admission():
    c = cfg(requeuing={"backoff_limit_seconds": 60})
    st, a = _to_timeout(c, GovState(), T0, 0)  # first admission T0, evicted at T0+10
    assert a.kind == "requeue" and st.jobs["1"].first_admitted_at == T0
    st, a = _to_timeout(c, st, T0 + 20, 1)  # T0+30: 30 s < 60
    assert a.kind == "requeue"
    st, a = _to_timeout(c, st, T0 + 50, 2)  # T0+60: 60 s since the first admission
    assert a.kind == "requeuehold" and st.jobs["1"].phase == "deactivated"
    assert "60s since first admission >= backoff_limit_seconds 60" in a.detail


def test_count_and_time_combined_any_or_all():
    rec = GangRecord("1", first_admitted_at=T0)
    both = {"backoff_limit_count": 2, "backoff_limit_seconds": 100}
    c_any = cfg(requeuing=both)
    c_all = cfg(requeuing={**both, "backoff_limit_combine": "all"})
    assert over_limit(c_any, rec, 3, T0 + 10).startswith("requeue 3 > backoff_limit_count 2")
    assert over_limit(c_all, rec, 3, T0 + 10) == ""  # the time is not up yet
    assert over_limit(c_any, rec, 1, T0 + 100) != "" and over_limit(c_all, rec, 1, T0 + 100) == ""
    assert " and " in over_limit(c_all, rec, 3, T0 + 100)
    # one limit set: "all" is that one
    c_t = cfg(requeuing={"backoff_limit_seconds": 100, "backoff_limit_combine": "all"})
    assert over_limit(c_t, rec, 50, T0 + 99) == "" and over_limit(c_t, rec, 1, T0 + 100)
    assert over_limit(cfg(), rec, 10**6, T0 + 10**6) == ""  # no limit: requeue forever


def test_operator_release_restarts_the_time_limit_too():
    c = cfg(requeuing={"backoff_limit_seconds": 15})
    st, a = _to_timeout(c, GovState(), T0, 0)
    st, a = _to_timeout(c, st, T0 + 20, 1)
    assert a.kind == "requeuehold"
    admin = job(state="PENDING", restarts=2, held=True, admin_held=True, reason="JobHeldAdmin")
    st, _ = decide(c, st, snap(admin), T0 + 31)
    st, acts = decide(c, st, snap(job(state="PENDING", restarts=2, reason="None")), T0 + 32)
    assert [a.reason for a in acts] == ["Released"] and st.jobs["1"].first_admitted_at is None
    st, a = _to_timeout(c, st, T0 + 100, 2)
    assert a.kind == "requeue" and st.jobs["1"].first_admitted_at == T0 + 100


def test_first_admission_survives_a_lost_state_file_through_the_admin_comment():
    from nodeforge.gang.events import decode_admin, encode_admin

    text = encode_admin(
        "", count=1, phase="backoff", next_eligible=T0 + 5, restarts=0, why="x", first_admitted=T0
    )
    assert decode_admin(text)["f"] == str(int(T0))
    c = cfg(requeuing={"backoff_limit_seconds": 60})
    st, _ = decide(
        c, GovState(), snap(job(state="PENDING", restarts=1, admin_comment=text)), T0 + 6
    )
    assert st.jobs["1"].first_admitted_at == T0


# ---- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "msg"),
    [
        ({"deadlines": {"min_seconds": 100, "max_seconds": 10}}, "deadlines.min_seconds"),
        ({"deadlines": {"min_seconds": 0}}, "deadlines.min_seconds"),
        ({"deadlines": {"field": "name"}}, "deadlines.field"),
        ({"deadlines": {"field": "Comment"}}, "deadlines.field"),
        ({"deadlines": {"key": "nfg timeout"}}, "deadlines.key"),
        ({"deadlines": {"key": "nfg=x"}}, "deadlines.key"),
        ({"deadlines": {"out_of_bounds": "widen"}}, "deadlines.out_of_bounds"),
        ({"deadlines": {"max_seconds": float("nan")}}, "deadlines.max_seconds"),
        ({"requeuing": {"backoff_limit_seconds": 0}}, "backoff_limit_seconds"),
        ({"requeuing": {"backoff_limit_seconds": -1}}, "backoff_limit_seconds"),
        ({"requeuing": {"backoff_limit_seconds": float("inf")}}, "backoff_limit_seconds"),
        ({"requeuing": {"backoff_limit_seconds": "\u0663s"}}, "backoff_limit_seconds"),
        ({"requeuing": {"backoff_limit_combine": "either"}}, "backoff_limit_combine"),
    ],
)
def test_config_errors_name_the_key(data, msg):
    with pytest.raises(gcfg.ConfigError, match=msg):
        gcfg.from_dict(data, "gang.yaml")


def test_config_defaults_keep_the_old_behaviour():
    c = gcfg.from_dict({}, "t")
    assert c.deadlines.field == "none" and c.requeuing.backoff_limit_seconds is None
    assert gcfg.from_dict({"requeuing": {"backoff_limit_seconds": None}}, "t") == c


# ---- what the user sees: the governor's AdminComment and events ---------------------------


def test_verdict_reaches_the_admin_comment_and_the_events(tmp_path):
    """Admitted long before the governor first looks (a restart): the deadline verdict and
    the requeue land in the same cycle; the requeue's AdminComment keeps the verdict, which
    is what `scontrol show job` shows the owner."""
    from nodeforge.gang.events import read_events
    from nodeforge.gang.governor import Governor
    from tests.unit.gang.gang_support import Recorder
    from tests.unit.gang.gang_support import array_het_job as jjob
    from tests.unit.gang.gang_support import jobs_doc as doc

    d = doc(
        jjob(100, array=100, task=1, start_time=900, state_reason="Prolog",
             comment="nfg-timeout=nan", admin_comment="site-note"),
    )  # fmt: skip
    slurm = Recorder(d)
    c = cfg(
        state_file=str(tmp_path / "s.json"),
        event_log=str(tmp_path / "e.jsonl"),
        metrics_file=str(tmp_path / "m.prom"),
    )
    Governor(c, slurm, clock=lambda: 1000.0).cycle()
    admin = [w for a in slurm.argv for w in a if w.startswith("AdminComment=")]
    assert admin[0] == "AdminComment=site-note nfg-deadline:refused,t=10,why=malformed"
    last = admin[-1].split("=", 1)[1].split()
    assert last[:2] == ["site-note", "nfg-deadline:refused,t=10,why=malformed"], admin
    assert last[2].startswith("nfg-gang:n=1,phase=backoff"), admin
    (ev,) = [e for e in read_events(c.event_log, "100_1") if e["action"] == "deadline"]
    assert (ev["reason"], ev["timeout_seconds"], ev["address"]) == ("DeadlineRefused", 10, "100_1")
    assert "nfg-timeout='nan' is not a time" in ev["detail"]
