"""Time of `nodeforge node health` on a CPU node, in one run: the whole CLI (interpreter start,
imports, checks, reports) vs the checks alone, as a ratio.

    .venv/bin/python bench/health_time.py [--repeat 10] [--root /]

With --root / it runs on this machine as the node (params.json must exist: a booted node).
Without it, a scratch root with a FIXTURE params.json {"node": "bench"} is used: the systemd
and disk probes are this host's, so the timing holds for a CPU node (no expected_gpus), while
the verdict (slurmd/munge down here) does not matter. Never drains (--no-slurm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--root", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="nf-health-bench-") as tmp:
        root = a.root or Path(tmp)
        if a.root is None:
            (root / "var/lib/nodeforge").mkdir(parents=True)
            (root / "var/lib/nodeforge/params.json").write_text(json.dumps({"node": "bench"}))
        walls, inner = [], []
        for _ in range(a.repeat):
            t0 = time.monotonic()
            cp = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "nodeforge",
                    "node",
                    "health",
                    "--no-slurm",
                    "--json",
                    "--root",
                    str(root),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            walls.append(time.monotonic() - t0)
            inner.append(json.loads(cp.stdout)["duration"])
    w, i = statistics.median(walls), statistics.median(inner)
    print(
        json.dumps(
            {
                "repeat": a.repeat,
                "cli_wall_median_s": round(w, 3),
                "checks_median_s": round(i, 3),
                "checks_share": round(i / w, 3),
                "cli_wall_max_s": round(max(walls), 3),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
