"""The controller's gang config through its params (`gang:`): checked by gang.yaml's own parser
at `params check` and at boot, written by the controller as /etc/nodeforge/gang.yaml, and read
back by the governor as the same config. Other roles check the key and ignore it.
"""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeforge import gang_config
from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.cli import main
from nodeforge.gang import config as gang_package_config
from tests.unit.support import COMPUTE, CTL, make

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
PROPS = settings(
    max_examples=150,
    deadline=2000,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
KEY = base64.b64encode(b"k" * 64).decode()
BASE = {"role": "controller", "cluster_name": "demo"}
GANG = {
    "timeout": "5m",
    "recovery_timeout": True,
    "requeuing": {"backoff_base_seconds": 30, "backoff_limit_count": 5},
    "gangs": {"min_nodes": 4, "partitions": ["train"], "comment_flag": "gang"},
    "probe": {"mode": "command", "command": ["nvidia-smi", "-L"]},
    "node_strike_limit": 2,
}


def test_the_governor_reads_gang_yaml_with_the_cores_parser():
    """The agent checks `gang` params with nodeforge/gang_config.py (it may not import gang/:
    pyproject's import-linter contract "bootstrap | gang"); the governor uses the same one."""
    assert gang_package_config.from_dict is gang_config.from_dict
    assert gang_package_config.load is gang_config.load


def test_gang_params_are_checked_and_kept_as_given():
    p = parse_params({**BASE, "gang": GANG}, "node.yaml")
    assert p.gang == GANG
    cfg = gang_config.from_dict(p.gang)
    assert (cfg.timeout, cfg.recovery_timeout, cfg.gangs.min_nodes) == (300.0, 300.0, 4)
    assert cfg.probe.command == ("nvidia-smi", "-L")
    assert parse_params(BASE, "node.yaml").gang is None
    assert parse_params({**BASE, "gang": None}, "node.yaml").gang is None
    assert parse_params({**BASE, "gang": {}}, "node.yaml").gang == {}


@pytest.mark.parametrize(
    ("gang", "says"),
    [
        (5, "gang: expected a mapping, got int"),
        ({"timout": 30}, "unknown key(s) 'gang.timout'; allowed here: block_admission,"),
        ({"requeuing": {"bogus": 1}}, "unknown key(s) 'gang.requeuing.bogus'"),
        ({"requeuing": []}, "'gang.requeuing' must be a mapping, got list"),
        ({"timeout": "5:00"}, "'gang.timeout': expected seconds"),
        ({"timeout": 0}, "'gang.timeout' must be > 0 seconds"),
        ({"timeout": "010"}, "'gang.timeout': expected seconds"),
        ({"timeout": float("nan")}, "'gang.timeout': must be a finite number of seconds"),
        (
            {"requeuing": {"backoff_base_seconds": 60, "backoff_max_seconds": 1}},
            "'gang.requeuing.backoff_max_seconds' (1.0) must be >= "
            "'gang.requeuing.backoff_base_seconds' (60.0)",
        ),
        ({"probe": {"mode": "always"}}, "'gang.probe.mode': must be one of none, command"),
        ({"gangs": {"min_nodes": "0x10"}}, "'gang.gangs.min_nodes': expected a non-negative"),
        ({"gangs": {"min_nodes": True}}, "'gang.gangs.min_nodes': expected a non-negative"),
        ({"gangs": {"partitions": ["a b"]}}, "'a b' is not a Slurm partition name"),
        ({"gangs": {"qos": ["hi\nx"]}}, "is not a Slurm QOS name"),
        ({"gangs": {"partitions": ["p"] * 65}}, "'gang.gangs.partitions': 65 items; at most 64"),
        ({"gangs": {"comment_flag": "a\nb"}}, "'gang.gangs.comment_flag': one token"),
        ({"probe": {"command": ["ok", "x\x1b[2J"]}}, "'gang.probe.command': 'x\\x1b[2J' is not"),
        ({"state_file": "relative/state.json"}, "'gang.state_file': an absolute path"),
        ({"event_log": "/var/log/../../etc/shadow"}, "'gang.event_log': an absolute path"),
        ({"metrics_file": "/var/lib/x\n"}, "'gang.metrics_file': an absolute path"),
        ({"deadlines": {"key": "Bad Key"}}, "'gang.deadlines.key': 1-32 characters"),
        (
            {"requeuing": {"jitter": 2}},
            "'gang.requeuing.jitter': expected a number between 0 and 1",
        ),
    ],
)
def test_a_bad_gang_value_names_the_source_and_gang_key(gang, says):
    with pytest.raises(ParamsError) as e:
        parse_params({**BASE, "gang": gang}, "/etc/nodeforge/node.yaml")
    msg = str(e.value)
    assert msg.startswith("/etc/nodeforge/node.yaml: ") and says in msg, msg
    assert len(msg) < 400 and "\n" not in msg


def test_a_huge_hostile_value_is_cut_in_the_error():
    with pytest.raises(ParamsError) as e:
        parse_params({**BASE, "gang": {"probe": {"mode": "x" * 100_000}}}, "user-data nodeforge")
    assert len(str(e.value)) < 300 and "'gang.probe.mode'" in str(e.value)


def test_a_compute_checks_the_key_too():
    """One params document shared by every role fails on every node when its gang is wrong."""
    node = {**COMPUTE, "munge_key": KEY}
    assert parse_params({**node, "gang": GANG}, "x").gang == GANG
    with pytest.raises(ParamsError, match=r"'gang.timeout'"):
        parse_params({**node, "gang": {"timeout": -1}}, "x")


# -- the agent: written on the controller, ignored elsewhere -----------------------------------
def test_controller_writes_gang_yaml_that_the_governor_reads_as_given(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**CTL, "gang": GANG})
    paths.systemd_lib[0].mkdir(parents=True)
    (paths.systemd_lib[0] / "nodeforge-gang.service").write_text("[Unit]\n")
    st = agent.init()
    assert st.status == "ready" and st.steps["role"].detail["gang_yaml"] == "written"
    f = paths.gang_yaml
    assert f == tmp_path / "etc/nodeforge/gang.yaml"
    assert stat.S_IMODE(f.stat().st_mode) == 0o644
    assert f.read_text().startswith("# Written by `nodeforge node init` from the node params'")
    assert gang_package_config.load(f) == gang_config.from_dict(GANG)
    assert fm.events[-1] == "enable nodeforge-gang.service"
    # the new file is read by a governor already running; a stopped one stays stopped
    assert ["systemctl", "try-restart", "--no-block", "nodeforge-gang.service"] in fm.calls


