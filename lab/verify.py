"""`nodeforge verify`: run the testinfra suites (tests/infra/) against booted nodes.

Host specs (``--hosts``, comma separated or repeated):

* ``ssh://[user@]host[:port][?key=PATH&name=LABEL]``  paramiko (testinfra's backend); the key
  may also come from ``--ssh-key``; host keys are not checked (fresh nodes have new ones —
  that is what the host-key check asserts).
* ``nsenter://PID``  a local node: commands run as ``nsenter -t PID -a -- sh -c …`` (testinfra
  has no nspawn backend; this wraps its local one).
* ``nspawn://CLUSTER``  every node of a `nodeforge cluster` (leader PIDs from its state),
  ``nspawn://CLUSTER/NODE`` one of them.
* ``vm://IMAGE_DIR?role=…&name=…``  boot the built disk in qemu (nodeforge.lab.vm), run the
  suite over SSH, stop it. Params for the agent: ``params=PATH`` (a node.yaml) or ``role=``.

Every check learns the host's role from the host itself (/var/lib/nodeforge/state.json);
a failing check is reported as ``host``, ``role``, ``check`` and the command output.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import time
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nodeforge.errors import NodeforgeError

SCHEMES = ("ssh", "nsenter", "nspawn", "vm")


class HostSpecError(NodeforgeError):
    pass


@dataclasses.dataclass(frozen=True)
class HostSpec:
    scheme: str  # ssh | nsenter | nspawn | vm
    label: str  # how the host is named in reports
    user: str = "root"
    host: str = ""
    port: int = 22
    key: str | None = None
    pid: int | None = None
    cluster: str | None = None
    node: str | None = None
    image_dir: str | None = None
    options: tuple[tuple[str, str], ...] = ()

    def option(self, name: str, default: str | None = None) -> str | None:
        return dict(self.options).get(name, default)


def parse_host_spec(text: str, ssh_key: str | None = None) -> HostSpec:
    """Parse one host spec; errors name the spec and say what is expected."""
    raw = text.strip()
    if re.search(r"[\x00-\x1f\x7f]", raw):
        raise HostSpecError(f"host spec {raw!r}: control characters are not allowed")
    if "://" not in raw:
        raise HostSpecError(
            f"host spec {raw!r}: expected SCHEME://…, one of "
            "ssh://user@host:port, nsenter://PID, nspawn://CLUSTER[/NODE], vm://IMAGE_DIR"
        )
    scheme, rest = raw.split("://", 1)
    if scheme not in SCHEMES:
        raise HostSpecError(
            f"host spec {raw!r}: unknown scheme {scheme!r} (use {', '.join(SCHEMES)})"
        )
    body, _, query = rest.partition("?")
    opts = _options(raw, scheme, query)
    od = dict(opts)
    if scheme == "ssh":
        m = _SSH_TARGET.fullmatch(body)
        if not body:
            raise HostSpecError(f"host spec {raw!r}: missing host (ssh://user@host:port)")
        if m is None:
            raise HostSpecError(
                f"host spec {raw!r}: expected ssh://[user@]host[:port] (user [a-z_][a-z0-9_.-], "
                "host a DNS name, an IPv4 or a [bracketed] IPv6 address)"
            )
        port = int(m["port"] or 22)
        if not 1 <= port <= 65535:
            raise HostSpecError(f"host spec {raw!r}: port must be a number 1-65535")
        host, user = m["host"].strip("[]"), m["user"] or "root"
        key = od.get("key") or ssh_key
        label = od.get("name") or f"{user}@{host}:{port}"
        return HostSpec("ssh", label, user=user, host=host, port=port, key=key, options=opts)
    if scheme == "nsenter":
        if not _PID.fullmatch(body):
            raise HostSpecError(f"host spec {raw!r}: nsenter:// takes a PID (a positive integer)")
        return HostSpec("nsenter", od.get("name") or f"pid{body}", pid=int(body), options=opts)
    if scheme == "nspawn":
        if _PID.fullmatch(body):
            return HostSpec("nsenter", od.get("name") or f"pid{body}", pid=int(body), options=opts)
        cluster, _, node = body.partition("/")
        if not _LABEL.fullmatch(cluster) or (node and not _LABEL.fullmatch(node)):
            raise HostSpecError(
                f"host spec {raw!r}: expected nspawn://CLUSTER[/NODE] or nspawn://PID "
                "(names of A-Z a-z 0-9 _ . -)"
            )
        label = f"{cluster}/{node}" if node else cluster
        return HostSpec("nspawn", label, cluster=cluster, node=node or None, options=opts)
    # vm
    if not body:
        raise HostSpecError(
            f"host spec {raw!r}: expected vm://IMAGE_DIR (a `nodeforge build` output)"
        )
    name = od.get("name") or od.get("role") or "vm"
    return HostSpec("vm", f"vm:{name}", image_dir=body, options=opts)


_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_PID = re.compile(r"[1-9][0-9]{0,9}")
_SSH_TARGET = re.compile(
    r"(?:(?P<user>[a-z_][a-z0-9_.-]{0,31})@)?"
    r"(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])"
    r"(?::(?P<port>[0-9]{1,5}))?"
)
_BOOL = ("1", "0", "yes", "no", "true", "false")
# Each scheme's query options and their full-match grammar: checked when the spec is parsed,
# so a typo fails before anything boots (a vm:// boot takes minutes).
_OPTIONS: dict[str, dict[str, tuple[re.Pattern[str] | tuple[str, ...], str]]] = {
    "ssh": {"key": (re.compile(r"[^\x00-\x1f\x7f]{1,4096}"), "a path"),
            "name": (_LABEL, "a label (A-Z a-z 0-9 _ . -)")},
    "nsenter": {"name": (_LABEL, "a label (A-Z a-z 0-9 _ . -)")},
    "nspawn": {},
    "vm": {
        "role": (("controller", "compute", "login"), "controller, compute or login"),
        "name": (_LABEL, "a label (A-Z a-z 0-9 _ . -)"),
        "cluster": (re.compile(r"[a-z0-9][a-z0-9_-]{0,39}"), "a cluster name ([a-z0-9_-])"),
        "params": (re.compile(r"[^\x00-\x1f\x7f]{1,4096}"), "the path of a node.yaml"),
        "accel": (("auto", "kvm", "tcg"), "auto, kvm or tcg"),
        "compat_net": (_BOOL, "yes or no"),
        "compat_keygen": (_BOOL, "yes or no"),
    },
}  # fmt: skip


def _options(raw: str, scheme: str, query: str) -> tuple[tuple[str, str], ...]:
    try:
        opts = urllib.parse.parse_qsl(
            query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=16
        )
    except ValueError as exc:
        raise HostSpecError(f"host spec {raw!r}: malformed query ({exc})") from None
    allowed = _OPTIONS[scheme]
    seen: set[str] = set()
    for k, val in opts:
        if k not in allowed:
            known = ", ".join(allowed) or "none"
            raise HostSpecError(
                f"host spec {raw!r}: {scheme}:// has no option {k!r} (options: {known})"
            )
        if k in seen:
            raise HostSpecError(f"host spec {raw!r}: option {k!r} given twice")
        seen.add(k)
        grammar, what = allowed[k]
        ok = val in grammar if isinstance(grammar, tuple) else grammar.fullmatch(val)
        if not ok:
            raise HostSpecError(f"host spec {raw!r}: {k}={val!r}: expected {what}")
    return tuple(opts)


def parse_host_specs(values: Iterable[str], ssh_key: str | None = None) -> list[HostSpec]:
    out: list[HostSpec] = []
    for v in values:
        for part in v.split(","):
            if part.strip():
                out.append(parse_host_spec(part, ssh_key))
    if not out:
        raise HostSpecError("no hosts given: use --hosts SPEC[,SPEC…]")
    labels = [h.label for h in out]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise HostSpecError(
            f"duplicate host label(s) {', '.join(dup)}: add ?name=LABEL to tell them apart"
        )
    return out


def expand_nspawn(spec: HostSpec) -> list[HostSpec]:
    """nspawn://CLUSTER[/NODE] -> nsenter specs, via the local cluster's state (needs root)."""
    if spec.scheme != "nspawn":
        return [spec]
    from nodeforge.lab import localcluster  # the cluster code; imported only when used

    cluster = localcluster.Cluster.load(spec.cluster or "")
    nodes = [cluster.node(spec.node)] if spec.node else list(cluster.nodes)
    return [
        HostSpec(
            "nsenter",
            f"{cluster.name}/{n.name}",
            pid=localcluster.leader_pid(n),
            options=spec.options,
        )
        for n in nodes
    ]


