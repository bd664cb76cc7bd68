"""The docs' own examples, run (issue 27): every example file and example block in the docs is
checked with the command the docs give for it, in-process through the real CLI entry point, and
every error message the docs show is produced by the code and compared with the docs' text.

The inventory test fails when the docs gain an example (a YAML/JSON/HCL block, a file under
docs/hyperpod/ or extensions/) that nothing here or in a named test module checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from nodeforge import gang_config
from nodeforge.bootstrap import failures
from nodeforge.bootstrap.contain import GroupResult
from nodeforge.bootstrap.hooks import HookError, discover
from nodeforge.bootstrap.params import Params, parse_params
from nodeforge.bootstrap.paths import Paths
from nodeforge.bootstrap.readiness import Gate
from nodeforge.cli import build_parser, main
from nodeforge.images import varfile
from nodeforge.lab.verify import CheckResult, format_report
from tests.helpers import REPO, http_server, routes_handler
from tests.unit.project.docs_support import DOCS, DocCommand, block, doc_commands, fences, subparser
from tests.unit.support import FakeHost, hook_params, runner, script

pytestmark = pytest.mark.unit


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- the inventory ------------------------------------------------------------------------------

# Example blocks (doc, first word of the block) -> the test that runs it.
EXAMPLE_BLOCKS = {
    ("README.md", "scrape_configs:"): "test_readme_scrape_job_targets_the_default_metrics_port",
    ("docs/deploy.md", "#cloud-config"): "test_user_data_examples_pass_params_check",
    ("docs/gang.md", "#cloud-config"): "test_user_data_examples_pass_params_check",
    ("docs/gang.md", "timeout:"): "test_gang_yaml_blocks_load_as_gang_yaml",
    ("docs/gang.md", "probe:"): "test_gang_yaml_blocks_load_as_gang_yaml",
    ("docs/hyperpod.md", '"nodeforge":'): "test_hyperpod_hook_fragment_is_the_example_files",
    ("extensions/README.md", "hooks:"): "test_extensions_hooks_block_passes_params_check",
}
# Example files -> where they run: a test here, or a named module (which must name the file).
EXAMPLE_FILES = {
    "docs/hyperpod/create-cluster.json": "test_hyperpod_example.py",
    "docs/hyperpod/hyperpod.pkrvars.hcl": "test_readme_var_files_pass_nodeforges_check",
    "docs/hyperpod/lifecycle/on_create.sh": "test_hyperpod_example.py",
    "docs/hyperpod/lifecycle/provisioning_parameters.json": "test_hyperpod_check_runs_as_documented",
    "docs/hyperpod/resource_config.example.json": "test_hyperpod_check_runs_as_documented",
    "docs/hyperpod/site/on_init_complete.sh": "test_hyperpod_site_extension_runs_as_a_hook",
    "extensions/10-cluster-users": "test_hooks_extensions.py",
    "extensions/20-shared-fs": "test_hooks_extensions.py",
    "extensions/50-enroot-warm": "test_hooks_extensions.py",
}
README = REPO / "README.md"
DATA_FENCES = {"yaml", "yml", "json", "hcl", "toml", "ini"}


def test_every_example_is_checked():
    blocks = {
        (str(d.relative_to(REPO)), content.split()[0])
        for d in DOCS
        for info, content, _ in fences(d)
        if info.split(" ")[0] in DATA_FENCES
    }
    assert blocks == set(EXAMPLE_BLOCKS), "an example block with no check (add one here)"
    files = {
        str(p.relative_to(REPO))
        for p in [*REPO.glob("docs/hyperpod/**/*"), *REPO.glob("extensions/*")]
        if p.is_file() and p.name != "README.md"
    }
    assert files == set(EXAMPLE_FILES), "an example file with no check (add one here)"
    here = Path(__file__).read_text()
    for f, where in {**EXAMPLE_FILES, **{str(k): v for k, v in EXAMPLE_BLOCKS.items()}}.items():
        if where.endswith(".py"):
            (test,) = (REPO / "tests/unit").rglob(where)  # (in the folder of its part)
            assert Path(f).name in test.read_text(), (f, where)
        else:
            assert f"def {where}(" in here, (f, where)


# -- example blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "doc, marker, expect",
    [
        ("docs/deploy.md", "role: compute", ["role: compute", "script: on_init.sh"]),
        ("docs/gang.md", "role: controller", ["role: controller", "gang:\n  timeout: 10m"]),
    ],
)
def test_user_data_examples_pass_params_check(tmp_path, capsys, doc, marker, expect):
    """The docs' `nodeforge params check --user-data FILE` on the docs' own user-data."""
    f = tmp_path / "user-data"
    f.write_text(block(doc, marker))
    rc, out, err = cli(capsys, "params", "check", "--user-data", str(f))
    assert (rc, err) == (0, ""), err
    assert out.startswith("valid node params (user-data)")
    for e in expect:
        assert e in out


def test_extensions_hooks_block_passes_params_check(tmp_path, capsys):
    """extensions/README.md's `hooks:` reference block, in a node.yaml: every hook shape it
    shows (https with a sha256, plain http with one, file, s3 object, s3 prefix + script)."""
    f = tmp_path / "node.yaml"
    f.write_text(
        "role: compute\ncluster_name: demo\ncontroller: {host: ctl, address: 10.0.0.2}\n"
        + block("extensions/README.md", "hooks:\n  - uri:")
    )
    rc, out, err = cli(capsys, "params", "check", "--node-yaml", str(f), "--json")
    assert (rc, err) == (0, ""), err
    hooks = json.loads(out)["params"]["hooks"]
    assert [h["uri"].split(":", 1)[0] for h in hooks] == ["https", "http", "file", "s3", "s3"]
    assert hooks[-1]["script"] == "on_create.sh" and hooks[-1]["name"] == "60-lifecycle"


def test_gang_yaml_blocks_load_as_gang_yaml(tmp_path):
    """gang.md's config block and its collective-preflight fragment are valid gang.yaml, read
    by the governor's own loader (the first one equals the defaults: test_params_gang.py)."""
    for marker in ("timeout: 300", "mode: collective"):
        f = tmp_path / "gang.yaml"
        f.write_text(block("docs/gang.md", marker))
        cfg = gang_config.load(f)
    assert cfg.probe.mode == "collective" and cfg.node_strike_limit == 3
    assert cfg.probe.min_bandwidth_mb_s == 500 and cfg.probe.max_latency_ms == 2


