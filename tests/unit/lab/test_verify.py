"""nodeforge.lab.verify: host spec parsing, nsenter wrapping, failure reports (no root, no hosts)."""

from __future__ import annotations

import json
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.lab import verify
from nodeforge.lab.verify import CheckResult, HostSpecError, parse_host_spec, parse_host_specs
from tests.unit.support import run_cli

pytestmark = pytest.mark.unit


def test_ssh_spec_full():
    s = parse_host_spec("ssh://admin@10.0.0.5:2222?key=/k/id&name=ctl")
    assert (s.scheme, s.user, s.host, s.port, s.key, s.label) == (
        "ssh",
        "admin",
        "10.0.0.5",
        2222,
        "/k/id",
        "ctl",
    )


def test_ssh_spec_defaults_and_global_key():
    s = parse_host_spec("ssh://node1", ssh_key="/home/me/.ssh/lab")
    assert (s.user, s.port, s.key, s.label) == ("root", 22, "/home/me/.ssh/lab", "root@node1:22")
    assert parse_host_spec("ssh://[::1]:2200").host == "::1"


@pytest.mark.parametrize(
    "bad,msg",
    [
        ("node1", "expected SCHEME://"),
        ("docker://x", "unknown scheme"),
        ("ssh://", "missing host"),
        ("ssh://h:99999", "port must be a number"),
        ("nsenter://abc", "takes a PID"),
        ("nsenter://0", "takes a PID"),
        ("nspawn://", "nspawn://CLUSTER"),
        ("vm://", "vm://IMAGE_DIR"),
    ],
)
def test_bad_specs_name_the_problem(bad, msg):
    with pytest.raises(HostSpecError, match=msg) as ei:
        parse_host_spec(bad)
    assert bad.split("?")[0] in str(ei.value)


def test_nsenter_and_nspawn_specs():
    assert parse_host_spec("nsenter://1234").pid == 1234
    s = parse_host_spec("nspawn://4321")
    assert (s.scheme, s.pid) == ("nsenter", 4321)
    s = parse_host_spec("nspawn://demo/c1")
    assert (s.scheme, s.cluster, s.node, s.label) == ("nspawn", "demo", "c1", "demo/c1")
    assert parse_host_spec("nspawn://demo").node is None


def test_vm_spec_options():
    s = parse_host_spec("vm:///srv/out?role=compute&compat_net=1")
    assert (s.image_dir, s.option("role"), s.option("compat_net"), s.label) == (
        "/srv/out",
        "compute",
        "1",
        "vm:compute",
    )


def test_many_specs_comma_and_repeat_and_duplicates():
    specs = parse_host_specs(["ssh://a:1,ssh://b:2", "nsenter://7"])
    assert [s.label for s in specs] == ["root@a:1", "root@b:2", "pid7"]
    with pytest.raises(HostSpecError, match="duplicate"):
        parse_host_specs(["ssh://a", "ssh://a"])
    with pytest.raises(HostSpecError, match="no hosts"):
        parse_host_specs([" , "])


def test_payload_roundtrip():
    s = parse_host_spec("ssh://u@h:3?key=/k&name=n")
    d = json.loads(json.dumps(verify.dataclasses.asdict(s)))
    assert verify.host_from_payload(d) == s


def test_nsenter_command_enters_all_namespaces():
    argv = verify.nsenter_command(99, "systemctl is-active slurmd")
    assert argv[:6] == ["nsenter", "-t", "99", "-a", "--", "env"]
    assert argv[-3:] == ["/bin/sh", "-c", "systemctl is-active slurmd"]


def test_failure_names_host_role_check_and_output():
    r = CheckResult(
        "ctl",
        "controller",
        "test_controller.py::test_slurmdbd_conf_secret",
        "failed",
        0.1,
        "/etc/slurm/slurmdbd.conf: 644 root (want 600 slurm)\n$ stat …\nexit 0",
    )
    text = verify.format_failure(r)
    first = text.splitlines()[0]
    assert (
        first
        == "FAIL  host=ctl  role=controller  check=test_controller.py::test_slurmdbd_conf_secret"
    )
    assert "    /etc/slurm/slurmdbd.conf: 644 root (want 600 slurm)" in text


def test_long_output_is_cut_in_the_middle():
    r = CheckResult("h", "compute", "c", "failed", 0, "\n".join(f"l{i}" for i in range(200)))
    lines = verify.format_failure(r, max_lines=20).splitlines()
    assert len(lines) <= 22 and "l0" in lines[1] and "l199" in lines[-1] and "cut" in "".join(lines)


