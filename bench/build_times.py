"""Benchmark: the local target's build paths side by side, one run, one fresh cache.

    sudo .venv/bin/python bench/build_times.py --artifact-mirror DIR [--versions-file F]

In order, on one cache dir and one output dir:
- cold: empty cache (mmdebstrap, every package download, the install pass, the layer);
- no_change: the same command again: content-addressed, returns the published build;
- config_only: one configuration variable changed through a var file (`ansible_vars`,
  logrotate_slurm_rotate): reuses the layer and re-applies only the logrotate role. With
  `--config-only-repeat N` it runs N times (config_only, config_only_2, ...), each with
  another value, so each is a real config-only rebuild (never a no-change hit); the
  report's `config_only_median` is their median;
- force_warm: `--force` with the cold build's inputs: reuses the layer, re-applies nothing,
  seals and exports (the floor of any rebuild over a layer);
- install_affecting: a role variable that chooses packages (docker_source, same value as
  the default) changes the layer key: a new install pass with warm base, apt and artifact
  caches.
With `--seed-from CACHE_DIR` the fresh cache starts with that cache's base tarballs, apt
archive and artifacts (copied, never written back): the first run is then a layer miss
with warm base and apt caches, reported as `layer_miss` instead of `cold` (no cold goal).
Prints wall seconds and phases of each, their ratio to cold, the load average before and
after, and the goals (2 cores): config-only ≤ 20 s, no-change ≤ 5 s, install-affecting with
warm caches ≤ 90 s, cold ≤ 150 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOALS = {"cold": 150.0, "no_change": 5.0, "config_only": 20.0, "install_affecting": 90.0}
VAR_FILES = {
    "install_affecting": 'ansible_vars = { docker_source = "debian" }\n',
}


def config_only_var_file(n: int) -> str:
    """The n-th config-only change (n >= 1): another rotate count each time (9, 8, ...)."""
    return f'ansible_vars = {{ logrotate_slurm_rotate = "{10 - n}" }}\n'


def build(out: Path, cache: Path, args, *extra: str, label: str = "") -> dict:
    t0 = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "nodeforge",
        "build",
        "--output",
        str(out),
        "--cache-dir",
        str(cache),
        "--json",
        *extra,
    ]
    if args.artifact_mirror:
        cmd += ["--artifact-mirror", args.artifact_mirror]
    if args.versions_file:
        cmd += ["--versions-file", args.versions_file]
    cp = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if cp.returncode != 0:
        sys.exit(f"build failed:\n{cp.stderr[-4000:]}")
    res = json.loads(cp.stdout)
    if args.keep_logs and label:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "build.log", args.keep_logs / f"{label}.build.log")
    res["wall_seconds"] = round(time.monotonic() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact-mirror")
    ap.add_argument("--versions-file")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/nodeforge-bench"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--no-install-affecting",
        action="store_true",
        help="stop after force_warm (the install-affecting run is a second install pass)",
    )
    ap.add_argument(
        "--config-only-repeat",
        type=int,
        default=1,
        choices=range(1, 10),
        metavar="N",
        help="config-only rebuilds in a row, each with another value (default 1)",
    )
    ap.add_argument(
        "--keep-logs", type=Path, help="copy each run's build.log here (the workdir is removed)"
    )
    ap.add_argument(
        "--seed-from", type=Path, help="copy base/, apt-archives/, artifacts/ of this cache dir"
    )
    args = ap.parse_args()
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    cache = args.workdir / "cache"
    out = args.workdir / "out"
    args.workdir.mkdir(parents=True)
    first = "cold"
    if args.seed_from:
        for d in ("base", "apt-archives", "artifacts"):
            if (args.seed_from / d).is_dir():
                shutil.copytree(args.seed_from / d, cache / d, symlinks=True)
        first = "layer_miss"
    var_files = {}
    for name, text in VAR_FILES.items():
        var_files[name] = args.workdir / f"{name}.pkrvars.hcl"
        var_files[name].write_text(text)
    load_before = os.getloadavg()
    runs = {}
    runs[first] = build(out, cache, args, label=first)
    runs["no_change"] = build(out, cache, args, label="no_change")
    for n in range(1, args.config_only_repeat + 1):
        vf = args.workdir / f"config_only_{n}.pkrvars.hcl"
        vf.write_text(config_only_var_file(n))
        label = "config_only" if n == 1 else f"config_only_{n}"
        runs[label] = build(
            args.workdir / "out-config", cache, args, "--var-file", str(vf), label=label
        )
    runs["force_warm"] = build(out, cache, args, "--force", label="force_warm")
    if not args.no_install_affecting:
        runs["install_affecting"] = build(
            args.workdir / "out-install",
            cache,
            args,
            "--var-file",
            str(var_files["install_affecting"]),
        )
    load_after = os.getloadavg()
    cold = runs[first]["wall_seconds"]
    config_runs = [v["wall_seconds"] for k, v in runs.items() if k.startswith("config_only")]
    report = {
        "seconds": {k: v["wall_seconds"] for k, v in runs.items()},
        "config_only_median": statistics.median(config_runs),
        "phases": {k: v["phases"] for k, v in runs.items()},
        # parts of the phases (sandbox, seal, export, the layer check); absent before 2026-12-03
        "steps": {k: v.get("steps", {}) for k, v in runs.items()},
        "cache": {k: v.get("cache", {}) | {"reused": v.get("reused")} for k, v in runs.items()},
        "ratio_to_cold": {k: round(v["wall_seconds"] / cold, 3) for k, v in runs.items()},
        "goals_met": {k: runs[k]["wall_seconds"] <= g for k, g in GOALS.items() if k in runs}
        | {"config_only_median": statistics.median(config_runs) <= GOALS["config_only"]},
        "seeded_from": str(args.seed_from) if args.seed_from else None,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(),
        "image_bytes": {k: v["bytes"] for k, v in runs[first]["artifacts"].items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report["seconds"].items():
            goal = (
                f"goal ≤ {GOALS[k]:.0f} s {'met' if report['goals_met'][k] else 'MISSED'}"
                if k in GOALS
                else ""
            )
            print(f"{k:<18} {v:8.1f} s  ×{report['ratio_to_cold'][k]:.3f} of {first}  {goal}")
            print(f"{'':<18} phases: {report['phases'][k]}")
        print(f"config_only median {report['config_only_median']:.1f} s of {len(config_runs)}")
        print(
            f"load average before {report['load_average_before']} after "
            f"{report['load_average_after']} on {report['cpus']} CPUs"
        )
        for k, b in report["image_bytes"].items():
            print(f"{k:<16} {b / 2**20:9.1f} MiB")
    shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