def test_hyperpod_hook_fragment_is_the_example_files():
    """hyperpod.md's `"nodeforge": {...}` fragment is what provisioning_parameters.json holds."""
    fragment = json.loads("{" + block("docs/hyperpod.md", '"nodeforge": {"hooks"') + "}")
    example = json.loads(
        (REPO / "docs/hyperpod/lifecycle/provisioning_parameters.json").read_text()
    )
    assert fragment["nodeforge"]["hooks"] == example["nodeforge"]["hooks"]


def test_readme_scrape_job_targets_the_default_metrics_port():
    """README's Prometheus job scrapes the port nodes serve on by default (`metrics_listen`),
    on the local cluster's node names."""
    job = yaml.safe_load(block("README.md", "scrape_configs:"))["scrape_configs"][0]
    targets = job["static_configs"][0]["targets"]
    default = Params.__dataclass_fields__["metrics_listen"].default
    port = default.rsplit(":", 1)[1]
    assert targets == [f"ctl:{port}", f"c001:{port}", f"c002:{port}"]


def test_readme_var_files_pass_nodeforges_check(tmp_path):
    """README's `cat > aws.pkrvars.hcl <<'EOF'` file and docs/hyperpod/hyperpod.pkrvars.hcl:
    the check `build --var-file` runs before Packer (names, types) passes for amazon-ebs."""
    sh = block("README.md", "cat > aws.pkrvars.hcl")
    body = re.search(r"<<'EOF'\n(.*?)\nEOF\n", sh, re.S)
    assert body, "README's heredoc moved"
    f = tmp_path / "aws.pkrvars.hcl"
    f.write_text(body.group(1) + "\n")
    assert varfile.load(f, "amazon-ebs") == {
        "region": "eu-west-1",
        "instance_type": "c6i.xlarge",
        "subnet_id": "subnet-0123456789abcdef0",
    }
    hp = varfile.load(REPO / "docs/hyperpod/hyperpod.pkrvars.hcl", "amazon-ebs")
    assert hp["encrypt_boot"] is False