def test_controller_rewrites_gang_yaml_only_when_params_change_it(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**CTL, "gang": GANG})
    agent.init()
    before = paths.gang_yaml.stat().st_mtime_ns
    fm.reboot()
    st = agent.init()
    assert st.steps["role"].detail["gang_yaml"] == "unchanged"
    assert paths.gang_yaml.stat().st_mtime_ns == before
    paths.node_yaml.write_text(json.dumps({**CTL, "gang": {"timeout": 60}}))
    fm.reboot()
    st = agent.init()
    assert st.steps["role"].detail["gang_yaml"] == "written"
    assert gang_package_config.load(paths.gang_yaml).timeout == 60.0


def test_without_gang_params_an_existing_gang_yaml_is_left_alone(tmp_path):
    agent, _, paths, _ = make(tmp_path, CTL)
    paths.gang_yaml.parent.mkdir(parents=True, exist_ok=True)
    paths.gang_yaml.write_text("timeout: 90\n")
    st = agent.init()
    assert "gang_yaml" not in st.steps["role"].detail
    assert paths.gang_yaml.read_text() == "timeout: 90\n"


def test_compute_ignores_gang_and_says_so(tmp_path):
    agent, _, paths, _ = make(tmp_path, {**COMPUTE, "gang": GANG})
    st = agent.init()
    assert st.status == "ready"
    assert st.steps["params"].detail["gang"] == (
        "ignored: only the controller runs the gang governor"
    )
    assert not paths.gang_yaml.exists()


def test_a_bad_gang_fails_the_params_step_before_anything_is_written(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**CTL, "gang": {"timeout": "soon"}})
    with pytest.raises(Exception, match=r"node.yaml: 'gang.timeout': expected seconds"):
        agent.init()
    assert not paths.gang_yaml.exists() and fm.events == []


