"""The core's one-of-each helpers: atomic writer, process-group stopper, controller ping, and
the table of Slurm version thresholds (no root)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeforge import fsutil, proc
from nodeforge import slurm_facts as slurm_facts
from nodeforge.errors import CommandError, MissingToolError, NodeforgeError
from nodeforge.images import build_proc
from tests.helpers import process_running

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


# -- atomic writer ------------------------------------------------------------------------------
def test_write_atomic_sets_content_and_mode_and_reports_changes(tmp_path, monkeypatch):
    renames = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append(b), real(a, b)))
    p = tmp_path / "sub" / "f.conf"
    assert fsutil.write_atomic(p, "a\n", 0o600) is True
    assert p.read_text() == "a\n" and (p.stat().st_mode & 0o7777) == 0o600
    assert fsutil.write_atomic(p, b"a\n", 0o600) is False  # same content and mode
    assert len(renames) == 1
    assert fsutil.write_atomic(p, "a\n", 0o644) is True  # a mode change is a change
    assert (p.stat().st_mode & 0o7777) == 0o644
    assert fsutil.write_atomic(p, "a\n", 0o644, skip_unchanged=False) is True
    assert renames == [p, p, p]
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.conf"]  # no temp files left


def test_write_atomic_fsyncs_file_and_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    p = tmp_path / "state.json"
    fsutil.write_json(p, {"b": 1, "a": [1, 2]}, 0o600, compact=True)
    assert p.read_text() == '{"b":1,"a":[1,2]}'
    assert len(synced) == 2 and synced[0].startswith(str(tmp_path / ".state.json."))
    assert synced[1] == str(tmp_path)  # the rename is made durable too


def test_write_atomic_failure_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "f"
    p.write_text("old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        fsutil.write_atomic(p, "new")
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["f"]


def test_write_json_default_is_sorted_indented_with_newline(tmp_path):
    p = tmp_path / "m.json"
    fsutil.write_json(p, {"b": 1, "a": 2})
    assert p.read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'


def test_no_other_atomic_writer_in_the_packages():
    """One writer: os.replace only in fsutil and where a tool's finished output is published."""
    allowed = {
        "nodeforge/fsutil.py",
        "images/base.py",  # mmdebstrap's tarball
        "images/pipeline.py",  # the finished output directory
        "nodeforge/download.py",  # a streamed download, verified before it is renamed in place
        "images/versions.py",  # a downloaded artifact
        "images/disk_seal.py",  # qemu-img's sealed disk
    }
    found = set()
    for pkg in ("nodeforge", "images", "bootstrap", "gang", "lab"):
        for f in (REPO / pkg).rglob("*.py"):
            text = f.read_text()
            if "os.replace(" in text or ("mkstemp(" in text and "fsync" in text):
                found.add(str(f.relative_to(REPO)))
    assert found <= allowed, sorted(found - allowed)


# -- process-group stopper ----------------------------------------------------------------------
def _start(script: str) -> tuple[subprocess.Popen, int]:
    """A shell in its own group that starts a background child and prints its pid."""
    p = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)  # fmt: skip
    assert p.stdout is not None
    child = int(p.stdout.readline())
    return p, child


def test_stop_group_stops_leader_and_strays_with_sigterm():
    p, child = _start("sleep 300 & echo $!; wait")
    assert process_running(child)
    assert proc.stop_group(p, grace=5) is False  # SIGTERM was enough
    assert p.returncode is not None and not process_running(child)


def test_stop_group_kills_what_ignores_sigterm():
    p, child = _start("trap '' TERM; sh -c 'trap \"\" TERM; sleep 300' & echo $!; wait")
    t0 = time.monotonic()
    assert proc.stop_group(p, grace=0.5) is True
    assert time.monotonic() - t0 < 8
    assert p.returncode == -signal.SIGKILL and not process_running(child)


