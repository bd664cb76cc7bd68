"""Hooks as untrusted input: remote hooks need https or a sha256, baked hooks must be root's and
not writable by others, symlinks stay inside on-init.d, `.`/`..` names are refused, a setsid
daemon does not outlive its hook, output is capped, a failed fetch is a retried attempt.
A refused hook drains the node with a reason naming it (what `sinfo -R` shows)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from nodeforge import download
from nodeforge.bootstrap import hooks as hooks_mod
from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.hooks import HookError, discover
from nodeforge.bootstrap.params import ParamsError
from tests.helpers import QuietHandler, http_server, loopback_tls, process_running, routes_handler
from tests.unit.support import COMPUTE, hook_params, make, runner, script

pytestmark = pytest.mark.unit

params = hook_params  # the hook tests' params (support.HOOK_PARAMS)

ROOT = os.geteuid() == 0


# -- remote hooks: https or a sha256 -----------------------------------------------------------
def test_plain_http_without_sha256_is_refused_before_anything_runs(paths, tmp_path):
    marker = tmp_path / "ran"
    script(paths.on_init_d / "10-first", f"touch {marker}\n")
    with pytest.raises(
        HookError,
        match=r"hook 50-x\.sh refused: http://h\.example/50-x\.sh is "
        r"plain http without a sha256; serve it over https:// or set "
        r"hooks\[0\]\.sha256",
    ):
        discover(paths, params(hooks=["http://h.example/50-x.sh"]))
    assert not marker.exists()
    ok = discover(
        paths,
        params(
            hooks=[
                "https://h.example/50-x.sh",
                {"uri": "http://h.example/60-y.sh", "sha256": "a" * 64},
            ]
        ),
    )
    assert [h.name for h in ok] == ["10-first", "50-x.sh", "60-y.sh"]


def test_https_to_http_redirect_is_a_failed_fetch(paths, tmp_path, monkeypatch):
    server_tls, client_tls = loopback_tls(tmp_path)
    with http_server(routes_handler({"/x.sh": b"#!/bin/sh\ntouch /nonexistent/never\n"})) as plain:

        class Redirect(QuietHandler):
            def do_GET(self):
                self.send(302, headers=[("Location", f"{plain}/x.sh")])

        monkeypatch.setattr(
            hooks_mod, "_FETCH_POLICY", download.Policy(attempts=1, timeout=5, context=client_tls)
        )
        with http_server(Redirect, server_tls) as tls:
            res = runner(paths).run_all(discover(paths, params(hooks=[f"{tls}/x.sh"]))).failure
    assert res.status == "fetch-failed"
    assert res.reason.startswith("hook x.sh could not be fetched: redirect to http://")
    assert res.reason.endswith("refused: a downgrade from https to http://")
    assert not (paths.hook_cache / "x.sh").exists()


# -- baked hooks: owner, mode, symlinks --------------------------------------------------------
def test_group_or_world_writable_hook_refused(paths):
    script(paths.on_init_d / "10-open", "true\n", mode=0o775)
    with pytest.raises(
        HookError,
        match=r"hook 10-open refused: .*10-open is group- or "
        r"world-writable \(mode 0775\); refused \(chmod go-w",
    ):
        discover(paths, params())
    (paths.on_init_d / "10-open").chmod(0o757)
    with pytest.raises(HookError, match=r"mode 0757"):
        discover(paths, params())


def test_writable_directory_refused(paths):
    script(paths.on_init_d / "10-ok", "true\n")
    paths.on_init_d.chmod(0o777)
    with pytest.raises(
        HookError,
        match=r"hooks: .*on-init\.d is group- or world-writable "
        r"\(mode 0777\)",
    ):
        discover(paths, params())


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root (CI runs as root)")
def test_hook_not_owned_by_root_refused(paths):
    p = script(paths.on_init_d / "10-theirs", "true\n")
    os.chown(p, 65534, 65534)
    with pytest.raises(
        HookError,
        match=r"hook 10-theirs refused: .* is owned by uid 65534, not "
        r"root; refused \(chown root:root",
    ):
        discover(paths, params())
    os.chown(p, 0, 0)
    os.chown(paths.on_init_d, 65534, 0)
    with pytest.raises(HookError, match=r"on-init\.d is owned by uid 65534"):
        discover(paths, params())


def test_symlink_out_of_on_init_d_refused_inside_allowed(paths, tmp_path):
    outside = script(tmp_path / "elsewhere" / "evil", "true\n")
    inside = script(paths.on_init_d / "real.disabled", "true\n")  # skipped by name, linked to
    (paths.on_init_d / "20-link").symlink_to(inside)
    assert [h.name for h in discover(paths, params())] == ["20-link"]
    (paths.on_init_d / "10-evil").symlink_to(outside)
    with pytest.raises(
        HookError,
        match=r"hook 10-evil refused: symlink to .*/elsewhere/evil "
        r"points out of .*on-init\.d",
    ):
        discover(paths, params())
    (paths.on_init_d / "10-evil").unlink()
    (paths.on_init_d / "10-dots").symlink_to("../../../elsewhere/evil")
    with pytest.raises(HookError, match="points out of"):
        discover(paths, params())
    (paths.on_init_d / "10-dots").unlink()
    (paths.on_init_d / "10-dangling").symlink_to(paths.on_init_d / "nothing")
    with pytest.raises(HookError, match="dangling symlink"):
        discover(paths, params())


def test_fifo_refused(paths):
    os.mkfifo(paths.on_init_d / "10-fifo")
    with pytest.raises(HookError, match="10-fifo refused: .* is not a regular file"):
        discover(paths, params())


def test_refused_baked_hook_drains_with_reason(tmp_path):
    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    paths.on_init_d.mkdir(parents=True)
    outside = script(tmp_path / "elsewhere" / "evil", f"touch {tmp_path}/ran\n")
    script(paths.on_init_d / "05-ok", f"touch {tmp_path}/ok-ran\n")
    (paths.on_init_d / "10-evil").symlink_to(outside)
    with pytest.raises(StepFailed, match="10-evil refused"):
        agent.init()
    reason = fm.nodes["c1"]["Reason"]
    assert reason.startswith("nodeforge: hook 10-evil refused: symlink to ") and len(reason) <= 200
    assert "DRAIN" in fm.nodes["c1"]["State"]
    assert not (tmp_path / "ran").exists() and not (tmp_path / "ok-ran").exists()


# -- names -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        {"uri": "file:///opt/hooks/x", "name": "."},
        {"uri": "file:///opt/hooks/x", "name": ".."},
        {"uri": "file:///opt/hooks/.."},
        {"uri": "https://h.example/a/."},
        {"uri": "file:///opt/hooks/x", "name": "x\n"},  # `$` in the params regex lets this by
        {"uri": "file:///opt/hooks/x", "name": "a" * 129},
    ],
)
def test_dot_names_refused(paths, spec):
    with pytest.raises((HookError, ParamsError), match=r"hooks\[0\]"):
        discover(paths, params(hooks=[spec]))


# -- containment, output cap -------------------------------------------------------------------


def test_setsid_daemon_started_by_a_hook_is_gone(paths, tmp_path):
    pidf = tmp_path / "daemon.pid"
    script(
        paths.on_init_d / "10-daemon",
        f"setsid sh -c 'echo $$ > {pidf}; exec sleep 300' </dev/null >/dev/null 2>&1 &\n"
        f"while [ ! -s {pidf} ]; do sleep 0.01; done\n",
    )
    assert runner(paths).run_all(discover(paths, params())).ok
    pid = int(pidf.read_text())
    end = time.monotonic() + 3
    while process_running(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not process_running(pid), "the hook's setsid daemon is still running"
    log = (paths.hooks_log_dir / "10-daemon.log").read_text()
    assert "processes it left running were stopped" in log and "install a systemd unit" in log


def test_output_is_capped_head_and_tail_kept(paths):
    script(
        paths.on_init_d / "10-loud",
        "echo FIRST; i=0; while [ $i -lt 20000 ]; do echo noise-$i; i=$((i+1)); done; "
        "echo LAST >&2\n",
    )
    p = params(hook_output_max=4096)
    assert runner(paths, output_max=p.hook_output_max).run_all(discover(paths, p)).ok
    log = (paths.hooks_log_dir / "10-loud.log").read_text()
    assert "FIRST\nnoise-0\n" in log and "noise-19999\nLAST\n" in log
    assert (
        "bytes of output dropped here" in log and "bytes of output dropped (hook_output_max)" in log
    )
    assert len(log) < 4096 + 1000


def test_output_cap_bounds(paths):
    with pytest.raises(ParamsError, match=r"hook_output_max: 10 out of range \[4096, 67108864\]"):
        params(hook_output_max=10)
    with pytest.raises(ParamsError, match="hook_output_max"):
        params(hook_output_max=float("nan"))


# -- fetch failures are retried attempts -------------------------------------------------------
def _truncating_handler(routes, truncate_first):
    """Serves *routes*; the first *truncate_first* bodies stop after 5 bytes."""
    state = {"n": 0}

    class H(QuietHandler):
        def do_GET(self):
            body = routes.get(self.path)
            if body is None:
                return self.send(404, close=True)
            state["n"] += 1
            cut = state["n"] <= truncate_first
            self.send(200, body[:5] if cut else body, length=len(body), close=True)

    return H


def test_truncated_fetch_is_retried_with_the_run_backoff(paths, tmp_path):
    marker = tmp_path / "ran"
    body = f"#!/bin/sh\ntouch {marker}\n".encode()
    sleeps: list[float] = []
    with http_server(_truncating_handler({"/40-net.sh": body}, truncate_first=2)) as base:
        p = params(
            hooks=[
                {
                    "uri": f"{base}/40-net.sh",
                    "sha256": hashlib.sha256(body).hexdigest(),
                    "retries": 3,
                }
            ]
        )
        res = (
            runner(paths, sleeps, backoff=2, backoff_max=60).run_all(discover(paths, p)).results[0]
        )
    assert res.ok and res.attempts == 3 and sleeps == [2, 4] and marker.exists()
    log = (paths.hooks_log_dir / "40-net.sh.log").read_text()
    assert log.count("FETCH FAILED") == 2 and "truncated body: got 5 of" in log


def test_fetch_failure_reason_after_all_attempts(paths):
    sleeps: list[float] = []
    p = params(hooks=[{"uri": "https://nodeforge-test.invalid/50-x.sh", "retries": 1}])
    res = runner(paths, sleeps, backoff=1).run_all(discover(paths, p)).failure
    assert res.status == "fetch-failed" and res.attempts == 2 and sleeps == [1]
    assert res.reason.startswith("hook 50-x.sh could not be fetched: DNS lookup failed")
    assert res.reason.endswith("after 2 attempts")


def test_duplicate_name_message_hides_url_secrets(paths):
    script(paths.on_init_d / "20-x", "true\n")
    with pytest.raises(HookError, match="two hooks are named '20-x'") as ei:
        discover(paths, params(hooks=["https://u:hunter2@h.example/20-x?sig=t0ken"]))
    assert "hunter2" not in str(ei.value) and "t0ken" not in str(ei.value)