# -- params check: the same rules offline, from every source ------------------------------------
def _check(capsys, *argv):
    rc = main(["params", "check", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_params_check_node_yaml_with_gang(tmp_path, capsys):
    f = tmp_path / "node.yaml"
    f.write_text(yaml.safe_dump({**BASE, "gang": GANG}))
    f.chmod(0o600)
    rc, out, _ = _check(capsys, "--node-yaml", str(f), "--json")
    assert rc == 0 and json.loads(out)["params"]["gang"] == GANG
    f.write_text(yaml.safe_dump({**BASE, "gang": {"gangs": {"min_nodes": -1}}}))
    rc, out, err = _check(capsys, "--node-yaml", str(f))
    assert rc == 2 and out == ""
    assert err.startswith(f"nodeforge: error: {f}: 'gang.gangs.min_nodes': expected a non-neg")


def test_params_check_user_data_with_gang(tmp_path, capsys):
    ud = tmp_path / "user-data"
    ud.write_text("#cloud-config\nnodeforge:\n  role: controller\n  cluster_name: demo\n"
                  "  gang:\n    timeout: 2h\n    bogus: 1\n")  # fmt: skip
    rc, _, err = _check(capsys, "--user-data", str(ud))
    assert rc == 2
    assert f"{ud} nodeforge: unknown key(s) 'gang.bogus'" in err, err


def test_params_check_hyperpod_section_carries_gang_to_the_controller(tmp_path, capsys):
    rc_doc = {"InstanceGroups": [
        {"Name": "ctl", "Instances": [{"InstanceName": "a", "CustomerIpAddress": "10.0.0.1"}]},
        {"Name": "w", "Instances": [{"InstanceName": "b", "CustomerIpAddress": "10.0.0.2"}]},
    ]}  # fmt: skip
    pp = {
        "controller_group": "ctl",
        "worker_groups": [{"instance_group_name": "w", "partition_name": "dev"}],
        "nodeforge": {"gang": {"timeout": 600, "gangs": {"partitions": ["dev"]}}},
    }
    (tmp_path / "resource_config.json").write_text(json.dumps(rc_doc))
    (tmp_path / "provisioning_parameters.json").write_text(json.dumps(pp))
    rc, out, _ = _check(capsys, "--hyperpod", str(tmp_path), "--address", "10.0.0.1", "--json")
    assert rc == 0 and json.loads(out)["params"]["gang"]["timeout"] == 600
    pp["nodeforge"]["gang"]["timeout"] = "forever"
    (tmp_path / "provisioning_parameters.json").write_text(json.dumps(pp))
    rc, _, err = _check(capsys, "--hyperpod", str(tmp_path), "--address", "10.0.0.2")
    assert rc == 2 and "provisioning_parameters.json (HyperPod): 'gang.timeout'" in err, err


# -- properties ---------------------------------------------------------------------------------
HOSTILE = list("\n\r\t\x00\x1b\x7f\u2028 =#\"'\\%$(),:;.[]*@é/")
scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.sampled_from(list("abc019smh.:-_/") + HOSTILE), max_size=12),
    st.sampled_from(["5m", "010", "5:00", "1_000", "0x1f", "250ms", "/var/x", "..", "none"]),
)
KEYS = {
    "": ["timeout", "recovery_timeout", "block_admission", "not_requeueable", "seed",
         "interval_seconds", "command_timeout", "state_file", "event_log", "metrics_file",
         "node_strike_limit", "node_strike_window_seconds", "node_strike_max_drained", "x"],
    "requeuing": ["timestamp", "backoff_base_seconds", "backoff_max_seconds",
                  "backoff_limit_count", "backoff_limit_seconds", "backoff_limit_combine",
                  "jitter"],
    "gangs": ["min_nodes", "partitions", "qos", "comment_flag"],
    "probe": ["mode", "command", "timeout"],
    "deadlines": ["field", "key", "min_seconds", "max_seconds", "out_of_bounds"],
}  # fmt: skip
value = st.one_of(scalar, st.lists(scalar, max_size=3))


