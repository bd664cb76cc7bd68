"""Benchmark: `nodeforge cluster replace` of one compute, repeated (run as root).

    sudo .venv/bin/python bench/replace.py --image DIR [--computes 2] [--rounds 3] [--json]

A fresh cluster (--name, default brepl) of one controller and --computes computes from
--image; then --rounds replacements of c001, each timed from the old machine's loss (its
container is gone) to the new one schedulable (a job pinned to it would start: readiness's
one definition) with its agent ready, as `LocalCluster.replace` measures it. Each round also
records the address and the state Slurm lists for the name. The cluster is always taken down.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from nodeforge.lab.localcluster import Cluster, LocalCluster


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", type=Path, required=True, help="output directory of nodeforge build")
    ap.add_argument("--computes", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="brepl")
    ap.add_argument("--timeout", type=float, default=400.0, help="per-node ready bound")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.rounds < 1 or a.computes < 1:
        ap.error("--rounds and --computes must be at least 1")

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    lc = LocalCluster(a.name, progress=progress)
    lc.down()
    rounds: list[dict] = []
    try:
        lc.up(a.image, a.computes, timeout=a.timeout)
        for i in range(a.rounds):
            old = Cluster.load(a.name).node("c001")
            new, secs = lc.replace("c001", timeout=a.timeout)
            sn = lc.slurm_nodes(Cluster.load(a.name))
            rounds.append(
                {
                    "round": i + 1,
                    "seconds": secs,
                    "old_address": old.address,
                    "new_address": new.address,
                    "slurm_state": sn["c001"].shown if "c001" in sn else "absent",
                }
            )
    finally:
        lc.down()
    secs = [r["seconds"] for r in rounds]
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
        "load_after": round(os.getloadavg()[0], 2),
        "rounds": rounds,
        "median_s": statistics.median(secs),
        "min_s": min(secs),
        "max_s": max(secs),
    }
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for r in rounds:
            print(f"round {r['round']}: schedulable {r['seconds']:.2f}s after the loss "
                  f"({r['old_address']} -> {r['new_address']}, {r['slurm_state']})")  # fmt: skip
        print(f"median {out['median_s']:.2f}s (min {out['min_s']:.2f}, max {out['max_s']:.2f}), "
              f"load {out['load_after']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
