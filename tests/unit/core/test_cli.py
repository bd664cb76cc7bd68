"""The `nodeforge` CLI as a user meets it: help on every option, --json on reporting commands,
JUnit XML, exit statuses, and no traceback for input errors or a closed pipe (no root)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from nodeforge import cli
from tests.unit.support import run_cli

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _walk(parser: argparse.ArgumentParser, path: list[str]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, [*path, name])
        else:
            yield path, action


def test_every_option_and_argument_has_help():
    missing = [f"{' '.join(p)} {a.option_strings or a.dest}"
               for p, a in _walk(cli.build_parser(), ["nodeforge"]) if not a.help]  # fmt: skip
    assert missing == []


@pytest.mark.parametrize(
    "command",
    [
        ["validate"],
        ["versions", "lock"],
        ["versions", "show"],
        ["cluster", "down"],
        ["cluster", "status"],
        ["verify"],
        ["build"],
        ["gang", "status"],
    ],
)
def test_reporting_commands_take_json(command):
    parser = cli.build_parser()
    sub = parser
    for word in command:
        sub = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction)).choices[
            word
        ]
    assert any("--json" in a.option_strings for a in sub._actions), command


def test_closed_pipe_is_quiet_with_status_141(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "nodeforge", "versions", "show", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader is gone before the first write, like `| head -c0`
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == cli.EXIT_PIPE
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_verify_vm_params_file_missing_is_an_input_error(tmp_path):
    cp = run_cli("verify", "--hosts", "vm://X?params=missing.yaml", cwd=tmp_path)
    assert cp.returncode == cli.EXIT_INPUT
    assert "params=missing.yaml: cannot read it" in cp.stderr and "Traceback" not in cp.stderr


def test_unreadable_path_is_an_input_error_not_a_traceback(monkeypatch, capsys):
    def boom(args):
        raise FileNotFoundError(2, "No such file or directory", "/nope/node.yaml")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    ns = parser.parse_args(["versions", "show"])
    monkeypatch.setattr(
        parser, "parse_args", lambda argv=None: argparse.Namespace(**{**vars(ns), "func": boom})
    )
    assert cli.main([]) == cli.EXIT_INPUT
    assert "nodeforge: error: /nope/node.yaml: No such file or directory" in capsys.readouterr().err


def test_exit_statuses_are_documented():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    for code in (
        cli.EXIT_OK,
        cli.EXIT_FAILURE,
        cli.EXIT_INPUT,
        cli.EXIT_INTERRUPTED,
        cli.EXIT_PIPE,
    ):
        assert f"| {code} |" in section, code


def test_versions_lock_json(tmp_path):
    from nodeforge.images import versions

    f = tmp_path / "versions.yaml"
    f.write_text(versions.VERSIONS_FILE.read_text())
    mirror = tmp_path / "m"
    mirror.mkdir()
    for a in versions.load(f).all_artifacts():
        (mirror / a.file).write_bytes(a.file.encode())
    cp = run_cli("versions", "lock", "--versions-file", str(f), "--artifact-mirror", str(mirror),
             "--variant", "all", "--arch", "all", "--json", cwd=tmp_path)  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    out = json.loads(cp.stdout)
    assert out["versions_file"] == str(f)
    assert {a.url for a in versions.load(f).all_artifacts()} == set(out["pinned"])
    assert all(len(s) == 64 for s in out["pinned"].values())
    assert out["unpinned"] == []


def test_validate_json(tmp_path):
    cp = run_cli("validate", "--target", "local", "--json", cwd=tmp_path)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout)["local"]["valid"] is True


def test_cluster_down_json(monkeypatch, capsys):
    from nodeforge.lab import localcluster

    monkeypatch.setattr(localcluster.LocalCluster, "down", lambda self: ["ctl", "c001"])
    assert cli.main(["cluster", "down", "--name", "t", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"cluster": "t", "removed": ["ctl", "c001"]}


def test_verify_junit_xml_and_json(tmp_path, capsys):
    from nodeforge.lab import verify, verify_cli

    results = [
        verify.CheckResult("ctl", "controller", "test_common.py::test_munge", "passed", 0.5),
        verify.CheckResult(
            "ctl",
            "controller",
            "test_controller.py::test_ping",
            "failed",
            1.0,
            "scontrol ping: DOWN\nmore",
        ),
        verify.CheckResult("c1", "compute", "test_compute.py::test_gpu", "skipped", 0.0, "no GPU"),
    ]
    out = tmp_path / "r.xml"
    args = argparse.Namespace(junitxml=out, json=True)
    verify_cli._write_reports(args, results, [("c2", "ssh: connection refused")], 1.5)
    root = ET.fromstring(out.read_text())
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {"ctl", "c1", "c2"}
    assert suites["ctl"].get("tests") == "2" and suites["ctl"].get("failures") == "1"
    failure = root.find(".//testcase[@name='test_controller.py::test_ping']/failure")
    assert failure is not None and failure.get("message") == "scontrol ping: DOWN"
    assert root.find(".//testcase[@name='test_compute.py::test_gpu']/skipped") is not None
    assert root.find(".//testsuite[@name='c2']/testcase/error").text == "ssh: connection refused"
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["unreachable"] == [
        {"host": "c2", "reason": "ssh: connection refused"}
    ]
    assert [r["outcome"] for r in data["results"]] == ["passed", "failed", "skipped"]


def test_cluster_wait_reports_each_node_as_it_becomes_ready(monkeypatch, tmp_path):
    """`cluster up/add` progress: one line per node (stubbed Slurm and agent state, no root)."""
    from nodeforge.lab import localcluster as lc

    monkeypatch.setattr(lc, "STATE_ROOT", tmp_path)
    monkeypatch.setattr(lc, "_alive", lambda pid: True)
    lines: list[str] = []
    c = lc.Cluster("t", "img", "lower", "nfc-t", 0.0, [
        lc.Node("ctl", "controller", 2, "10.213.0.2", "ns-ctl", str(tmp_path / "ctl"), 1, 100.0),
        lc.Node("c001", "compute", 3, "10.213.0.3", "ns-c001", str(tmp_path / "c001"), 2, 100.0),
        lc.Node("c002", "compute", 4, "10.213.0.4", "ns-c002", str(tmp_path / "c002"), 3, 100.0),
    ])  # fmt: skip
    (tmp_path / "t").mkdir()
    polls = {"n": 0}

    from nodeforge.bootstrap.readiness import from_sinfo

    def node(short: str):
        return lc.SlurmNode(from_sinfo(short), short)

    def slurm_nodes(self, cluster):
        polls["n"] += 1  # c001 is idle at once, c002 one poll later (idle* first: not ready)
        return {"c001": node("idle"), "c002": node("idle" if polls["n"] > 2 else "idle*")}

    monkeypatch.setattr(lc.LocalCluster, "slurm_nodes", slurm_nodes)
    monkeypatch.setattr(lc.LocalCluster, "agent_state", lambda self, node: {"status": "ready"})
    monkeypatch.setattr(lc.time, "sleep", lambda s: None)
    lc.LocalCluster("t", progress=lines.append).wait_ready(c, ["c001", "c002"], timeout=60)
    assert [ln.split(":")[0] for ln in lines] == ["c001", "c002"]
    assert all("ready after" in ln for ln in lines), lines


def _drained_c001(monkeypatch, tmp_path, reason: str):
    """A stubbed two-node cluster (no root) whose c001 is DRAIN with *reason* in Slurm while
    its agent says ready, on a fake clock; returns (localcluster module, cluster, clock)."""
    from nodeforge.bootstrap.readiness import from_sinfo
    from nodeforge.lab import localcluster as lc

    monkeypatch.setattr(lc, "STATE_ROOT", tmp_path)
    monkeypatch.setattr(lc, "_alive", lambda pid: True)
    c = lc.Cluster("t", "img", "lower", "nfc-t", 0.0, [
        lc.Node("ctl", "controller", 2, "10.213.0.2", "ns-ctl", str(tmp_path / "ctl"), 1, 100.0),
        lc.Node("c001", "compute", 3, "10.213.0.3", "ns-c001", str(tmp_path / "c001"), 2, 100.0),
    ])  # fmt: skip
    (tmp_path / "t").mkdir()
    drained = {"c001": lc.SlurmNode(from_sinfo("drain"), "drain", reason)}
    monkeypatch.setattr(lc.LocalCluster, "slurm_nodes", lambda self, cl: drained)
    monkeypatch.setattr(lc.LocalCluster, "agent_state", lambda self, node: {"status": "ready"})
    clock = {"t": 0.0}
    monkeypatch.setattr(lc.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(lc.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))
    return lc, c, clock


def test_cluster_wait_names_a_health_drain_at_once(monkeypatch, tmp_path):
    """A node the health check drained (agent ready) fails the wait with its reason, not after
    the timeout with a bare state."""
    from nodeforge.bootstrap.health import REASON_PREFIX
    from nodeforge.errors import NodeforgeError

    reason = f"{REASON_PREFIX} disk: /var/lib/enroot 96% full"
    lc, c, clock = _drained_c001(monkeypatch, tmp_path, reason)
    with pytest.raises(NodeforgeError) as exc:
        lc.LocalCluster("t", progress=lambda m: None).wait_ready(c, ["c001"], timeout=60)
    assert str(exc.value) == f"node c001 is drained: {reason}"
    assert clock["t"] == 0.0  # at the first poll, not after the timeout


def test_cluster_wait_timeout_names_an_operator_drain_reason(monkeypatch, tmp_path):
    from nodeforge.errors import NodeforgeError

    lc, c, clock = _drained_c001(monkeypatch, tmp_path, "maint")
    with pytest.raises(NodeforgeError, match=r"c001 \(.*DRAIN.* reason='maint', agent ready\)"):
        lc.LocalCluster("t", progress=lambda m: None).wait_ready(c, ["c001"], timeout=60)
    assert clock["t"] > 60  # an operator's drain may be lifted: waited out the timeout


def _failing_c001(monkeypatch, tmp_path, final_reason: str, flip_after: int):
    """A stubbed cluster whose c001 agent is running hooks ("nodeforge: running hooks" in Slurm)
    until *flip_after* reads (of either kind) have happened; then, at once, the agent's drain
    with *final_reason* and its `failed` record (the agent's order: drain, then record)."""
    from nodeforge.bootstrap.readiness import RUNNING_HOOKS, from_sinfo

    lc, c, clock = _drained_c001(monkeypatch, tmp_path, RUNNING_HOOKS)
    reads = {"n": 0}
    failed = {
        "status": "failed",
        "steps": {"hooks": {"status": "failed", "error": "hook 50-dev failed (exit 1)\nmore"}},
    }

    def world():
        reads["n"] += 1
        return reads["n"] > flip_after

    def slurm_nodes(self, cluster):
        reason = final_reason if world() else RUNNING_HOOKS
        return {"c001": lc.SlurmNode(from_sinfo("drain"), "drain", reason)}

    def agent_state(self, node):
        return failed if world() else {"status": "running"}

    monkeypatch.setattr(lc.LocalCluster, "slurm_nodes", slurm_nodes)
    monkeypatch.setattr(lc.LocalCluster, "agent_state", agent_state)
    return lc, c, clock


@pytest.mark.parametrize("flip_after", [0, 1, 2, 3])
def test_cluster_wait_names_the_failure_reason_whenever_the_agent_fails(
    monkeypatch, tmp_path, flip_after
):
    """However the agent's failure falls between the wait's two reads, the error carries the
    failure's drain reason, never the transient "running hooks" (CI, stop 30: the rollout
    reported "node c002 is drained: nodeforge: running hooks")."""
    from nodeforge.errors import NodeforgeError

    final = "nodeforge: hook 50-dev failed (exit 1)"
    lc, c, _clock = _failing_c001(monkeypatch, tmp_path, final, flip_after)
    with pytest.raises(NodeforgeError) as exc:
        lc.LocalCluster("t", progress=lambda m: None).wait_ready(c, ["c001"], timeout=60)
    assert str(exc.value) == f"node c001 is drained: {final}"


def test_cluster_wait_names_the_failed_step_when_the_drain_did_not_get_through(
    monkeypatch, tmp_path
):
    """The agent failed but its drain with the reason never reached slurmctld: the error says
    the reason is stale and gives the failed step's first error line."""
    from nodeforge.bootstrap.readiness import RUNNING_HOOKS
    from nodeforge.errors import NodeforgeError

    lc, c, _clock = _failing_c001(monkeypatch, tmp_path, RUNNING_HOOKS, 0)
    with pytest.raises(NodeforgeError) as exc:
        lc.LocalCluster("t", progress=lambda m: None).wait_ready(c, ["c001"], timeout=60)
    assert str(exc.value) == (
        f"node c001 is drained (reason still {RUNNING_HOOKS!r}): its agent failed in step "
        "hooks: hook 50-dev failed (exit 1)"
    )


# -- light dispatch: `nodeforge node …` / `params …` build only bootstrap's parser -----------


@pytest.mark.parametrize(
    ("argv", "module"),
    [
        (["node", "init"], "nodeforge.bootstrap.cli"),
        (["-v", "node", "health", "--quiet"], "nodeforge.bootstrap.cli"),
        (["--verbose", "params", "check", "--cmdline", "x"], "nodeforge.bootstrap.cli"),
        (["--help"], None),
        (["--version", "node"], None),
        (["-h", "node", "init"], None),
        (["gang", "run"], None),
        (["versions", "show"], None),
        (["nodex", "init"], None),
        ([], None),
    ],
)
def test_light_module_only_for_the_node_commands(argv, module):
    assert cli.light_module(argv) == module


def _help_texts(parser: argparse.ArgumentParser, path: list[str]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub.format_help()
                yield from _help_texts(sub, [*path, name])


def test_light_parser_gives_the_same_node_and_params_commands_as_the_full_one():
    full = dict(_help_texts(cli.build_parser(), []))
    light = dict(_help_texts(cli.build_parser(("nodeforge.bootstrap.cli",)), []))
    assert set(light) >= {
        ("node", "init"),
        ("node", "health"),
        ("node", "status"),
        ("params", "check"),
    }
    assert {k: full[k] for k in light} == light  # same options, same help, same usage lines


def test_node_command_does_not_import_the_other_packages_clis(tmp_path):
    """`nodeforge node status` (as `node init` and slurmd's `node health`) runs with bootstrap's
    parser alone: the gang/images/lab CLIs are never imported on the node's boot path."""
    (tmp_path / "var/lib/nodeforge").mkdir(parents=True)  # a ready node's record
    (tmp_path / "var/lib/nodeforge/state.json").write_text('{"status": "ready"}')
    code = (
        "import sys\nfrom nodeforge import cli\n"
        f"rc = cli.main(['node', 'status', '--root', {str(tmp_path)!r}])\n"
        "print(sorted(m for m in sys.modules if m.endswith('cli') and m.startswith('nodeforge')))\n"
        "sys.exit(rc)\n"
    )
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, cwd=tmp_path)  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.strip().splitlines()[-1] == "['nodeforge.bootstrap.cli', 'nodeforge.cli']"


@pytest.mark.parametrize("argv", [["node", "init", "--bogus"], ["node"], ["node", "nope"]])
def test_light_parser_usage_errors_match_the_full_parser(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as full:
        cli.build_parser().parse_args(argv)
    expected = capsys.readouterr().err
    light = run_cli(*argv, cwd=tmp_path)  # the real command: light dispatch
    assert (light.returncode, light.stderr) == (full.value.code, expected) == (2, expected)
    assert expected.startswith("usage: nodeforge")


def _one_value_options(parser: argparse.ArgumentParser, path: list[str]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _one_value_options(sub, [*path, name])
        elif action.option_strings and action.nargs is None:
            yield parser, path, action


def test_every_one_value_option_takes_a_literal_double_dash(capsys):
    """`--opt=--` gave the option `[]` (argparse strips the `--`) and `versions lock --arch=--`
    crashed with a TypeError: every one-value option of every command now gets the value `--`,
    through its type and choices (a usage error where those refuse it), never a list."""
    cases = list(_one_value_options(cli.build_parser(), []))
    assert len(cases) > 50  # the walk reached the subcommands' options
    for parser, path, action in cases:
        try:
            value = parser._get_values(action, ["--"])
        except argparse.ArgumentError:  # its type or choices refuse '--': parse_args says so
            continue
        except SystemExit as exc:
            err = capsys.readouterr().err
            assert exc.code == 2 and "Traceback" not in err, (path, action.dest, err)
            continue
        assert not isinstance(value, list), (path, action.dest, value)
        assert value == (action.type("--") if callable(action.type) else "--")


def test_versions_lock_arch_double_dash_is_refused_naming_the_architecture(capsys, tmp_path):
    rc = cli.main(["versions", "lock", "--versions-file", str(tmp_path / "none.yaml"), "--arch=--"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("copy", "msg"),
    [
        ("SRC:/../../root/.bashrc", "not a safe relative name"),
        ("SRC:/etc/../../x", "not a safe relative name"),
        ("SRC:relative/dest", "expected SRC:/absolute/dest"),
        ("SRC", "expected SRC:/absolute/dest"),
        ("SRC:/etc//x", "not a safe relative name"),
    ],
)
def test_cluster_copy_destination_stays_inside_the_node(tmp_path, copy, msg):
    """`cluster up/add/replace/rollout --copy SRC:DEST` writes DEST inside a node's root: a
    destination that could lead out (onto the host) is refused before any node starts."""
    from nodeforge.errors import NodeforgeError
    from nodeforge.lab import cluster_cli

    src = tmp_path / "f"
    src.write_text("x")
    args = argparse.Namespace(params=None, copy=[copy.replace("SRC", str(src))])
    with pytest.raises(NodeforgeError, match=msg):
        cluster_cli._inputs(args)


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        ("a: &x [1]\nb: *x\n", "anchor"),
        ("[" * 200 + "]" * 200, "nested deeper"),
        ("- 1\n", "expected a mapping"),
        ("a: [\n", "--params"),
    ],
)
def test_cluster_params_file_is_parsed_strictly(tmp_path, text, msg):
    from nodeforge.errors import NodeforgeError
    from nodeforge.lab import cluster_cli

    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(NodeforgeError, match=msg) as exc:
        cluster_cli._inputs(argparse.Namespace(params=f, copy=[]))
    assert str(exc.value).startswith(f"--params {f}")


def test_cluster_params_syntax_error_never_quotes_the_line(tmp_path):
    """A YAML syntax error on the line that holds a munge key names the position only."""
    from nodeforge.errors import NodeforgeError
    from nodeforge.lab import cluster_cli

    secret = "c2VjcmV0LW11bmdlLWtleS1kby1ub3QtcHJpbnQ="
    f = tmp_path / "p.yaml"
    for text in (f'munge_key: "{secret}\n', f"munge_key: {secret}: [\n"):
        f.write_text(text)  # PyYAML's own message quotes the head, or the tail, of that line
        with pytest.raises(NodeforgeError, match=r"line 1") as exc:
            cluster_cli._inputs(argparse.Namespace(params=f, copy=[]))
        shown = str(exc.value)
        assert not any(secret[i : i + 8] in shown for i in range(len(secret) - 7)), shown
