"""gang config validation, Slurm output parsing, state persistence, metrics, CLI status."""

from __future__ import annotations

import json

import pytest

from gang import config as gcfg
from gang import metrics
from gang import state as st_mod
from gang.slurm import expand_hostlist, job_from_record, node_flags, parse_records

pytestmark = pytest.mark.unit

JOB_LINE = (
    "JobId=42 JobName=train UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=0 Nice=0 "
    "Account=(null) QOS=normal JobState=PENDING Reason=job_requeued_in_held_state Dependency=(null) "
    "Requeue=1 Restarts=2 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED "
    "SubmitTime=2026-12-02T20:27:22 EligibleTime=2026-12-02T20:29:23 StartTime=2026-12-02T20:29:23 "
    "Partition=main AllocNode:Sid=vm:123 NodeList=gn[1-2],gc1 NumNodes=3 NumCPUs=3 "
    "AdminComment=ops nfg-gang:n=2,phase=deactivated,r=1 Comment=gang nfg-ready=1 "
    "Command=/tmp/job.sh WorkDir=/tmp Power="
)


def test_parse_job_line():
    (rec,) = parse_records(JOB_LINE + "\n\n")
    j = job_from_record(rec)
    assert (j.job_id, j.state, j.reason, j.restarts, j.num_nodes) == (
        "42",
        "PENDING",
        "job_requeued_in_held_state",
        2,
        3,
    )
    assert j.nodes == ("gn1", "gn2", "gc1")
    assert j.held and j.requeue
    assert j.admin_comment == "ops nfg-gang:n=2,phase=deactivated,r=1"
    assert j.comment == "gang nfg-ready=1"
    assert j.start_time is not None and j.partition == "main"


def test_no_requeue_and_interactive_not_requeueable():
    for tok in ("Requeue=0 BatchFlag=1", "Requeue=1 BatchFlag=0"):
        (rec,) = parse_records(f"JobId=1 JobState=RUNNING {tok} NumNodes=2")
        assert not job_from_record(rec).requeue


def test_node_flags_and_hostlist():
    assert node_flags("ALLOCATED+CLOUD+NOT_RESPONDING+POWERING_UP") >= {
        "POWERING_UP",
        "NOT_RESPONDING",
    }
    assert node_flags("DOWN*") == {"DOWN", "NOT_RESPONDING"}
    assert expand_hostlist("n[01-03,7],x") == ("n01", "n02", "n03", "n7", "x")
    assert expand_hostlist("(null)") == ()


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
    ],
)
def test_config_errors_name_file_and_key(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(gcfg.ConfigError) as ei:
        gcfg.load(p)
    assert str(p) in str(ei.value) and needle in str(ei.value)


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
    assert back.jobs["1"].count == 2 and back.counters.evicted == {"PodsReadyTimeout|main": 1}
    assert not [x for x in p.parent.iterdir() if x.name.startswith(".state-")]
    p.write_text("{broken")
    with pytest.raises(Exception, match="unreadable"):
        st_mod.load(p)


def test_metrics_text_has_kueue_names():
    st = st_mod.GovState()
    st.jobs["1"] = st_mod.GangRecord("1", phase="admitted", partition="main")
    metrics.inc_evicted(st, "PodsReadyTimeout", "main")
    txt = metrics.render(st, 0.01)
    assert 'kueue_evicted_workloads_total{cluster_queue="main",reason="PodsReadyTimeout"} 1' in txt
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
        "import sys; import gang.cli; bad=[m for m in sys.modules if m.split('.')[0] in "
        "('rich','hcl2','ansible','jinja2')]; print(bad); sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
