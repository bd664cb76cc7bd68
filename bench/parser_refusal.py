"""Benchmark: the cost of refusing each parser's worst input, against parsing a typical valid one.

    .venv/bin/python bench/parser_refusal.py [--only PARSER ...] [--checkout DIR] [--json]

Parsers: node.yaml, EC2 user-data, a kernel command line, HyperPod's JSON, the versions file,
gang.yaml and Slurm's jobs JSON. Each input runs in a fresh process (imports done before the
clock starts), twice: once for wall time and the growth of the process's peak RSS (VmHWM),
once under tracemalloc for the peak of Python allocations. Hostile inputs are just under the
1 MiB document cap (so the byte cap is not what refuses them): flat lists and mappings past
the value bound, nesting far past the depth bound (flow and block), one huge scalar, and for
JSON a huge integer. The outcome column says how the parser answered (ok, or the error's
class and its first words); "crash" is anything that is not the parser's own error.

--checkout DIR runs the same inputs against another checkout's sources (e.g. a worktree of
main) for a before/after in one run.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CAP = (1 << 20) - 64  # under the 1 MiB cap: the other bounds must refuse these
BASE = "role: compute\ncluster_name: demo\ncontroller: 10.0.0.1\n"

TYPICAL_NODE_YAML = BASE + (
    "node_name: c17\n"
    f"munge_key: {base64.b64encode(b'k' * 64).decode()}\n"
    "features: [gpu, nvme, ib, a100]\ngres: [gpu:a100:8]\ncpus: 96\n"
    "partitions:\n  - {name: batch, default: true, max_time: 2-00:00:00}\n"
    "hooks:\n  - {uri: https://cfg.internal/hooks/10-mounts.sh, sha256: " + "a" * 64 + "}\n"
    "  - s3://bucket/lifecycle/20-users.sh\n"
    "wait_timeout: 360\nextra:\n  site: {rack: r7}\n  users: ["
    + ", ".join(f"u{i}" for i in range(20))
    + "]\n"
)


def _fill(head: str, unit: str, tail: str = "", cap: int = CAP) -> str:
    n = (cap - len(head) - len(tail)) // len(unit)
    return head + unit * n + tail


def _lines(head: str, line) -> str:
    parts, size, i = [head], len(head), 0
    while size + len(line(i)) + 2 < CAP:  # + 2: user-data indents each line by two more
        parts.append(line(i))
        size += len(parts[-1]) + 2
        i += 1
    return "".join(parts)


YAML_WORST = {
    "flat list": lambda pre: _fill(pre + "extra: {a: [", "1,", "1]}\n"),
    "flat mapping": lambda pre: _lines(pre + "extra:\n", lambda i: f"  k{i}: {i}\n"),
    "deep flow": lambda pre: _fill(pre + "extra: ", "["),
    "deep block": lambda pre: _fill(pre + "extra:\n  ", "- "),
    "huge scalar": lambda pre: _fill(pre + "extra: {a: ", "x", "}\n"),
}


def cases() -> dict[str, dict[str, tuple[str, str]]]:
    """parser -> case -> (file name, content)."""
    jobs = (REPO / "tests/fixtures/slurm/scontrol-show-job-24.11.json").read_text()
    versions = (REPO / "images/versions.yaml").read_text()
    rc = {
        "InstanceGroups": [
            {"Name": "ctl", "Instances": [{"CustomerIpAddress": "10.0.0.1", "InstanceName": "c"}]},
            {
                "Name": "workers",
                "Instances": [
                    {"CustomerIpAddress": f"10.0.{i // 250}.{i % 250 + 2}", "InstanceName": f"w{i}"}
                    for i in range(500)
                ],
            },
        ]
    }
    out: dict[str, dict[str, tuple[str, str]]] = {
        "node_yaml": {"typical": ("node.yaml", TYPICAL_NODE_YAML)},
        "user_data": {"typical": ("ud", "#cloud-config\nnodeforge:\n  role: compute\n  cluster_name: demo\n  controller: 10.0.0.1\n")},
        "versions": {"typical": ("versions.yaml", versions)},
        "gang_config": {"typical": ("gang.yaml", "timeout: 5m\nrequeuing:\n  backoff_base_seconds: 60\n")},
        "cmdline": {
            "typical": ("cmdline", "ro quiet nodeforge.role=compute nodeforge.cluster=demo nodeforge.controller=10.0.0.1 nodeforge.cpus=96"),
            "huge": ("cmdline", _fill("nodeforge.role=compute ", "nodeforge.features=a,b,c ")),
            "quotes": ("cmdline", _fill("nodeforge.role=", '"a ')),
            # just under the 64 KiB command-line cap: the worst that gets parsed
            "quotes 64K": ("cmdline", _fill("nodeforge.role=", '"a ', cap=65536 - 8)),
        },
        "hyperpod": {
            "typical": ("resource_config.json", json.dumps(rc)),
            "flat list": ("resource_config.json", _fill('{"InstanceGroups": [], "a": [', "1,", "1]}")),
            "deep": ("resource_config.json", _fill('{"InstanceGroups": ', "[")),
            "huge int": ("resource_config.json", _fill('{"InstanceGroups": [], "a": ', "9", "}")),
        },
        "slurm_jobs": {
            "typical": ("jobs.json", jobs),
            "deep": ("jobs.json", _fill('{"jobs": ', "[")),
        },
    }  # fmt: skip
    for parser, pre in (
        ("node_yaml", BASE),
        ("user_data", "#cloud-config\nnodeforge:\n  role: compute\n"),
        ("versions", "schema: 1\n"),
        ("gang_config", "timeout: 5m\n"),
    ):
        name = out[parser]["typical"][0]
        for case, make in YAML_WORST.items():
            text = make(pre)
            if parser == "user_data":  # inside the nodeforge: section
                text = text.replace("\nextra:", "\n  extra:").replace("\n  k", "\n    k")
            out[parser][case] = (name, text)
    return out


CHILD = r"""
import os, sys, time, tracemalloc, types, json, resource
checkout, parser, path, traced = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
if checkout:
    sys.path.insert(0, checkout)
    for sub in ("bootstrap", "gang", "images", "lab"):
        m = types.ModuleType("nodeforge." + sub); m.__path__ = [os.path.join(checkout, sub)]
        sys.modules["nodeforge." + sub] = m