# ------------------------------------------------------------------------ testinfra backends


def nsenter_command(pid: int, command: str) -> list[str]:
    """argv that runs a shell *command* inside every namespace of *pid* (its root, its PATH)."""
    return [
        "nsenter", "-t", str(pid), "-a", "--",
        "env", "-i", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG=C.UTF-8", "HOME=/root", "/bin/sh", "-c", command,
    ]  # fmt: skip


def make_host(spec: HostSpec) -> Any:
    """A testinfra Host for *spec* (ssh or nsenter; expand nspawn and boot vm first)."""
    import testinfra
    from testinfra.backend import base as tbase
    from testinfra.backend.local import LocalBackend

    if spec.scheme == "nsenter":
        assert spec.pid is not None
        pid = spec.pid

        class NsenterBackend(LocalBackend):  # testinfra's local backend, through nsenter
            NAME = "nsenter"

            def run(self, command: str, *args: str, **kwargs: Any) -> tbase.CommandResult:
                cmd = self.get_command(command, *args)
                return self.run_local(" ".join(shlex.quote(a) for a in nsenter_command(pid, cmd)))

            def get_pytest_id(self) -> str:
                return spec.label

        backend = NsenterBackend()
        host = testinfra.host.Host(backend)
        backend.set_host(host)
        return host
    if spec.scheme == "ssh":
        alias = ssh_alias(spec)
        kw: dict[str, Any] = {"timeout": 30, "ssh_config": _ssh_config_for(spec, alias)}
        return testinfra.get_host(f"paramiko://{spec.user}@{alias}", **kw)
    raise HostSpecError(f"{spec.label}: scheme {spec.scheme} must be resolved before connecting")


