"""Fuzz every parser of input from outside, with hypothesis (no root, no network).

    .venv/bin/python bench/fuzz_parsers.py [--examples N] [--only NAME ...] [--json]

Parsers: node.yaml (`load_node_yaml`), the kernel command line (`params check --cmdline`'s
reader and the agent's), EC2 user-data (cloud-config, plain YAML, scripts, MIME multipart),
HyperPod's two JSON files, the versions file, gang.yaml, and Slurm's records (JSON jobs and
nodes, with and without the block cache; `scontrol -o show node` lines; `--version`).

The invariant, for every input: no traceback. Either a valid result, or the parser's own
error (ParamsError, ConfigError, NodeforgeError, SlurmDataError) whose message starts with the
source it read (file or label) and is bounded in length. Inputs mix grammar-shaped documents
with what YAML 1.1 retypes (`2:00:00`, `010`, `0x1f`), nesting far past any bound, anchors,
tags, NaN, huge integers, truncation and control characters.

The unit tier runs each target with a few dozen examples (tests/unit/core/test_parsers_fuzz.py);
this runs --examples per target and prints, per parser, the cases run and the failures (the
first falsifying input, shrunk, with its traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
MESSAGE_MAX = 12000  # an error quotes a value at most a few KiB long, never the document


class InvariantBroken(AssertionError):
    pass


def expect(fn: Callable[[], Any], allowed: tuple[type[BaseException], ...], *sources: str) -> Any:
    """Run *fn*: a result, or an *allowed* error whose message names one of *sources* at its
    start ("versions file PATH: ..." names PATH too)."""
    try:
        return fn()
    except allowed as exc:
        msg = str(exc)
        if not any(src in msg[: len(src) + 40] for src in sources):
            raise InvariantBroken(f"error does not name {sources!r}: {msg[:300]!r}") from exc
        if len(msg) > MESSAGE_MAX:
            raise InvariantBroken(f"error of {len(msg)} characters: {msg[:200]!r}") from exc
        return None


# -- shared pieces --------------------------------------------------------------------------
# What YAML 1.1 retypes, what strict YAML refuses, and hostile characters.
SCALARS = [
    "010", "0o10", "0x1f", "0b11", "1_000", "2:00:00", "1:30", "190:20:30", "1-12:00:00",
    "2024-01-01", "2024-13-45 25:00:00", ".nan", ".inf", "-.inf", "1e999", "1.0e+999", "-1",
    "0", "96", "4.5", "99999999999999999999999", "9" * 5000, "yes", "off", "~", "null", "",
    "true", "!!int 010", "!!binary aGk=", "!!python/object:os.system x", "&a 1", "*a",
    "[a, b]", "{a: 1}", "'quoted'", '"\\x00"', '"\\u2028"', "|\n  block\n", ">-\n  folded\n",
    "compute", "controller", "demo", "10.0.0.1", "::", "ctl.example", "x" * 5000, "é", "\t1",
    "INFINITE", "= ", "<<", "? a", "- a", "%", "@x", "`x", "'unterminated", '"unterminated',
]  # fmt: skip
PARAM_KEYS = [
    "role", "cluster_name", "controller", "node_name", "node_address", "munge_key_file",
    "features", "gres", "gres_types", "cpus", "real_memory", "max_node_count", "accounting",
    "docker", "hook_timeout", "hook_retries", "hook_backoff", "hook_backoff_max",
    "hook_output_max", "wait_timeout", "expected_gpus", "health_interval", "s3_endpoint_url",
    "extra", "unknown_key", "<<", "role",
]  # fmt: skip
NESTED = [
    "partitions:\n  - name: p\n    max_time: {v}\n",
    "partitions: [{{name: p, default: {v}}}]\n",
    "hooks:\n  - uri: file:///x\n    timeout: {v}\n    retries: {v}\n",
    "controller:\n  host: {v}\n  address: {v}\n",
    "extra:\n  k: {v}\n  l: [{v}, {v}]\n",
    "users_keypair:\n  public: {v}\n  private: {v}\n",
]
BASE = "role: compute\ncluster_name: demo\ncontroller: 10.0.0.1\n"
scalar = st.one_of(st.sampled_from(SCALARS), st.text(max_size=12))


def _nest(n: int, kind: str) -> str:
    if kind == "flow":
        return "[" * n + "]" * n
    if kind == "open":
        return "[" * n
    if kind == "map":
        return "{a: " * n + "1" + "}" * n
    return "".join(f"\n{'  ' * (i + 1)}a:" for i in range(n)) + " 1"


deep = st.builds(
    lambda key, n, kind: f"{key}: {_nest(n, kind)}\n",
    st.sampled_from(["extra", "partitions", "hooks", "x"]),
    st.integers(0, 3000),
    st.sampled_from(["flow", "open", "map", "block"]),
)
wide = st.builds(
    lambda n, item: "extra:\n  big: [" + ", ".join([item] * n) + "]\n",
    st.integers(0, 30000),
    st.sampled_from(["1", "a", "{}", "[]"]),
)
param_line = st.one_of(
    st.builds(lambda k, v: f"{k}: {v}\n", st.sampled_from(PARAM_KEYS), scalar),
    st.builds(lambda t, v: t.format(v=v), st.sampled_from(NESTED), scalar),
    deep,
)
TOKENS = ["\n", " ", "  ", "- ", ": ", "[", "]", "{", "}", ",", "#", "&a ", "*a", "!!str ",
          "? ", "'", '"', "|", ">", "---\n", "...\n", "%YAML 1.1\n", "\t", "\x00", "\ufeff",
          "\u2028", "role", "nodeforge", "cpus", "010", "2:00:00", "a"]  # fmt: skip
soup = st.lists(st.sampled_from(TOKENS), max_size=40).map("".join)
yaml_doc = st.one_of(
    st.lists(param_line, max_size=8).map(lambda ls: BASE + "".join(ls)),
    st.lists(param_line, max_size=6).map("".join),
    soup,
    wide,
)


def _write(dirpath: Path, name: str, text: str | bytes, mode: int = 0o600) -> Path:
    p = dirpath / name
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    p.write_bytes(text)
    p.chmod(mode)
    return p


# -- targets ----------------------------------------------------------------------------------
def t_node_yaml(work: Path) -> tuple[st.SearchStrategy, Callable[[Any], None]]:
    from nodeforge.bootstrap.params import ParamsError
    from nodeforge.bootstrap.params_sources import load_node_yaml

    def check(text: str) -> None:
        p = _write(work, "node.yaml", text)
        expect(lambda: load_node_yaml(p), (ParamsError,), str(p))

    return yaml_doc, check


CMD_TOKENS = [
    "nodeforge.role=compute", "nodeforge.cluster=demo", "nodeforge.controller=10.0.0.1",
    "nodeforge.controller=ctl(10.0.0.2)", "nodeforge.cpus=", "nodeforge.cpus=010",
    "nodeforge.hook_timeout=", "nodeforge.accounting=", "nodeforge.features=",
    "nodeforge.munge_key=", "nodeforge.params=file:///nonexistent/p.yaml",
    "nodeforge.params=https://x.invalid/p", "nodeforge.role=", "nodeforge.node=",
    "nodeforge.max_node_count=", "nodeforge.bogus=1", "quiet", "--", " ", "  ", "\t", "\n",
    "\xa0", '"', "=", ",", "010", "0x1f", "1_000", "2.5", "nan", "é", "\x00", "\u2028", "a",
]  # fmt: skip
cmdline = st.lists(st.sampled_from(CMD_TOKENS), max_size=30).map("".join)


def t_cmdline(work: Path) -> tuple[st.SearchStrategy, Callable[[Any], None]]:
    from nodeforge.bootstrap.params import ParamsError, parse_params
    from nodeforge.bootstrap.params_check import check_cmdline
    from nodeforge.bootstrap.params_sources import cmdline_params

    def offline(url: str, label: str) -> dict[str, Any]:
        raise ParamsError(f"{label}: not fetched in the fuzz run")

    def agent(text: str) -> None:  # what `node init` does with /proc/cmdline
        data = cmdline_params(text, "kernel command line", url_reader=offline)
        if data is not None:
            parse_params(data, "kernel command line")

    def check(raw: bytes) -> None:
        text = raw.decode("latin-1")  # /proc/cmdline bytes, as the agent reads them
        label = "kernel command line (--cmdline)"
        expect(lambda: check_cmdline(text, label), (ParamsError,), label)
        expect(lambda: agent(text), (ParamsError,), "kernel command line")

    return cmdline.map(lambda s: s.encode("utf-8")), check


MIME = (
    'MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary="==B=="\n\n--==B==\n'
    'Content-Type: text/cloud-config; charset="us-ascii"\n\n{part}\n--==B==\n'
    "Content-Type: text/x-shellscript\n\n#!/bin/sh\necho hi\n--==B==--\n"
)
user_data = st.one_of(
    yaml_doc.map(lambda d: "#cloud-config\nnodeforge:\n" + "".join("  " + ln + "\n" for ln in d.splitlines())),
    yaml_doc.map(lambda d: "#cloud-config\n" + d),
    yaml_doc,
    yaml_doc.map(lambda d: MIME.format(part="#cloud-config\n" + d)),
    yaml_doc.map(lambda d: "#!/bin/bash\n" + d),
    st.builds(lambda n: "#cloud-config\nruncmd: " + "[" * n + "]" * n + "\n", st.integers(0, 5000)),
    st.builds(lambda n: "#cloud-config\nx: &a [1]\n" + "".join(f"y{i}: *a\n" for i in range(n)), st.integers(0, 50)),
)  # fmt: skip


def t_user_data(work: Path) -> tuple[st.SearchStrategy, Callable[[Any], None]]:
    from nodeforge.bootstrap.params import ParamsError
    from nodeforge.bootstrap.params_check import check_user_data

    def check(text: str) -> None:
        p = _write(work, "user-data", text)
        expect(lambda: check_user_data(p, True), (ParamsError,), str(p))

    return user_data, check


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8,
)
name_or_junk = st.one_of(st.sampled_from(["ctl", "workers", "login", "g1"]), json_value)
ip_or_junk = st.one_of(st.sampled_from(["10.0.0.1", "10.0.0.2", "::1", "0.0.0.0"]), json_value)
instance = st.fixed_dictionaries(
    {"CustomerIpAddress": ip_or_junk, "InstanceName": name_or_junk},
    optional={"AgentIpAddress": json_value},
)
resource_config = st.fixed_dictionaries(
    {
        "InstanceGroups": st.lists(
            st.fixed_dictionaries(
                {"Name": name_or_junk, "Instances": st.lists(instance, max_size=3)}
            ),
            max_size=3,
        )
    }
)
provisioning = st.fixed_dictionaries(
    {"controller_group": name_or_junk},
    optional={
        "workload_manager": st.sampled_from(["slurm", "k8s"]),
        "login_group": name_or_junk,
        "cluster_name": name_or_junk,
        "worker_groups": st.lists(
            st.fixed_dictionaries(
                {"instance_group_name": name_or_junk, "partition_name": name_or_junk}
            ),
            max_size=3,
        ),
        "nodeforge": st.dictionaries(st.sampled_from(PARAM_KEYS), json_value, max_size=4),
    },
)


def _mutate_json(doc: Any, how: str, n: int) -> str:
    text = json.dumps(doc)
    if how == "truncate":
        return text[: n % (len(text) + 1)]
    if how == "deep":
        return text[:-1] + ', "z": ' + "[" * n + "]" * n + "}" if text.endswith("}") else text
    if how == "bigint":
        return text.replace("1", "1" * (n + 1), 1)
    if how == "nan":
        return text.replace("0", "NaN", 1)
    return text


def json_doc(shape: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(
        _mutate_json,
        shape,
        st.sampled_from(["none", "none", "truncate", "deep", "bigint", "nan"]),
        st.integers(0, 6000),
    )


def t_hyperpod(work: Path) -> tuple[st.SearchStrategy, Callable[[Any], None]]:
    from nodeforge.bootstrap.params import ParamsError
    from nodeforge.bootstrap.params_check import check_hyperpod

    def check(docs: tuple[str, str]) -> None:
        _write(work, "resource_config.json", docs[0])
        _write(work, "provisioning_parameters.json", docs[1])
        expect(lambda: check_hyperpod(work, ["10.0.0.1"], "ctl"), (ParamsError,), str(work))

    return st.tuples(json_doc(resource_config), json_doc(provisioning)), check


def _versions_lines() -> list[str]:
    return (REPO / "images" / "versions.yaml").read_text().splitlines(keepends=True)


def _edit_lines(lines: list[str], edits: list[tuple[int, str, str]]) -> str:
    out = list(lines)
    for i, how, val in edits:
        if not out:
            break
        j = i % len(out)
        line = out[j]
        if how == "value" and ":" in line:
            out[j] = line.split(":", 1)[0] + ": " + val + "\n"
        elif how == "insert":
            out.insert(j, val + "\n")
        elif how == "delete":
            del out[j]
        elif how == "truncate":
            out = out[:j]
    return "".join(out)


edits = st.lists(
    st.tuples(
        st.integers(0, 10**6),
        st.sampled_from(["value", "value", "insert", "delete", "truncate"]),
        st.one_of(scalar, deep.map(str.strip), soup),
    ),
    max_size=5,
)


def t_versions(work: Path) -> tuple[st.SearchStrategy, Callable[[Any], None]]:
    from nodeforge.errors import NodeforgeError
    from nodeforge.images import versions

    lines = _versions_lines()

    def check(text: str) -> None:
        p = _write(work, "versions.yaml", text, 0o644)
        expect(lambda: versions.load(p), (NodeforgeError,), str(p))

    return st.one_of(edits.map(lambda e: _edit_lines(lines, e)), yaml_doc), check


GANG_KEYS = [
    "timeout", "recovery_timeout", "block_admission", "not_requeueable", "interval_seconds",
    "command_timeout", "seed", "node_strike_limit", "node_strike_window_seconds",
    "node_strike_max_drained", "state_file", "requeuing", "gangs", "probe", "bogus",
]  # fmt: skip
GANG_NESTED = [
    "requeuing:\n  backoff_base_seconds: {v}\n  backoff_limit_count: {v}\n  jitter: {v}\n",
    "gangs:\n  min_nodes: {v}\n  partitions: {v}\n  comment_flag: {v}\n",
    "probe:\n  mode: {v}\n  command: {v}\n  timeout: {v}\n",
]
gang_doc = st.one_of(
    st.lists(
        st.one_of(
            st.builds(lambda k, v: f"{k}: {v}\n", st.sampled_from(GANG_KEYS), scalar),
            st.builds(lambda t, v: t.format(v=v), st.sampled_from(GANG_NESTED), scalar),
            deep,
        ),
        max_size=6,
    ).map("".join),
    soup,
)


def t_gang_config(work: Path) -> tuple[st.SearchStrategy, Callable[[Any], None]]:
    from nodeforge.gang import config

    def check(text: str) -> None:
        p = _write(work, "gang.yaml", text, 0o644)
        expect(lambda: config.load(p, missing_ok=False), (config.ConfigError,), str(p))

    return gang_doc, check


SPLICE = ["[", "{", "]", "}", '"', ",", "NaN", "1e999", "-1", "null", "true", '"x"',
          "99999999999999999999999", "\x00", "\\u0000", "é", "\n    }", "[" * 3000]  # fmt: skip


def _splice(text: str, cuts: list[tuple[int, int, str]]) -> str:
    for pos, length, ins in cuts:
        p = pos % (len(text) + 1)
        text = text[:p] + ins + text[p + length % 40 :]
    return text


RECORD = "Slurm JSON: "  # a record's own error: "Slurm JSON: node c1: field 'state' ..."


def t_slurm_records(work: Path) -> tuple[st.SearchStrategy, Callable[[Any], None]]:
    from nodeforge import slurm_records as sr
    from nodeforge.gang import slurm_view as gang_slurm

    fixtures = REPO / "tests" / "fixtures" / "slurm"
    jobs = (fixtures / "scontrol-show-job-24.11.json").read_text()
    nodes = (fixtures / "scontrol-show-node-24.11.json").read_text()
    fixture = {"jobs": jobs, "nodes": nodes}
    cuts = st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 40), st.sampled_from(SPLICE)),
        min_size=1,
        max_size=4,
    )
    doc = st.one_of(
        st.tuples(st.just("jobs"), cuts.map(lambda c: _splice(jobs, c))),
        st.tuples(st.just("nodes"), cuts.map(lambda c: _splice(nodes, c))),
        st.tuples(st.sampled_from(["jobs", "nodes"]), json_value.map(json.dumps)),
        st.tuples(
            st.just("line"),
            st.builds(lambda s: "NodeName=n1 " + s, st.text(max_size=60)) | st.text(max_size=60),
        ),
        st.tuples(st.just("version"), st.text(max_size=30)),
    )

    def check(item: tuple[str, str]) -> None:
        kind, text = item
        err = (sr.SlurmDataError,)
        if kind in ("jobs", "nodes"):
            parse = sr.parse_jobs if kind == "jobs" else sr.parse_nodes
            cache = sr.BlockCache()
            parse(fixture[kind].encode(), kind, cache)  # a valid pass first: the cache is used
            raw = text.encode("utf-8", "surrogatepass")
            expect(lambda: parse(raw, kind, cache), err, kind, RECORD)
            expect(lambda: parse(text, kind), err, kind, RECORD)
            if kind == "jobs":  # the governor's reader on top (JobObs, its own cache)
                gcache = gang_slurm.JobCache()
                gang_slurm.parse_jobs(fixture["jobs"].encode(), "jobs", gcache)
                expect(lambda: gang_slurm.parse_jobs(raw, "jobs", gcache), err, kind, RECORD)
        elif kind == "line":
            expect(lambda: sr.node_from_line(text, "n1"), err, "scontrol show node n1")
        else:
            expect(lambda: sr.parse_version(text), err, "scontrol --version")

    return doc, check


TARGETS: dict[str, Callable[[Path], tuple[st.SearchStrategy, Callable[[Any], None]]]] = {
    "node_yaml": t_node_yaml,
    "cmdline": t_cmdline,
    "user_data": t_user_data,
    "hyperpod": t_hyperpod,
    "versions": t_versions,
    "gang_config": t_gang_config,
    "slurm_records": t_slurm_records,
}


@dataclass
class Result:
    name: str
    cases: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def run(name: str, examples: int, work: Path) -> Result:
    """*examples* cases of one target; the first failure (shrunk) with its traceback."""
    strategy, check = TARGETS[name](work)
    res = Result(name)

    @settings(
        max_examples=examples,
        deadline=None,  # a shared CI machine: a slow example is not a failure
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(strategy)
    def prop(value: Any) -> None:
        res.cases += 1
        try:
            check(value)
        except InvariantBroken:
            raise
        except Exception as exc:
            raise InvariantBroken(
                f"{type(exc).__name__} escaped for input {value!r:.300}:\n"
                + "".join(traceback.format_exception(exc))[-3000:]
            ) from exc

    t0 = time.perf_counter()
    try:
        prop()
    except InvariantBroken as exc:
        res.failures.append(str(exc))
    except BaseExceptionGroup as group:  # hypothesis found several distinct failures
        res.failures += [str(e) for e in group.exceptions]
    res.seconds = round(time.perf_counter() - t0, 2)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000, help="cases per parser")
    ap.add_argument("--only", nargs="*", choices=sorted(TARGETS), help="these parsers only")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="nodeforge-fuzz-") as tmp:
        for name in a.only or TARGETS:
            work = Path(tmp) / name
            work.mkdir()
            rows.append(run(name, a.examples, work))
    if a.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
    else:
        print(f"{'parser':14} {'cases':>7} {'failures':>8} {'seconds':>8}")
        for r in rows:
            print(f"{r.name:14} {r.cases:7} {len(r.failures):8} {r.seconds:8}")
        for r in rows:
            for f in r.failures:
                print(f"\n--- {r.name} ---\n{f}")
    return 1 if any(r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