from pathlib import Path
from nodeforge.errors import NodeforgeError
from nodeforge.bootstrap.params_check import check_cmdline, check_hyperpod, check_user_data
from nodeforge.bootstrap.params_sources import load_node_yaml
from nodeforge.images import versions
from nodeforge.gang import config
from nodeforge import slurm_records
p = Path(path)
fn = {
    "node_yaml": lambda: load_node_yaml(p),
    "user_data": lambda: check_user_data(p, True),
    "cmdline": lambda: check_cmdline(p.read_text(), "cmdline"),
    "hyperpod": lambda: check_hyperpod(p.parent, ["10.0.0.1"], ""),
    "versions": lambda: versions.load(p),
    "gang_config": lambda: config.load(p),
    "slurm_jobs": lambda: slurm_records.parse_jobs(p.read_bytes(), "jobs"),
}[parser]
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
if traced:
    tracemalloc.start()
before = hwm()
t0 = time.perf_counter()
try:
    fn(); outcome = "ok"
except NodeforgeError as exc:
    outcome = type(exc).__name__ + ": " + str(exc).replace(str(p.parent) + "/", "")[:70]
except BaseException as exc:
    outcome = "crash " + type(exc).__name__
took = time.perf_counter() - t0
print(json.dumps({"s": took, "rss": hwm() - before,
                  "peak": tracemalloc.get_traced_memory()[1] if traced else None,
                  "outcome": outcome}))
"""


def measure(checkout: str, parser: str, path: Path, timeout: float) -> dict:
    out: dict = {}
    for traced in ("0", "1"):
        try:
            cp = subprocess.run(
                [sys.executable, "-c", CHILD, checkout, parser, str(path), traced],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            row = json.loads(cp.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            row = {"s": timeout, "rss": None, "peak": None, "outcome": f"timeout {timeout:.0f}s"}
        except (IndexError, ValueError):
            row = {"s": None, "rss": None, "peak": None, "outcome": "crash (no result)"}
        if traced == "0":
            out.update(s=row["s"], rss=row["rss"], outcome=row["outcome"])
        else:
            out["peak"] = row["peak"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="these parsers only")
    ap.add_argument("--checkout", default="", help="run against this checkout's sources")
    ap.add_argument("--timeout", type=float, default=120.0, help="per run (s)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="nodeforge-refusal-") as tmp:
        for parser, by_case in cases().items():
            if a.only and parser not in a.only:
                continue
            for case, (name, text) in by_case.items():
                d = Path(tmp) / f"{parser}-{case.replace(' ', '_')}"
                d.mkdir()
                f = d / name
                f.write_text(text)
                os.chmod(f, 0o600)
                if parser == "hyperpod":
                    pp = d / "provisioning_parameters.json"
                    pp.write_text('{"controller_group": "ctl"}')
                    os.chmod(pp, 0o600)
                r = measure(a.checkout, parser, f, a.timeout)
                rows.append({"parser": parser, "case": case, "bytes": len(text.encode())} | r)
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'parser':12} {'case':13} {'bytes':>8} {'ms':>9} {'peak MB':>8} {'rss+ MB':>8}  outcome"
    )
    for r in rows:
        ms = "-" if r["s"] is None else f"{r['s'] * 1000:.1f}"
        peak = "-" if r["peak"] is None else f"{r['peak'] / 2**20:.1f}"
        rss = "-" if r["rss"] is None else f"{r['rss'] / 2**20:.1f}"
        print(
            f"{r['parser']:12} {r['case']:13} {r['bytes']:8} {ms:>9} {peak:>8} {rss:>8}  {r['outcome']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
