"""Collective preflight cost per gang, by node count (gang/collective.py, the real code).

Every rank is a thread on this machine, each on its own loopback address (127.0.0.<r+1>),
so all ranks share this machine's CPUs: the figures are the check's own cost (protocol,
XOR, framing) with a network that is not the bottleneck, not a fabric measurement. One run;
prints one line per node count: wall seconds of the whole check, and the slowest node's
figures.

    .venv/bin/python bench/preflight_cost.py [--bytes 4194304] [--nodes 2,4,8,16]
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

from nodeforge.gang import collective as col


def _ports(n: int) -> tuple[int, ...]:
    socks = [socket.socket() for _ in range(n)]
    for i, s in enumerate(socks):
        s.bind((f"127.0.0.{i + 1}", 0))
    ports = tuple(s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    return ports


def one(n: int, nbytes: int, pings: int) -> tuple[float, col.Verdict]:
    hosts = tuple(f"n{i}" for i in range(n))
    addrs = tuple(f"127.0.0.{i + 1}" for i in range(n))
    ports = _ports(n)
    deadline = time.monotonic() + 120
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        out[r] = col.participate(col.Plan(1, r, hosts, addrs, ports, nbytes, deadline, pings))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(130)
    secs = time.perf_counter() - t0
    v = out.get(0)
    if not isinstance(v, col.Verdict):
        raise SystemExit(f"{n} nodes: no verdict ({out})")
    return secs, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--nodes", default="2,4,8,16")
    ap.add_argument("--pings", type=int, default=5)
    a = ap.parse_args()
    print(f"bytes={a.bytes} pings={a.pings} (threads on loopback, one machine)")
    print(f"{'NODES':>5} {'WALL_S':>8} {'MAX_LAT_MS':>10} {'MIN_MB/S':>9}")
    for n in (int(x) for x in a.nodes.split(",")):
        secs, v = one(n, a.bytes, a.pings)
        lat = max(f.latency_ms for f in v.nodes)
        bw = min(f.bandwidth_mbps for f in v.nodes)
        print(f"{n:>5} {secs:>8.3f} {lat:>10.3f} {bw:>9.1f}")


if __name__ == "__main__":
    main()
