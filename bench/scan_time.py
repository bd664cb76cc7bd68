"""Benchmark: the image secret scanner (images/scan.py) on a real built tree, against main's.

    .venv/bin/python bench/scan_time.py --tree DIR [--base main] [--repeat 3] [--json]
    .venv/bin/python bench/scan_time.py --archive OUT/rootfs.tar.zst ...   (extracted once)

Each run is a fresh process (`python -c` scanning the tree, as the build's seal step does);
the base revision's scanner (`git archive <--base> nodeforge images`, put on PYTHONPATH) and
this checkout's run interleaved, so both see the same load on a shared machine. Reports the
median wall and CPU seconds of each and the number of findings (never their text: a finding
on a real tree is printed by `nodeforge` itself). Needs no root to scan a readable tree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from nodeforge import proc
from nodeforge.images import rootfs_tar

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, resource, sys, time
from pathlib import Path
from nodeforge.images import scan
t0, c0 = time.monotonic(), time.process_time()
found = scan.scan(Path(sys.argv[1]))
print(json.dumps({"wall": time.monotonic() - t0, "cpu": time.process_time() - c0,
                  "findings": len(found), "module": scan.__file__,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def _one(tree: Path, pythonpath: str | None) -> dict:
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    cp = proc.run(
        [sys.executable, "-c", PROBE, tree], env=env, cwd=tempfile.gettempdir(), timeout=900
    )
    return json.loads(cp.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tree", type=Path, help="an extracted image tree")
    src.add_argument("--archive", type=Path, help="a rootfs.tar.zst to extract once")
    ap.add_argument("--base", default="main", help="git revision to compare with ('' for none)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nf-scan-bench-") as tmp:
        tree = a.tree
        if tree is None:
            tree = Path(tmp, "tree")
            tree.mkdir()
            rootfs_tar.untar(a.archive, tree, zstd=True, xattrs=False)
        base_path = None
        if a.base:
            base_path = Path(tmp, "base")
            base_path.mkdir()
            blob = proc.run(
                ["git", "-C", REPO, "archive", a.base, "nodeforge", "images"],
                text=False,
                timeout=120,
            ).stdout
            proc.run(["tar", "-C", base_path, "-x"], input=blob, text=False, timeout=120)
            (base_path / "images").rename(base_path / "nodeforge/images")
        runs: dict[str, list[dict]] = {"this": [], "base": []}
        for _ in range(a.repeat):
            runs["this"].append(_one(tree, None))
            if base_path is not None:
                runs["base"].append(_one(tree, str(base_path)))
    out = {
        name: {
            "wall_s": round(statistics.median(r["wall"] for r in rs), 2),
            "cpu_s": round(statistics.median(r["cpu"] for r in rs), 2),
            "findings": rs[-1]["findings"],
            "rss_mib": max(r["rss_mib"] for r in rs),
            "runs_wall_s": [round(r["wall"], 2) for r in rs],
        }
        for name, rs in runs.items()
        if rs
    }
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for name, r in out.items():
            print(
                f"{name:5} wall {r['wall_s']:6.2f} s  cpu {r['cpu_s']:6.2f} s  rss {r['rss_mib']} MiB  findings {r['findings']}  runs {r['runs_wall_s']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
