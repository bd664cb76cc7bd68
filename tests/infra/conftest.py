"""testinfra suites, run by `nodeforge verify --hosts …` (lab/verify.py).

Each module holds the checks of one role (common, controller, compute, login). A host's role
is read from the host itself (/var/lib/nodeforge/state.json, else `nodeforge node status
--json`); checks of another role are skipped as "not this host's role". Every check fails
with a message that names the command and shows its output; verify adds host and role.

Run directly: pytest tests/infra --nf-hosts-json '[{"scheme": "ssh", …}]' (verify builds this).
"""

from __future__ import annotations

import json
import shlex
from typing import Any, ClassVar

import pytest

from nodeforge.lab import verify
from nodeforge.lab.verify import explain


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--nf-hosts-json", default="[]", help="hosts (JSON list of verify.HostSpec)")


def _specs(config: pytest.Config) -> list[verify.HostSpec]:
    return [verify.host_from_payload(d) for d in json.loads(config.getoption("--nf-hosts-json"))]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "role(name): the check applies to hosts of this role only")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "nf_spec" in metafunc.fixturenames:
        specs = _specs(metafunc.config)
        metafunc.parametrize("nf_spec", specs, ids=[s.label for s in specs], scope="module")


class Node:
    """One host under test: the testinfra Host plus what we learn about it once."""

    _cache: ClassVar[dict[str, Node]] = {}

    def __init__(self, spec: verify.HostSpec):
        self.spec = spec
        self.label = spec.label
        self.host = verify.make_host(spec)
        self._state: dict[str, Any] | None = None
        self._image: dict[str, Any] | None = None

    @classmethod
    def get(cls, spec: verify.HostSpec) -> Node:
        if spec.label not in cls._cache:
            cls._cache[spec.label] = cls(spec)
        return cls._cache[spec.label]

    # -- commands ------------------------------------------------------------------------
    def run(self, cmd: str, timeout: int | None = None):
        if timeout:
            cmd = f"timeout {int(timeout)} sh -c {shlex.quote(cmd)}"
        return self.host.run(cmd)

    def sh(self, cmd: str, timeout: int | None = 120, what: str = "") -> str:
        """Run *cmd*; fail the check (with the command and its output) unless it exits 0."""
        r = self.run(cmd, timeout)
        if r.rc != 0:
            pytest.fail(explain(cmd, r, what or "command failed"), pytrace=False)
        return r.stdout

    def open_files(self, unit: str) -> list[str]:
        """What the unit's main process has open (one readlink per descriptor: one that it
        closes meanwhile, e.g. a connection, is gone before it is read; `ls -l` of the whole
        directory failed on that in CI)."""
        pid = self.sh(f"systemctl show -P MainPID {shlex.quote(unit)}").strip()
        if not pid.isdigit() or pid == "0":
            pytest.fail(f"{unit} has no main process (MainPID {pid!r})", pytrace=False)
        out = self.run(f'for f in /proc/{pid}/fd/*; do readlink "$f"; done').stdout
        return out.split("\n")

    # -- facts ---------------------------------------------------------------------------
    @property
    def state(self) -> dict[str, Any]:
        if self._state is None:
            r = self.run(
                "cat /var/lib/nodeforge/state.json 2>/dev/null || nodeforge node status --json", 30
            )
            try:
                self._state = json.loads(r.stdout) if r.rc == 0 else {}
            except json.JSONDecodeError:
                self._state = {}
        return self._state

    @property
    def role(self) -> str:
        return str(self.state.get("role") or "?")

    def role_detail(self, key: str) -> Any:
        """What the agent's role step recorded for *key* (what this node is meant to run)."""
        step = (self.state.get("steps") or {}).get("role") or {}
        return (step.get("detail") or {}).get(key)

    @property
    def image(self) -> dict[str, Any]:
        if self._image is None:
            r = self.run("cat /etc/nodeforge/image.json", 30)
            if r.rc != 0:
                pytest.fail(
                    explain("cat /etc/nodeforge/image.json", r, "image manifest missing"),
                    pytrace=False,
                )
            self._image = json.loads(r.stdout)
        return self._image

    def boot_time(self) -> int:
        return int(self.sh("awk '/^btime/ {print $2}' /proc/stat").strip())


@pytest.fixture(scope="module")
def node(nf_spec: verify.HostSpec) -> Node:
    return Node.get(nf_spec)


@pytest.fixture(scope="session")
def all_nodes(request: pytest.FixtureRequest) -> list[Node]:
    return [Node.get(s) for s in _specs(request.config)]


@pytest.fixture
def host(node: Node):
    """testinfra's Host for the node under test (the usual testinfra fixture name)."""
    return node.host


@pytest.fixture(autouse=True)
def _role_gate(request: pytest.FixtureRequest) -> None:
    if "nf_spec" not in request.fixturenames:
        return
    n: Node = request.getfixturevalue("node")
    request.node.user_properties.append(("nf_host", n.label))
    request.node.user_properties.append(("nf_role", n.role))
    m = request.node.get_closest_marker("role")
    if m is not None and n.role not in m.args:
        pytest.skip(f"not this host's role ({n.role}; check is for {', '.join(m.args)})")
