"""The governor's cycle against a live slurmctld (issue 24, item 5): the image's Slurm 24.11
in the gang e2e's local cluster (lab/gang_cluster.py, root), with >= 100 running 2-node
gang jobs and 10k, then 50k, queued jobs. Per cycle, from the Slurm call to the decision,
persistence included (Governor.cycle): the client's wall time (snapshot: Slurm's clients and
the reader), decide+persist, and slurmctld's own cost apart (sdiag: RPC count and time per
message type, before/after). Two read paths, same governor, same queue:

- `full`: every job in full each cycle (`scontrol show job --json`, the path before),
- `planned`: gang/read_plan.py (`squeue --only-job-state`, then in full what is needed).

    flock /var/tmp/nf-e2e.lock env NODEFORGE_E2E_IMAGE=/var/tmp/nodeforge-e2e/image \\
        .venv/bin/python bench/gang_live_cycle.py OUT.json [--queued 10000,50000]

FIXTURE lab config on top of the gang e2e's (MaxJobCount, MaxArraySize, an oversubscribed
partition `scale` so 4 small nodes run >= 100 2-node jobs). --prefix-file attaches to a lab
started elsewhere (one line per argv word of the controller's command prefix; the lab must
carry the same fixture config). --calls also times, per queue size, the read plan's calls
standalone (the state listing, `squeue --jobs` of 1-64 ids, `scontrol show job --json ID`:
read_plan.few_ids() is their break-even; and the cold cycle's read of every job, by squeue
and by scontrol). Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from nodeforge import proc
from nodeforge.gang import config as gcfg
from nodeforge.gang.governor import Governor
from nodeforge.gang.slurm_view import SlurmCli, Snapshot

QUEUE_CONF = "MaxJobCount=120000\n"  # Slurm's default (10000) would refuse the queues
SCALE_CONF = (
    QUEUE_CONF
    + """MaxArraySize=60001
