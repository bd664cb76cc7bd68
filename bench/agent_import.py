"""Benchmark: the agent's start-up cost, per install, in one run (issue 13: it must not grow).

    .venv/bin/python bench/agent_import.py [--python NAME=INTERPRETER ...] [--runs 15]

For each interpreter (default: this one) it measures, from a directory outside the checkout:
- `-X importtime` self+cumulative microseconds of `nodeforge.cli` (what `nodeforge node ...`
  loads before it parses arguments) and of `nodeforge.bootstrap.agent` (what `node init` adds);
- the wall time of `python -m nodeforge node --help` (median of --runs);
- how many nodeforge modules `node --help` imports.
Prints a table and each install's ratio to the first one. Interpreters are compared in the
same run, so the machine's load affects them alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time


def importtime(python: str, module: str, runs: int, cwd: str) -> int:
    """Median cumulative import time of *module* in microseconds (-X importtime)."""
    vals = []
    for _ in range(runs):
        cp = subprocess.run([python, "-X", "importtime", "-c", f"import {module}"],
                            capture_output=True, text=True, cwd=cwd, check=True)  # fmt: skip
        for line in cp.stderr.splitlines():
            parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
            if len(parts) == 3 and parts[2] == module:
                vals.append(int(parts[1]))
    return int(statistics.median(vals))


def wall(python: str, argv: list[str], runs: int, cwd: str) -> float:
    vals = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([python, *argv], capture_output=True, cwd=cwd, check=True)
        vals.append(time.perf_counter() - t0)
    return statistics.median(vals)


def modules(python: str, cwd: str) -> int:
    code = ("import sys; from nodeforge.cli import build_parser\n"
            "try: build_parser().parse_args(['node', '--help'])\n"
            "except SystemExit: pass\n"
            "print(sum(1 for m in sys.modules if m.startswith('nodeforge')))")  # fmt: skip
    return int(subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd,
                              check=True).stdout.split()[-1])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", default=[], metavar="NAME=INTERPRETER",
                    help="an install to measure (repeatable); default: this interpreter")
    ap.add_argument("--runs", type=int, default=15, help="runs per measurement (median)")
    args = ap.parse_args()
    import os
    import sys

    installs = [(n, os.path.abspath(py)) for n, py in (p.split("=", 1) for p in args.python)]
    installs = installs or [("this", sys.executable)]
    rows = []
    with tempfile.TemporaryDirectory() as cwd:
        for name, py in installs:
            rows.append((
                name,
                importtime(py, "nodeforge.cli", args.runs, cwd),
                importtime(py, "nodeforge.bootstrap.agent", args.runs, cwd),
                wall(py, ["-m", "nodeforge", "node", "--help"], args.runs, cwd),
                modules(py, cwd),
            ))  # fmt: skip
    base = rows[0]
    print(f"{'install':<12} {'cli_us':>8} {'agent_us':>9} {'node_help_s':>12} {'modules':>8}  ratio(cli, agent, help)")
    for r in rows:
        print(f"{r[0]:<12} {r[1]:>8} {r[2]:>9} {r[3]:>12.3f} {r[4]:>8}  "
              f"{r[1] / base[1]:.2f} {r[2] / base[2]:.2f} {r[3] / base[3]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
