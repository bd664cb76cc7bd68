"""Gang governance bench: a deterministic cluster simulator plus two measurements.

    python bench/gang_sim.py sim       # simulator: wasted node-hours, completions (seeded)
    python bench/gang_sim.py cycle     # governor cycle cost with 10,000 jobs in the queue
    python bench/gang_sim.py deadline  # deadline -> requeue delay on a real slurmctld (root)
    python bench/gang_sim.py all

The simulator replays a congested cluster where nodes join continuously (cloud capacity
arriving a few at a time, each booting for a while), some never become ready (they stay
POWERING_UP until Slurm's ResumeTimeout marks them DOWN and they are replaced), and
multi-node jobs arrive faster than they can run. Every scenario uses the same seed, and the
governor's decisions come from `gang.policy.decide`: the exact code the daemon runs. Jobs
that are requeued or held are moved by the simulator the way slurmctld would.

It prints, per scenario: node-hours wasted by allocations that were not ready, useful
node-hours, jobs completed, mean submit->completion time, and the nodes the governor's node
strikes drained (in brackets: how many of them really were never-booting nodes; nobody
resumes a drained node in the model, so a wrong drain costs its capacity to the end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nodeforge.gang import config as gcfg
from nodeforge.gang.policy import decide
from nodeforge.gang.slurm_view import JobObs, Snapshot
from nodeforge.gang.state import GovState

HOUR = 3600.0


@dataclass
class Node:
    name: str
    joined: float  # when slurmctld learned about it (allocatable from then on)
    boot: float  # boot duration once powering up
    bad: bool  # never finishes booting
    boot_started: float | None = None
    job: str | None = None
    down: bool = False
    drain_reason: str = ""  # drained by the governor's node strikes (nobody resumes it here)

    def ready(self, now: float) -> bool:
        return (
            not self.bad
            and not self.down
            and self.boot_started is not None
            and now >= self.boot_started + self.boot
        )


@dataclass
class Job:
    jid: str
    size: int
    runtime: float
    limit: float
    submit: float
    state: str = "PENDING"  # PENDING RUNNING COMPLETED TIMEOUT
    nodes: list[str] = field(default_factory=list)
    start: float | None = None
    ready_at: float | None = None  # all nodes ready (application really starts)
    eligible: float = 0.0
    held: bool = False
    hung: bool = False  # a node's prolog hangs (container import stuck): never ready
    restarts: int = 0
    admin_comment: str = ""
    end: float | None = None


@dataclass
class Params:
    seed: int = 1
    hours: float = 48.0
    tick: float = 15.0
    initial_nodes: int = 48
    join_every: float = 300.0  # one node joins every 5 min (continuous provisioning)
    max_nodes: int = 128
    bad_fraction: float = 0.08
    boot_min: float = 120.0
    boot_max: float = 900.0
    resume_timeout: float = 3600.0  # Slurm marks a never-booting node DOWN after this
    prolog_hang: float = 0.01  # per node per allocation: prolog hangs until the job ends
    job_every: float = 300.0  # mean inter-arrival (demand exceeds capacity: congested)
    sizes: tuple[int, ...] = (2, 4, 4, 8, 8, 16)
    runtime_min: float = 1800.0
    runtime_max: float = 3 * HOUR
    # share of jobs submitted with a begin time (`sbatch --begin`) this far ahead: a released
    # gang that waits for it must not stall block_admission (issue 10)
    begin_fraction: float = 0.0
    begin_delay: float = 6 * HOUR


def simulate(p: Params, cfg: gcfg.GangConfig | None) -> dict:
    rng = random.Random(p.seed)
    hang_rng = random.Random(p.seed * 7919 + 1)  # own stream: arrivals identical in all scenarios
    nodes: dict[str, Node] = {}
    node_seq = 0

    def add_node(t: float) -> None:
        nonlocal node_seq
        node_seq += 1
        nodes[f"n{node_seq:04d}"] = Node(
            f"n{node_seq:04d}",
            t,
            rng.uniform(p.boot_min, p.boot_max),
            rng.random() < p.bad_fraction,
        )

    for _ in range(p.initial_nodes):
        add_node(0.0)
    # job arrivals, precomputed from the same rng stream for every scenario
    arrivals: list[Job] = []
    t = 0.0
    k = 0
    while t < p.hours * HOUR:
        t += rng.expovariate(1.0 / p.job_every)
        k += 1
        rt = rng.uniform(p.runtime_min, p.runtime_max)
        arrivals.append(Job(str(k), rng.choice(p.sizes), rt, rt * 2 + HOUR, t, eligible=t))
    if p.begin_fraction:
        brng = random.Random(p.seed * 104729 + 3)  # own stream: the arrivals stay the same
        for j in arrivals:
            if brng.random() < p.begin_fraction:
                j.eligible = j.submit + p.begin_delay
    jobs: dict[str, Job] = {}
    st = GovState()
    wasted = useful = 0.0
    next_join = p.join_every
    ai = 0
    steps = int(p.hours * HOUR / p.tick)
    for step in range(steps + 1):
        now = step * p.tick
        # capacity: joins and replacements
        while next_join <= now:
            if sum(1 for n in nodes.values() if not n.down) < p.max_nodes:
                add_node(next_join)
            next_join += p.join_every
        while ai < len(arrivals) and arrivals[ai].submit <= now:
            j = arrivals[ai]
            # submitted unheld: with block_admission the governor's admin hold queues it (the
            # governor runs before the scheduler in each tick; on Slurm, see docs/gang.md)
            j.held = False
            jobs[j.jid] = j
            ai += 1
        # node failures: a never-booting node goes DOWN at ResumeTimeout; Slurm requeues
        # its job (NODE_FAIL) unless --no-kill; it is replaced by a new node.
        for n in list(nodes.values()):
            if (
                n.bad
                and not n.down
                and n.boot_started is not None
                and now >= n.boot_started + p.resume_timeout
            ):
                n.down = True
                add_node(now)
                if n.job:
                    _requeue(jobs[n.job], nodes, now, held=False, start_at=now)
        # running jobs: finish or hit their time limit
        for j in jobs.values():
            if j.state != "RUNNING":
                continue
            all_ready = not j.hung and all(nodes[x].ready(now) for x in j.nodes)
            if j.ready_at is None and all_ready:
                j.ready_at = now
            if j.ready_at is not None and now >= j.ready_at + j.runtime:
                _finish(j, nodes, now, "COMPLETED")
            elif now >= j.start + j.limit:
                _finish(j, nodes, now, "TIMEOUT")
        # the governor
        if cfg is not None:
            snap = _snapshot(jobs, nodes, now)
            st, actions = decide(cfg, st, snap, now)
            for a in actions:
                if a.kind == "drain" and a.node in nodes:
                    nodes[a.node].drain_reason = a.detail  # what slurmctld shows as Reason
                j = jobs.get(a.job_id)
                if j is None or a.node:  # node actions (strike, drain, ...) end here
                    continue
                if a.kind == "requeue" and j.state == "RUNNING":
                    _requeue(j, nodes, now, held=a.hold, start_at=a.start_at or now)
                elif a.kind == "requeuehold" and j.state == "RUNNING":
                    _requeue(j, nodes, now, held=True, start_at=now)
                elif a.kind == "set_start":
                    j.eligible = a.start_at or now
                elif a.kind == "hold" and j.state == "PENDING":
                    j.held = True
                elif a.kind == "release":
                    j.held = False
                elif a.kind == "cancel" and j.state in ("PENDING", "RUNNING"):
                    _finish(j, nodes, now, "CANCELLED")
        # the scheduler: priority = submit order; start what fits (backfill style)
        free = [
            n
            for n in nodes.values()
            if n.job is None and not n.down and not n.drain_reason and n.joined <= now
        ]
        free.sort(key=lambda n: (not n.ready(now), n.name))  # booted nodes first
        for j in sorted(
            (j for j in jobs.values() if j.state == "PENDING"), key=lambda j: (j.submit, int(j.jid))
        ):
            if j.held or j.eligible > now or len(free) < j.size:
                continue
            take, free = free[: j.size], free[j.size :]
            for n in take:
                n.job = j.jid
                if n.boot_started is None:
                    n.boot_started = now  # cloud node powers up on first allocation
            j.state, j.nodes, j.start, j.ready_at = "RUNNING", [n.name for n in take], now, None
            j.hung = any(hang_rng.random() < p.prolog_hang for _ in take)
        # accounting for this tick
        for j in jobs.values():
            if j.state == "RUNNING":
                if j.ready_at is None:
                    wasted += len(j.nodes) * p.tick
                else:
                    useful += len(j.nodes) * p.tick
    done = [j for j in jobs.values() if j.state == "COMPLETED"]
    drained = [n for n in nodes.values() if n.drain_reason]
    return {
        "drained": len(drained),
        "drained_bad": sum(1 for n in drained if n.bad),  # ground truth the governor lacks
        "wasted_node_hours": wasted / HOUR,
        "useful_node_hours": useful / HOUR,
        "completed": len(done),
        "submitted": len(jobs),
        "timeouts": sum(1 for j in jobs.values() if j.state == "TIMEOUT"),
        "requeues": sum(j.restarts for j in jobs.values()),
        "mean_completion_h": statistics.mean((j.end - j.submit) / HOUR for j in done)
        if done
        else 0.0,
    }


def _requeue(j: Job, nodes: dict[str, Node], now: float, held: bool, start_at: float) -> None:
    for x in j.nodes:
        nodes[x].job = None
    j.state, j.nodes, j.start, j.ready_at = "PENDING", [], None, None
    j.restarts += 1
    j.held = held
    j.eligible = start_at


def _finish(j: Job, nodes: dict[str, Node], now: float, state: str) -> None:
    for x in j.nodes:
        nodes[x].job = None
    j.state, j.end = state, now


def _snapshot(jobs: dict[str, Job], nodes: dict[str, Node], now: float) -> Snapshot:
    obs = []
    for j in jobs.values():
        if j.state == "COMPLETED" and j.end is not None and now - j.end > 2 * HOUR:
            continue  # purged after MinJobAge
        obs.append(
            JobObs(
                job_id=j.jid,
                state=j.state,
                reason=(
                    "JobHeldAdmin"
                    if j.held
                    else "BeginTime"
                    if j.state == "PENDING" and j.eligible > now
                    else "Prolog"
                    if j.hung
                    else "None"
                ),
                nodes=tuple(j.nodes),
                num_nodes=j.size,
                partition="main",
                start_time=j.start,
                submit_time=j.submit,
                eligible_time=j.eligible,
                restarts=j.restarts,
                held=j.held,
                admin_held=j.held,  # the sim's only holds are the governor's (admin)
                admin_comment=j.admin_comment,
            )
        )
    node_obs = {}
    for n in nodes.values():
        if n.down:
            flags = {"DOWN", "CLOUD"}
        elif n.ready(now):
            flags = {"ALLOCATED" if n.job else "IDLE"}
        else:
            flags = {"ALLOCATED" if n.job else "IDLE", "CLOUD", "POWERING_UP"}
        if n.drain_reason:
            flags.add("DRAIN")
        node_obs[n.name] = frozenset(flags)
    reasons = {n.name: n.drain_reason for n in nodes.values() if n.drain_reason}
    return Snapshot(jobs=obs, nodes=node_obs, taken_at=now, node_reasons=reasons)


def scenarios(
    timeout: str = "20m", strike_limit: int = 2
) -> list[tuple[str, gcfg.GangConfig | None]]:
    common = {
        "timeout": timeout,
        "requeuing": {"backoff_base_seconds": 60, "backoff_max_seconds": 1800, "jitter": 0.1},
    }
    return [
        ("no governance", None),
        ("governance", gcfg.from_dict(common, "sim")),
        (
            "governance + block_admission",
            gcfg.from_dict({**common, "block_admission": True}, "sim"),
        ),
        (
            f"governance + node strikes ({strike_limit}/1h)",
            gcfg.from_dict(
                {**common, "node_strike_limit": strike_limit, "node_strike_window_seconds": 3600},
                "sim",
            ),
        ),
    ]


def cmd_sim(args) -> None:
    p = Params(
        seed=args.seed,
        hours=args.hours,
        resume_timeout=args.resume_timeout,
        begin_fraction=args.begin_fraction,
    )
    runs = scenarios(args.timeout, args.strike_limit)
    if p.begin_fraction:
        # the rule before issue 10: any released-but-pending gang blocks the queue
        runs.insert(3, ("block_admission, old rule", runs[2][1]))
    print(
        f"# governor: timeout={args.timeout} backoff 60-1800s jitter 0.1; node strikes: "
        f"limit {args.strike_limit} in 1 h (last scenario only)\n"
        f"# simulator: seed={p.seed} hours={p.hours} tick={p.tick}s nodes {p.initial_nodes}->"
        f"{p.max_nodes} (+1 per {p.join_every:.0f}s) bad={p.bad_fraction:.0%} "
        f"boot {p.boot_min:.0f}-{p.boot_max:.0f}s ResumeTimeout={p.resume_timeout:.0f}s\n"
        f"#   prolog hangs {p.prolog_hang:.0%} per node per allocation; a job every "
        f"{p.job_every:.0f}s on average; jobs' time limit = 2 x runtime + 1 h"
    )
    print(
        f"{'scenario':<32} {'wasted_nh':>10} {'useful_nh':>10} {'completed':>10} {'requeues':>9}"
        f" {'mean_done_h':>11} {'drained(bad)':>12}"
    )
    base = None
    from unittest import mock

    from nodeforge.gang import policy

    for name, cfg in runs:
        t0 = time.perf_counter()
        if name.endswith("old rule"):
            with mock.patch.object(policy, "waits_for_itself", lambda *a, **k: False):
                r = simulate(p, cfg)
        else:
            r = simulate(p, cfg)
        base = base or r
        print(
            f"{name:<32} {r['wasted_node_hours']:>10.1f} {r['useful_node_hours']:>10.1f} "
            f"{r['completed']:>5}/{r['submitted']:<4} {r['requeues']:>9} {r['mean_completion_h']:>11.2f}"
            f" {r['drained']:>7} ({r['drained_bad']})   ({time.perf_counter() - t0:.1f}s)"
        )
    # determinism check: same seed, same numbers
    short = Params(seed=p.seed, hours=min(p.hours, 6), resume_timeout=p.resume_timeout)
    assert simulate(short, runs[-1][1]) == simulate(short, runs[-1][1])
    print("# deterministic: re-run with the same seed gives identical results")


# The other ~90 keys of a 22.05 `squeue --json` job (names from a real capture, typical
# values), so that the bytes and the parse cost match what slurmctld sends (~3.5 kB a job).
FILLER = {
    f"{k}": v
    for k, v in zip(
        [
            "accrue_time",
            "association_id",
            "batch_features",
            "batch_host",
            "billable_tres",
            "burst_buffer",
            "burst_buffer_state",
            "cluster",
            "cluster_features",
            "container",
            "contiguous",
            "core_spec",
            "cores_per_socket",
            "cpu_frequency_governor",
            "cpu_frequency_maximum",
            "cpu_frequency_minimum",
            "cpus_per_task",
            "cpus_per_tres",
            "deadline",
            "delay_boot",
            "dependency",
            "derived_exit_code",
            "end_time",
            "excluded_nodes",
            "exit_code",
            "features",
            "federation_origin",
            "federation_siblings_active",
            "federation_siblings_viable",
            "flags",
            "gres_detail",
            "group_id",
            "group_name",
            "het_job_id_set",
            "last_sched_evaluation",
            "licenses",
            "max_cpus",
            "max_nodes",
            "mcs_label",
            "memory_per_cpu",
            "memory_per_node",
            "memory_per_tres",
            "minimum_cpus_per_node",
            "minimum_tmp_disk_per_node",
            "nice",
            "pre_sus_time",
            "preempt_time",
            "prefer",
            "profile",
            "reboot",
            "required_nodes",
            "resize_time",
            "resv_name",
            "shared",
            "show_flags",
            "sockets_per_board",
            "sockets_per_node",
            "standard_error",
            "standard_input",
            "suspend_time",
            "system_comment",
            "tasks_per_board",
            "tasks_per_core",
            "tasks_per_node",
            "tasks_per_socket",
            "thread_spec",
            "threads_per_core",
            "time_minimum",
            "tres_alloc_str",
            "tres_bind",
            "tres_freq",
            "tres_per_job",
            "tres_per_node",
            "tres_per_socket",
            "tres_per_task",
            "user_name",
            "wckey",
        ],
        [
            1796290183,
            0,
            "",
            "n0001",
            96.0,
            "",
            "",
            "cluster",
            "",
            "",
            False,
            0,
            0,
            0,
            0,
            0,
            1,
            "",
            0,
            0,
            "",
            0,
            1796376583,
            "",
            0,
            "",
            "",
            "",
            "",
            ["CRON_JOB", "EXACT_NODES"],
            [],
            1000,
            "users",
            "",
            1796290190,
            "",
            0,
            8,
            "",
            0,
            0,
            "",
            1,
            0,
            0,
            0,
            0,
            "",
            [],
            0,
            "",
            0,
            "",
            ["ALLOW_OVERSUBSCRIBE"],
            ["DETAIL", "LOCAL"],
            0,
            0,
            "/home/u/slurm-%j.err",
            "/dev/null",
            0,
            "",
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            "cpu=96,mem=1000000M,node=8,billing=96,gres/gpu=64",
            "",
            "",
            "",
            "gres:gpu:8",
            "",
            "",
            "u",
            "",
        ]
        * 2,
        strict=False,
    )
}
FILLER["job_resources"] = {
    "nodes": "n[0001-0008]",
    "allocated_cores": 768,
    "allocated_hosts": 8,
    "allocated_nodes": [{"sockets": {"0": "unassigned"}, "cores": {"0": "allocated"}}] * 2,
}


def cmd_cycle(args) -> None:
    """Governor cycle cost with N jobs: parse Slurm's JSON (22.05 `squeue --json` shape) +
    decide() + persistence (state file written only when it changed), and the bytes that
    slurmctld returns per cycle."""
    import json

    n = args.jobs
    rng = random.Random(args.seed)
    nodes_doc = {
        "nodes": [
            {
                "name": f"n{i:04d}",
                "state": "allocated" if i % 3 else "idle",
                "state_flags": [] if i % 3 else ["CLOUD", "POWERING_UP"],
                "reason": "",
                "partitions": ["main"],
                "address": "10.0.0.1",
                "hostname": f"n{i:04d}",
                "cpus": 96,
                "real_memory": 1_000_000,
                "tres": "cpu=96,mem=1000000M,gres/gpu=8",
            }
            for i in range(1, 2001)
        ],
        "errors": [],
    }
    t_sub = 1796200000
    if args.shape == "24.11":
        return _cycle_run(args, *_jobs_2411(n, rng, t_sub, args.active), t_sub, rng)
    nodes = nodes_doc["nodes"]
    jobs = []
    for i in range(1, n + 1):
        state = rng.choice(["PENDING"] * 6 + ["RUNNING"] * 3 + ["CONFIGURING"])
        nn = rng.choice([1, 2, 4, 8])
        first = rng.randint(1, 1990)
        nl = f"n[{first:04d}-{first + nn - 1:04d}]" if state != "PENDING" else ""
        jobs.append(
            {
                # the keys the reader uses plus a typical payload of the others
                "job_id": i,
                "name": f"j{i}",
                "comment": "",
                "admin_comment": "",
                "job_state": state,
                "state_reason": "Prolog" if state == "CONFIGURING" else "None",
                "state_description": "",
                "node_count": nn,
                "nodes": nl,
                "array_job_id": 0,
                "array_task_id": None,
                "het_job_id": 0,
                "het_job_offset": 0,
                "start_time": t_sub + 36000,
                "submit_time": t_sub,
                "eligible_time": t_sub,
                "priority": 1000 + i,
                "restart_cnt": 0,
                "requeue": True,
                "batch_flag": True,
                "partition": "main",
                "qos": "normal",
                "user_id": 1000,
                "current_working_directory": "/home/u",
                "command": "/home/u/train.sh",
                "standard_output": "/home/u/slurm-%j.out",
                "account": "acct",
                "tres_req_str": "cpu=96,mem=1000000M,node=8,billing=96,gres/gpu=64",
                "time_limit": 1440,
                "cpus": nn * 96,
                "tasks": nn * 8,
                **(FILLER if args.full_jobs else {}),
            }
        )
    return _cycle_run(
        args, jobs, nodes, lambda: json.dumps(nodes_doc, indent=2), _toggle_22, _dump_22, t_sub, rng
    )


def _churn(jobs: list[dict], k: int, rng: random.Random) -> None:
    """*k* pending jobs leave the queue (anywhere in it) and *k* new pending jobs, copies of
    one with new ids, arrive at its end (slurmctld lists its jobs in submission order)."""
    pending = [i for i, j in enumerate(jobs) if j["job_state"] in ("PENDING", ["PENDING"])]
    template = jobs[pending[0]]
    for i in sorted(rng.sample(pending, min(k, len(pending))), reverse=True):
        del jobs[i]
    top = max(j["job_id"] for j in jobs)
    for jid in range(top + 1, top + 1 + k):
        new = dict(template, job_id=jid, name=f"j{jid}", restart_cnt=0)
        if "standard_output" in template:
            new["standard_output"] = f"/home/u/slurm-{jid}.out"
        jobs.append(new)


def _toggler(key: str) -> Callable[[dict], None]:
    """Drain or resume a node of the document (DRAIN in `key`: 22.05's state_flags, 24.11's
    state list), with the operator's reason."""

    def toggle(node: dict) -> None:
        drained = "DRAIN" in node[key]
        node[key] = [w for w in node[key] if w != "DRAIN"] if drained else [*node[key], "DRAIN"]
        node["reason"] = "" if drained else "maintenance"

    return toggle