# -- documented commands, run ------------------------------------------------------------------


def test_hyperpod_check_runs_as_documented(tmp_path, capsys):
    """hyperpod.md's check block, as written (its /tmp/hp is a temporary directory here): the
    copy commands run in a shell from the checkout, the check itself in-process."""
    sh = block("docs/hyperpod.md", "params check --hyperpod").replace("/tmp/hp", str(tmp_path))
    lines = [ln for ln in re.sub(r"\\\n\s*", " ", sh).splitlines() if ln.strip()]
    copy = next(ln for ln in lines if ln.startswith("mkdir"))
    subprocess.run(["bash", "-c", copy], cwd=REPO, check=True, timeout=30)
    check = next(ln for ln in lines if "params check" in ln)
    argv = shlex.split(check, comments=True)
    assert argv[0] == ".venv/bin/nodeforge"
    rc, out, err = cli(capsys, *argv[1:], "--json")
    assert (rc, err) == (0, ""), err
    p = json.loads(out)["params"]
    assert p["role"] == "compute" and p["cluster_name"] == "demo"
    # hyperpod.md: the worker group's partition_name becomes the compute's feature
    assert p["hooks"][0]["name"] == "60-site" and p["features"] == ["cpu"]


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_node_status_on_a_machine_that_is_not_a_node(tmp_path, capsys, json_flag):
    """operate.md/agent.md: `nodeforge node status` (and `--json`) exits 1 with `this machine is
    not a nodeforge node` where there is neither state.json nor image.json."""
    rc, out, err = cli(capsys, "node", "status", "--root", str(tmp_path), *json_flag)
    assert rc == 1 and out == ""
    assert err.startswith("nodeforge: this machine is not a nodeforge node: no ")
    for doc in ("docs/operate.md", "docs/agent.md"):
        text = " ".join((REPO / doc).read_text().split())
        assert "and 1 with `this machine is not a nodeforge node`" in text, doc


def test_hyperpod_site_extension_runs_as_a_hook(tmp_path):
    """docs/hyperpod/site/on_init_complete.sh, run by the agent's hook runner with the env the
    agent gives it: exit 0, and it says which node it ran on."""
    paths = Paths.under(tmp_path / "root")
    paths.params_json.parent.mkdir(parents=True)
    paths.params_json.write_text('{"extra": {}}')
    src = tmp_path / "site" / "on_init_complete.sh"
    src.parent.mkdir()
    src.write_bytes((REPO / "docs/hyperpod/site/on_init_complete.sh").read_bytes())
    src.chmod(0o755)
    report = runner(paths).run_all(discover(paths, hook_params(hooks=[f"file://{src}"])))
    assert report.ok, report.failure
    log = (paths.hooks_log_dir / "on_init_complete.sh.log").read_text()
    assert "site extension on c1 (compute) of demo" in log


# -- documented errors, produced -----------------------------------------------------------------


