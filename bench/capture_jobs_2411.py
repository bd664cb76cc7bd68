"""Capture real job records from the image's Slurm (24.11) for the cycle bench's `--shape 24.11`
and the reader's tests: starts the gang e2e's local cluster (lab/gang_cluster.py, root),
submits a few gang-like jobs (a 2-node running job with hostile name/comment/workdir, a held
one, one with a begin time, a 2-task array) and writes what slurmctld prints.

    flock /var/tmp/nf-e2e.lock env NODEFORGE_E2E_IMAGE=/var/tmp/nf-ci/image \
        .venv/bin/python bench/capture_jobs_2411.py OUTDIR

OUTDIR gets `scontrol-show-job.json`, `squeue.json` (both `--json`), `version.txt` and
`captured.txt` (UTC date). The fixture tests/fixtures/slurm/scontrol-show-job-24.11.json is
this output as captured (see that folder's README).
"""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from nodeforge.lab.gang_cluster import ClusterLab

# Hostile user text (what the reader must keep as data): newline, '=', quotes, JSON-looking.
NAME = 'train NumNodes=1 "x" {"job_id": 999}'
COMMENT = 'c\nJobId=999 JobState=RUNNING NumNodes=2 "},{"job_id":999'


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    image = Path(__import__("os").environ["NODEFORGE_E2E_IMAGE"])
    lab = ClusterLab(image, nodes=2, name="nfcap24")
    try:
        lab.start()
        wd = lab.make_dir("wd\nJobId=999 JobState=RUNNING")
        lab.sbatch("-N2", f"--job-name={NAME}", f"--comment={COMMENT}", f"--chdir={wd}")
        lab.sbatch("-N2", "--hold", "--job-name=held")
        lab.sbatch("-N1", "--begin=now+3600", "--job-name=later")
        lab.sbatch("-N1", "--array=0-1", "--job-name=arr", "--hold")
        time.sleep(5)  # the 2-node job starts (sched_interval=1)
        (out / "scontrol-show-job.json").write_text(
            lab.run("scontrol", "show", "job", "--json").stdout
        )
        (out / "squeue.json").write_text(lab.run("squeue", "--json", "--states=all").stdout)
        (out / "version.txt").write_text(lab.run("scontrol", "--version").stdout)
        (out / "captured.txt").write_text(datetime.now(UTC).isoformat(timespec="seconds") + "\n")
    finally:
        lab.close()


if __name__ == "__main__":
    main()
