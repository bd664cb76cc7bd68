"""Benchmark: 8 computes joining one local cluster, per node and for all (run as root).

    sudo .venv/bin/python bench/join8.py [--image DIR] [--computes 8] [--intervals 0,3] [--json]

For each join interval: `cluster up --computes 0` (a fresh cluster named --name, default
b8j), then `cluster add 1 --no-wait` every INTERVAL seconds until --computes nodes were added
(interval 0 = all at once, i.e. back to back), while `sinfo` on the controller is polled.
Reported: each node's time from its systemd-nspawn start to the first sinfo showing it IDLE,
the agent's own share (state.json step durations), and the time for all (first add call ->
last node IDLE). Every wait is bounded; the cluster is always taken down.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import time_to_ready as ttr

from nodeforge.errors import NodeforgeError
from nodeforge.lab.localcluster import Cluster, LocalCluster, _agent_seconds

log = ttr.log


def round_(lc: LocalCluster, image: Path, n: int, interval: float, args) -> dict:
    res: dict = {"interval_s": interval, "computes": n}
    try:
        t0 = time.time()
        lc.up(image, 0, timeout=args.timeout)
        res["controller_up_s"] = round(time.time() - t0, 2)
        log(f"interval {interval}: controller up in {res['controller_up_s']}s")
        res["load_before"] = round(os.getloadavg()[0], 2)
        started: dict[str, float] = {}
        ready: dict[str, float] = {}
        t_first = time.time()
        next_add = time.monotonic()
        deadline = time.monotonic() + args.timeout + n * interval
        while len(ready) < n:
            now = time.monotonic()
            if len(started) < n and now >= next_add:
                (name,) = lc.add(1, wait=False)  # `nodeforge cluster add 1 --no-wait`
                started[name] = Cluster.load(lc.name).node(name).started
                next_add = now + interval
                if interval == 0:
                    continue  # back to back: the next add at once
            cluster = Cluster.load(lc.name)
            t = time.time()
            states = lc.slurm_nodes(cluster) if started else {}
            for name, t_start in started.items():
                st = states.get(name, {}).get("state", "").rstrip("*~#")
                if name not in ready and st in ttr.READY_STATES:
                    ready[name] = t
                    log(f"  {name} IDLE after {t - t_start:.2f}s")
            for name in started:
                if name not in ready and not ttr._alive(cluster.node(name).pid):
                    raise NodeforgeError(f"node {name} exited; see its console.log")
            if time.monotonic() > deadline:
                raise NodeforgeError(f"not schedulable in time: "
                                     f"{', '.join(sorted(set(started) - set(ready)))}")
            time.sleep(args.poll)
        cluster = Cluster.load(lc.name)
        nodes = []
        for name in sorted(started):
            st = ttr.read_state(cluster.node(name))
            nodes.append({
                "node": name,
                "started_after_first_add_s": round(started[name] - t_first, 2),
                "seconds": round(ready[name] - started[name], 2),
                "agent_seconds": _agent_seconds(st),
                "agent_started_after_s": round(st["first_started"] - started[name], 2)
                if st.get("first_started") else None,
            })
        secs = [x["seconds"] for x in nodes]
        res.update({
            "ok": True,
            "nodes": nodes,
            "all_seconds": round(max(ready.values()) - t_first, 2),
            "last_start_to_all_ready_s": round(max(ready.values()) - max(started.values()), 2),
            "per_node_median_s": round(statistics.median(secs), 2),
            "per_node_min_s": min(secs),
            "per_node_max_s": max(secs),
            "agent_median_s": round(statistics.median(
                [x["agent_seconds"] for x in nodes if x["agent_seconds"] is not None]), 2),
            "load_after": round(os.getloadavg()[0], 2),
        })
    except (NodeforgeError, OSError) as exc:
        res["ok"] = False
        res["error"] = str(exc)[-2000:]
        log(f"interval {interval} FAILED: {str(exc)[-500:]}")
        try:
            res["status"] = lc.status()
        except (NodeforgeError, OSError, ValueError):
            pass
    finally:
        log(f"cluster down {lc.name}")
        lc.down()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", type=Path, default=Path("/var/tmp/nodeforge-e2e/image"))
    ap.add_argument("--name", default="b8j", help="cluster name (default: %(default)s)")
    ap.add_argument("--computes", type=int, default=8)
    ap.add_argument("--intervals", default="0,3",
                    help="comma-separated join intervals in s, one fresh cluster each "
                         "(default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="bound for the controller and for all computes after the last add")
    ap.add_argument("--poll", type=float, default=0.25)
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/nodeforge-bench"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (network namespaces, overlays, systemd-nspawn)")
    intervals = [float(x) for x in args.intervals.split(",") if x.strip()]
    image = args.image.resolve()
    manifest, _ = ttr.check_image(image)
    log(f"image {image} created {manifest.get('created')}")
    lc = LocalCluster(args.name)
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "image": str(image),
              "image_created": manifest.get("created"), "cpus": os.cpu_count(),
              "poll_s": args.poll, "rounds": []}
    for iv in intervals:
        report["rounds"].append(round_(lc, image, args.computes, iv, args))
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "join8.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report["rounds"]:
            if not r.get("ok"):
                print(f"interval {r['interval_s']}s: FAILED: {r.get('error')}")
                continue
            print(f"interval {r['interval_s']}s, {r['computes']} computes: all schedulable "
                  f"{r['all_seconds']}s after the first add "
                  f"({r['last_start_to_all_ready_s']}s after the last start); per node median "
                  f"{r['per_node_median_s']}s (min {r['per_node_min_s']}, max "
                  f"{r['per_node_max_s']}), agent median {r['agent_median_s']}s")
            for x in r["nodes"]:
                print(f"  {x['node']}  start +{x['started_after_first_add_s']:6.2f}s  "
                      f"to IDLE {x['seconds']:6.2f}s  agent {x['agent_seconds']}s "
                      f"(started {x['agent_started_after_s']}s after nspawn)")
        print(f"full result: {args.workdir / 'join8.json'}")
    return 0 if all(r.get("ok") for r in report["rounds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