def _drain_reason(reason: str) -> str:
    """The Reason= the agent gives scontrol for a failed hook (Gate.fail, as agent._drain)."""
    host = FakeHost()
    Gate(host, "c1", Path("/run/nodeforge/slurm.conf")).fail(reason)
    (reason_arg,) = [a for a in host.calls[-1] if a.startswith("Reason=")]
    return reason_arg.removeprefix("Reason=")


def test_extensions_drain_reasons_are_the_ones_produced(tmp_path, monkeypatch):
    """extensions/README.md's `sinfo -R` reasons, each made by the hook runner from a real
    failing hook (the timeout's 600 s from a fixture attempt result: nobody waits 10 min)."""
    shown = block("extensions/README.md", "nodeforge: hook 20-shared-fs").splitlines()
    paths = Paths.under(tmp_path / "root")
    paths.params_json.parent.mkdir(parents=True)
    paths.params_json.write_text("{}")
    src = tmp_path / "src"
    got: list[str] = []

    def fail_of(hooks: list[dict], retries: int = 0) -> str:
        report = runner(paths).run_all(
            discover(paths, hook_params(hooks=hooks, hook_retries=retries))
        )
        assert not report.ok
        return _drain_reason(report.failure.reason)

    shared_fs = script(src / "20-shared-fs", "exit 3\n")
    got.append(fail_of([f"file://{shared_fs}"], retries=2))
    once = fail_of([f"file://{shared_fs}"])  # operate.md's example: no retries
    assert f"`{once}`" in " ".join((REPO / "docs/operate.md").read_text().split())
    warm = script(src / "50-enroot-warm", "exit 0\n")
    with monkeypatch.context() as m:
        timed_out = GroupResult(returncode=-9, timed_out=True, duration=600.0)  # FIXTURE
        m.setattr(type(runner(paths)), "_attempt", lambda *a, **k: timed_out)
        got.append(fail_of([{"uri": f"file://{warm}", "timeout": 600}]))
    users = script(src / "10-cluster-users", "kill -KILL $$\n")
    got.append(fail_of([f"file://{users}"]))
    site = script(src / "20-site", "exit 0\n")
    got.append(fail_of([{"uri": f"file://{site}", "sha256": "0" * 64}]))
    with http_server(routes_handler({})) as base:
        got.append(fail_of([{"uri": f"{base}/h/40-net.sh", "sha256": "0" * 64}], retries=2))
    baked = script(paths.on_init_d / "10-x", "exit 0\n", mode=0o775)
    with pytest.raises(HookError) as refused:
        discover(paths, hook_params())
    assert baked.is_relative_to(paths.root)
    # the docs show the node's own paths: this test's root is a temporary directory
    got.append(_drain_reason(str(refused.value).splitlines()[0].replace(str(paths.root), "")))
    assert got == shown
    # the symlink refusal the trust section shows
    baked.unlink()
    outside = script(paths.root / "tmp/x", "exit 0\n")
    baked.symlink_to(outside)
    with pytest.raises(HookError) as refused:
        discover(paths, hook_params())
    reason = _drain_reason(str(refused.value).splitlines()[0].replace(str(paths.root), ""))
    assert f"`{reason}`" in " ".join((REPO / "extensions/README.md").read_text().split())


def test_readme_bootstrap_summary_is_the_one_produced():
    """README's `cluster up` summary of failed first boots: made by the summary code from two
    nodes' state.json as the agent writes a failed hooks step (error = reason; see log)."""
    readme = (REPO / "README.md").read_text()
    shown = re.search(r"`(bootstrap: step hooks failed on [^`]*)`", readme)
    assert shown, "README's summary example moved"
    log = Paths().hooks_log_dir / "10-mirror.log"
    states = {
        node: {
            "status": "failed",
            "steps": {
                "hooks": {
                    "status": "failed",
                    "ended": at,
                    "error": f"hook 10-mirror failed (exit 6); see {log}",
                }
            },
        }
        for node, at in (("c003", 10.0), ("c004", 11.0))
    }
    (line,) = failures.lines(failures.summarize(states))
    assert line == shown.group(1)


