"""Benchmark: the agent's params step with the issue-9 checks, in one run (no root).

    .venv/bin/python bench/params_parse.py [--n 2000] [--json]

Measured on a realistic compute node.yaml (features, gres, 3 hooks, extra) in a 0600 file:
- `load_params` (node.yaml source: no-symlink open + fstat, strict YAML, full validation):
  the in-process cost the agent pays at every boot;
- the same document through main's loader and validator (`yaml.safe_load` + the pre-issue-9
  `parse_params`, loaded from `git show <--base>:bootstrap/params.py`): the ratio new/old;
- the kernel command-line parser (`kernel_args`, next_arg() rules) vs `shlex.split` on a
  300-character command line;
- `nodeforge params check --node-yaml` as a process (interpreter start + imports + check),
  next to `nodeforge --version` (interpreter start + CLI imports) interleaved in the same run:
  the difference is what reading + checking params costs the agent. Goal: <= 0.3 s.
Medians of --n in-process calls (and of 7 process runs).
"""

from __future__ import annotations

import argparse
import base64
import json
import shlex
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import yaml

from nodeforge import proc
from nodeforge.bootstrap.params import parse_params
from nodeforge.bootstrap.params_sources import SourceConfig, kernel_args, load_params
from nodeforge.bootstrap.paths import Paths

REPO = Path(__file__).resolve().parents[1]

DOC = {
    "role": "compute",
    "cluster_name": "demo",
    "controller": {"host": "ctl", "address": "10.9.0.2"},
    "node_name": "c17",
    "munge_key": base64.b64encode(b"k" * 64).decode(),
    "features": ["gpu", "nvme", "ib", "a100"],
    "gres": ["gpu:a100:8"],
    "cpus": 96,
    "hooks": [
        {"uri": "https://cfg.internal/hooks/10-mounts.sh", "sha256": "a" * 64, "timeout": 120},
        {"uri": "s3://bucket/lifecycle/20-users.sh", "retries": 3},
        "file:///etc/nodeforge/on-init.d/30-check",
    ],
    "wait_timeout": 360,
    "extra": {"users": [f"u{i},{1000 + i},/home/u{i}" for i in range(20)], "site": {"rack": "r7"}},
}
CMDLINE = (
    "BOOT_IMAGE=/boot/vmlinuz-6.1.0-25-cloud-amd64 root=PARTUUID=3f1a0c2e-01 ro console=tty0 "
    "console=ttyS0,115200n8 nvme_core.io_timeout=4294967295 net.ifnames=0 "
    "nodeforge.role=compute nodeforge.cluster=demo nodeforge.controller=ctl(10.9.0.2) "
    'nodeforge.features="gpu,nvme,ib" nodeforge.cpus=96 nodeforge.wait_timeout=360 '
    "nodeforge.params=file:///etc/nodeforge/site.yaml quiet splash\n"
)


def median_us(fn, n: int) -> float:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def old_parse_params(base: str):
    src = proc.run(
        ["git", "-C", str(REPO), "show", f"{base}:bootstrap/params.py"], timeout=30
    ).stdout
    mod = types.ModuleType("old_params")
    sys.modules["old_params"] = mod  # dataclasses look their module up
    exec(compile(src, f"{base}:bootstrap/params.py", "exec"), mod.__dict__)
    return mod.parse_params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--base", default="main", help="git revision with the pre-issue-9 params.py")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="nodeforge-bench-params-") as tmp:
        paths = Paths.under(tmp)
        paths.node_yaml.parent.mkdir(parents=True)
        text = yaml.safe_dump(DOC, sort_keys=False)
        paths.node_yaml.write_text(text)
        paths.node_yaml.chmod(0o600)
        cfg = SourceConfig(paths, imds_url=None)
        new = median_us(lambda: load_params(cfg), a.n)
        old_pp = old_parse_params(a.base)
        old = median_us(lambda: old_pp(yaml.safe_load(paths.node_yaml.read_text()), "x"), a.n)
        validate_only = median_us(lambda: parse_params(DOC, "x"), a.n)
        karg = median_us(lambda: kernel_args(CMDLINE), a.n)
        shl = median_us(lambda: shlex.split(CMDLINE), a.n)
        argv = [
            sys.executable,
            "-m",
            "nodeforge",
            "params",
            "check",
            "--node-yaml",
            str(paths.node_yaml),
        ]
        baseline = [sys.executable, "-m", "nodeforge", "--version"]
        proc.run(argv, timeout=60)  # warm the page cache once
        walls, bases = [], []
        for _ in range(7):  # interleaved, so both see the same machine load
            for cmd, out in ((argv, walls), (baseline, bases)):
                t = time.perf_counter()
                proc.run(cmd, timeout=60)
                out.append(time.perf_counter() - t)
        wall, base = statistics.median(walls), statistics.median(bases)
    row = {
        "load_params_us": round(new, 1),
        "old_safe_load_parse_us": round(old, 1),
        "ratio_new_over_old": round(new / old, 2),
        "parse_params_only_us": round(validate_only, 1),
        "kernel_args_us": round(karg, 1),
        "shlex_split_us": round(shl, 1),
        "params_check_process_s": round(wall, 3),
        "nodeforge_version_process_s": round(base, 3),
        "params_check_minus_version_s": round(wall - base, 3),
        "n": a.n,
        "doc_bytes": len(text),
    }
    if a.json:
        print(json.dumps(row, indent=2))
    else:
        for k, v in row.items():
            print(f"{k:28} {v}")
        print(f"goal: params cost <= 0.3 s: {'met' if wall - base <= 0.3 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