_toggle_22, _toggle_2411 = _toggler("state_flags"), _toggler("state")


def _dump_22(jobs: list) -> str:
    return json.dumps({"jobs": jobs, "errors": []}, indent=2)  # squeue pretty-prints


# A real capture (see tests/fixtures/slurm/README.md): `scontrol show job --json` of the
# image's Slurm 24.11.5 (data_parser v0.0.42), 2026-12-03; job 1 running, job 2 held.
FIXTURE_2411 = Path(__file__).resolve().parents[1] / "tests/fixtures/slurm"


def _n(v: int) -> dict:
    return {"set": True, "infinite": False, "number": v}


def _jobs_2411(n: int, rng: random.Random, t_sub: int, active: int | None = None):
    """N jobs shaped as the captured 24.11 records (every key, nested numbers, state lists,
    `\\/`-escaped slashes as Slurm's serializer writes them), 2,000 nodes as the 24.11 node
    fixture. Only the keys that differ between jobs are set per job; the rest is the
    capture's (shared objects: the text is what counts). *active*: that many running or
    configuring jobs and the rest pending (a queue), instead of 40% / 60%."""
    import json

    cap = json.loads((FIXTURE_2411 / "scontrol-show-job-24.11.json").read_text())["jobs"]
    running, pending = cap[0], cap[1]
    ncap = json.loads((FIXTURE_2411 / "scontrol-show-node-24.11.json").read_text())
    node0 = ncap["nodes"][0]
    nodes = []
    for i in range(1, 2001):
        nd = dict(node0, name=f"n{i:04d}", hostname=f"n{i:04d}")
        nd["state"] = ["ALLOCATED"] if i % 3 else ["IDLE", "CLOUD", "POWERING_UP"]
        nd["reason"] = ""
        nodes.append(nd)
    jobs = []
    for i in range(1, n + 1):
        state = rng.choice(["PENDING"] * 6 + ["RUNNING"] * 3 + ["CONFIGURING"])
        if active is not None:
            state = rng.choice(["RUNNING"] * 3 + ["CONFIGURING"]) if i <= active else "PENDING"
        nn = rng.choice([1, 2, 4, 8])
        first = rng.randint(1, 1990)
        j = dict(pending if state == "PENDING" else running)
        j.update(
            job_id=i,
            name=f"j{i}",
            job_state=["RUNNING", "CONFIGURING"] if state == "CONFIGURING" else [state],
            state_reason="Prolog" if state == "CONFIGURING" else "None",
            node_count=_n(nn),
            nodes=f"n[{first:04d}-{first + nn - 1:04d}]" if state != "PENDING" else "",
            priority=_n(1000 + i),
            restart_cnt=0,
            submit_time=_n(t_sub),
            eligible_time=_n(t_sub),
            start_time=_n(t_sub + 36000),
            last_sched_evaluation=_n(t_sub + 36000),
            standard_output=f"/home/u/slurm-{i}.out",
        )
        jobs.append(j)
    return (
        jobs,
        nodes,
        lambda: _slurm_json({**ncap, "nodes": nodes}),
        _toggle_2411,
        _Render2411(),
    )