def test_verify_report_is_the_one_produced():
    """verify.md's failing report, made by the report code from 34 results on one host."""
    shown = block("docs/verify.md", "verify: FAILED")
    msg = "/etc/slurm/slurmdbd.conf: 644 root (want 600 slurm)"
    check = "test_controller.py::test_slurmdbd_conf_secret"
    assert "def test_slurmdbd_conf_secret(" in (REPO / "tests/infra/test_controller.py").read_text()
    results = [CheckResult("ctl", "controller", check, "failed", 1.0, msg)]
    results += [CheckResult("ctl", "controller", f"c::p{i}", "passed", 1.0) for i in range(21)]
    results += [CheckResult("ctl", "controller", f"c::s{i}", "skipped", 0.0) for i in range(12)]
    assert format_report(results, {"ctl": 38.2}) + "\n" == shown


@pytest.mark.parametrize(
    "doc, field, value",
    [
        ("docs/agent.md", "hooks", ["file:///opt/a", {"uri": "file:///opt/b", "sha256": "3f1c"}]),
        ("docs/agent.md", "cpus", "010"),
        ("docs/agent.md", "features", ["gpu\nNodeName=x"]),
    ],
)
def test_agent_md_params_errors_are_the_ones_produced(tmp_path, capsys, doc, field, value):
    """agent.md's params errors (shown for /etc/nodeforge/node.yaml), from `params check`."""
    f = tmp_path / "node.yaml"
    base = {"role": "compute", "cluster_name": "demo", "controller": "ctl"}
    f.write_text(yaml.safe_dump({**base, field: value}).replace("'010'", "010"))
    rc, out, err = cli(capsys, "params", "check", "--node-yaml", str(f))
    assert rc == 2 and out == ""
    got = err.removeprefix("nodeforge: error: ").strip().replace(str(f), "/etc/nodeforge/node.yaml")
    text = " ".join((REPO / doc).read_text().split())
    assert got in text or got.removeprefix("/etc/nodeforge/node.yaml: ") in text, got


def test_agent_md_secret_error_is_the_one_produced():
    """agent.md's munge_key error: names the rule, never the value."""
    text = " ".join((REPO / "docs/agent.md").read_text().split())
    shown = re.search(r"`(munge_key: contains a control character[^`]*)`", text)
    assert shown
    key = "A" * 44 + "\n"
    with pytest.raises(Exception) as e:
        parse_params(
            {"role": "compute", "cluster_name": "d", "controller": "c", "munge_key": key}, "f"
        )
    assert str(e.value) == f"f: {shown.group(1)}" and key.strip() not in str(e.value)


# -- every documented command: run here, or why not ----------------------------------------------