def test_report_summary_per_host():
    rs = [
        CheckResult("a", "compute", "x", "passed"),
        CheckResult("a", "compute", "y", "failed", 0, "boom"),
        CheckResult("b", "login", "x", "skipped", 0, "not this host's role"),
    ]
    rep = verify.format_report(rs, {"a": 12.5})
    assert "FAIL  host=a  role=compute  check=y" in rep and "boom" in rep
    assert "verify: FAILED: 2 of 3" in rep
    row = next(ln for ln in rep.splitlines() if ln.startswith("a ")).split()
    assert row == ["a", "compute", "1", "1", "0", "12.5"]


def test_run_suite_collects_host_role_and_assertion_output(tmp_path):
    """The real pytest plumbing, on a synthetic suite (no host needed)."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent("""
        import json, pytest
        def pytest_addoption(parser):
            parser.addoption("--nf-hosts-json", default="[]")
        @pytest.fixture(autouse=True)
        def _tag(request):
            request.node.user_properties += [("nf_host", "fake1"), ("nf_role", "compute")]
    """)
    )
    (tmp_path / "test_x.py").write_text(
        textwrap.dedent("""
        import pytest
        def test_ok(): pass
        def test_bad():
            assert False, "slurmd is active on a login\\n$ systemctl is-active slurmd\\nactive"
        def test_skip(): pytest.skip("not this host's role")
    """)
    )
    rc, results = verify.run_suite([], suite_dir=tmp_path)
    by = {r.check.split("::")[-1]: r for r in results}
    assert rc == 1 and set(by) == {"test_ok", "test_bad", "test_skip"}
    bad = by["test_bad"]
    assert (bad.host, bad.role, bad.outcome) == ("fake1", "compute", "failed")
    assert (
        "slurmd is active on a login" in bad.message
        and "$ systemctl is-active slurmd" in bad.message
    )
    assert by["test_skip"].outcome == "skipped" and "role" in by["test_skip"].message


def test_verify_cli_imports_stdlib_only():
    import subprocess
    import sys

    code = (
        "import sys, nodeforge.lab.verify_cli as m; "
        "bad=[n for n in ('pytest','testinfra','paramiko','yaml') if n in sys.modules]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_ssh_alias_is_ssh_config_safe():
    s = parse_host_spec("ssh://admin@10.0.0.5:2222")
    assert verify.ssh_alias(s) == "nf-admin_10.0.0.5_2222"


@pytest.mark.parametrize(
    ("nodeid", "want"),
    [
        ("test_compute.py::test_docker_active_with_log_rotation[e2e/c001]",
         "test_compute.py::test_docker_active_with_log_rotation"),
        ("tests/infra/test_common.py::test_host_keys[ssh://root@h:22]",
         "test_common.py::test_host_keys"),
        ("test_login.py::test_x[a/b[c]/d]", "test_login.py::test_x"),
        ("test_common.py::test_plain", "test_common.py::test_plain"),
    ],
)  # fmt: skip
def test_check_name_survives_host_labels_with_slashes(nodeid, want):
    """An nspawn node's label (`e2e/c001`) holds a slash: the check came out as `c001]`."""
    assert verify.check_name(nodeid) == want


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
@settings(max_examples=200, deadline=None)
def test_check_name_ignores_any_host_label(label):
    assert verify.check_name(f"test_c.py::test_y[{label}]") == "test_c.py::test_y"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("vm:///srv/out?role=compte", "role='compte': expected controller, compute or login"),
        ("vm:///srv/out?rol=compute", "vm:// has no option 'rol'"),
        ("vm:///srv/out?role=compute&role=login", "option 'role' given twice"),
        ("vm:///srv/out?accel=fast", "accel='fast': expected auto, kvm or tcg"),
        ("vm:///srv/out?name=a%20b", "name='a b': expected a label"),
        ("vm:///srv/out?compat_net=maybe", "compat_net='maybe'"),
        ("vm:///srv/out?role", "malformed query"),
        ("ssh://h?keys=/k", "ssh:// has no option 'keys'"),
        ("nspawn://c?name=x", "nspawn:// has no option 'name'"),
        ("vm:///srv/out\n?role=compute", "control characters"),
    ],
)
def test_bad_spec_options_fail_before_anything_boots(spec, says):
    with pytest.raises(HostSpecError) as e:
        parse_host_spec(spec)
    assert says in str(e.value)


@given(st.text(max_size=60))
@settings(max_examples=300, deadline=None)
def test_any_spec_text_parses_or_is_a_spec_error(text):
    for raw in (text, f"vm:///o?{text}", f"ssh://{text}", f"nspawn://{text}"):
        try:
            parse_host_spec(raw)
        except HostSpecError as exc:
            assert "host spec" in str(exc)


def test_vm_spec_without_a_built_image_fails_before_booting(tmp_path):

    cp = run_cli("verify", "--hosts", f"vm://{tmp_path}?role=compute")
    assert cp.returncode == 2, cp.stderr
    assert f"{tmp_path} has no manifest.json or disk.qcow2" in cp.stderr
    assert "Traceback" not in cp.stderr
