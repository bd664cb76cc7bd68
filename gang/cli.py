"""`nodeforge gang run|status|ready`. Imports only stdlib (+yaml via config) at import time."""

from __future__ import annotations

import json
import os
import sys
import time

DEFAULT_CONFIG = "/etc/nodeforge/gang.yaml"


def register(subparsers) -> None:
    p = subparsers.add_parser("gang", help="gang readiness governor (controller)")
    sub = p.add_subparsers(dest="gang_command", metavar="SUBCOMMAND")
    sub.required = True

    r = sub.add_parser("run", help="run the governor daemon (nodeforge-gang.service)")
    r.add_argument(
        "--config", default=DEFAULT_CONFIG, help="governor config file (default: %(default)s)"
    )
    r.add_argument("--once", action="store_true", help="one cycle, then exit")
    r.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    r.set_defaults(func=_run)

    s = sub.add_parser(
        "status",
        help="list gang jobs (phase, counter, next eligible time) and struck/drained nodes",
    )
    s.add_argument(
        "--config", default=DEFAULT_CONFIG, help="governor config file (default: %(default)s)"
    )
    s.add_argument("--json", action="store_true", help="print the gangs as JSON")
    s.add_argument("--all", action="store_true", help="include finished jobs")
    s.set_defaults(func=_status)

    q = sub.add_parser("ready", help="app readiness probe: run inside a job (batch script)")
    q.add_argument(
        "--config", default=DEFAULT_CONFIG, help="governor config file (default: %(default)s)"
    )
    q.add_argument(
        "--local",
        action="store_true",
        help="only check this node (what the job-wide probe runs on every node)",
    )
    q.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for readiness (default: from the config)",
    )
    q.set_defaults(func=_ready)


def _load(path: str):
    from .config import load

    return load(path)


def _run(args) -> int:
    import logging
    import signal

    from .governor import Governor

    cfg = _load(args.config)
    logging.getLogger("nodeforge").setLevel(logging.INFO)
    gov = Governor(cfg)
    signal.signal(signal.SIGTERM, lambda *_: gov.stop())
    signal.signal(signal.SIGINT, lambda *_: gov.stop())
    gov.run(max_cycles=1 if args.once else None, duration=args.duration)
    return 0


def _fmt_ts(ts) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts))


def _status(args) -> int:
    from . import state as st_mod

    cfg = _load(args.config)
    st = st_mod.load(cfg.state_file)
    rows = []
    for r in sorted(st.jobs.values(), key=lambda r: (len(r.job_id), r.job_id)):
        if r.phase == st_mod.DONE and not args.all:
            continue
        rows.append(
            {
                "job_id": r.job_id,
                "phase": r.phase,
                "count": r.count,
                "next_eligible": r.next_eligible,
                "admitted_at": r.admitted_at,
                "ready_at": r.ready_at,
                "partition": r.partition,
                "why": r.why,
            }
        )
    nodes = _node_rows(st)
    if args.json:
        json.dump(
            {"state_file": cfg.state_file, "gangs": rows, "nodes": nodes}, sys.stdout, indent=2
        )
        print()
        return 0
    if not rows:
        print(f"no gang jobs (state: {cfg.state_file})")
    else:
        print(f"{'JOBID':<10} {'PHASE':<18} {'COUNT':>5} {'NEXT_ELIGIBLE':<20} WHY")
    for row in rows:
        print(
            f"{row['job_id']:<10} {row['phase']:<18} {row['count']:>5} {_fmt_ts(row['next_eligible']):<20} {row['why']}"
        )
    if nodes:
        print(f"\n{'NODE':<16} {'STATE':<9} {'STRIKES':>7} {'LAST_STRIKE':<20} {'LAST_JOB':<9} WHY")
    for n in nodes:
        print(
            f"{n['node']:<16} {n['state']:<9} {n['strikes']:>7} {_fmt_ts(n['last_strike_at']):<20}"
            f" {n['last_job'] or '-':<9} {n['why']}"
        )
    return 0


def _node_rows(st) -> list[dict]:
    """Nodes with strikes in the window, or drained by the governor (as of its last cycle)."""
    out = []
    for r in sorted(st.nodes.values(), key=lambda r: r.name):
        last = r.strikes[-1] if r.strikes else None
        out.append(
            {
                "node": r.name,
                "state": r.drain or "struck",
                "strikes": len(r.strikes),
                "last_strike_at": last.at if last else None,
                "last_job": last.job_id if last else "",
                "why": r.drain_reason or (last.why if last else ""),
            }
        )
    return out


