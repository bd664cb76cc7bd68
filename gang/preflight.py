"""`nodeforge gang ready` with `probe.mode: collective`: the launcher side (in the batch
script) and the participant side (`gang ready --local`, one per node, started by srun).

The launcher takes the node names from Slurm's record of the job (never from job text),
their addresses from `scontrol -o show node` (NodeAddr), hands both to the participants in
the environment srun passes on, and reads back rank 0's one result line. Each participant
checks that it is the node its rank names. The verdict is put in the job's Comment:
`nfg-ready=<Restarts>` when every node meets the thresholds, else
`nfg-slow=<Restarts>:<node>[,<node>]` (read by gang/readiness.py).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from nodeforge.errors import NodeforgeError

from . import collective
from .config import Probe

ENV_PEERS = "NFG_PREFLIGHT_PEERS"  # gn1=10.0.0.2,gn2=10.0.0.3 (rank order)
ENV_DEADLINE = "NFG_PREFLIGHT_DEADLINE"  # epoch seconds
ENV_JOB = "NFG_PREFLIGHT_JOB"
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ADDR_IN_LINE = re.compile(r" NodeAddr=(\S{1,255})(?= )")
_BUSBW = re.compile(r"# Avg bus bandwidth\s*: ([0-9]{1,9}(?:\.[0-9]{1,9})?)\s*")


class PreflightFailed(NodeforgeError):
    pass


# ---- launcher --------------------------------------------------------------------------------


def node_addresses(text: str, names: Sequence[str]) -> dict[str, str]:
    """NodeAddr of each of *names* from `scontrol -o show node <names>` (one line per node).
    Only the part of a line before ` State=` is read: what comes before it is config or
    slurmd's, the free texts (Comment, Reason) come after (slurm_records.node_from_line)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(f"NodeName={name} "):
                head = line.split(" State=", 1)[0]
                m = _ADDR_IN_LINE.search(head + " ")
                if m is None:
                    raise PreflightFailed(f"scontrol show node {name}: no NodeAddr")
                out[name] = resolve(m.group(1), name)
    missing = [n for n in names if n not in out]
    if missing:
        raise PreflightFailed(f"scontrol show node: no record of {', '.join(missing)}")
    return out


def resolve(addr: str, node: str) -> str:
    """One IP address for *node*'s NodeAddr (a literal, or a name with exactly one)."""
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    if not _NODE.fullmatch(addr):
        raise PreflightFailed(f"node {node}: NodeAddr {addr!r:.60} is not an address or name")
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PreflightFailed(f"node {node}: cannot resolve NodeAddr {addr}: {exc}") from None
    ips = sorted({str(i[4][0]) for i in infos})
    if len(ips) != 1:
        raise PreflightFailed(
            f"node {node}: NodeAddr {addr} resolves to {ips or 'nothing'}; set NodeAddr to "
            "the address the job's traffic uses"
        )
    return ips[0]


def encode_peers(addrs: Mapping[str, str]) -> str:
    return ",".join(f"{n}={a}" for n, a in addrs.items())