def test_stop_group_by_pid_and_single_process():
    # a pid (no Popen at hand: the local cluster's nspawn, a detached qemu)
    p, child = _start("sleep 300 & echo $!; wait")
    assert proc.stop_group(p.pid, grace=5) is False
    assert not process_running(child)
    p.wait(timeout=5)
    # group=False: only that process; the rest of its group is left alone
    q, child = _start("sleep 300 & echo $!; wait")
    try:
        assert proc.stop_group(child, grace=5, group=False) is False
        assert not process_running(child)
    finally:
        proc.stop_group(q, grace=5)


def test_stop_group_of_a_finished_process_is_a_no_op():
    p = subprocess.Popen(["true"], start_new_session=True)
    p.wait()
    assert proc.stop_group(p) is False
    assert proc.stop_group(p.pid) is False


STOPPERS = {
    Path("nodeforge/proc.py"),
    Path("bootstrap/contain.py"),
    Path("images/build_proc.py"),
}


def test_one_process_stopper():
    """killpg / SIGKILL appear only in nodeforge/proc.py (the stopper), bootstrap/contain.py (a
    hook's container) and images/build_proc.py (the watcher, the lab's power cut)."""
    offenders = []
    for pkg in ("nodeforge", "images", "bootstrap", "gang", "lab"):
        for f in (REPO / pkg).rglob("*.py"):
            if f.relative_to(REPO) in STOPPERS:
                continue
            if re.search(r"\bkillpg\(|signal\.SIGKILL\b", f.read_text()):
                offenders.append(str(f.relative_to(REPO)))
    assert offenders == []


# -- controller ping ----------------------------------------------------------------------------
def _cp(rc: int, out: str) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(["scontrol", "ping"], rc, out)


@pytest.mark.parametrize(
    ("rc", "out", "up"),
    [
        (0, "Slurmctld(primary) at ctl is UP\n", True),
        (1, "Slurmctld(primary) at ctl is DOWN\n", False),
        (0, "Slurmctld(primary) at ctl is DOWN\n", False),
        (1, "Slurmctld(primary) at ctl is UP\n", False),
        (0, "", False),
    ],
)
def test_controller_up_reads_scontrol_ping(rc, out, up):
    seen = []

    def run(argv):
        seen.append(argv)
        return _cp(rc, out)

    assert slurm_facts.controller_up(run) is up
    assert seen == [["scontrol", "ping"]]


def test_controller_up_timeout_is_not_up_but_a_missing_tool_is_raised():
    def timeout(argv):
        raise CommandError(argv, -1, "", hint="timed out after 15s")

    def gone(argv):
        raise NodeforgeError("node ctl is not running")

    def missing(argv):
        raise MissingToolError("scontrol", "slurm-client")

    assert slurm_facts.controller_up(timeout) is False
    assert slurm_facts.controller_up(gone) is False
    with pytest.raises(MissingToolError):
        slurm_facts.controller_up(missing)


def test_one_controller_ping():
    offenders = []
    for pkg in ("images", "bootstrap", "gang", "lab"):
        for f in (REPO / pkg).rglob("*.py"):
            if re.search(r"""["']scontrol["'],\s*["']ping["']""", f.read_text()):
                offenders.append(str(f.relative_to(REPO)))
    assert offenders == []


# -- Slurm version thresholds -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("version", "feature", "expected"),
    [
        ("22.05.8", "prolog_force_requeue_on_fail", False),
        ("23.02.0", "prolog_force_requeue_on_fail", True),
        ("24.11.5", "dynamic_nodes_without_tree_width", True),
        ("22.05.8", "slurmd_systemd_notify", False),
        ("23.02.7", "sackd", False),
        ("23.11.1", "sackd", True),
        ((24, 11, 5), "sackd", True),
    ],
)
def test_thresholds(version, feature, expected):
    assert slurm_facts.has(version, feature) is expected


def test_thresholds_table_is_one_file_shared_with_the_slurm_role():
    table = json.loads(slurm_facts.THRESHOLDS_FILE.read_text())
    assert set(slurm_facts.thresholds()) == {k for k in table if not k.startswith("_")}
    role_copy = REPO / "roles/slurm/files/slurm_versions.json"
    assert role_copy.is_symlink() and role_copy.resolve() == slurm_facts.THRESHOLDS_FILE.resolve()
    install = (REPO / "roles/slurm/tasks/install.yml").read_text()
    assert "lookup('ansible.builtin.file', 'slurm_versions.json')" in install
    for key in ("prolog_force_requeue_on_fail", "dynamic_nodes_without_tree_width"):
        assert f"slurm_thresholds.{key}" in install