def ssh_alias(spec: HostSpec) -> str:
    """A Host alias for ssh_config made of the label (no @, :, spaces)."""
    import re

    return "nf-" + re.sub(r"[^A-Za-z0-9_.-]", "_", spec.label)


def _ssh_config_for(spec: HostSpec, alias: str) -> str:
    """An ssh_config file for one host (paramiko reads it: port, key, no host-key check)."""
    import tempfile

    lines = [
        f"Host {alias}",
        f"  HostName {spec.host}",
        f"  Port {spec.port}",
        f"  User {spec.user}",
        "  StrictHostKeyChecking no",
        "  UserKnownHostsFile /dev/null",
    ]
    if spec.key:
        lines.append(f"  IdentityFile {spec.key}")
    fd, path = tempfile.mkstemp(prefix="nodeforge-verify-", suffix=".ssh_config")
    with open(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    # paramiko reads it at connect time (lazily), so it lives until the process ends.
    import atexit
    import os

    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return path


# ------------------------------------------------------------------------------- reporting


def explain(cmd: str, r: Any, what: str, tail: int = 40) -> str:
    """A check's failure text: what is wrong, the command, its exit status and output."""
    out = (getattr(r, "stdout", "") or "").rstrip()
    err = (getattr(r, "stderr", "") or "").rstrip()
    text = f"{what}\n$ {cmd}\nexit {r.rc}"
    if out:
        text += "\n--- stdout ---\n" + "\n".join(out.splitlines()[-tail:])
    if err:
        text += "\n--- stderr ---\n" + "\n".join(err.splitlines()[-tail:])
    return text


@dataclasses.dataclass
class CheckResult:
    host: str
    role: str
    check: str  # module::test
    outcome: str  # passed | failed | skipped | error
    duration: float = 0.0
    message: str = ""  # assertion text (names the command and its output) or skip reason


def format_failure(r: CheckResult, max_lines: int = 30) -> str:
    """One failure as the operator reads it: host, role, check, then the evidence."""
    lines = (r.message or "(no output)").strip().splitlines()
    if len(lines) > max_lines:
        lines = (
            lines[:5]
            + [f"… ({len(lines) - max_lines + 5} lines cut) …"]
            + lines[-(max_lines - 6) :]
        )
    body = "\n".join("    " + ln for ln in lines)
    return f"FAIL  host={r.host}  role={r.role}  check={r.check}\n{body}"


def junit_xml(results: list[CheckResult], unreachable: Iterable[tuple[str, str]] = ()) -> str:
    """JUnit XML for CI systems: one testsuite per host, one testcase per check."""
    import xml.etree.ElementTree as ET

    by_host: dict[str, list[CheckResult]] = {}
    for r in results:
        by_host.setdefault(r.host, []).append(r)
    root = ET.Element("testsuites", name="nodeforge verify")
    for host, why in unreachable:
        suite = ET.SubElement(root, "testsuite", name=host, tests="1", failures="0", errors="1",
                              skipped="0", time="0")  # fmt: skip
        case = ET.SubElement(suite, "testcase", classname=host, name="reachable", time="0")
        ET.SubElement(case, "error", message="host unreachable").text = why
    for host, rs in by_host.items():
        count = {k: sum(1 for r in rs if r.outcome == k) for k in ("failed", "error", "skipped")}
        suite = ET.SubElement(root, "testsuite", name=host, tests=str(len(rs)),
                              failures=str(count["failed"]), errors=str(count["error"]),
                              skipped=str(count["skipped"]),
                              time=f"{sum(r.duration for r in rs):.3f}")  # fmt: skip
        for r in rs:
            case = ET.SubElement(suite, "testcase", classname=f"{host}.{r.role}", name=r.check,
                                 time=f"{r.duration:.3f}")  # fmt: skip
            if r.outcome in ("failed", "error", "skipped"):
                tag = {"failed": "failure", "error": "error", "skipped": "skipped"}[r.outcome]
                first = (r.message or r.outcome).strip().splitlines()[:1] or [r.outcome]
                ET.SubElement(case, tag, message=first[0][:200]).text = r.message
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def format_report(results: list[CheckResult], durations: dict[str, float] | None = None) -> str:
    bad = [r for r in results if r.outcome in ("failed", "error")]
    out = [format_failure(r) for r in bad]
    by_host: dict[str, list[CheckResult]] = {}
    for r in results:
        by_host.setdefault(r.host, []).append(r)
    out.append("")
    out.append(f"{'host':<28} {'role':<11} {'pass':>5} {'fail':>5} {'skip':>5} {'seconds':>8}")
    for host, rs in by_host.items():
        role = next((r.role for r in rs if r.role and r.role != "?"), "?")
        n = {
            k: sum(1 for r in rs if r.outcome == k)
            for k in ("passed", "failed", "skipped", "error")
        }
        secs = (durations or {}).get(host, sum(r.duration for r in rs))
        out.append(f"{host:<28} {role:<11} {n['passed']:>5} {n['failed'] + n['error']:>5} "
                   f"{n['skipped']:>5} {secs:>8.1f}")  # fmt: skip
    out.append("")
    out.append(f"verify: {'FAILED' if bad else 'OK'}: {len(results) - len(bad)} of {len(results)} "
               f"checks passed or skipped, {len(bad)} failed")  # fmt: skip
    return "\n".join(out)


class _Collector:
    """pytest plugin: one CheckResult per test call (or setup error)."""

    def __init__(self) -> None:
        self.results: list[CheckResult] = []

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.results.append(CheckResult("(all)", "?", f"collect {report.nodeid or 'suite'}",
                                            "error", 0.0, str(report.longrepr)[-3000:]))  # fmt: skip

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            props = dict(getattr(report, "user_properties", []))
            host = props.get("nf_host", "?")
            role = props.get("nf_role", "?")
            check = check_name(report.nodeid)
            if report.outcome == "skipped":
                msg = (
                    report.longrepr[2]
                    if isinstance(report.longrepr, tuple)
                    else str(report.longrepr)
                )
                outcome = "skipped"
            elif report.outcome == "failed":
                msg = _failure_text(report)
                outcome = "failed" if report.when == "call" else "error"
            else:
                msg, outcome = "", "passed"
            self.results.append(CheckResult(host, role, check, outcome, report.duration, msg))


def check_name(nodeid: str) -> str:
    """``test_compute.py::test_x`` from a pytest node id: the module's file name and the test,
    without the host parameter (an nspawn node's label such as ``e2e/c001`` holds slashes, so the
    id is split at ``::`` before any ``/`` is looked at)."""
    path, sep, rest = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1] + sep + rest
    return name.split("[", 1)[0]