# Commands that need what the unit tier lacks (root, a built image, booted nodes, Slurm, the
# network): their flags parse (test_docs.py) and each runs in the tier named.
NOT_OFFLINE = {
    ("build",): "root, the Debian mirror, Packer (AWS for amazon-ebs): e2e builds, bench/README.md",
    ("cluster",): "root and a built image: the e2e tier's local clusters, bench/README.md",
    ("verify",): "booted nodes: the e2e tier (nspawn://, vm://, ssh://)",
    ("validate",): "Packer's own validate: test_cli.py, test_images_template.py",
    ("versions", "lock"): "downloads (or a mirror): test_versions_lock_variant.py, FIXTURE mirror",
    ("node", "init"): "a machine booted from the image: the e2e tier",
    ("node", "health"): "a node's slurmd and munge: the e2e tier",
    ("node", "gave-up"): "systemd's OnFailure= on a node: test_agent_gave_up.py, the e2e faults",
    ("node", "rejoin"): "nodeforge-rejoin.timer on a node: test_agent_rejoin.py, the e2e faults",
    ("gang", "run"): "a controller's slurmctld: the e2e tier",
    ("gang", "ready"): "a Slurm job's allocation: the e2e tier",
    ("gang",): "the command group, named in prose",
}
# Offline commands, run in-process; each with the test-only options that point it at this
# test's files instead of the machine's (a node's root, a gang state file, a build cache).
OFFLINE = {
    ("node", "status"): ("--root", "{tmp}/not-a-node"),
    ("params", "check"): (),
    ("versions", "show"): (),
    ("render",): (),
    ("gang", "status"): ("--config", "{tmp}/gang.yaml"),
    ("cache", "ls"): ("--cache-dir", "{tmp}/cache"),
    ("cache", "prune"): ("--cache-dir", "{tmp}/cache"),
    (): (),  # `nodeforge --version`
}
# A template's placeholders, filled with the docs' own example files.
FILL = {
    "FILE": "{tmp}/user-data",  # docs/deploy.md's user-data
    "node.yaml": "{tmp}/node.yaml",  # the same params as a node.yaml
    "/tmp/hp": "{tmp}/hp",  # hyperpod.md's copy of docs/hyperpod/
    "/opt/ml/config": "{tmp}/hp",
    "T": "amazon-ebs",
    "[--json]": "--json",
    "[--all]": "--all",
    "[--max-size": "--max-size",  # `[--max-size 20G | --all]`: the first choice
}
COMMANDS = doc_commands()


def _key(parser, argv: tuple[str, ...]) -> tuple[str, ...]:
    path = tuple(subparser(parser, argv)[1])
    keys = [k for k in (*NOT_OFFLINE, *OFFLINE) if k and path[: len(k)] == k]
    return max(keys, key=len) if keys else path


def _examples(tmp: Path) -> None:
    """The docs' example files where FILL points."""
    (tmp / "user-data").write_text(block("docs/deploy.md", "role: compute"))
    params = yaml.safe_load((tmp / "user-data").read_text())["nodeforge"]
    (tmp / "node.yaml").write_text(yaml.safe_dump(params))
    hp = tmp / "hp"
    hp.mkdir()
    hp_src = REPO / "docs/hyperpod"
    (hp / "provisioning_parameters.json").write_bytes(
        (hp_src / "lifecycle/provisioning_parameters.json").read_bytes()
    )
    (hp / "resource_config.json").write_bytes(
        (hp_src / "resource_config.example.json").read_bytes()
    )
    (tmp / "gang.yaml").write_text(
        f"state_file: {tmp}/gang/state.json\nevent_log: {tmp}/gang/events.jsonl\n"
        f"metrics_file: {tmp}/gang/metrics.prom\n"
    )
    (tmp / "cache").mkdir()


def _run_offline(capsys, tmp: Path, cmd: DocCommand) -> tuple[list[str], int, str, str] | None:
    """*cmd* as documented, placeholders filled; None when the docs only mention it (it does not
    parse as a whole, e.g. `nodeforge params check` in a sentence)."""
    parser = build_parser()
    argv = [FILL.get(a, a).format(tmp=tmp) for a in cmd.argv]
    argv += [a.format(tmp=tmp) for a in OFFLINE[_key(parser, cmd.argv)]]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return None
        capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:  # --version
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return argv, rc, out, err


def _expect(key: tuple[str, ...], rc: int, out: str, err: str) -> bool:
    if key == ("node", "status"):
        return rc == 1 and err.startswith("nodeforge: this machine is not a nodeforge node")
    if key == ("params", "check"):
        return rc == 0 and ('"params"' in out or out.startswith("valid node params"))
    if key == ("versions", "show"):
        return rc == 0 and "enroot_deb" in out and "pyxis_src" in out
    if key == ("render",):
        return rc == 0 and 'source "amazon-ebs" "node"' in out
    if key == ("gang", "status"):
        return rc == 0 and (out.startswith("no gang jobs (state: ") or '"gangs": []' in out)
    if key == ("cache", "ls"):
        return rc == 0 and "0 entries, 0.00 GiB in " in out + err
    if key == ("cache", "prune"):
        return rc == 0 and "pruned 0 entries from " in out + err
    return key == () and rc == 0 and out.startswith("nodeforge ")


