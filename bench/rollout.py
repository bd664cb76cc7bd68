"""Benchmark: `nodeforge cluster rollout` of N computes in batches (run as root).

    sudo .venv/bin/python bench/rollout.py --image DIR [--computes 8] [--batch 2] [--json]

A fresh cluster (--name, default brol) of one controller and --computes computes from --image;
then the same code path as `nodeforge cluster rollout --nodes c001,…` (the computes: what the
capacity figure is about) onto a second image directory: --new-image, or the image's files
hard-linked into <workdir>/image-new (same content, another directory). No jobs run, so no step
waits on --drain-timeout. Reported: the total, each step's time (drain -> replaced, healthy,
`nodeforge verify` passed, resumed), and the capacity kept online: node-seconds of computes
not taken out by the rollout against all computes for the whole rollout (the ideal). A node
counts as out from its step's drain to the step's end. The cluster is always taken down.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from nodeforge.lab.localcluster import LocalCluster
from nodeforge.lab.rollout import Rollout


def linked_copy(src: Path, dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            os.link(f, dest / f.name)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", type=Path, required=True, help="output directory of nodeforge build")
    ap.add_argument("--new-image", type=Path, help="the image to roll out (default: a linked copy)")
    ap.add_argument("--computes", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--name", default="brol")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/nodeforge-bench-rollout"))
    ap.add_argument("--timeout", type=float, default=400.0, help="per-node ready bound")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    a.workdir.mkdir(parents=True, exist_ok=True)
    new = a.new_image or linked_copy(a.image, a.workdir / "image-new")
    lc = LocalCluster(a.name, progress=progress)
    lc.down()
    try:
        t = time.monotonic()
        lc.up(a.image, a.computes, timeout=a.timeout)
        up_s = time.monotonic() - t
        computes = [f"c{i:03d}" for i in range(1, a.computes + 1)]
        summary = Rollout(
            lc, new, batch=a.batch, drain_timeout=0.0, ready_timeout=a.timeout, nodes=computes
        ).run()
    finally:
        lc.down()
        if a.new_image is None:
            shutil.rmtree(a.workdir / "image-new", ignore_errors=True)
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
        "computes": a.computes,
        "batch": a.batch,
        "cluster_up_s": round(up_s, 1),
        **summary,
        "capacity_kept_pct": round(
            100 * summary["capacity_node_seconds"] / summary["ideal_node_seconds"], 1
        )
        if summary["ideal_node_seconds"]
        else None,
    }
    (a.workdir / "rollout.json").write_text(json.dumps(out, indent=2))
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for s in out["steps"]:
            print(
                f"step {s['step']} {s['kind']:<7} {','.join(s['nodes']):<10} {s['seconds']:7.1f}s"
            )
        print(
            f"total {out['seconds']:.1f}s; capacity {out['capacity_node_seconds']:.0f} of "
            f"{out['ideal_node_seconds']:.0f} node-seconds ({out['capacity_kept_pct']}%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
