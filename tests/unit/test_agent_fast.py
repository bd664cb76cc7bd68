"""The agent's path to ready does no avoidable work: no extra process spawn in the munge step,
no download stack (urllib, http.client, ssl) imported on a node without extension hooks, no
1 s poll where a local daemon answers in milliseconds (issue 12, "agent share")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nodeforge.bootstrap import munge
from nodeforge.bootstrap.host import Host
from nodeforge.bootstrap.params import parse_params
from nodeforge.bootstrap.paths import Paths
from tests.unit.test_bootstrap import COMPUTE, FakeMachine, make

pytestmark = pytest.mark.unit

DOWNLOAD_STACK = ("nodeforge.download", "urllib.request", "http.client", "ssl")


def _munge_calls(fm: FakeMachine) -> list[list[str]]:
    return [c for c in fm.calls if c[0] == "systemctl" and c[-1] == "munge.service"]


def test_first_boot_starts_munge_with_one_systemctl_call(tmp_path):
    agent, fm, paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    first_munge_n = fm.calls.index(["munge", "-n"])
    before = [c for c in _munge_calls(fm) if fm.calls.index(c) < first_munge_n]
    # the key was written: one restart (it starts a stopped munged), no is-active first
    assert before == [["systemctl", "restart", "munge.service"]]
    assert paths.munge_key.read_bytes() == agent.params.munge_key_bytes()


def test_unchanged_key_only_starts_munge(tmp_path):
    paths = Paths.under(tmp_path)
    fm = FakeMachine(tmp_path, "c1")
    host = Host(run=fm.run, chown=lambda *a: None, sleep=lambda s: None)
    params = parse_params(COMPUTE, "test")
    munge.run(host, paths, params, "test")  # writes the key
    fm.calls.clear()
    fm.active.discard("munge.service")  # e.g. stopped by an operator; key already in place
    detail = munge.run(host, paths, params, "test")
    assert detail == {"key": "unchanged"}
    assert _munge_calls(fm) == [["systemctl", "start", "munge.service"]]
    assert fm.calls[-1] == ["munge", "-n"]


def test_munge_poll_is_short_when_munged_answers_late(tmp_path):
    """munged that answers on the 3rd `munge -n`: the waits between are 0.05 s, not 1 s."""
    paths = Paths.under(tmp_path)
    fm = FakeMachine(tmp_path, "c1")
    sleeps: list[float] = []
    answers = iter([1, 1, 0])
    real_run = fm.run

    def run(argv, **kw):
        if argv[0] == "munge":
            return subprocess.CompletedProcess(argv, next(answers), "", None)
        return real_run(argv, **kw)

    host = Host(run=run, chown=lambda *a: None, sleep=sleeps.append)
    munge.run(host, paths, parse_params(COMPUTE, "test"), "test")
    assert sleeps == [0.05, 0.05]


_NODE_PATH = """
import json, sys
from nodeforge.bootstrap import agent, hooks
from nodeforge.bootstrap.node_roles import compute
from nodeforge.bootstrap.params import parse_params
from nodeforge.bootstrap.paths import Paths
paths = Paths.under(sys.argv[1])
params = parse_params(json.loads(sys.argv[2]), "test")
found = [h.name for h in hooks.discover(paths, params)]
print(json.dumps({"hooks": found, "loaded": [m for m in sys.argv[3].split() if m in sys.modules]}))
"""


def _node_path(tmp_path, params: dict) -> dict:
    cp = subprocess.run(
        [sys.executable, "-c", _NODE_PATH, str(tmp_path), json.dumps(params), " ".join(DOWNLOAD_STACK)],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return json.loads(cp.stdout)


def test_node_without_extension_hooks_never_loads_the_download_stack(tmp_path):
    got = _node_path(tmp_path, COMPUTE)
    assert got == {"hooks": [], "loaded": []}


def test_extension_hook_still_loads_it_and_is_validated(tmp_path):
    """The control: a named extension hook needs nodeforge.download, and gets it."""
    got = _node_path(tmp_path, COMPUTE | {"hooks": ["https://hooks.example/setup.sh"]})
    assert got["hooks"] == ["setup.sh"]
    assert "nodeforge.download" in got["loaded"]
