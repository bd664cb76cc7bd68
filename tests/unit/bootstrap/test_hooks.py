"""Hook runner: order, env, process-group timeout, retries/backoff, sha256, failure reasons."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from nodeforge.bootstrap.hooks import HookError, discover, fetch
from nodeforge.bootstrap.paths import Paths
from tests.helpers import http_server, process_running, routes_handler
from tests.unit.support import hook_params, runner, script

pytestmark = pytest.mark.unit


params = hook_params


@pytest.fixture
def paths(tmp_path):
    p = Paths.under(tmp_path)
    p.on_init_d.mkdir(parents=True)
    p.params_json.parent.mkdir(parents=True)
    p.params_json.write_text("{}")
    return p


def test_order_baked_and_extensions_env_and_logs(paths, tmp_path):
    out = tmp_path / "order.txt"
    body = f'echo "$NODEFORGE_HOOK $NODEFORGE_ROLE $NODEFORGE_CLUSTER $NODEFORGE_NODE $NODEFORGE_CONTROLLER $NODEFORGE_PARAMS $NODEFORGE_HOOK_ATTEMPT" >> {out}\necho to-stdout; echo to-stderr >&2\n'
    script(paths.on_init_d / "50-baked", body)
    script(paths.on_init_d / "10-first", body)
    script(paths.on_init_d / "README.md", "exit 1\n")  # docs are not hooks
    script(paths.on_init_d / "30-notexec", "exit 1\n", mode=0o644)  # not executable: skipped
    ext = script(tmp_path / "src" / "20-ext.sh", body)
    ext2 = script(tmp_path / "src" / "x.sh", body)
    p = params(hooks=[{"uri": f"file://{ext}"}, {"uri": f"file://{ext2}", "name": "90-last"}])
    hooks = discover(paths, p)
    assert [h.name for h in hooks] == ["10-first", "20-ext.sh", "50-baked", "90-last"]
    report = runner(paths).run_all(hooks)
    assert report.ok
    lines = out.read_text().splitlines()
    assert [ln.split()[0] for ln in lines] == ["10-first", "20-ext.sh", "50-baked", "90-last"]
    assert lines[0].split()[1:] == ["compute", "demo", "c1", "ctl", str(paths.params_json), "1"]
    log = (paths.hooks_log_dir / "10-first.log").read_text()
    assert "attempt 1/1" in log and "to-stdout" in log and "to-stderr" in log and "exit 0" in log


def test_duplicate_names_refused(paths, tmp_path):
    script(paths.on_init_d / "20-x", "true\n")
    ext = script(tmp_path / "src" / "20-x", "true\n")
    with pytest.raises(HookError, match="two hooks are named '20-x'"):
        discover(paths, params(hooks=[f"file://{ext}"]))


def test_failure_reason_exit_code(paths):
    script(paths.on_init_d / "10-ok", "true\n")
    script(paths.on_init_d / "20-bad", "echo broken; exit 3\n")
    script(paths.on_init_d / "30-never", "touch /nonexistent-should-not-run\n")
    report = runner(paths).run_all(discover(paths, params()))
    assert not report.ok
    f = report.failure
    assert f.name == "20-bad" and f.exit_code == 3 and f.reason == "hook 20-bad failed (exit 3)"
    assert [r.name for r in report.results] == ["10-ok", "20-bad"]  # stops at the first failure


def test_killed_by_signal_reason(paths):
    script(paths.on_init_d / "10-crash", "kill -SEGV $$\n")
    res = runner(paths).run_all(discover(paths, params())).failure
    assert res.status == "signal" and res.signal == 11
    assert res.reason == "hook 10-crash killed by signal 11 (SIGSEGV)"


def test_timeout_kills_whole_process_group_incl_grandchildren(paths, tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # The hook starts a grandchild (sh -> sh -> sleep) that ignores nothing and would outlive it.
    script(
        paths.on_init_d / "10-hang",
        f"sh -c 'sleep 300 & echo $! > {pidfile}; wait' &\nsleep 300\n",
    )
    t = time.monotonic()
    res = runner(paths).run_all(discover(paths, params(hook_timeout=1))).failure
    assert time.monotonic() - t < 5
    assert res.status == "timeout" and res.reason == "hook 10-hang timed out after 1s"
    gpid = int(pidfile.read_text())
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and process_running(gpid):
        time.sleep(0.05)
    assert not process_running(gpid), "grandchild survived the timeout"
    assert (
        "TIMED OUT after 1s (everything it started was stopped)"
        in (paths.hooks_log_dir / "10-hang.log").read_text()
    )


def test_term_ignoring_hook_gets_sigkill(paths):
    script(paths.on_init_d / "10-stubborn", "trap '' TERM\nwhile :; do sleep 0.1; done\n")
    t = time.monotonic()
    res = runner(paths).run_all(discover(paths, params(hook_timeout=0.5))).failure
    assert res.status == "timeout" and time.monotonic() - t < 4


def test_leftover_background_process_is_stopped_on_exit(paths, tmp_path):
    pidfile = tmp_path / "bg.pid"
    script(paths.on_init_d / "10-bg", f"sleep 300 & echo $! > {pidfile}\nexit 0\n")
    assert runner(paths).run_all(discover(paths, params())).ok
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and process_running(pid):
        time.sleep(0.05)
    assert not process_running(pid)


def test_retries_with_exponential_backoff(paths, tmp_path):
    counter = tmp_path / "n"
    # Fails twice, then succeeds on the third attempt.
    script(
        paths.on_init_d / "10-flaky",
        f"n=$(cat {counter} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {counter}; [ $n -ge 3 ]\n",
    )
    sleeps: list[float] = []
    r = runner(paths, sleeps, backoff=2, backoff_max=60)
    res = r.run_all(discover(paths, params(hook_retries=4))).results[0]
    assert res.ok and res.attempts == 3 and sleeps == [2, 4]
    log = (paths.hooks_log_dir / "10-flaky.log").read_text()
    assert "attempt 1/5" in log and "attempt 2/5" in log and "attempt 3/5" in log
    assert [r.delay(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [2, 4, 8, 16, 32, 60, 60]


def test_retries_exhausted_reason(paths):
    script(paths.on_init_d / "10-bad", "exit 7\n")
    sleeps: list[float] = []
    res = runner(paths, sleeps, backoff=1).run_all(discover(paths, params(hook_retries=2))).failure
    assert res.attempts == 3 and sleeps == [1, 2]
    assert res.reason == "hook 10-bad failed (exit 7) after 3 attempts"


def test_sha256_verified_before_running(paths, tmp_path):
    marker = tmp_path / "ran"
    ext = script(tmp_path / "src" / "20-ext", f"touch {marker}\n")
    good = hashlib.sha256(ext.read_bytes()).hexdigest()
    bad = "0" * 64
    res = (
        runner(paths)
        .run_all(discover(paths, params(hooks=[{"uri": f"file://{ext}", "sha256": bad}])))
        .failure
    )
    assert res.status == "refused" and res.reason == "hook 20-ext sha256 mismatch (not run)"
    assert not marker.exists()
    assert "REFUSED" in (paths.hooks_log_dir / "20-ext.log").read_text()
    assert (
        runner(paths)
        .run_all(discover(paths, params(hooks=[{"uri": f"file://{ext}", "sha256": good}])))
        .ok
    )
    assert marker.exists()


def test_http_fetch_and_missing_file(paths, tmp_path):
    body = b"#!/bin/sh\nexit 0\n"
    with http_server(routes_handler({"/h/30-net.sh": body})) as base:
        url = f"{base}/h/30-net.sh"
        p = params(hooks=[{"uri": url, "sha256": hashlib.sha256(body).hexdigest()}])
        assert runner(paths).run_all(discover(paths, p)).ok
        assert (paths.hook_cache / "30-net.sh").read_bytes() == body
        res = (
            runner(paths)
            .run_all(
                discover(
                    paths,
                    params(hooks=[{"uri": url.replace("30-net", "31-gone"), "sha256": "0" * 64}]),
                )
            )
            .failure
        )
        assert res.status == "fetch-failed"
        assert res.reason == "hook 31-gone.sh could not be fetched: HTTP 404 Not Found"


def test_s3_without_boto3_names_the_fix(paths, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_boto(name, *a, **kw):
        if name == "boto3":
            raise ImportError("no boto3")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_boto)
    hook = discover(paths, params(hooks=["s3://bucket/hooks/40-s3.sh"]))[0]
    with pytest.raises(HookError, match=r"needs boto3.*python3-boto3.*nodeforge\[s3\]"):
        fetch(hook, paths.hook_cache)


def test_params_file_is_passed(paths, tmp_path):
    out = tmp_path / "seen.json"
    paths.params_json.write_text(json.dumps({"extra": {"k": "v"}}))
    script(paths.on_init_d / "10-read", f'cat "$NODEFORGE_PARAMS" > {out}\n')
    assert runner(paths).run_all(discover(paths, params())).ok
    assert json.loads(out.read_text()) == {"extra": {"k": "v"}}