def decode_peers(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The launcher's list, checked (it passed through the job's environment)."""
    hosts, addrs = [], []
    for item in text.split(","):
        name, eq, addr = item.partition("=")
        if not eq or not _NODE.fullmatch(name) or name in hosts:
            raise PreflightFailed(f"{ENV_PEERS}: bad entry {item!r:.80}")
        try:
            addrs.append(str(ipaddress.ip_address(addr)))
        except ValueError:
            raise PreflightFailed(f"{ENV_PEERS}: {name}: {addr!r:.60} is not an address") from None
        hosts.append(name)
    if not 1 <= len(hosts) <= collective.MAX_NODES:
        raise PreflightFailed(f"{ENV_PEERS}: {len(hosts)} nodes")
    return tuple(hosts), tuple(addrs)


def read_result(output: str, hosts: Sequence[str]) -> collective.Verdict:
    """Rank 0's one result line from srun's output. Anything else (no line, two lines, a
    node not of this job) is not a verdict."""
    lines = [ln for ln in output.splitlines() if ln.startswith(collective.RESULT_PREFIX)]
    if len(lines) != 1:
        raise PreflightFailed(f"expected one preflight result line, got {len(lines)}")
    try:
        d = json.loads(lines[0][len(collective.RESULT_PREFIX) :])
        slow = d["slow"]
        if not isinstance(slow, list) or not all(isinstance(n, str) for n in slow):
            raise TypeError
        nodes = tuple(
            collective.NodeFigure(
                str(n["node"]),
                float(n["latency_ms"]) if n["latency_ms"] is not None else math.inf,
                float(n["bandwidth_mbps"]) if n["bandwidth_mbps"] is not None else math.inf,
                n["node"] in slow,
                str(n["why"]),
            )
            for n in d["nodes"]
        )
        transport = str(d["transport"])
    except (ValueError, KeyError, TypeError):
        raise PreflightFailed("the preflight result line is malformed") from None
    if sorted(n.node for n in nodes) != sorted(hosts) or not set(slow) <= set(hosts):
        raise PreflightFailed("the preflight result does not name exactly the job's nodes")
    return collective.Verdict(nodes, transport)


def table(v: collective.Verdict) -> str:
    rows = [f"{'NODE':<20} {'LATENCY_MS':>10} {'MB/S':>10}  RESULT"]
    for n in v.nodes:
        lat = "-" if not math.isfinite(n.latency_ms) else f"{n.latency_ms:.2f}"
        bw = "-" if not math.isfinite(n.bandwidth_mbps) else f"{n.bandwidth_mbps:.1f}"
        rows.append(f"{n.node:<20} {lat:>10} {bw:>10}  {'SLOW: ' + n.why if n.slow else 'ok'}")
    return "\n".join(rows)


def nccl_available() -> str | None:
    """NCCL's all_reduce_perf (nccl-tests) on a GPU node: its path, else None."""
    path = shutil.which("all_reduce_perf")
    return path if path and Path("/dev/nvidia0").exists() else None


def nccl_busbw(output: str) -> float | None:
    """all_reduce_perf's `# Avg bus bandwidth : X` (GB/s) as MB/s; None if absent."""
    found = [m for ln in output.splitlines() if (m := _BUSBW.fullmatch(ln))]
    return float(found[-1].group(1)) * 1000 if len(found) == 1 else None


# ---- participant -----------------------------------------------------------------------------


def participant_plan(probe: Probe, env: Mapping[str, str]) -> collective.Plan:
    hosts, addrs = decode_peers(env.get(ENV_PEERS, ""))
    rank_s = env.get("SLURM_NODEID", "")
    if not (rank_s.isascii() and rank_s.isdigit() and int(rank_s) < len(hosts)):
        raise PreflightFailed(f"SLURM_NODEID={rank_s[:12]!r} is not a rank of {len(hosts)}")
    rank = int(rank_s)
    me = env.get("SLURMD_NODENAME", "")
    if me != hosts[rank]:
        raise PreflightFailed(f"rank {rank} is {hosts[rank]}, but this is node {me[:64]!r}")
    job_s = env.get(ENV_JOB, "")
    if not (job_s.isascii() and job_s.isdigit() and len(job_s) <= 10):
        raise PreflightFailed(f"{ENV_JOB}={job_s[:12]!r} is not a job id")
    try:
        until = float(env.get(ENV_DEADLINE, ""))
    except ValueError:
        raise PreflightFailed(f"{ENV_DEADLINE} is not a time") from None
    left = until - time.time()
    if not math.isfinite(left):
        raise PreflightFailed(f"{ENV_DEADLINE} is not a time")
    left = min(left, probe.timeout)  # never longer than the operator's bound
    return collective.Plan(
        job_id=int(job_s),
        rank=rank,
        hosts=hosts,
        addrs=addrs,
        ports=(probe.port,) * len(hosts),
        nbytes=probe.bytes,
        deadline=time.monotonic() + left,
        pings=probe.pings,
    )


def participate(probe: Probe, env: Mapping[str, str] | None = None) -> str | None:
    """Run this node's part; rank 0 returns its result line (thresholds applied)."""
    plan = participant_plan(probe, os.environ if env is None else env)
    try:
        v = collective.participate(plan)
    except collective.PreflightError as exc:
        raise PreflightFailed(f"collective preflight on {plan.hosts[plan.rank]}: {exc}") from None
    if v is None:
        return None
    v = collective.apply_thresholds(v, probe.min_bandwidth_mb_s, probe.max_latency_ms)
    return v.to_line()
