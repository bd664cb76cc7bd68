"""Benchmark: cold build, warm rebuild and a config-only rebuild of the local target, one run.

    sudo .venv/bin/python bench/build_times.py --artifact-mirror DIR [--versions-file F]

Cold = empty cache dir (mmdebstrap + every package download). Warm = same cache (base
tarball, apt archive and artifacts reused). Config-only = warm plus one role variable changed
through a var file (`ansible_vars`), i.e. what an operator does to change a config file.
Prints seconds per phase, the warm/cold and config/cold ratios and the image sizes. Goals on
2 cores: cold ≤ 12 min, warm ≤ 4 min, config-only ≤ 60 s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build(out: Path, cache: Path, args, *extra: str) -> dict:
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
    cp = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if cp.returncode != 0:
        sys.exit(f"build failed:\n{cp.stderr[-4000:]}")
    res = json.loads(cp.stdout)
    res["wall_seconds"] = round(time.monotonic() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact-mirror")
    ap.add_argument("--versions-file")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/nodeforge-bench"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    cache = args.workdir / "cache"
    out = args.workdir / "out"
    runs = {}
    runs["cold"] = build(out, cache, args)
    runs["warm"] = build(out, cache, args)
    with tempfile.NamedTemporaryFile("w", suffix=".pkrvars.hcl", delete=False) as vf:
        vf.write('ansible_vars = { logrotate_slurm_rotate = "9" }\n')
    runs["config_only"] = build(out, cache, args, "--var-file", vf.name)
    sizes = {k: v["bytes"] for k, v in runs["config_only"]["artifacts"].items()}
    cold = runs["cold"]["wall_seconds"]
    report = {
        "seconds": {k: v["wall_seconds"] for k, v in runs.items()},
        "phases": {k: v["phases"] for k, v in runs.items()},
        "ratio_warm_to_cold": round(runs["warm"]["wall_seconds"] / cold, 3),
        "ratio_config_to_cold": round(runs["config_only"]["wall_seconds"] / cold, 3),
        "image_bytes": sizes,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for k, v in report["seconds"].items():
            print(f"{k:<12} {v:8.1f} s   phases: {report['phases'][k]}")
        print(f"warm/cold   {report['ratio_warm_to_cold']:.3f}")
        print(f"config/cold {report['ratio_config_to_cold']:.3f}")
        for k, b in sizes.items():
            print(f"{k:<16} {b / 2**20:9.1f} MiB")
    shutil.rmtree(args.workdir)


if __name__ == "__main__":
    main()