@st.composite
def hostile_gang(draw):
    top = draw(st.dictionaries(st.sampled_from(KEYS[""]), value, max_size=4))
    for sec in ("requeuing", "gangs", "probe", "deadlines"):
        if draw(st.booleans()):
            top[sec] = draw(
                st.one_of(st.dictionaries(st.sampled_from(KEYS[sec]), value, max_size=3), scalar)
            )
    return top


@PROPS
@given(hostile_gang())
def test_any_gang_value_is_refused_cleanly_or_written_and_read_back_the_same(
    tmp_path_factory, gang
):
    """Hostile values: a ParamsError naming the source and a `gang.` key, never another
    exception; what passes is written as YAML that the governor reads as the same config."""
    try:
        p = parse_params({**BASE, "gang": gang}, "src")
    except ParamsError as exc:
        msg = str(exc)
        assert msg.startswith("src: ") and "gang" in msg and "\n" not in msg, msg
        return
    text = yaml.safe_dump(p.gang, sort_keys=False)
    f = tmp_path_factory.mktemp("g") / "gang.yaml"
    f.write_text(text)
    assert gang_config.load(f) == gang_config.from_dict(gang)


@PROPS
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "timeout": st.one_of(
                st.integers(1, 10**6), st.sampled_from(["30s", "5m", "1h", "250ms", "1.5m"])
            ),
            "gangs": st.fixed_dictionaries(
                {},
                optional={
                    "min_nodes": st.integers(0, 1000),
                    "partitions": st.lists(
                        st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,10}", fullmatch=True),
                        max_size=3,
                    ),
                    "comment_flag": st.from_regex(r"[!-~]{0,10}", fullmatch=True),
                },
            ),
            "probe": st.fixed_dictionaries(
                {"mode": st.sampled_from(["none", "command"])},
                optional={"command": st.lists(st.text("ab -'\"é", min_size=1), max_size=3)},
            ),
            "state_file": st.from_regex(
                r"/[a-z]{1,8}(/[a-z0-9._-]{1,8}){0,3}", fullmatch=True
            ).filter(lambda s: not any(x in (".", "..") for x in s.split("/"))),
            "requeuing": st.fixed_dictionaries(
                {}, optional={"jitter": st.floats(0, 1), "backoff_limit_count": st.none()}
            ),
        },
    )
)
def test_valid_gang_values_pass_and_round_trip(tmp_path_factory, gang):
    p = parse_params({**BASE, "gang": gang}, "src")
    f = tmp_path_factory.mktemp("g") / "gang.yaml"
    f.write_text(yaml.safe_dump(p.gang, sort_keys=False))
    assert gang_config.load(f) == gang_config.from_dict(gang)


def test_the_documented_error_is_the_one_produced():
    """docs/gang.md's example error for `timeout: 5:00` in EC2 user-data, word for word."""
    doc = (REPO / "docs/gang.md").read_text()
    shown = next(ln.strip() for ln in doc.splitlines() if "'gang.timeout'" in ln)
    with pytest.raises(ParamsError) as e:
        parse_params({**BASE, "gang": {"timeout": "5:00"}}, "EC2 user-data (IMDSv2) nodeforge")
    assert str(e.value) == shown


def test_the_documented_gang_yaml_block_is_the_defaults():
    """docs/gang.md's gang.yaml block lists every key with the code's default."""
    from nodeforge import strict_yaml

    doc = (REPO / "docs/gang.md").read_text()
    block = doc.split("## Configuration: `/etc/nodeforge/gang.yaml`", 1)[1]
    block = block.split("```yaml\n", 1)[1].split("```", 1)[0]
    data = strict_yaml.load(block)
    assert gang_config.from_dict(data) == gang_config.GangConfig()
    fields = {f for f in gang_config.GangConfig.__dataclass_fields__}
    assert set(data) == fields
    for sec, cls in (("requeuing", gang_config.Requeuing), ("gangs", gang_config.Gangs),
                     ("probe", gang_config.Probe), ("deadlines", gang_config.Deadlines)):  # fmt: skip
        assert set(data[sec]) == set(cls.__dataclass_fields__), sec
