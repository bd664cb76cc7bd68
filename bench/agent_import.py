"""Benchmark: the agent's start-up cost, per install, in one run (issue 13: it must not grow).

    .venv/bin/python bench/agent_import.py [--python NAME=INTERPRETER ...] [--runs 15]

For each interpreter (default: this one) it measures, from a directory outside the checkout:
- `-X importtime` cumulative microseconds of `nodeforge.cli` (what `nodeforge node ...` loads
  before it parses arguments) and of `nodeforge.bootstrap.agent` (what `node init` adds);
- the wall time of `python -m nodeforge node --help`;
- how many nodeforge modules `node --help` imports.
Runs are interleaved across installs; the table gives minimum and median of --runs and the
ratio of each install's minima to the first one's (the minimum is the least load-disturbed).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time


def _importtime(python: str, module: str, cwd: str) -> int:
    """Cumulative import time of *module* in microseconds (-X importtime), one run."""
    cp = subprocess.run([python, "-X", "importtime", "-c", f"import {module}"],
                        capture_output=True, text=True, cwd=cwd, check=True)  # fmt: skip
    for line in cp.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] == module:
            return int(parts[1])
    raise SystemExit(f"{python}: no import time reported for {module}")


def _wall(python: str, argv: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, *argv], capture_output=True, cwd=cwd, check=True)
    return time.perf_counter() - t0


def modules(python: str, cwd: str) -> int:
    code = ("import sys; from nodeforge.cli import build_parser\n"
            "try: build_parser().parse_args(['node', '--help'])\n"
            "except SystemExit: pass\n"
            "print(sum(1 for m in sys.modules if m.startswith('nodeforge')))")  # fmt: skip
    return int(subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd,
                              check=True).stdout.split()[-1])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="NAME=INTERPRETER",
        help="an install to measure (repeatable); default: this interpreter",
    )
    ap.add_argument("--runs", type=int, default=15, help="runs per measurement (median)")
    args = ap.parse_args()
    import os
    import sys

    installs = [(n, os.path.abspath(py)) for n, py in (p.split("=", 1) for p in args.python)]
    installs = installs or [("this", sys.executable)]
    # Interleaved: run i of every install, then run i+1, so load changes hit all of them.
    samples: dict[str, dict[str, list[float]]] = {n: {"cli": [], "agent": [], "help": []}
                                                  for n, _ in installs}  # fmt: skip
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.runs):
            for name, py in installs:
                samples[name]["cli"].append(_importtime(py, "nodeforge.cli", cwd))
                samples[name]["agent"].append(_importtime(py, "nodeforge.bootstrap.agent", cwd))
                samples[name]["help"].append(_wall(py, ["-m", "nodeforge", "node", "--help"], cwd))
        rows = []
        for name, py in installs:
            s = samples[name]
            rows.append((name, min(s["cli"]), statistics.median(s["cli"]), min(s["agent"]),
                         statistics.median(s["agent"]), min(s["help"]), modules(py, cwd)))  # fmt: skip
    base = rows[0]
    print(f"{'install':<12} {'cli_us min/med':>16} {'agent_us min/med':>18} {'node_help_s min':>16} "
          f"{'modules':>8}  ratio of minima (cli, agent, help)")  # fmt: skip
    for r in rows:
        print(f"{r[0]:<12} {r[1]:>7.0f}/{r[2]:<8.0f} {r[3]:>8.0f}/{r[4]:<9.0f} {r[5]:>16.3f} {r[6]:>8}  "
              f"{r[1] / base[1]:.2f} {r[3] / base[3]:.2f} {r[5] / base[5]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
