"""Where a baked compute's time goes: one node booted, then its journal and the agent's record.

    sudo .venv/bin/python bench/agent_trace.py --image IMAGE [--agent-from-checkout] --out DIR

One local cluster (controller + one compute, the path of `cluster add`). After the compute is
ready it collects, from inside the node (not timed): `journalctl -b -o short-monotonic`,
`systemd-analyze critical-chain nodeforge-init.service` and `blame`, state.json, agent.log,
`python -X importtime` of the agent's node path with the image's interpreter (and `-v`, to
count bytecode loaded from .pyc versus compiled), and the wall time of `nodeforge node --help`
run the way the unit runs it. Writes them into --out and prints the unit/step timeline. The
cluster is always taken down. Run it inside the shared e2e lock (it boots nspawn nodes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from time_to_ready import agent_from_checkout, wait_schedulable

from nodeforge.lab.localcluster import Cluster, LocalCluster, node_exec

PY = "/opt/nodeforge/bin/python"
NODE_PATH_MODULES = (
    "nodeforge.cli",
    "nodeforge.bootstrap.cli",
    "nodeforge.bootstrap.agent",
    "nodeforge.bootstrap.node_roles.compute",
)

# Commands run inside the booted node after it is ready (name -> argv).
PROBES = {
    "journal.txt": ["journalctl", "-b", "-o", "short-monotonic", "--no-pager"],
    "critical-chain.txt": ["systemd-analyze", "critical-chain", "nodeforge-init.service"],
    "critical-chain-slurmd.txt": ["systemd-analyze", "critical-chain", "slurmd.service"],
    # munge.service (and so the agent's munge step) follows basic.target whatever the agent's
    # own ordering: what an earlier agent start can overlap
    "critical-chain-munge.txt": ["systemd-analyze", "critical-chain", "munge.service"],
    "blame.txt": ["systemd-analyze", "blame", "--no-pager"],
    "unit.txt": ["systemctl", "cat", "nodeforge-init.service"],
    "importtime.txt": [
        "env", "PYTHONDONTWRITEBYTECODE=1", PY, "-X", "importtime", "-c",
        "import " + ", ".join(NODE_PATH_MODULES),
    ],
    "import-verbose.txt": [
        "env", "PYTHONDONTWRITEBYTECODE=1", PY, "-v", "-c", "import " + ", ".join(NODE_PATH_MODULES),
    ],
    "modules.txt": [
        PY, "-c",
        "import sys, " + ", ".join(NODE_PATH_MODULES) + "; print('\\n'.join(sorted(sys.modules)))",
    ],
}  # fmt: skip


def wall(node, argv: list[str], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        node_exec(node, argv, check=False, timeout=60)
        out.append(round(time.perf_counter() - t0, 4))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", type=Path, required=True)
    ap.add_argument("--name", default="trace")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--agent-from-checkout", action="store_true")
    ap.add_argument("--timeout", type=float, default=180.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lc = LocalCluster(args.name)
    try:
        lc.up(args.image, 0, timeout=args.timeout)
        prep = agent_from_checkout if args.agent_from_checkout else None
        node = lc.start_node("c001", prepare=prep)
        cluster = Cluster.load(lc.name)
        t_ready, _ = wait_schedulable(lc, cluster, node, args.timeout, 0.05)
        report: dict = {"seconds": round(t_ready - node.started, 3)}
        time.sleep(2)  # let the agent write its final state
        for fname, argv in PROBES.items():
            cp = node_exec(node, argv, check=False, timeout=60)
            (args.out / fname).write_text((cp.stdout or "") + (cp.stderr or ""))
        merged = node.merged
        for rel in ("var/lib/nodeforge/state.json", "var/log/nodeforge/agent.log"):
            f = merged / rel
            if f.exists():
                (args.out / f.name).write_text(f.read_text())
        # Interpreter start-up the way the unit starts it, vs. leaner variants (5 runs each,
        # through nsenter: the nsenter cost is in every figure alike).
        report["wall_s"] = {
            "true": wall(node, ["true"], 5),
            "nodeforge node --help": wall(node, ["/usr/local/bin/nodeforge", "node", "--help"], 5),
            "python -c pass": wall(node, [PY, "-c", "pass"], 5),
            "python -S -c pass": wall(node, [PY, "-S", "-c", "pass"], 5),
            "python -I -c pass": wall(node, [PY, "-I", "-c", "pass"], 5),
        }
        (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
    finally:
        lc.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