def test_no_slurm_version_literal_outside_the_table():
    pat = re.compile(r"\(2[0-9], ?[0-9]{1,2}\)|version\('2[0-9]\.|_minor < ")
    offenders = []
    for pkg in ("nodeforge", "images", "bootstrap", "gang", "lab", "roles"):
        for f in (REPO / pkg).rglob("*"):
            if f.suffix in (".py", ".yml", ".j2") and pat.search(f.read_text()):
                offenders.append(str(f.relative_to(REPO)))
    assert offenders == []


def test_bad_threshold_value_names_the_file_and_key(tmp_path, monkeypatch):
    bad = tmp_path / "slurm_versions.json"
    bad.write_text(json.dumps({"sackd": "23.11\n"}))
    monkeypatch.setattr(slurm_facts, "THRESHOLDS_FILE", bad)
    slurm_facts.thresholds.cache_clear()
    try:
        with pytest.raises(NodeforgeError, match=r"slurm_versions.json: sackd: expected a release"):
            slurm_facts.thresholds()
    finally:
        slurm_facts.thresholds.cache_clear()


def test_helpers_run_in_a_fresh_interpreter():
    """The agent imports these at start: no import-time side effects, stdlib only."""
    code = "import nodeforge.fsutil, nodeforge.slurm_facts, sys; print(sorted(m for m in sys.modules if m.startswith('yaml') or m.startswith('jinja2')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout  # fmt: skip
    assert out.strip() == "[]"


def test_stop_group_does_not_wait_on_an_unreaped_zombie():
    """A group whose only member is a zombie (its parent does not reap it) counts as stopped."""
    code = ("import os, sys, time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os.setsid(); os._exit(0)\n"
            "print(pid, flush=True); time.sleep(60)\n")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        assert proc.stop_group(child, grace=5) is False
        assert time.monotonic() - t0 < 2
    finally:
        parent.kill()
        parent.wait()


def test_slurm_role_reads_the_table_through_its_link(tmp_path):
    """The slurm role's lookup + `version` test, run by ansible-playbook on the real table file
    (a role whose files/slurm_versions.json is the same link), for 22.05 and 24.11."""
    ansible = Path(sys.executable).with_name("ansible-playbook")
    if not ansible.exists():
        pytest.fail("ansible-playbook not found next to the test interpreter", pytrace=False)
    role = tmp_path / "roles" / "probe"
    (role / "tasks").mkdir(parents=True)
    (role / "files").mkdir()
    link = REPO / "roles/slurm/files/slurm_versions.json"
    (role / "files" / "slurm_versions.json").symlink_to(link)
    install = (REPO / "roles/slurm/tasks/install.yml").read_text()
    lookup = re.search(r'slurm_thresholds: "(.*)"', install).group(1)
    frq = re.search(r'force_requeue_on_fail: "(.*)"', install).group(1)
    tw = re.search(r'tree_width_65533: "(.*)"', install).group(1)
    (role / "tasks" / "main.yml").write_text(
        "- name: Probe\n"
        "  vars:\n"
        f'    slurm_thresholds: "{lookup}"\n'
        '    slurm_version_installed: "{{ item }}"\n'
        "  ansible.builtin.debug:\n"
        f'    msg: "{{{{ slurm_version_installed }}}} frq={frq} tw={tw}"\n'
        "  loop: ['22.05.8', '24.11.5']\n"
    )
    play = tmp_path / "p.yml"
    play.write_text("- hosts: localhost\n  gather_facts: false\n  roles: [probe]\n")
    cp = subprocess.run(
        [str(ansible), "-i", "localhost,", "-c", "local", str(play)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "ANSIBLE_ROLES_PATH": str(tmp_path / "roles"), "HOME": str(tmp_path)},
    )  # fmt: skip
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    out = re.findall(r'"msg": "(.*)"', cp.stdout)
    assert out == ["22.05.8 frq=False tw=True", "24.11.5 frq=True tw=False"]