def _ready(args) -> int:
    from nodeforge import proc
    from nodeforge.errors import NodeforgeError

    from .readiness import ready_marker
    from .slurm_view import SlurmCli

    cfg = _load(args.config)
    timeout = args.timeout if args.timeout is not None else cfg.probe.timeout
    if args.local:
        if cfg.probe.command:
            proc.run(
                list(cfg.probe.command),
                timeout=timeout,
                hint=f"probe.command in {args.config} failed on {os.uname().nodename}",
            )
        if cfg.probe.mode == "collective":
            from . import preflight

            line = preflight.participate(cfg.probe)
            if line is not None:
                print(line, flush=True)
        return 0
    raw_id = os.environ.get("SLURM_JOB_ID", "")
    if not raw_id:
        raise NodeforgeError(
            "`nodeforge gang ready` runs inside a Slurm job (SLURM_JOB_ID unset); "
            "call it from the batch script, or use --local on a node"
        )
    if not (raw_id.isascii() and raw_id.isdigit() and len(raw_id) <= 10):
        raise NodeforgeError(
            f"SLURM_JOB_ID={raw_id[:40]!r} is not a Slurm job id (digits); "
            "run `nodeforge gang ready` from the job's batch script"
        )
    job_id = int(raw_id)
    nnodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
    cmd = [
        "srun",
        f"--nodes={nnodes}",
        "--ntasks-per-node=1",
        f"--ntasks={nnodes}",
        "--kill-on-bad-exit=1",
        sys.executable,
        "-m",
        "nodeforge.cli",
        "gang",
        "ready",
        "--local",
        "--config",
        args.config,
    ]
    slurm = SlurmCli(timeout=cfg.command_timeout)
    if cfg.probe.mode == "collective":
        return _ready_collective(args, cfg, slurm, job_id, cmd)
    proc.run(cmd, timeout=timeout, hint="the gang readiness probe failed on a node")
    job = _own_job(slurm, job_id)
    _mark(slurm, job, ready_marker(job.restarts))
    print(f"gang ready: job {job_id} ({nnodes} nodes) marked {ready_marker(job.restarts)}")
    return 0


def _own_job(slurm, job_id: int):
    from nodeforge.errors import NodeforgeError

    job = slurm.show_job(job_id)
    if job is None:
        raise NodeforgeError(f"job {job_id} not found by scontrol; cannot record readiness")
    if not job.address:
        raise NodeforgeError(f"job {job_id}: Slurm's record names no single job; not marked")
    return job


def _mark(slurm, job, token: str) -> None:
    """Replace our readiness tokens in the job's Comment with *token*."""
    from .readiness import READY_MARK, SLOW_MARK

    toks = [t for t in job.comment.split() if not t.startswith((READY_MARK, SLOW_MARK))]
    # (by the job's address: for the array task that carries the array's id, JobId=<id>
    # would mark every task of the array ready)
    slurm.set_comment(job.address, " ".join([*toks, token]))


def _ready_collective(args, cfg, slurm, job_id: int, cmd: list[str]) -> int:
    """Every node up: the all-reduce across exactly the job's nodes (Slurm's record of
    them), then the verdict in the Comment. Exit 0 only when the job was marked ready."""
    from nodeforge import proc

    from . import preflight
    from .readiness import ready_marker, slow_marker

    probe = cfg.probe
    job = _own_job(slurm, job_id)
    hosts = list(job.nodes)
    started = time.monotonic()
    if probe.transport == "auto" and preflight.nccl_available():
        nccl = _nccl(probe, len(hosts))
        if nccl is not None and nccl >= probe.min_bandwidth_mb_s:
            _mark(slurm, job, ready_marker(job.restarts))
            print(f"gang ready: NCCL all_reduce_perf bus bandwidth {nccl:.0f} MB/s: marked ready")
            return 0
        print("gang ready: NCCL all-reduce below threshold or failed; the TCP check names nodes")
    elif probe.transport == "auto":
        print("gang ready: NCCL all_reduce_perf not installed (or no GPU): TCP check used")
    shown = proc.run(
        [*slurm.prefix, "scontrol", "-o", "show", "node", ",".join(hosts)],
        timeout=cfg.command_timeout,
        env=slurm.env,
        hint="scontrol show node (the job's node addresses) failed",
    ).stdout
    addrs = preflight.node_addresses(shown, hosts)
    left = max(1.0, probe.timeout - (time.monotonic() - started))
    env = {
        preflight.ENV_PEERS: preflight.encode_peers(addrs),
        preflight.ENV_DEADLINE: f"{time.time() + left:.3f}",
        preflight.ENV_JOB: str(job_id),
    }
    # srun passes our environment on to every task; the participants stop at the deadline,
    # srun is given a little more to collect them
    cp = proc.run(cmd, timeout=left + 10, env=env, check=False)
    out = cp.stdout or ""
    try:
        verdict = preflight.read_result(out, hosts)
    except preflight.PreflightFailed as exc:
        tail = "\n".join(out.strip().splitlines()[-10:])
        raise preflight.PreflightFailed(
            f"collective preflight of job {job_id} did not complete within probe.timeout "
            f"({probe.timeout:g}s): {exc}; job not marked ready\n{tail}"
        ) from None
    print(preflight.table(verdict))
    slow = [n for n in verdict.slow if n in hosts]
    if slow:
        _mark(slurm, job, slow_marker(job.restarts, slow))
        print(f"gang ready: job {job_id} NOT ready: below threshold: {', '.join(slow)}")
        return 1
    _mark(slurm, job, ready_marker(job.restarts))
    print(f"gang ready: job {job_id} ({len(hosts)} nodes) marked {ready_marker(job.restarts)}")
    return 0


def _nccl(probe, nodes: int) -> float | None:
    """NCCL's all-reduce across the job (one task per node, as the TCP check): its bus
    bandwidth in MB/s, or None when it did not run or printed no figure."""
    from nodeforge import proc

    from . import preflight

    cp = proc.run(
        [
            "srun",
            f"--nodes={nodes}",
            "--ntasks-per-node=1",
            f"--ntasks={nodes}",
            "--kill-on-bad-exit=1",
            "all_reduce_perf",
            "-b",
            str(probe.bytes),
            "-e",
            str(probe.bytes),
        ],
        timeout=probe.timeout,
        check=False,
    )
    return preflight.nccl_busbw(cp.stdout or "") if cp.returncode == 0 else None
