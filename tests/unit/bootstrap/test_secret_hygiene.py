"""Passwords never reach an error message, a log line or state.json, on any failure path:
non-zero exit, timeout, the controller's MariaDB step failing or hanging."""

from __future__ import annotations

import logging
import traceback

import pytest

from nodeforge import proc
from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.node_roles import controller
from nodeforge.errors import CommandError
from tests.unit.support import CTL, make  # the agent harness (fake machine, real proc for mariadb)

pytestmark = pytest.mark.unit

SECRET = "pw-Zq8v3KfX1tLr"


def _all_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(getattr(exc, "argv", ""))


def test_failed_command_redacts_argv_and_output(caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(CommandError) as ei:
        proc.run(
            ["sh", "-c", f"echo using {SECRET}; echo {SECRET[:6]}; exit 3", "x", SECRET],
            redact=[SECRET],
        )
    assert SECRET not in _all_text(ei.value) and "***" in str(ei.value)
    assert SECRET[:6] in str(ei.value)  # only the secret itself is hidden, not look-alikes
    assert SECRET not in caplog.text


def test_timeout_redacts_argv_and_output(caplog):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(CommandError, match="timed out after 0.5s") as ei:
        proc.run(
            ["sh", "-c", f"echo {SECRET}; exec sleep 5", "x", SECRET], timeout=0.5, redact=[SECRET]
        )
    assert SECRET not in _all_text(ei.value)
    assert ei.value.__cause__ is None and ei.value.__suppress_context__
    assert SECRET not in caplog.text


def test_overlapping_secrets_longest_first():
    with pytest.raises(CommandError) as ei:
        proc.run(["sh", "-c", "echo abcdef; exit 1"], redact=["abc", "abcdef"])
    assert "def" not in str(ei.value).split("last output ---", 1)[1]


def _mariadb_through_real_proc(fm, script: str, timeout: float | None = None):
    """mariadb replaced by a real shell that echoes its stdin (the SQL, with the password, as
    MariaDB does in a syntax error) and then fails or hangs; every other command is faked."""

    def run(argv, **kw):
        if str(argv[0]) == "mariadb":
            if timeout is not None:
                kw["timeout"] = timeout
            return proc.run(["sh", "-c", script], **kw)
        return fm.run(argv, **kw)

    return run


@pytest.mark.parametrize(
    "script, timeout, expect",
    [
        ('echo "ERROR 1064 (42000) near: $(cat)"; exit 1', None, "exit 1"),
        ("cat; exec sleep 10", 0.5, "timed out after 0.5s"),
    ],
)
def test_controller_db_password_absent_on_failure(tmp_path, caplog, script, timeout, expect):
    caplog.set_level(logging.DEBUG)
    agent, fm, paths, _ = make(tmp_path, CTL)
    agent.host.run = _mariadb_through_real_proc(fm, script, timeout)
    with pytest.raises(StepFailed) as ei:
        agent.init()
    pw = (paths.secrets / controller.PASS_FILE).read_text().strip()
    assert len(pw) >= 40
    assert expect in str(ei.value) and "***" in str(ei.value)
    for where, text in (
        ("exception", _all_text(ei.value)),
        ("log", caplog.text),
        ("state.json", paths.state_file.read_text()),
    ):
        assert pw not in text, f"the DB password leaked into the {where}"