def _slurm_json(d: dict) -> str:
    import json

    # Slurm 24.11's serializer: indent 2, "key": value, '/' escaped as '\\/'
    return json.dumps(d, indent=2).replace("/", "\\/")


def _dump_2411(jobs: list) -> str:
    return _slurm_json(
        {
            "jobs": jobs,
            "last_backfill": _n(0),
            "last_update": _n(1796311596),
            "meta": {},
            "errors": [],
            "warnings": [],
        }
    )


class _Render2411:
    """_dump_2411, faster (json.dumps with indent is pure Python: ~3 s for 90 MB): each job's
    text is kept with a gap for its last_sched_evaluation number and re-rendered only when
    its restart_cnt moves. The first document is checked against _dump_2411."""

    MARK = 918273645546372819  # a number no job holds

    def __init__(self) -> None:
        self.texts: dict[int, tuple[int, str, str]] = {}
        self.checked = False
        empty = _dump_2411([])
        self.head, self.tail = '{\n  "jobs": [\n', "\n  ]," + empty.split('"jobs": [],', 1)[1]

    def __call__(self, jobs: list) -> str:
        items = []
        for j in jobs:
            c = self.texts.get(j["job_id"])
            if c is None or c[0] != j["restart_cnt"]:
                t = _slurm_json({**j, "last_sched_evaluation": _n(self.MARK)})
                pre, post = ("    " + t.replace("\n", "\n    ")).split(str(self.MARK))
                c = self.texts[j["job_id"]] = (j["restart_cnt"], pre, post)
            items.append(f"{c[1]}{j['last_sched_evaluation']['number']}{c[2]}")
        out = self.head + ",\n".join(items) + self.tail
        if not self.checked:
            assert out == _dump_2411(jobs), "the fast renderer differs from json.dumps"
            self.checked = True
        return out


