"""Benchmark: what containing a hook attempt costs, per attempt, as ratios in one run.

    .venv/bin/python bench/hook_overhead.py [--repeat 200] [--json]

Runs the same trivial hook (`/bin/true`) through nodeforge.contain.run_group --repeat times per
mode, interleaved (one attempt of each mode per round, rotated) so load changes hit every
mode alike:
- group:     its own process group only (the old runner: a setsid daemon escapes);
- subreaper: child subreaper + process-tree sweep (the fallback where no cgroup is writable);
- cgroup:    a cgroup v2 directory per attempt (needs root and a writable cgroup2 mount);
- scope:     a transient systemd scope (only where systemd is PID 1, e.g. a node);
- full:      what Runner does per attempt on this machine: best containment + the output cap
             pipe + the log header/footer (Runner.run_one of a baked hook).
Reported: median and p90 per attempt (ms) and each median over the `group` median.
Modes this machine cannot do are listed as unavailable, not guessed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nodeforge.bootstrap import contain
from nodeforge.bootstrap.hooks import Hook, HookEnv, Runner
from nodeforge.bootstrap.paths import Paths


def _available() -> list[str]:
    modes = ["group", "subreaper"]
    if contain._cgroup_base() is not None:
        modes.append("cgroup")
    if os.path.isdir("/run/systemd/system"):
        modes.append("scope")
    return modes + ["full"]


def _one(mode: str, runner: Runner, hook: Hook, out) -> float:
    t = time.perf_counter()
    if mode == "full":
        res = runner.run_one(hook)
        assert res.ok, res.reason
    else:
        real = contain.containment
        if mode != "group":
            contain.containment = lambda: mode  # type: ignore[assignment]
        try:
            gr = contain.run_group(
                ["/bin/true"],
                timeout=30,
                output=out,
                grace=1,
                contain=None if mode == "group" else "bench",
            )
        finally:
            contain.containment = real  # type: ignore[assignment]
        assert gr.returncode == 0
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    modes = _available()
    with tempfile.TemporaryDirectory(prefix="nf-bench-hooks-") as tmp:
        paths = Paths.under(tmp)
        paths.params_json.parent.mkdir(parents=True)
        paths.params_json.write_text("{}")
        runner = Runner(
            paths,
            HookEnv("compute", "bench", "b1", "ctl", paths.params_json),
            sleep=lambda s: None,
            grace=1,
        )
        hook = Hook("10-true", Path("/bin/true"), 30, 0, "baked")
        times: dict[str, list[float]] = {m: [] for m in modes}
        with open(Path(tmp) / "out", "w") as out:
            for m in modes:  # warm-up (imports, page cache)
                _one(m, runner, hook, out)
            for r in range(args.repeat):
                for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    times[m].append(_one(m, runner, hook, out))
    base = statistics.median(times["group"])
    result = {
        "repeat": args.repeat,
        "containment_used_by_runner": contain.containment(),
        "unavailable": [m for m in ("cgroup", "scope") if m not in modes],
        "modes": {
            m: {
                "median_ms": round(statistics.median(v) * 1000, 2),
                "p90_ms": round(sorted(v)[int(0.9 * (len(v) - 1))] * 1000, 2),
                "ratio_to_group": round(statistics.median(v) / base, 2),
            }
            for m, v in times.items()
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"per attempt, N={args.repeat}, runner uses: {result['containment_used_by_runner']}"
            f"; unavailable here: {', '.join(result['unavailable']) or 'none'}"
        )
        for m, r in result["modes"].items():
            print(
                f"  {m:<10} median {r['median_ms']:7.2f} ms  p90 {r['p90_ms']:7.2f} ms  "
                f"x{r['ratio_to_group']:.2f} of group"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