def _failure_text(report: Any) -> str:
    """The assertion message (our checks put the command and its output in it)."""
    lr = report.longrepr
    crash = getattr(lr, "reprcrash", None)
    text = str(lr)
    # Prefer the "E   " lines pytest shows: they hold the assertion message.
    elines = [ln[4:] for ln in text.splitlines() if ln.startswith("E   ")]
    if elines:
        return "\n".join(elines)
    return crash.message if crash is not None else text[-3000:]


def preflight(spec: HostSpec) -> str | None:
    """None if commands run on the host, else why not (so one line replaces N failures)."""
    try:
        r = make_host(spec).run("true")
    except Exception as exc:  # noqa: BLE001 - paramiko/socket errors of every kind
        return f"{type(exc).__name__}: {exc}"
    if r.rc != 0:
        return (r.stderr or r.stdout or f"exit {r.rc}").strip()[-500:]
    return None


def run_suite(
    specs: list[HostSpec],
    *,
    suite_dir: Path | None = None,
    select: str | None = None,
    pytest_args: Iterable[str] = (),
    quiet: bool = True,
) -> tuple[int, list[CheckResult]]:
    """Run tests/infra against *specs* (already resolved to ssh/nsenter). Returns (rc, results)."""
    import pytest

    from nodeforge import data

    suite_dir = suite_dir or data.path("tests/infra")  # the checkout's, or the wheel's copy
    payload = json.dumps([dataclasses.asdict(s) for s in specs])
    args = [
        str(suite_dir), "-p", "no:cacheprovider", "-p", "no:testinfra",
        "--rootdir", str(suite_dir), "-o", "addopts=", "--nf-hosts-json", payload,
    ]  # fmt: skip
    if quiet:  # our report says it all; pytest's terminal output only with verbose
        args += ["-p", "no:terminal"]
    if select:
        args += ["-k", select]
    args += list(pytest_args)
    col = _Collector()
    rc = pytest.main(args, plugins=[col])
    return int(rc), col.results


def host_from_payload(d: dict[str, Any]) -> HostSpec:
    d = dict(d)
    d["options"] = tuple(tuple(x) for x in d.get("options") or ())
    return HostSpec(**d)


def timed(fn: Any, *a: Any, **kw: Any) -> tuple[Any, float]:
    t = time.monotonic()
    r = fn(*a, **kw)
    return r, time.monotonic() - t