def _fake_squeue(argv, jobs: list, dump, folder: str) -> str:
    """FIXTURE squeue of 24.11 for `cycle --planned`: the state listing (`--only-job-state`:
    each job's name and state, as 24.11 prints it) or the full records of the --jobs ids,
    written to a file that `cat` prints (the rendering is counted as the client's time)."""
    path = os.path.join(folder, argv[0] + ".json")
    if argv[0] == "fake-squeue-state":
        items = [{"job_id": str(j["job_id"]), "state": j["job_state"]} for j in jobs]
        text = _slurm_json({"jobs": items, "meta": {}, "errors": [], "warnings": []})
    else:
        ids = next((a[len("--jobs=") :].split(",") for a in argv if a.startswith("--jobs=")), None)
        want = None if ids is None else {int(x) for x in ids}
        text = dump(jobs if want is None else [j for j in jobs if j["job_id"] in want])
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _cycle_run(
    args,
    jobs: list,
    nodes: list,
    render_nodes: Callable[[], str],
    toggle_node: Callable[[dict], None],
    dump,
    t_sub: int,
    rng: random.Random,
) -> None:
    import tempfile

    from nodeforge.gang import state as state_mod
    from nodeforge.gang.policy import full_reads, next_deadline, settled_reads
    from nodeforge.gang.slurm_view import SlurmCli

    if args.planned and args.shape != "24.11":
        raise SystemExit("cycle --planned needs --shape 24.11 (22.05 has no state listing)")
    n = args.jobs
    cfg = gcfg.from_dict({"timeout": 300, "recovery_timeout": 60}, "bench")
    now = float(t_sub + 36000 + 180)
    tmp = tempfile.mkdtemp(prefix="gang-cycle-")
    path = os.path.join(tmp, "state.json")
    # What slurmctld returns, in files that `cat` prints: the governor's own SlurmCli runs
    # `cat` where it would run scontrol/squeue, so the figure holds what the governor pays
    # for a read (spawning the client, taking its output, decoding if it does), as well as
    # the parse. In memory (/dev/shm) when there is one: scontrol's output comes from memory.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp
    docs = tempfile.mkdtemp(prefix="gang-cycle-", dir=shm)
    jobs_file, nodes_file = os.path.join(docs, "jobs.json"), os.path.join(docs, "nodes.json")
    with open(nodes_file, "w", encoding="utf-8") as f:
        f.write(render_nodes())
    client_s = [0.0]
    client_cpu = [0.0]

    class ClientTimedCli(SlurmCli):
        """Counts the wall time spent in the client (spawn, cat's own writing, exit): cat
        stands in for scontrol, whose time (and slurmctld's) a real cycle waits for too but
        which is not the governor's work. Also this process's CPU in it: the FIXTURE squeue
        renders its document here, which the CPU figure must leave out."""

        def _run(self, *argv: str, check: bool = True, **kw):
            t, c = time.perf_counter(), time.process_time()
            try:
                if argv[0] in ("fake-squeue-state", "fake-squeue-full"):
                    argv = ("cat", _fake_squeue(argv, jobs, dump, docs))
                return super()._run(*argv, check=check, **kw)
            finally:
                client_s[0] += time.perf_counter() - t
                client_cpu[0] += time.process_time() - c

    cli = ClientTimedCli(timeout=15.0, clock=lambda: now)
    cli._commands = (["cat", jobs_file], ["cat", nodes_file])  # (no `scontrol --version`)
    if args.planned:  # gang/read_plan.py: the state listing, then --jobs (FIXTURE squeue)
        cli._state_argv = ["fake-squeue-state"]
        cli._full_argv = ["fake-squeue-full"]

    saved = None
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()

    # Collector passes that start inside the timed part of a cycle, by generation: what
    # `--gc governor` moves out of the cycle (gc.callbacks; CPU from start to stop).
    import gc

    timed = [False]
    in_cycle: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started_at = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if not timed[0]:
            return
        if phase == "start":
            started_at[0] = time.process_time()
        else:
            in_cycle[info["generation"]].append(time.process_time() - started_at[0])

    gc.callbacks.append(on_gc)

    def one(st, change: float, node_change: float = 0.0, churn: float = 0.0, profile=True):
        nonlocal saved
        if churn:  # a share *churn* of the queue leaves (cancelled) and as many new jobs come
            _churn(jobs, max(1, int(len(jobs) * churn)), rng)
        # a share *change* of the jobs changes between cycles (restarts: a requeue by Slurm)
        for k in rng.sample(range(len(jobs)), int(len(jobs) * change)):
            jobs[k]["restart_cnt"] += 1
        # a share *node_change* of the nodes is drained or resumed by an operator: their
        # flags really change, so the node map is parsed again and the jobs on those nodes
        # are looked at again (a drain is not lost readiness: no action follows from it)
        if node_change:
            for k in rng.sample(range(len(nodes)), int(len(nodes) * node_change)):
                toggle_node(nodes[k])
            with open(nodes_file, "w", encoding="utf-8") as f:  # not timed
                f.write(render_nodes())
        if args.full_jobs or args.shape == "24.11":
            # every scheduler pass stamps the pending jobs it looked at
            for j in jobs:
                if args.shape == "24.11" and j["job_state"] == ["PENDING"]:
                    j["last_sched_evaluation"] = _n(j["last_sched_evaluation"]["number"] + 1)
                elif j["job_state"] == "PENDING":
                    j["last_sched_evaluation"] += 1
        with open(jobs_file, "w", encoding="utf-8") as f:  # slurmctld's part: not timed
            f.write(dump(jobs))
        if prof is not None and profile:
            prof.enable()
        client_s[0] = client_cpu[0] = 0.0
        timed[0] = True
        c0, t0 = time.process_time(), time.perf_counter()
        # spawn `cat` twice (planned: three times), take the output, parse jobs (+ nodes)
        snap = (
            cli.snapshot(need=full_reads(cfg, st), settled=settled_reads(st))
            if args.planned
            else cli.snapshot()
        )
        t1, c1 = time.perf_counter(), time.process_time()
        st2, _acts = decide(cfg, st, snap, now)
        t2, c2 = time.perf_counter(), time.process_time()
        saved = state_mod.save_if_changed(st2, path, saved)
        # the governor's loop asks for the next gang deadline after every cycle (next_wait)
        next_deadline(cfg, st2, now)
        t3, c3 = time.perf_counter(), time.process_time()
        timed[0] = False
        if prof is not None:
            prof.disable()
        walls = (t1 - t0 - client_s[0], t2 - t1, t3 - t2, client_s[0])
        cpus = (c1 - c0 - client_cpu[0], c2 - c1, c3 - c2)
        return st2, (*walls, *cpus), snap.bytes_read

    # `gang run`'s collector (gang/cyclic_gc.py): automatic passes off, the young
    # generation collected and frozen after every cycle, a full pass every 5th cycle here
    # (every 300 s in the daemon). Its CPU is measured apart: it runs while the governor
    # would sleep.
    from nodeforge.gang.cyclic_gc import Collector

    cycles = [0]
    col = (
        Collector(full_every=5.0, clock=lambda: float(cycles[0])) if args.gc == "governor" else None
    )
    if col is not None:
        col.__enter__()
    gc_cpu: dict[str, list[float]] = {"young": [], "full": []}

    def between() -> None:
        cycles[0] += 1
        if col is not None:
            c = time.process_time()
            kind = col.between_cycles(idle=1.0)
            gc_cpu[kind].append(time.process_time() - c)

    st, _cold, _b = one(GovState(), 0, profile=False)
    between()
    for v in in_cycle.values():  # the first (cold) cycle is not in the figures
        v.clear()
    cases = (
        ("1% changed, 0.1% leave, 0.1% arrive", 0.01, 0.0, 0.001),
    )
    for label, change, node_change, churn in cases:
        ts, nbytes = [], 0
        for _ in range(args.repeat):
            st, t, nbytes = one(st, change, node_change, churn)
            ts.append(t)
            between()
        p_, d_, s_, w_, cp_, cd_, cs_ = (
            statistics.median(x[i] for x in ts) * 1000 for i in range(7)
        )
        tot = statistics.median(sum(x[:3]) for x in ts) * 1000
        cpu = statistics.median(sum(x[4:7]) for x in ts) * 1000
        cpu_min = min(sum(x[4:7]) for x in ts) * 1000  # the least disturbed by the load
        cpu_max = max(sum(x[4:7]) for x in ts) * 1000  # where a collector pass shows
        passes = ", ".join(f"gen{g} {len(v)} ({sum(v) * 1000:.1f} ms)" for g, v in in_cycle.items())
        for v in in_cycle.values():
            v.clear()
        print(
            f"{n:>6} jobs ({len(st.jobs)} gangs), {label:<40}: read+parse {p_:7.1f} ms  "
            f"decide {d_:6.1f} ms  persist+wake {s_:6.1f} ms  total {tot:7.1f} ms  "
            f"| CPU {cp_:5.1f} / {cd_:5.1f} / {cs_:5.1f} = {cpu:6.1f} ms (min {cpu_min:6.1f}, "
            f"max {cpu_max:6.1f})  "
            f"| client {w_:6.1f} ms  | slurmctld bytes/cycle {nbytes / 1e6:6.1f} MB"
        )
        print(f"    collector passes inside these {args.repeat} cycles: {passes}")
    print(
        f"(shape {args.shape}{', full jobs' if args.full_jobs else ''}; median of "
        f"{args.repeat} (max: the slowest cycle); wall ms without the client; CPU = this process's user+sys time "
        f"per phase, the client's (cat's, and the FIXTURE squeue's rendering here) not in it; client = wall time in the "
        f"client calls, cat writing the document included; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)"
    )
    gc.callbacks.remove(on_gc)
    if col is not None:
        col.__exit__(None, None, None)
        y, f = gc_cpu["young"], gc_cpu["full"]
        print(
            f"collector between cycles (--gc governor, not in the figures above): young "
            f"pass median {statistics.median(y) * 1000:.1f} ms CPU over {len(y)}, full pass "
            f"median {statistics.median(f) * 1000:.1f} ms over {len(f)} (max "
            f"{max(f) * 1000:.1f})"
            if y and f
            else f"collector between cycles: young {len(y)}, full {len(f)} passes"
        )
    else:
        print("(--gc auto: Python's automatic collector, its passes inside the cycles)")
    shutil.rmtree(docs, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    if prof is not None:
        prof.dump_stats(args.profile)
        print(f"cProfile of the timed parts (warm cycles, all cases): {args.profile}")


def cmd_deadline(args) -> None:
    """Deadline -> requeue delay on a real slurmctld (lab/slurm_netns.py, needs root)."""
    import tempfile
    import threading

    from nodeforge.gang.events import read_events
    from nodeforge.gang.governor import Governor
    from nodeforge.gang.slurm_view import SlurmCli
    from nodeforge.lab.slurm_netns import Lab

    if args.slurm == "24.11":
        # the image's own Slurm in a local nspawn cluster (lab/gang_cluster.py)
        from nodeforge.lab.gang_cluster import ClusterLab

        if args.image is None:
            raise SystemExit("deadline --slurm 24.11 needs --image (output dir of a build)")
        from gang_live_cycle import QUEUE_CONF

        lab = ClusterLab(args.image, nodes=2, extra_conf=QUEUE_CONF if args.queued else "")
        backend = "Slurm 24.11 local cluster (image)"
    else:
        if args.queued:
            raise SystemExit("deadline --queued needs --slurm 24.11 (the 22.05 lab is too small)")
        lab = Lab(nodes=2, cloud_nodes=0)
        backend = "Slurm 22.05 lab"
    tmp = Path(tempfile.mkdtemp(prefix="nfg-gang-bench-"))
    running: list[tuple[Governor, threading.Thread]] = []

    def stop_gov() -> None:
        while running:
            gov, th = running.pop()
            gov.stop()
            th.join(timeout=20)

    try:
        lab.start()
        lab.set_prolog("gn2", "hang")
        if args.queued:  # the governor reads them every cycle (the planned read), never acts
            from gang_live_cycle import counts, queue_gangs

            t = time.monotonic()
            queue_gangs(lab.prefix(), args.queued)
            queued = counts(lab.prefix()).get("PENDING", 0)
            print(f"queued {queued} gangs in {time.monotonic() - t:.0f} s", flush=True)
        cfg = gcfg.from_dict(
            {
                "timeout": 3,
                "interval_seconds": args.interval,
                "requeuing": {"backoff_base_seconds": 1, "backoff_max_seconds": 1, "jitter": 0},
                "state_file": str(tmp / "s.json"),
                "event_log": str(tmp / "e.jsonl"),
                "metrics_file": str(tmp / "m.prom"),
            },
            "bench",
        )

        calls: list[tuple[float, float, str]] = []  # (end time, seconds, command) per client call

        class TimedCli(SlurmCli):
            """SlurmCli that records how long each client call took (for the slow rounds)."""

            def _run(self, *argv: str, check: bool = True, **kw):
                t0 = time.time()
                try:
                    return super()._run(*argv, check=check, **kw)
                finally:
                    calls.append((time.time(), time.time() - t0, " ".join(argv[:3])))

        def start_gov() -> None:
            gov = Governor(cfg, TimedCli(prefix=lab.prefix(), env=lab.env, timeout=10))
            th = threading.Thread(target=gov.run, kwargs={"duration": 300}, daemon=True)
            th.start()
            running.append((gov, th))

        # The delay depends on where the governor's cycles fall relative to the deadline
        # (StartTime is whole seconds). One governor for all rounds keeps that phase fixed, so
        # every round measures the same point; --phase random starts a fresh governor after a
        # random pause (seeded) each round, which samples the phase.
        rng = random.Random(args.seed)
        if args.phase == "fixed":
            start_gov()
        delays, slurm_delays = [], []
        load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())

        def requeues(job_id: int) -> list[dict]:
            return [e for e in read_events(cfg.event_log, str(job_id)) if e["action"] == "requeue"]

        def gone(job_id: int) -> bool:
            out = lab.run("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False).stdout.strip()
            return out in ("", "CANCELLED")

        for _ in range(args.rounds):
            lab.rearm_prologs()
            if args.phase == "random":
                stop_gov()
                time.sleep(rng.uniform(0, args.interval))
                start_gov()
            j = lab.sbatch("-N2", "-w", "gn1,gn2")
            Lab.wait(lambda j=j: requeues(j), 30, "requeue")
            ev = requeues(j)[0]
            delays.append(ev["requeued_at"] - ev["deadline"])
            if delays[-1] > args.interval:  # where did the time go? client calls around it
                near = [c for c in calls if ev["deadline"] - 2 <= c[0] <= ev["requeued_at"]]
                slow = max(near, key=lambda c: c[1], default=None)
                fails = [
                    e
                    for e in read_events(cfg.event_log)
                    if e["action"] == "slurmctld_unreachable"
                    and ev["deadline"] - 2 <= e.get("time", 0) <= ev["requeued_at"]
                ]
                print(
                    f"round {len(delays)}: delay {delays[-1]:.2f} s, "
                    f"{len(near)} client calls from deadline-2s to the requeue; slowest "
                    + (f"{slow[1]:.2f} s ({slow[2]})" if slow else "-")
                    + "".join(f"; read failed: {e.get('detail', '')[-300:]}" for e in fails)
                )
            slurm_delays.append(int(lab.job(j)["Restarts"]))
            lab.release_prologs()
            lab.run("scancel", str(j), check=False)
            Lab.wait(lambda j=j: gone(j), 30, "job gone")
            lab.wait_nodes_idle(["gn1", "gn2"], 30)
        stop_gov()
        unreachable = [
            e for e in read_events(cfg.event_log) if e["action"] == "slurmctld_unreachable"
        ]
        print(
            f"# deadline -> requeue on a real slurmctld ({backend}), interval={args.interval}s,"
            f" {args.rounds} rounds, governor phase {args.phase}, {args.queued} more gangs "
            f"queued; load average before: {load0}"
        )
        print("delays (s): " + " ".join(f"{d:.2f}" for d in delays))
        ds = sorted(delays)
        p95 = ds[min(len(ds) - 1, math.ceil(0.95 * len(ds)) - 1)]
        print(
            f"p50 {statistics.median(ds):.2f} s, p95 {p95:.2f} s, max {ds[-1]:.2f} s   "
            f"goal p95 <= one interval ({args.interval} s): "
            f"{'OK' if p95 <= args.interval else 'MISSED'}  (Restarts after each: {slurm_delays})"
        )
        print(f"failed reads of slurmctld (events): {len(unreachable)}")
        for e in unreachable[:5]:
            print("  " + str(e.get("detail", ""))[-300:])
        print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    finally:
        stop_gov()
        lab.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=["sim", "cycle", "deadline", "all"], nargs="?", default="sim")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hours", type=float, default=48.0)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", metavar="FILE", help="cycle: cProfile the timed parts to FILE")
    ap.add_argument(
        "--full-jobs",
        action="store_true",
        help="cycle: 22.05-sized jobs (~100 keys) whose last_sched_evaluation moves every cycle",
    )
    ap.add_argument(
        "--shape",
        choices=("22.05", "24.11"),
        default="22.05",
        help="cycle: 22.05 `squeue --json` jobs (synthetic) or 24.11 `scontrol show job "
        "--json` jobs (every key of a real 24.11.5 capture, ~6-8 kB each)",
    )
    ap.add_argument(
        "--gc",
        choices=("governor", "auto"),
        default="governor",
        help="cycle: Python's cyclic collector as `gang run` runs it (between cycles, "
        "gang/cyclic_gc.py; a full pass every 5th cycle here, its CPU reported apart) or "
        "Python's default (automatic, its passes fall inside the cycles)",
    )
    ap.add_argument(
        "--planned",
        action="store_true",
        help="cycle (--shape 24.11): the planned read of Slurm >= 24.05 (gang/read_plan.py: "
        "state listing, then in full what the cycle needs) from a FIXTURE squeue",
    )
    ap.add_argument(
        "--active",
        type=int,
        help="cycle (--shape 24.11): this many running/configuring jobs, the rest pending "
        "(a queue; default: 40%% running/configuring)",
    )
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument(
        "--phase",
        choices=("fixed", "random"),
        default="random",
        help="deadline: one governor for all rounds (fixed cycle phase) or a fresh one per round",
    )
    ap.add_argument(
        "--slurm",
        choices=("22.05", "24.11"),
        default="22.05",
        help="deadline: the host's 22.05 lab, or a local cluster from --image (24.11)",
    )
    ap.add_argument(
        "--image", type=Path, help="deadline --slurm 24.11: output directory of `nodeforge build`"
    )
    ap.add_argument("--timeout", default="20m", help="sim: the governor's timeout")
    ap.add_argument(
        "--queued",
        type=int,
        default=0,
        help="deadline (--slurm 24.11): this many more 2-node gangs queued (held or begin a day "
        "ahead) beside the rounds, so every cycle is the planned read of a real queue",
    )
    ap.add_argument("--strike-limit", type=int, default=2, help="sim: node_strike_limit")
    ap.add_argument(
        "--begin-fraction",
        type=float,
        default=0.0,
        help="sim: share of jobs submitted with --begin 6 h ahead (adds the old-rule row)",
    )
    ap.add_argument(
        "--resume-timeout", type=float, default=3600.0, help="sim: Slurm's ResumeTimeout (s)"
    )
    args = ap.parse_args()
    if args.what in ("sim", "all"):
        cmd_sim(args)
    if args.what in ("cycle", "all"):
        cmd_cycle(args)
    if args.what in ("deadline", "all"):
        cmd_deadline(args)


if __name__ == "__main__":
    main()
