"""gang config validation, Slurm output parsing, state persistence, metrics, CLI status."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.errors import NodeforgeError
from nodeforge.gang import config as gcfg
from nodeforge.gang import metrics
from nodeforge.gang import state as st_mod

pytestmark = pytest.mark.unit


def write(tmp_path, text):
    p = tmp_path / "gang.yaml"
    p.write_text(text)
    return p


def test_config_defaults_and_values(tmp_path):
    c = gcfg.load(write(tmp_path, "timeout: 5m\nrequeuing:\n  backoff_limit_count: 3\n"))
    assert c.timeout == 300 and c.requeuing.backoff_limit_count == 3
    assert c.requeuing.backoff_base_seconds == 60 and c.recovery_timeout == 0
    d = gcfg.GangConfig()
    assert (d.timeout, d.block_admission, d.requeuing.timestamp) == (300, False, "eviction")


@pytest.mark.parametrize(
    "text,needle",
    [
        ("timeuot: 3\n", "'timeuot'"),
        ("requeuing:\n  base: 3\n", "'requeuing.base'"),
        ("block_admission: yes please\n", "'block_admission'"),
        ("timeout: -1\n", "'timeout'"),
        ("requeuing:\n  timestamp: submit\n", "'requeuing.timestamp'"),
        ("gangs:\n  partitions: 3\n", "'gangs.partitions'"),
        (
            "requeuing:\n  backoff_base_seconds: 100\n  backoff_max_seconds: 10\n",
            "backoff_max_seconds",
        ),
        ("- a\n", "mapping"),
        ("timeout: [\n", "not valid YAML"),
        ("node_strike_limt: 2\n", "'node_strike_limt'"),
        ("node_strike_limit: -1\n", "'node_strike_limit'"),
        ("node_strike_limit: true\n", "'node_strike_limit'"),
        ("node_strike_limit: '2'\n", "'node_strike_limit'"),
        ("node_strike_limit: 1.5\n", "'node_strike_limit'"),
        ("node_strike_window_seconds: soon\n", "'node_strike_window_seconds'"),
        ("node_strike_window_seconds: 0\n", "'node_strike_window_seconds'"),
        ("node_strike_window_seconds: -5m\n", "'node_strike_window_seconds'"),
        ("node_strike_max_drained: many\n", "'node_strike_max_drained'"),
        ("requeuing:\n  node_strike_limit: 2\n", "'requeuing.node_strike_limit'"),
        ("timeout: .nan\n", "'timeout'"),
        ("timeout: .inf\n", "'timeout'"),
        ("recovery_timeout: 1e300\n", "'recovery_timeout'"),
        ("seed: 100000000000000000000\n", "'seed'"),
        ("timeout: 5\ntimeout: 6\n", "duplicate key 'timeout'"),
        ("requeuing:\n  jitter: 0.1\n  jitter: 0.2\n", "duplicate key 'jitter'"),
    ],
)
def test_config_errors_name_file_and_key(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(gcfg.ConfigError) as ei:
        gcfg.load(p)
    assert str(p) in str(ei.value) and needle in str(ei.value)


def test_node_strike_config_defaults_and_values(tmp_path):
    d = gcfg.GangConfig()
    # off by default: a drain outlives the job and needs an operator to undo
    assert (d.node_strike_limit, d.node_strike_window_seconds, d.node_strike_max_drained) == (
        0,
        3600,
        10,
    )
    c = gcfg.load(
        write(
            tmp_path,
            "node_strike_limit: 2\nnode_strike_window_seconds: 2h\nnode_strike_max_drained: 0\n",
        )
    )
    assert (c.node_strike_limit, c.node_strike_window_seconds, c.node_strike_max_drained) == (
        2,
        7200,
        0,
    )


def test_missing_explicit_config_is_an_error(tmp_path):
    with pytest.raises(gcfg.ConfigError, match="not found"):
        gcfg.load(tmp_path / "nope.yaml")


def test_state_roundtrip_atomic(tmp_path):
    st = st_mod.GovState()
    st.jobs["1"] = st_mod.GangRecord("1", phase="backoff", count=2, next_eligible=5.0)
    metrics.inc_evicted(st, "PodsReadyTimeout", "main")
    metrics.observe(st, "kueue_admitted_until_ready_wait_time_seconds", 3.0)
    p = tmp_path / "s" / "state.json"
    st_mod.save(st, p)
    back = st_mod.load(p)
    assert back.jobs["1"].count == 2 and back.counters.evicted == {"PodsReadyTimeout||main": 1}
    assert not [x for x in p.parent.iterdir() if x.name.startswith(".state-")]
    p.write_text("{broken")
    with pytest.raises(Exception, match="unreadable"):
        st_mod.load(p)


def test_metrics_text_has_kueue_names():
    st = st_mod.GovState()
    st.jobs["1"] = st_mod.GangRecord("1", phase="admitted", partition="main")
    metrics.inc_evicted(st, "PodsReadyTimeout", "main")
    txt = metrics.render(st, 0.01)
    assert (
        'kueue_evicted_workloads_total{cluster_queue="main",reason="PodsReadyTimeout",'
        'underlying_cause=""} 1'
    ) in txt
    assert "kueue_pods_ready_to_evicted_time_seconds_count 0" in txt
    assert 'kueue_admitted_active_workloads{cluster_queue="main"} 1' in txt
    for line in txt.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


def test_cli_status_json(tmp_path, capsys):
    from nodeforge.cli import main

    st = st_mod.GovState()
    st.jobs["7"] = st_mod.GangRecord("7", phase="backoff", count=1, next_eligible=1e9)
    st_mod.save(st, tmp_path / "state.json")
    cfgp = write(tmp_path, f"state_file: {tmp_path / 'state.json'}\n")
    assert main(["gang", "status", "--json", "--config", str(cfgp)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gangs"][0]["job_id"] == "7" and out["gangs"][0]["count"] == 1
    assert main(["gang", "status", "--config", str(cfgp)]) == 0
    assert "backoff" in capsys.readouterr().out


def test_cli_bad_config_is_operator_error(tmp_path, capsys):
    from nodeforge.cli import main

    cfgp = write(tmp_path, "bogus: 1\n")
    assert main(["gang", "status", "--config", str(cfgp)]) == 2
    assert "'bogus'" in capsys.readouterr().err


def test_cli_module_imports_only_stdlib():
    import subprocess
    import sys

    code = (
        "import sys; import nodeforge.gang.cli; bad=[m for m in sys.modules if m.split('.')[0] in "
        "('rich','hcl2','ansible','jinja2')]; print(bad); sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---- node strikes: parsing, state, metrics, status, the governor's drain ------------------


def test_state_roundtrip_keeps_node_strikes(tmp_path):
    st = st_mod.GovState()
    st.nodes["gc1"] = st_mod.NodeStrikes(
        "gc1", strikes=[st_mod.Strike(5.0, "7", "POWERING_UP")], drain="draining", drain_reason="r"
    )
    st.counters.drains_skipped["MaxDrained"] = 1
    p = tmp_path / "state.json"
    st_mod.save(st, p)
    back = st_mod.load(p)
    assert back.nodes == st.nodes and back.counters.drains_skipped == {"MaxDrained": 1}
    # a state file written before node strikes existed still loads
    p.write_text(json.dumps({"jobs": {}, "counters": {"deactivated": 2}}))
    old = st_mod.load(p)
    assert old.nodes == {} and old.counters.deactivated == 2 and old.counters.nodes_drained == 0


def test_metrics_node_strikes():
    st = st_mod.GovState()
    st.nodes["gc1"] = st_mod.NodeStrikes("gc1", drain="drained")
    st.nodes["gc2"] = st_mod.NodeStrikes("gc2", strikes=[st_mod.Strike(1.0, "3", "DOWN")])
    st.counters.node_strikes, st.counters.nodes_drained = 3, 1
    st.counters.drains_skipped["AlreadyOut"] = 2
    lines = metrics.render(st).splitlines()
    for want in (
        "# TYPE nodeforge_gang_nodes_drained_total counter",
        "nodeforge_gang_nodes_drained_total 1",
        "nodeforge_gang_node_strikes_total 3",
        'nodeforge_gang_node_drains_skipped_total{reason="AlreadyOut"} 2',
        "nodeforge_gang_nodes_drained 1",
        "nodeforge_gang_nodes_struck 1",
    ):
        assert want in lines, want


def test_cli_status_lists_struck_and_drained_nodes(tmp_path, capsys):
    from nodeforge.cli import main

    st = st_mod.GovState()
    st.nodes["gc1"] = st_mod.NodeStrikes(
        "gc1",
        strikes=[st_mod.Strike(1e9, "4", "POWERING_UP"), st_mod.Strike(1e9 + 9, "5", "DOWN")],
        drain="drained",
        drain_reason="nodeforge-gang: not ready at 2 gang timeouts",
    )
    st.nodes["gn7"] = st_mod.NodeStrikes("gn7", strikes=[st_mod.Strike(1e9, "4", "NOT_RESPONDING")])
    st_mod.save(st, tmp_path / "state.json")
    cfgp = write(tmp_path, f"state_file: {tmp_path / 'state.json'}\n")
    assert main(["gang", "status", "--json", "--config", str(cfgp)]) == 0
    rows = json.loads(capsys.readouterr().out)["nodes"]
    assert [(r["node"], r["state"], r["strikes"], r["last_job"]) for r in rows] == [
        ("gc1", "drained", 2, "5"),
        ("gn7", "struck", 1, "4"),
    ]
    assert rows[0]["why"].startswith("nodeforge-gang:") and rows[1]["why"] == "NOT_RESPONDING"
    assert main(["gang", "status", "--config", str(cfgp)]) == 0
    out = capsys.readouterr().out
    assert "NODE" in out and "gc1" in out and "drained" in out and "gn7" in out


class FakeSlurm:
    """SlurmCli stand-in: serves snapshots, records commands, can fail like slurmctld."""

    def __init__(self, snaps, node_now=None, requeue_output=None):
        self.snaps = list(snaps)
        self.node_now = node_now  # what `scontrol show node X` says at drain time
        self.requeue_output = requeue_output
        self.calls: list[tuple] = []
        self.on_drain = None

    def snapshot(self, need=None, settled=()):
        return self.snaps.pop(0)

    def show_node(self, name):
        self.calls.append(("show_node", name))
        return self.node_now

    def drain_node(self, name, reason):
        if self.on_drain:
            self.on_drain()
        self.calls.append(("drain", name, reason))

    def requeue(self, job_id):
        self.calls.append(("requeue", job_id))
        if self.requeue_output:
            from nodeforge.errors import CommandError

            raise CommandError(["scontrol", "requeue", job_id], 1, self.requeue_output)

    def __getattr__(self, name):  # set_admin_comment, set_start_time, hold, ...
        return lambda *a: self.calls.append((name, *a))


def _gov(tmp_path, slurm, t):
    from nodeforge.gang.governor import Governor

    c = gcfg.from_dict(
        {
            "timeout": 10,
            "node_strike_limit": 1,
            "requeuing": {"jitter": 0},
            "state_file": str(tmp_path / "state.json"),
            "event_log": str(tmp_path / "events.jsonl"),
            "metrics_file": str(tmp_path / "metrics.prom"),
        },
        "t",
    )
    return Governor(c, slurm, clock=lambda: t)


def _timed_out_gang():
    from nodeforge.gang.slurm_view import JobAddress, JobObs, Snapshot

    j = JobObs(
        "9",
        "CONFIGURING",
        "None",
        ("gn1", "gc1"),
        2,
        partition="main",
        start_time=1e9,
        address=JobAddress("9"),
    )
    booting = frozenset({"ALLOCATED", "CLOUD", "POWERING_UP"})
    return Snapshot([j], nodes={"gn1": frozenset({"ALLOCATED"}), "gc1": booting})


def test_governor_drains_after_persisting_the_decision_then_requeues(tmp_path):
    from nodeforge.gang.events import read_events

    slurm = FakeSlurm([_timed_out_gang()], node_now=(frozenset({"IDLE", "POWERING_UP"}), ""))
    g = _gov(tmp_path, slurm, 1e9 + 10)
    on_disk = []
    slurm.on_drain = lambda: on_disk.append(st_mod.load(tmp_path / "state.json").nodes["gc1"])
    g.cycle()
    assert on_disk and on_disk[0].drain == "draining"  # write-ahead
    names = [c[0] for c in slurm.calls]
    assert names.index("drain") < names.index("requeue")
    (drain,) = [c for c in slurm.calls if c[0] == "drain"]
    assert drain[1] == "gc1" and drain[2].startswith("nodeforge-gang: not ready at 1 gang")
    ev = read_events(tmp_path / "events.jsonl")
    assert [(e["action"], e.get("node")) for e in ev if e.get("node")] == [
        ("strike", "gc1"),
        ("drain", "gc1"),
    ]
    prom = (tmp_path / "metrics.prom").read_text().splitlines()
    assert "nodeforge_gang_nodes_drained_total 1" in prom
    assert "nodeforge_gang_node_strikes_total 1" in prom


def test_governor_does_not_override_a_drain_set_since_the_snapshot(tmp_path):
    from nodeforge.gang.events import read_events
    from nodeforge.gang.slurm_view import Snapshot

    foreign = (frozenset({"IDLE", "DRAIN", "POWERING_UP"}), "ops: chassis swap")
    slurm = FakeSlurm([_timed_out_gang()], node_now=foreign)
    g = _gov(tmp_path, slurm, 1e9 + 10)
    g.cycle()
    assert not [c for c in slurm.calls if c[0] == "drain"]
    assert ("requeue", "9") in slurm.calls
    # the next cycle sees the foreign drain: no second report, no drain
    slurm.snaps.append(
        Snapshot([], nodes={"gc1": foreign[0]}, node_reasons={"gc1": "ops: chassis swap"})
    )
    g.cycle()
    assert not [c for c in slurm.calls if c[0] == "drain"]
    (skip,) = [e for e in read_events(tmp_path / "events.jsonl") if e["action"] == "drain_skipped"]
    assert skip["reason"] == "AlreadyOut" and "ops: chassis swap" in skip["detail"]
    assert g.state.nodes["gc1"].drain == "" and len(g.state.nodes["gc1"].strikes) == 1
    prom = (tmp_path / "metrics.prom").read_text().splitlines()
    assert 'nodeforge_gang_node_drains_skipped_total{reason="AlreadyOut"} 1' in prom
    assert "nodeforge_gang_nodes_drained_total 0" in prom


def test_governor_requeue_after_slurm_requeued_on_the_drain_still_sets_backoff(tmp_path):
    from nodeforge.gang.events import read_events

    slurm = FakeSlurm(
        [_timed_out_gang()],
        node_now=(frozenset({"IDLE", "POWERING_UP"}), ""),
        requeue_output="Job is pending execution for job 9\n",
    )
    _gov(tmp_path, slurm, 1e9 + 10).cycle()
    assert [c[0] for c in slurm.calls if c[0] in ("set_start_time", "requeue")] == [
        "requeue",
        "set_start_time",
    ]
    (req,) = [e for e in read_events(tmp_path / "events.jsonl") if e["action"] == "requeue"]
    assert req["requeued_by"] == "slurmctld" and "error" not in req
    assert "nodeforge_gang_action_errors_total 0" in (tmp_path / "metrics.prom").read_text()
    # any other requeue failure is still an error
    slurm = FakeSlurm([_timed_out_gang()], requeue_output="Invalid job id specified\n")
    (tmp_path / "state.json").unlink()
    _gov(tmp_path, slurm, 1e9 + 10).cycle()
    assert "nodeforge_gang_action_errors_total 1" in (tmp_path / "metrics.prom").read_text()


def test_persistent_read_failure_backs_off_with_events(tmp_path):
    """A slurmctld that keeps failing (or output that does not parse) is read again after
    growing delays, with an event at the 1st, 2nd, 4th, 8th... failure: not a 1 Hz loop."""
    from nodeforge.errors import NodeforgeError
    from nodeforge.gang.events import read_events
    from nodeforge.gang.governor import READ_BACKOFF_MAX

    class Failing(FakeSlurm):
        reads = 0

        def snapshot(self, need=None, settled=()):
            Failing.reads += 1
            raise NodeforgeError("scontrol: Unable to contact slurm controller")

    now = [1000.0]
    g = _gov(tmp_path, Failing([]), 0)
    g.clock = lambda: now[0]
    for _ in range(600):  # ten minutes at 1 s
        g.cycle()
        now[0] += 1.0
    assert Failing.reads <= 20, Failing.reads  # backed off up to 60 s
    ev = [
        e for e in read_events(tmp_path / "events.jsonl") if e["action"] == "slurmctld_unreachable"
    ]
    assert [e["failures"] for e in ev][:4] == [1, 2, 4, 8] and len(ev) <= 6
    assert g.retry_at - now[0] <= READ_BACKOFF_MAX
    assert "nodeforge_gang_up 0" in (tmp_path / "metrics.prom").read_text()


def test_metrics_label_values_escaped_and_deactivation_under_kueue_reason():
    st = st_mod.GovState()
    metrics.inc_evicted(st, metrics.REASON_DEACTIVATED, 'a"b\\c\nd', metrics.CAUSE_REQUEUING_LIMIT)
    st.counters.evicted["PodsReadyTimeout|old"] = 2  # a state file from before the cause label
    # Kueue < 0.10's name for it, kept by an older state file: merged into one series
    st.counters.evicted['InactiveWorkload|RequeuingLimitExceeded|a"b\\c\nd'] = 4
    txt = metrics.render(st)
    assert (
        'kueue_evicted_workloads_total{cluster_queue="a\\"b\\\\c\\nd",reason="Deactivated",'
        'underlying_cause="RequeuingLimitExceeded"} 5'
    ) in txt
    assert "InactiveWorkload" not in txt
    assert 'cluster_queue="old",reason="PodsReadyTimeout",underlying_cause=""} 2' in txt
    # every sample line is one line: no raw newline leaked from a label value
    assert all(ln.startswith(("#", "kueue_", "nodeforge_")) for ln in txt.splitlines())


def test_recovery_timeout_true_means_timeout(tmp_path):
    c = gcfg.load(write(tmp_path, "timeout: 5m\nrecovery_timeout: true\n"))
    assert c.recovery_timeout == 300
    assert gcfg.load(write(tmp_path, "recovery_timeout: false\n")).recovery_timeout == 0


def test_state_written_only_when_it_changed(tmp_path):
    p = tmp_path / "state.json"
    st = st_mod.GovState()
    st.jobs["1"] = st_mod.GangRecord("1", phase="admitted")
    saved = st_mod.save_if_changed(st, p)
    assert st_mod.load(p).jobs["1"].phase == "admitted"
    p.unlink()
    same = st_mod.GovState(jobs={"1": st_mod.GangRecord("1", phase="admitted")})
    saved = st_mod.save_if_changed(same, p, saved)
    assert not p.exists()  # equal records: nothing written
    same.counters.released += 1
    saved = st_mod.save_if_changed(same, p, saved)
    assert st_mod.load(p).counters.released == 1
    changed = st_mod.GovState(
        jobs={"1": st_mod.GangRecord("1", phase="ready")}, counters=same.counters
    )
    st_mod.save_if_changed(changed, p, saved)
    assert st_mod.load(p).jobs["1"].phase == "ready"


def test_state_written_incrementally_loads_back_exactly(tmp_path):
    """save_if_changed reuses the bytes of unchanged records and appends changed ones to the
    log: what load() gives back must be the state, through added, changed, equal-but-new and
    gone records; the full file is what a full serialization gives (plus its log token)."""
    p = tmp_path / "state.json"
    recs = {str(i): st_mod.GangRecord(str(i), phase="pending", partition='p\n"x') for i in range(5)}
    st = st_mod.GovState(jobs=dict(recs))
    saved = st_mod.save_if_changed(st, p)
    on_disk = json.loads(p.read_bytes())
    assert on_disk.pop("log") == saved.token and on_disk == json.loads(st_mod.dumps(st))
    full = p.read_bytes()
    steps = [
        lambda j: j.update({"2": dataclasses.replace(j["2"], phase="admitted", admitted_at=1.5)}),
        lambda j: j.update({"7": st_mod.GangRecord("7", why="new \u00e9")}),
        lambda j: j.pop("0"),
        lambda j: j.update({"3": dataclasses.replace(j["3"])}),  # equal content, new object
    ]
    for step in steps:
        jobs = dict(st.jobs)
        step(jobs)
        st = st_mod.GovState(jobs=jobs, counters=st.counters)
        st.counters.released += 1  # so that every step writes
        saved = st_mod.save_if_changed(st, p, saved)
        assert p.read_bytes() == full  # the file stays; the log took the change
        back = st_mod.load(p)
        assert {k: r.__dict__ for k, r in back.jobs.items()} == {
            k: r.__dict__ for k, r in jobs.items()
        }
        assert back.counters == st.counters
    # a new process (no `last`) compacts: the whole file, the log gone
    st_mod.save_if_changed(st, p)
    assert not st_mod.log_path(p).exists()
    assert {k: r.__dict__ for k, r in st_mod.load(p).jobs.items()} == {
        k: r.__dict__ for k, r in st.jobs.items()
    }


def _recs(st):
    return {k: r.__dict__ for k, r in st.jobs.items()}, dataclasses.asdict(st.counters)


def _requeue(st, k):
    """The governor's requeue decision on gang *k* (count up), as decide() makes it: new
    record objects, the counter of evictions up."""
    jobs = dict(st.jobs)
    jobs[k] = dataclasses.replace(jobs[k], count=jobs[k].count + 1, phase="backoff")
    c = dataclasses.replace(
        st.counters, evicted={"PodsReadyTimeout|p": sum(r.count for r in jobs.values())}
    )
    return st_mod.GovState(jobs=jobs, counters=c, nodes=st.nodes)


def test_state_log_appends_only_the_changed_records(tmp_path):
    p = tmp_path / "state.json"
    st = st_mod.GovState(jobs={str(i): st_mod.GangRecord(str(i)) for i in range(1000)})
    saved = st_mod.save_if_changed(st, p)
    size = p.stat().st_size
    st = _requeue(st, "7")
    saved = st_mod.save_if_changed(st, p, saved)
    log = st_mod.log_path(p).read_bytes()
    assert p.stat().st_size == size and len(log) < 400, log
    assert b'"7":' in log and b'"8":' not in log
    assert st_mod.load(p).jobs["7"].count == 1


def test_state_log_compacted_when_it_outgrows_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(st_mod, "LOG_MIN_COMPACT", 0)
    p = tmp_path / "state.json"
    st = st_mod.GovState(jobs={str(i): st_mod.GangRecord(str(i)) for i in range(20)})
    saved = st_mod.save_if_changed(st, p)
    compactions = 0
    for n in range(60):
        st = _requeue(st, str(n % 20))
        before = saved.token
        saved = st_mod.save_if_changed(st, p, saved)
        compactions += saved.token != before
        assert _recs(st_mod.load(p)) == _recs(st)
        assert (
            st_mod.log_path(p).stat().st_size <= 2 * p.stat().st_size if saved.log_bytes else True
        )
    assert compactions >= 3


def test_state_write_cut_short_never_loses_or_double_counts_a_requeue(tmp_path):
    """A crash in the middle of appending a cycle's batch: at every cut point, load() gives
    the state before that cycle (its requeue never reached Slurm: the state is written
    first, so the restarted governor decides it again with the same count) or after it,
    never a mix, never a count applied twice. A process that goes on after a failed write
    (full disk) appends its next batch readably after the cut one."""
    p = tmp_path / "state.json"
    st0 = st_mod.GovState(jobs={str(i): st_mod.GangRecord(str(i)) for i in range(5)})
    saved = st_mod.save_if_changed(st0, p)
    st1 = _requeue(st0, "1")
    saved1 = st_mod.save_if_changed(st1, p, saved)
    st2 = _requeue(_requeue(st1, "2"), "1")  # one cycle: two requeues
    lp = st_mod.log_path(p)
    good = lp.read_bytes()
    st_mod.save_if_changed(st2, p, saved1)
    full = lp.read_bytes()
    assert full.startswith(good)
    for cut in range(len(good), len(full) + 1):
        lp.write_bytes(full[:cut])
        got = _recs(st_mod.load(p))
        assert got in (_recs(st1), _recs(st2)), cut
        assert got == (_recs(st2) if cut == len(full) else _recs(st1))
    # the process survived a cut write (ENOSPC): its next cycle appends after it, readably
    lp.write_bytes(full[: len(full) - 5])
    st3 = _requeue(st2, "3")
    st_mod.save_if_changed(st3, p, saved1)  # `last` is still what was last written in full
    assert _recs(st_mod.load(p)) == _recs(st3)
    # the log's own first write cut short: nothing in it was acted on
    lp.write_bytes(good[:10])
    assert _recs(st_mod.load(p)) == _recs(st0)


def test_stale_log_after_a_compaction_cut_short_is_ignored(tmp_path):
    """Crash between renaming the compacted file in and removing the old log: the old log
    is older than the file; replaying it would undo newer counts, so it is ignored."""
    p = tmp_path / "state.json"
    st = st_mod.GovState(jobs={str(i): st_mod.GangRecord(str(i)) for i in range(3)})
    saved = st_mod.save_if_changed(st, p)
    st = _requeue(st, "1")
    saved = st_mod.save_if_changed(st, p, saved)
    old_log = st_mod.log_path(p).read_bytes()
    st = _requeue(st, "1")  # count 2, written in full by a restarted governor
    st_mod.save_if_changed(st, p)
    st_mod.log_path(p).write_bytes(old_log)  # the unlink never happened
    assert st_mod.load(p).jobs["1"].count == 2
    # a file written by save() (no token) ignores any log as well
    st_mod.save(st, p)
    assert st_mod.load(p).jobs["1"].count == 2


def test_corrupt_log_batch_shape_is_an_error_naming_the_files(tmp_path):
    p = tmp_path / "state.json"
    st = st_mod.GovState(jobs={"1": st_mod.GangRecord("1")})
    saved = st_mod.save_if_changed(st, p)
    st_mod.save_if_changed(_requeue(st, "1"), p, saved)
    lp = st_mod.log_path(p)
    lp.write_bytes(lp.read_bytes() + b'\n{"jobs":[1]}')
    with pytest.raises(NodeforgeError, match="state.json.log"):
        st_mod.load(p)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["requeue", "add", "drop", "restart", "noop"]), st.integers(0, 9)
        ),
        max_size=40,
    ),
    compact_at=st.sampled_from([0, 200, 1 << 20]),
)
def test_state_log_property_load_is_the_last_saved_state(tmp_path_factory, ops, compact_at):
    p = tmp_path_factory.mktemp("s") / "state.json"
    old = st_mod.LOG_MIN_COMPACT
    st_mod.LOG_MIN_COMPACT = compact_at
    try:
        st = st_mod.GovState(jobs={str(i): st_mod.GangRecord(str(i)) for i in range(4)})
        saved = st_mod.save_if_changed(st, p)
        for op, x in ops:
            k = str(x)
            if op == "requeue" and k in st.jobs:
                st = _requeue(st, k)
            elif op == "add" and k not in st.jobs:
                st = st_mod.GovState(
                    jobs={**st.jobs, k: st_mod.GangRecord(k)}, counters=st.counters
                )
            elif op == "drop" and k in st.jobs:
                st = st_mod.GovState(
                    jobs={j: r for j, r in st.jobs.items() if j != k}, counters=st.counters
                )
            elif op == "restart":  # a new governor process: loads, then writes in full
                st = st_mod.load(p)
                saved = None
            saved = st_mod.save_if_changed(st, p, saved)
            assert _recs(st_mod.load(p)) == _recs(st)
    finally:
        st_mod.LOG_MIN_COMPACT = old


@pytest.mark.parametrize(
    "text",
    [
        "nfg-gang:n=1,phase=backoff,next=nan",
        "nfg-gang:n=99999999999,phase=backoff",
        "nfg-gang:n=1,phase=backoff,next=1e309",
        "nfg-gang:n=1,phase=Backoff\nJobId=9",
    ],
)
def test_admin_comment_token_out_of_grammar_is_ignored(text):
    from nodeforge.gang.events import decode_admin

    assert decode_admin(text) is None


def test_metrics_count_gangs_per_phase_and_partition():
    recs = [
        ("1", "pending", "a"),
        ("2", "waiting_admission", "a"),
        ("3", "backoff", "a"),
        ("4", "deactivated", "b"),
        ("5", "admitted", "b"),
        ("6", "ready", "b"),
        ("7", "recovering", ""),
        ("8", "done", "a"),
    ]
    st = st_mod.GovState(jobs={j: st_mod.GangRecord(j, phase=ph, partition=p) for j, ph, p in recs})
    lines = set(metrics.render(st).splitlines())
    assert {
        'kueue_pending_workloads{cluster_queue="a",status="active"} 2',
        'kueue_pending_workloads{cluster_queue="a",status="inadmissible"} 1',
        'kueue_pending_workloads{cluster_queue="b",status="inadmissible"} 1',
        'kueue_admitted_active_workloads{cluster_queue="b"} 2',
        'kueue_admitted_active_workloads{cluster_queue=""} 1',
        'nodeforge_gang_jobs{phase="done"} 1',
        'nodeforge_gang_jobs{phase="pending"} 1',
    } <= lines


def test_state_file_leaves_defaults_out_and_loads_every_record_back_exactly(tmp_path):
    p = tmp_path / "state.json"
    bare = st_mod.GangRecord("1")
    # values that equal a default only loosely (0 vs None, 0.0 vs None, False vs 0) stay
    full = st_mod.GangRecord(
        "2_3",
        phase="backoff",
        count=0,
        admitted_at=0.0,
        restarts_at_action=0,
        released_by_us=True,
        why='q"\n=',
        updated=5.5,
    )
    st = st_mod.GovState(jobs={"1": bare, "2_3": full})
    st_mod.save_if_changed(st, p)
    raw = json.loads(p.read_text())["jobs"]
    assert raw["1"] == {"job_id": "1"}  # nothing but the identity for a fresh record
    assert raw["2_3"]["admitted_at"] == 0.0 and raw["2_3"]["restarts_at_action"] == 0
    back = st_mod.load(p).jobs
    for k, r in st.jobs.items():
        assert back[k].__dict__ == r.__dict__
        assert {f: type(v) for f, v in back[k].__dict__.items()} == {
            f: type(v) for f, v in r.__dict__.items()
        }