def test_pid_alive_is_right_for_a_process_name_with_spaces_and_parens():
    """/proc/PID/stat puts the name in parentheses; `split()[2]` read a name such as
    `x) Z (y` as the state Z and called a running process dead."""
    code = (
        "import ctypes, sys, time; "
        "ctypes.CDLL(None).prctl(15, b'x) Z (y', 0, 0, 0); "  # PR_SET_NAME
        "print('named', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "named"
        assert Path(f"/proc/{p.pid}/stat").read_text().split()[2] == "Z"  # the old reading
        assert proc.proc_state(p.pid) in ("S", "R") and proc.pid_alive(p.pid)
        p.kill()
        deadline = time.monotonic() + 10
        while proc.proc_state(p.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not proc.pid_alive(p.pid)  # a zombie, not yet reaped, is not alive
    finally:
        p.kill()
        p.wait()
    assert not proc.pid_alive(p.pid) and proc.proc_state(p.pid) is None
    assert not proc.pid_alive(0) and not proc.pid_alive(None) and not proc.pid_alive(-1)


def test_one_pid_check_in_the_tree():
    """No copy of the /proc/PID/stat reading outside nodeforge/proc.py (issue 25: six copies,
    two wrong)."""
    hits = []
    for d in ("nodeforge", "bootstrap", "images", "gang", "lab", "bench", "tests"):
        for f in (Path(__file__).parents[3] / d).rglob("*.py"):
            if (f.name == "proc.py" and f.parent.name == "nodeforge") or f == Path(__file__):
                continue
            text = f.read_text()
            if re.search(r"/proc/\{[a-z_.]*pid[a-z_.]*\}/stat\b", text):
                hits.append(str(f))
    assert hits == [], hits


def test_kill_now_is_sigkill_without_warning_and_tolerates_a_gone_pid():
    """build_proc.kill_now: the lab's power cut; the process dies by SIGKILL (no SIGTERM it could
    handle), and a pid already gone is not an error."""
    p = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60"])
    build_proc.kill_now(p.pid)
    assert p.wait(timeout=10) == -9
    build_proc.kill_now(p.pid)  # reaped: no such process


# -- directory swap -----------------------------------------------------------------------------
def test_swap_dir_replaces_the_tree_whole_and_clears_a_leftover(tmp_path):
    """fsutil.swap_dir, the one directory swap (build output, cache layer, agent wheel, s3
    hook): the new tree in place, nothing of the old one left, a stale .old from an
    interrupted swap removed; the first swap needs no existing tree."""
    final = tmp_path / "out"
    first = tmp_path / "first"
    (first / "a").mkdir(parents=True)
    fsutil.swap_dir(first, final)
    assert (final / "a").is_dir() and not first.exists()
    stale = tmp_path / "out.old"
    (stale / "junk").mkdir(parents=True)
    second = tmp_path / "second"
    second.mkdir()
    (second / "b").write_text("new")
    fsutil.swap_dir(second, final)
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert not stale.exists() and not second.exists()
    third = tmp_path / "third"
    third.mkdir()
    fsutil.swap_dir(third, final, old=tmp_path / ".aside")
    assert list(final.iterdir()) == [] and not (tmp_path / ".aside").exists()


def test_atomic_output_renames_a_whole_file_and_drops_a_failed_one(tmp_path):
    """fsutil.atomic_output (a base tarball, the sealed disk, the agent wheel): the target is
    the old file until the writer finishes, and a writer that fails leaves no temp file."""
    out = tmp_path / "base.tar"
    out.write_text("old")
    with pytest.raises(RuntimeError), fsutil.atomic_output(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the tool failed")
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["base.tar"]
    with fsutil.atomic_output(out, tmp_name=".part-1-base.tar") as tmp:
        assert tmp.name == ".part-1-base.tar" and out.read_text() == "old"
        tmp.write_text("new")
    assert out.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["base.tar"]