def test_every_documented_command_runs_here_or_says_where(tmp_path, capsys):
    """Every `nodeforge …` in the docs (code blocks and inline code) is either run here, as
    written with the docs' example files, and gives the documented outcome, or is one that
    needs a machine the unit tier is not (NOT_OFFLINE says which tier runs it)."""
    _examples(tmp_path)
    parser = build_parser()
    ran, mentioned, bad = [], [], []
    for cmd in COMMANDS:
        key = _key(parser, cmd.argv)
        if key in NOT_OFFLINE:
            continue
        assert key in OFFLINE, f"{cmd.where}: `{cmd.text}`: neither run here nor NOT_OFFLINE"
        if cmd.template and any(
            a not in FILL and DocCommand("", (a,), "").template for a in cmd.argv
        ):
            mentioned.append(cmd)  # a placeholder with no example file to fill it
            continue
        res = _run_offline(capsys, tmp_path, cmd)
        if res is None:
            mentioned.append(cmd)
            continue
        argv, rc, out, err = res
        ran.append(cmd)
        if not _expect(key, rc, out, err):
            bad.append(
                f"{cmd.where}: `{cmd.text}` -> nodeforge {shlex.join(argv)}: exit {rc}\n{err}"
            )
    assert not bad, "\n".join(bad)
    # the count issue 27 reports; a drop means a documented command stopped being run
    assert len(ran) >= 29, [c.where for c in ran]
    assert {_key(parser, c.argv) for c in ran} == set(OFFLINE)
    left = sorted({c.text for c in mentioned})
    assert left == sorted(MENTIONED_ONLY), left


# Offline commands the docs only mention or show with a placeholder no example file fills.
MENTIONED_ONLY = {
    "nodeforge params check",
    "nodeforge … | head",  # any command
}


def test_readme_progress_line_is_the_one_produced(monkeypatch, tmp_path, capsys):
    """README's `cluster up` progress example, made by the cluster's wait (Slurm and the agent's
    state stubbed: FIXTURE values of a real run) and printed by the CLI's progress writer."""
    from nodeforge.bootstrap.readiness import from_flags
    from nodeforge.lab import cluster_cli
    from nodeforge.lab import localcluster as lc

    shown = re.search(r"`(\[\d\d:\d\d:\d\d\] c001: ready after [^`]*)`", README.read_text())
    assert shown, "README's progress example moved"
    monkeypatch.setattr(lc, "STATE_ROOT", tmp_path)
    monkeypatch.setattr(lc, "_alive", lambda pid: True)
    (tmp_path / "t").mkdir()
    node = lc.Node("c001", "compute", 3, "10.213.0.3", "ns-c001", str(tmp_path / "c001"), 2, 1000.0)
    c = lc.Cluster("t", "img", "lower", "nfc-t", 0.0, [node])
    state = lc.SlurmNode(from_flags(["IDLE", "DYNAMIC_NORM"]), "idle")
    agent = {"status": "ready", "steps": {"params": {"duration": 0.02}, "role": {"duration": 0.7}}}
    monkeypatch.setattr(lc.LocalCluster, "slurm_nodes", lambda self, cl: {"c001": state})
    monkeypatch.setattr(lc.LocalCluster, "agent_state", lambda self, n: agent)
    monkeypatch.setattr(lc.time, "time", lambda: 1005.1)
    monkeypatch.setattr(lc.time, "strftime", lambda fmt, *a: "14:17:18")  # the time module's
    lc.LocalCluster("t", progress=cluster_cli._progress).wait_ready(c, ["c001"], timeout=60)
    assert capsys.readouterr().err == shown.group(1) + "\n"