PartitionName=scale Nodes=ALL Default=NO MaxTime=INFINITE State=UP OverSubscribe=FORCE:64
"""
)
_RPC = re.compile(r"^\s+([A-Z_]+)\s+\(\s*\d+\)\s+count:(\d+)\s+ave_time:\d+\s+total_time:(\d+)")


class FullRead(SlurmCli):
    """The path before: every job in full every cycle, whatever the governor needs."""

    def snapshot(self, need=None, settled=()) -> Snapshot:
        return super().snapshot(None)


class Timed:
    """Wraps a SlurmCli: the wall time of each snapshot (the client side of a cycle)."""

    def __init__(self, cli: SlurmCli):
        self.cli = cli
        self.last = 0.0

    def __getattr__(self, name):
        return getattr(self.cli, name)

    def snapshot(self, need=None, settled=()) -> Snapshot:
        t = time.perf_counter()
        try:
            return self.cli.snapshot(need, settled)
        finally:
            self.last = time.perf_counter() - t


def rpc_stats(prefix: list[str]) -> dict[str, tuple[int, int]]:
    """sdiag's RPC table: message type -> (count, total microseconds)."""
    out = proc.run([*prefix, "sdiag"], timeout=30).stdout
    stats = {}
    for line in out.splitlines():
        m = _RPC.match(line)
        if m:
            stats[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return stats


def counts(prefix: list[str]) -> dict[str, int]:
    out = proc.run([*prefix, "squeue", "-h", "-t", "all", "-o", "%T"], timeout=60).stdout.split()
    res: dict[str, int] = {}
    for s in out:
        res[s] = res.get(s, 0) + 1
    return res


def submit(prefix: list[str], n: int, args: str, timeout: float) -> None:
    """*n* single jobs (not an array: each its own record), two loops in parallel."""
    if n <= 0:
        return
    half = (n + 1) // 2
    loop = (
        f"cd /tmp; sub() {{ for i in $(seq $1); do sbatch -Q -o /dev/null {args} --wrap 'sleep 3000'"
        f" || exit 1; done; }}; sub {half} & sub {n - half} & wait"
    )
    proc.run([*prefix, "bash", "-c", loop], timeout=timeout)


def queue_gangs(prefix: list[str], n: int, partition: str = "main") -> None:
    """*n* 2-node gangs that stay queued while cycles are measured: half held by their owner,
    half waiting for a begin time a day ahead."""
    submit(prefix, n // 2, f"-N2 -p {partition} --hold", 1800)
    submit(prefix, n - n // 2, f"-N2 -p {partition} --begin=now+1day", 1800)


def wait(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(2)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def measure(prefix: list[str], mode: str, cycles: int, tmp: Path, stale: float) -> dict:
    """A fresh governor (empty state) on the live queue: one cold cycle (every job new),
    then *cycles* steady ones, 1 s apart (the default interval)."""
    d = tmp / mode
    d.mkdir(parents=True, exist_ok=True)
    cfg = gcfg.from_dict(
        {
            "timeout": 600,
            "interval_seconds": 1,
            "command_timeout": 60,
            "state_file": str(d / "state.json"),
            "event_log": str(d / "events.jsonl"),
            "metrics_file": str(d / "metrics.prom"),
        },
        "bench",
    )
    cls = FullRead if mode == "full" else SlurmCli
    cli = Timed(cls(prefix=prefix, timeout=60, stale_seconds=stale))
    gov = Governor(cfg, cli)  # type: ignore[arg-type]
    rows = []
    rpc0 = None
    ru0 = None
    for k in range(cycles + 1):
        if k == 1:
            rpc0 = rpc_stats(prefix)
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        gov.cycle()
        wall = time.perf_counter() - t
        rows.append(
            {"cycle": wall, "client": cli.last, "decide_persist": wall - cli.last,
             "bytes": gov.last_bytes, "gangs": len(gov.state.jobs)}
        )  # fmt: skip
        if not gov.up:
            raise SystemExit(f"{mode}: the governor could not read slurmctld")
        time.sleep(max(0.0, 1.0 - wall))
    rpc1 = rpc_stats(prefix)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert rpc0 is not None and ru0 is not None
    ctld = {
        name: {
            "count": (rpc1[name][0] - rpc0.get(name, (0, 0))[0]) / cycles,
            "ms": (rpc1[name][1] - rpc0.get(name, (0, 0))[1]) / 1000 / cycles,
        }
        for name in rpc1
        if name.startswith(("REQUEST_JOB", "REQUEST_NODE", "REQUEST_PARTITION", "REQUEST_FED"))
        and rpc1[name][0] != rpc0.get(name, (0, 0))[0]
    }  # per cycle; (sdiag itself is REQUEST_STATS_INFO, not counted)
    steady = rows[1:]

    def stat(key: str) -> dict:
        v = sorted(r[key] for r in steady)
        return {
            "median": statistics.median(v),
            "p95": v[min(len(v) - 1, round(0.95 * (len(v) - 1)))],
            "max": v[-1],
        }

    return {
        "mode": mode,
        "cold": rows[0],
        "steady": {k: stat(k) for k in ("cycle", "client", "decide_persist")},
        "bytes_median": statistics.median(r["bytes"] for r in steady),
        "gangs": steady[-1]["gangs"],
        "slurmctld_per_cycle": ctld,
        "clients_cpu_s_per_cycle": (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime)
        / cycles,
        "cycles": cycles,
        # every steady cycle: wall ms, client ms, bytes read (which cycles made the p95)
        "rows": [
            [round(r["cycle"] * 1000, 1), round(r["client"] * 1000, 1), r["bytes"]] for r in steady
        ],
    }


CALL_IDS = (1, 2, 4, 8, 16, 32, 64)  # squeue --jobs sizes timed by --calls


def call_costs(prefix: list[str], repeat: int = 5) -> dict:
    """The read plan's calls on this queue, standalone, median of *repeat* (read_plan.py's
    few_ids() break-even: one `scontrol show job --json ID` per plain id against one `squeue
    --jobs` of them all): the state listing, squeue with k pending ids, scontrol by id for a
    pending and a running job. Wall ms, client and slurmctld together, as a cycle waits."""
    out = proc.run(
        [*prefix, "squeue", "-h", "-t", "PD", "-o", "%i", "--sort=i"], timeout=120
    ).stdout.split()
    pending = [x for x in out if x.isdigit()]
    running = proc.run([*prefix, "squeue", "-h", "-t", "R", "-o", "%i"], timeout=120).stdout.split()
    if len(pending) < max(CALL_IDS) or not running:
        raise SystemExit(f"--calls: {len(pending)} pending, {len(running)} running jobs")

    def ms(argv: list[str]) -> float:
        v = []
        for _ in range(repeat):
            t = time.perf_counter()
            proc.run([*prefix, *argv], timeout=120)
            v.append((time.perf_counter() - t) * 1000)
        return round(statistics.median(v), 1)

    step = len(pending) // max(CALL_IDS)  # ids spread over the queue, not its head
    res = {"listing": ms(["squeue", "--json", "--only-job-state", "--states=all"])}
    for k in CALL_IDS:
        ids = ",".join(pending[i * step] for i in range(k))
        res[f"squeue_jobs_{k}"] = ms(["squeue", "--json", "--states=all", f"--jobs={ids}"])
    res["scontrol_pending"] = ms(["scontrol", "show", "job", "--json", pending[len(pending) // 2]])
    res["scontrol_running"] = ms(["scontrol", "show", "job", "--json", running[0]])
    # the cold cycle's read of every job in full, by scontrol and by squeue, in the order
    # A B B A (slurmctld may still be busy with a fresh queue: the order must not decide),
    # into a file as the governor's memory file takes it: wall ms each, and the MB
    full = {
        "full_scontrol": ["scontrol", "show", "job", "--json"],
        "full_squeue": ["squeue", "--json", "--states=all"],
    }
    for name in ("full_scontrol", "full_squeue", "full_squeue", "full_scontrol"):
        with tempfile.TemporaryFile() as f:
            t = time.perf_counter()
            proc.run([*prefix, *full[name]], timeout=600, output_file=f)
            res.setdefault(name, []).append(round((time.perf_counter() - t) * 1000, 1))
            res[name + "_mb"] = round(f.tell() / 1e6, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--queued", default="10000,50000")
    ap.add_argument("--running", type=int, default=120)
    ap.add_argument("--cycles-full", type=int, default=5)
    ap.add_argument("--cycles-planned", type=int, default=20)
    ap.add_argument("--prefix-file")
    ap.add_argument("--stale", default="30", help="planned runs, one per STALE_SECONDS value")
    ap.add_argument("--calls", action="store_true", help="also time the read plan's calls")
    a = ap.parse_args()
    lab = None
    if a.prefix_file:
        prefix = Path(a.prefix_file).read_text().split("\n")
    else:
        from nodeforge.lab import gang_cluster

        lab = gang_cluster.ClusterLab(
            Path(os.environ["NODEFORGE_E2E_IMAGE"]), nodes=4, name="nfgscale", extra_conf=SCALE_CONF
        )
        lab.start()
        prefix = lab.prefix()
    results: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs, "
        + next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            "?",
        ),
        "slurm": proc.run([*prefix, "scontrol", "--version"], timeout=30).stdout.strip(),
        "runs": [],
    }
    try:
        c = counts(prefix)
        running = c.get("RUNNING", 0)
        if running < a.running:
            submit(prefix, a.running - running, "-N2 -p scale", 600)
            wait(lambda: counts(prefix).get("RUNNING", 0) >= 100, 600, ">= 100 running jobs")
        with tempfile.TemporaryDirectory(prefix="nf-gang-live-") as tmp:
            for q in (int(x) for x in a.queued.split(",")):
                have = counts(prefix).get("PENDING", 0)
                t = time.monotonic()
                more = max(0, q - have)
                queue_gangs(prefix, more)
                c = counts(prefix)
                print(f"queued {c.get('PENDING', 0)} running {c.get('RUNNING', 0)} "
                      f"(submitted {more} in {time.monotonic() - t:.0f} s)", flush=True)  # fmt: skip
                if a.calls:
                    r = {"mode": "calls", "queued": c.get("PENDING", 0), **call_costs(prefix)}
                    results["runs"].append(r)
                    print(json.dumps(r), flush=True)
                runs = [("full", a.cycles_full, 0.0)] if a.cycles_full else []
                runs += [("planned", a.cycles_planned, float(x)) for x in a.stale.split(",")]
                for mode, n, stale in runs:
                    load0 = os.getloadavg()
                    r = measure(prefix, mode, n, Path(tmp) / f"{q}-{stale}", stale or 30.0)
                    r.update(queued=c.get("PENDING", 0), running=c.get("RUNNING", 0))
                    if mode == "planned":
                        r["stale_seconds"] = stale
                    r["load_before"] = [round(x, 2) for x in load0]
                    r["load_after"] = [round(x, 2) for x in os.getloadavg()]
                    results["runs"].append(r)
                    print(json.dumps(r), flush=True)
                    Path(a.out).write_text(json.dumps(results, indent=2))
    finally:
        if lab is not None:
            lab.close()


if __name__ == "__main__":
    main()
