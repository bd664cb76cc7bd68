"""Benchmark: N computes joining one local cluster, per node and for all (run as root).

    sudo .venv/bin/python bench/join.py [--image DIR] [--computes 32] [--intervals 2] [--json]

For each join interval: `cluster up --computes 0` (a fresh cluster named --name, default bj),
then `cluster add 1 --no-wait` every INTERVAL seconds until --computes nodes were added
(interval 0 = back to back), while the controller is polled with the same call and the same
definition of ready as `cluster up` (nodeforge.bootstrap.readiness.NodeState.ready: IDLE/MIXED,
no flag such as NOT_RESPONDING). Reported: each node's time from its systemd-nspawn start to
ready, the agent's own share (state.json step durations), the time for all (first add ->
last node ready), and the least-squares slope of per-node time over the join index (s per
node already in the cluster): flat (slope ~0) means a join does not get slower as the
cluster grows.

Bounded: every wait has a timeout, and no node is added while the host has less than
--min-free-mib of memory available; a node that exits during boot (the host's limits: with
the default fs.inotify.max_user_instances=128 about 22 booted systemd instances fit) also
stops the adding. The round then says how many fit and why, and reports the nodes that
joined. fs.inotify.max_user_instances is raised for the run to fit --computes (and restored). The cluster is always taken down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import time_to_ready as ttr

from nodeforge.errors import NodeforgeError
from nodeforge.lab.localcluster import Cluster, LocalCluster, _agent_seconds

log = ttr.log


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise NodeforgeError("/proc/meminfo has no MemAvailable")


INOTIFY_LIMIT = Path("/proc/sys/fs/inotify/max_user_instances")
INOTIFY_PER_NODE = 8  # seen: ~7 inotify instances per booted systemd node (systemd, journald, ...)


def inotify_limit() -> str:
    try:
        return INOTIFY_LIMIT.read_text().strip()
    except OSError:
        return "?"


@contextlib.contextmanager
def inotify_headroom(computes: int, wanted: int | None):
    """Root's inotify instances are per user, and every booted node's systemd holds several:
    at the default 128 only ~21 nodes boot. Raise the limit for this run only (to *wanted*, or
    enough for *computes* + the controller + the host's own 128) and restore it afterwards."""
    old = int(inotify_limit()) if inotify_limit().isdigit() else None
    need = wanted if wanted is not None else 128 + (computes + 1) * INOTIFY_PER_NODE
    if old is None or need <= old:
        yield old
        return
    log(f"fs.inotify.max_user_instances {old} -> {need} for this run (restored afterwards)")
    INOTIFY_LIMIT.write_text(f"{need}\n")
    try:
        yield need
    finally:
        INOTIFY_LIMIT.write_text(f"{old}\n")
        log(f"fs.inotify.max_user_instances restored to {old}")


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs (None with fewer than 3 points)."""
    if len(xs) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def round_(lc: LocalCluster, image: Path, n: int, interval: float, args) -> dict:
    res: dict = {"interval_s": interval, "computes_asked": n}
    try:
        t0 = time.time()
        lc.up(image, 0, timeout=args.timeout)
        res["controller_up_s"] = round(time.time() - t0, 2)
        log(f"interval {interval}: controller up in {res['controller_up_s']}s")
        res["load_before"] = round(os.getloadavg()[0], 2)
        res["mem_available_before_mib"] = mem_available_mib()
        started: dict[str, float] = {}
        ready: dict[str, float] = {}
        load_at_start: dict[str, float] = {}
        exited: dict[str, str] = {}
        stopped_adding = ""
        t_first = time.time()
        next_add = time.monotonic()
        deadline = time.monotonic() + args.timeout + n * interval
        while len(ready) < len(started) or (len(started) < n and not stopped_adding):
            now = time.monotonic()
            if len(started) < n and not stopped_adding and now >= next_add:
                free = mem_available_mib()
                if free < args.min_free_mib:
                    stopped_adding = (
                        f"stopped at {len(started)} nodes: {free} MiB available "
                        f"< --min-free-mib {args.min_free_mib}"
                    )
                    log(stopped_adding)
                    continue
                if args.agent_from_checkout:  # the same path as `cluster add` (_start)
                    name = f"c{len(started) + 1:03d}"
                    lc.start_node(name, prepare=ttr.agent_from_checkout)
                else:
                    (name,) = lc.add(1, wait=False)  # `nodeforge cluster add 1 --no-wait`
                started[name] = Cluster.load(lc.name).node(name).started
                load_at_start[name] = round(os.getloadavg()[0], 2)
                next_add = now + interval
                if interval == 0:
                    continue  # back to back: the next add at once
            cluster = Cluster.load(lc.name)
            t = time.time()
            states = lc.slurm_nodes(cluster) if started else {}
            for name, t_start in started.items():
                sl = states.get(name)
                if name not in ready and sl is not None and sl.state.ready:
                    ready[name] = t
                    log(
                        f"  {name} ready after {t - t_start:.2f}s "
                        f"({len(ready)}/{len(started)} ready, load {os.getloadavg()[0]:.1f})"
                    )
            for name in list(started):
                if name not in ready and not ttr._alive(cluster.node(name).pid):
                    # The host's capacity (seen: fs.inotify.max_user_instances, 128 by default,
                    # ~6 per booted systemd): stop adding, keep the nodes that joined.
                    tail = ttr.console_tail(cluster.node(name), 8)
                    exited[name] = tail
                    del started[name]
                    stopped_adding = stopped_adding or (
                        f"stopped at {len(started)} nodes: {name} exited during boot "
                        f"(fs.inotify.max_user_instances={inotify_limit()}); console: "
                        f"{tail[-600:]}"
                    )
                    log(stopped_adding)
            if time.monotonic() > deadline:
                late = ", ".join(
                    f"{x} ({states[x].state if x in states else 'unregistered'})"
                    for x in sorted(set(started) - set(ready))
                )
                raise NodeforgeError(f"not ready in time: {late}")
            time.sleep(args.poll)
        if not started:
            raise NodeforgeError(f"no node joined: {stopped_adding}")
        cluster = Cluster.load(lc.name)
        nodes = []
        for k, name in enumerate(sorted(started, key=started.get)):
            st = ttr.read_state(cluster.node(name))
            nodes.append(
                {
                    "node": name,
                    "index": k,
                    "started_after_first_add_s": round(started[name] - t_first, 2),
                    "seconds": round(ready[name] - started[name], 2),
                    "agent_seconds": _agent_seconds(st),
                    "agent_waits_s": ttr.agent_waits(st),
                    "agent_started_after_s": round(st["first_started"] - started[name], 2)
                    if st.get("first_started")
                    else None,
                    "load_at_start": load_at_start[name],
                }
            )
        secs = [x["seconds"] for x in nodes]
        sl = slope([float(x["index"]) for x in nodes], secs)
        half = len(secs) // 2
        res.update(
            {
                "ok": True,
                "computes": len(nodes),
                "stopped_adding": stopped_adding or None,
                "exited": exited,
                "nodes": nodes,
                "all_seconds": round(max(ready.values()) - t_first, 2),
                "last_start_to_all_ready_s": round(max(ready.values()) - max(started.values()), 2),
                "per_node_median_s": round(statistics.median(secs), 2),
                "per_node_min_s": min(secs),
                "per_node_max_s": max(secs),
                "first_half_median_s": round(statistics.median(secs[:half]), 2) if half else None,
                "second_half_median_s": round(statistics.median(secs[half:]), 2) if half else None,
                "slope_s_per_node": round(sl, 4) if sl is not None else None,
                "agent_median_s": round(
                    statistics.median(
                        [x["agent_seconds"] for x in nodes if x["agent_seconds"] is not None]
                    ),
                    2,
                ),
                "load_after": round(os.getloadavg()[0], 2),
                "mem_available_after_mib": mem_available_mib(),
            }
        )
        res["mem_per_node_mib"] = round(
            (res["mem_available_before_mib"] - res["mem_available_after_mib"]) / len(nodes), 1
        )
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
    ap.add_argument(
        "--image",
        type=Path,
        default=Path("/var/tmp/nodeforge-e2e/image"),
        help="output directory of `nodeforge build` (default: %(default)s)",
    )
    ap.add_argument("--name", default="bj", help="cluster name (default: %(default)s)")
    ap.add_argument(
        "--computes", type=int, default=32, help="computes to join per round (default: %(default)s)"
    )
    ap.add_argument(
        "--intervals",
        default="2",
        help="comma-separated join intervals in s, one fresh cluster each; 2 s "
        "suits 2 cores (default: %(default)s)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="bound for the controller and for all computes after the last add "
        "(default: %(default)ss)",
    )
    ap.add_argument(
        "--min-free-mib",
        type=int,
        default=3072,
        help="add no node while the host has less memory available (default: %(default)s MiB)",
    )
    ap.add_argument(
        "--agent-from-checkout",
        action="store_true",
        help="nodes run this checkout's agent (see time_to_ready.py)",
    )
    ap.add_argument("--poll", type=float, default=0.25, help="controller poll interval (s)")
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path("/var/tmp/nodeforge-bench"),
        help="where join.json is written (default: %(default)s)",
    )
    ap.add_argument(
        "--inotify-instances",
        type=int,
        help="fs.inotify.max_user_instances for the run (default: raised to fit --computes if "
        "lower; restored afterwards)",
    )
    ap.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (network namespaces, overlays, systemd-nspawn)")
    if args.inotify_instances is not None and not 128 <= args.inotify_instances <= 65536:
        sys.exit("--inotify-instances: 128..65536")
    if not 1 <= args.computes <= 200:
        sys.exit("--computes: 1..200 (the cluster subnet has 247 addresses)")
    intervals = [float(x) for x in args.intervals.split(",") if x.strip()]
    image = args.image.resolve()
    manifest, _ = ttr.check_image(image)
    log(f"image {image} created {manifest.get('created')}")
    lc = LocalCluster(args.name, progress=lambda m: None)
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "image": str(image),
        "image_created": manifest.get("created"),
        "cpus": os.cpu_count(),
        "poll_s": args.poll,
        "argv": sys.argv[1:],
        "rounds": [],
    }
    with inotify_headroom(args.computes, args.inotify_instances) as limit:
        report["inotify_max_user_instances"] = limit
        for iv in intervals:
            report["rounds"].append(round_(lc, image, args.computes, iv, args))
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "join.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for r in report["rounds"]:
            if not r.get("ok"):
                print(f"interval {r['interval_s']}s: FAILED: {r.get('error')}")
                continue
            print(
                f"interval {r['interval_s']}s, {r['computes']} computes: all ready "
                f"{r['all_seconds']}s after the first add "
                f"({r['last_start_to_all_ready_s']}s after the last start); per node median "
                f"{r['per_node_median_s']}s (min {r['per_node_min_s']}, max "
                f"{r['per_node_max_s']}; first half {r['first_half_median_s']}s, second half "
                f"{r['second_half_median_s']}s), slope {r['slope_s_per_node']} s/node, agent "
                f"median {r['agent_median_s']}s, ~{r['mem_per_node_mib']} MiB/node"
            )
            if r.get("stopped_adding"):
                print(f"  {r['stopped_adding']}")
            for x in r["nodes"]:
                print(
                    f"  {x['node']}  start +{x['started_after_first_add_s']:6.2f}s  "
                    f"to ready {x['seconds']:6.2f}s  agent {x['agent_seconds']}s "
                    f"(started {x['agent_started_after_s']}s after nspawn, load "
                    f"{x['load_at_start']})"
                )
        print(f"full result: {args.workdir / 'join.json'}")
    return 0 if all(r.get("ok") for r in report["rounds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
