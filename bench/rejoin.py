"""Benchmark: computes that missed slurmctld join once it is back (run as root).

    sudo .venv/bin/python bench/rejoin.py --image DIR [--computes 3] [--away 10] [--json]

A fresh cluster (--name, default brejoin) of one controller from --image; slurmctld is
stopped, --computes computes join with `wait_timeout: --away` (their role step fails, they
are outside Slurm), and once every agent has failed, slurmctld is started again. Each compute
is timed from slurmctld's start to schedulable (a job pinned to it would start: readiness's one
definition) with its agent ready: the wait for nodeforge-rejoin.timer's next look (every 30 s,
up to 10 s randomized) plus the agent's resumed first boot. The cluster is always taken down.
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

from nodeforge.lab.localcluster import Cluster, LocalCluster, node_exec

FAIL_BOUND_S = 180.0  # every agent failed its role step by then


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", type=Path, required=True, help="output directory of nodeforge build")
    ap.add_argument("--computes", type=int, default=3)
    ap.add_argument("--away", type=int, default=10, help="the computes' wait_timeout (s)")
    ap.add_argument("--name", default="brejoin")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-node ready bound")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.computes < 1 or not 1 <= a.away <= 300:
        ap.error("--computes must be at least 1 and --away 1 to 300")

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    lc = LocalCluster(a.name, progress=progress)
    lc.down()
    names = [f"c{i:03d}" for i in range(1, a.computes + 1)]
    try:
        lc.up(a.image, 0, timeout=a.timeout)
        ctl = Cluster.load(a.name).controller
        node_exec(ctl, ["systemctl", "stop", "slurmctld.service"], timeout=120)
        for n in names:
            lc.start_node(n, params={"wait_timeout": a.away})
        deadline = time.monotonic() + FAIL_BOUND_S
        while True:
            c = Cluster.load(a.name)
            states = {n: lc.agent_state(c.node(n)).get("status") for n in names}
            if all(s == "failed" for s in states.values()):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"agents not all failed after {FAIL_BOUND_S:.0f}s: {states}")
            time.sleep(1)
        node_exec(ctl, ["systemctl", "start", "slurmctld.service"], timeout=120)
        back = time.monotonic()
        c = Cluster.load(a.name)
        lc.wait_ready(c, names, timeout=a.timeout)
        c = Cluster.load(a.name)
        # node.ready_at is wall clock: convert through the same moment
        wall_back = time.time() - (time.monotonic() - back)
        nodes = [
            {
                "node": n,
                "seconds": round(c.node(n).ready_at - wall_back, 2),
                "role_runs": lc.agent_state(c.node(n))["steps"]["role"]["runs"],
            }
            for n in names
        ]
    finally:
        lc.down()
    secs = [r["seconds"] for r in nodes]
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
        "load_after": round(os.getloadavg()[0], 2),
        "away_s": a.away,
        "nodes": nodes,
        "median_s": statistics.median(secs),
        "max_s": max(secs),
    }
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for r in nodes:
            print(f"{r['node']}: schedulable {r['seconds']:.1f}s after slurmctld was back "
                  f"(role step ran {r['role_runs']} times)")  # fmt: skip
        print(f"median {out['median_s']:.1f}s, max {out['max_s']:.1f}s, load {out['load_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
