"""`nodeforge cluster rollout` on a real local cluster (issue 28 item 2): 1 controller and 3
computes, canary then a batch of 2, then the controller. A job running on the canary is requeued
and completes, a job queued before the rollout runs after it, the controller's replacement
keeps the queue and sacct's history, and a step whose new machine fails its first boot is
stopped and restored on the old image.

The second image is the built image's files hard-linked into another directory (same content,
another path): what the lab can honestly build in the time of a test. The forced failure is a
real first-boot failure of the new machine: `--params` gives it an extension hook that cannot
be fetched (file:///dev/zero, refused as not a regular file), so its agent fails and drains it;
the restore boots the old image with the cluster's own params (no such hook).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.conftest import require_tools, wait_for
from tests.helpers import E2E_ROOT, REPO, linked_copy, nodeforge

pytestmark = pytest.mark.e2e
CLUSTER = "e2ero"
COMPUTES = ("c001", "c002", "c003")


def cx(node: str, *cmd: str, check: bool = True) -> str:
    cp = subprocess.run(
        [sys.executable, "-m", "nodeforge", "cluster", "exec", "--name", CLUSTER, node, "--", *cmd],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    if check and cp.returncode != 0:
        pytest.fail(f"[{node}] {' '.join(cmd)} exited {cp.returncode}: {cp.stdout}", pytrace=False)
    return cp.stdout


def job_state(job: str) -> str:
    return cx("ctl", "sacct", "-n", "-X", "-P", "-j", job, "-o", "State", check=False).strip()


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def completes(job: str, what: str, timeout: float = 240) -> None:
    """*job* ends COMPLETED within *timeout*; otherwise the failure shows its state and
    Slurm's own account of it and the nodes (a job that failed is not waited on)."""
    state = ""
    try:
        state = wait_for(
            what, lambda: next((e for e in ENDED if job_state(job).startswith(e)), ""), timeout
        )
    finally:
        if state != "COMPLETED":
            print(cx("ctl", "scontrol", "show", "job", job, check=False))
            print(cx("ctl", "sinfo", "-N", "-o", "%N %T %E", check=False))
    assert state == "COMPLETED", f"{what}: job {job} ended {state}"


def states() -> dict[str, str]:
    out = cx("ctl", "sinfo", "-h", "-N", "-o", "%N|%T")
    return dict(line.split("|", 1) for line in out.split() if "|" in line)


def machine_ids() -> dict[str, str]:
    return {n: cx(n, "cat", "/etc/machine-id").strip() for n in COMPUTES}


def rollout(*args: str) -> subprocess.CompletedProcess:
    return nodeforge("cluster", "rollout", "--name", CLUSTER, *args, check=False, timeout=1500)


def test_rollout_canary_batches_requeue_and_restore(built_image, tmp_path):
    require_tools("systemd-nspawn", "ip", "nsenter")
    new_image = linked_copy(built_image, E2E_ROOT / f"{CLUSTER}-image-new")
    old_manifest = json.loads((built_image / "manifest.json").read_text())
    old_slurmd = old_manifest["packages"]["slurmd"]
    too_old = dict(old_manifest, packages=dict(old_manifest["packages"], slurmd="22.05.8-4"))
    old_slurm_image = linked_copy(built_image, E2E_ROOT / f"{CLUSTER}-image-2205", too_old)
    (tmp_path / "empty").mkdir()
    nodeforge("cluster", "down", "--name", CLUSTER, check=False)
    nodeforge(
        "cluster", "up", "--name", CLUSTER, "--image", str(built_image),
        "--computes", str(len(COMPUTES)), "--timeout", "400",
    )  # fmt: skip
    try:
        # Refused before anything is drained, each naming what to fix.
        img = ("--image", str(new_image))
        for args, expect in [
            ((*img, "--batch", "0"), "--batch 0"),
            ((*img, "--nodes", "c001,c999"), "has no node 'c999'"),
            (("--image", str(tmp_path / "empty")), "manifest.json: missing"),
            (("--image", str(old_slurm_image)), f"slurmd 22.05.8-4 cannot join cluster {CLUSTER}"),
        ]:
            bad = rollout(*args)
            assert bad.returncode == 2 and expect in bad.stderr, (args, bad.stderr)
            assert "Traceback" not in bad.stderr
        assert old_slurmd in bad.stderr  # both versions named
        before = machine_ids()
        assert all(s == "idle" for s in states().values()), states()
        # The plan, and nothing changed.
        dry = rollout(*img, "--batch", "2", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        plan = [ln.split() for ln in dry.stdout.splitlines() if ln.strip().startswith("step ")]
        assert plan == [
            ["step", "1/3", "canary", "c001"],
            ["step", "2/3", "batch", "c002,", "c003"],
            ["step", "3/3", "controller", "ctl"],
        ], dry.stdout
        digest = old_manifest["artifacts"]["rootfs.tar.zst"]["sha256"][:16]
        assert f"rootfs sha256 {digest}" in dry.stdout and str(new_image) in dry.stdout
        assert machine_ids() == before and all(s == "idle" for s in states().values())

        # A job running on the canary, and one queued behind it (needs every compute whole).
        running = cx(
            "ctl", "sbatch", "--parsable", "--requeue", "-w", "c001", "--wrap", "sleep 40"
        ).strip()
        wait_for("the canary's job to run", lambda: job_state(running) == "RUNNING", 60)
        queued = cx(
            "ctl", "sbatch", "--parsable", "-N3", "--exclusive", "--wrap", "srun hostname"
        ).strip()
        assert job_state(queued) == "PENDING"
        held = cx("ctl", "sbatch", "--parsable", "--hold", "--wrap", "hostname").strip()
        ctl_id = cx("ctl", "cat", "/etc/machine-id").strip()

        cp = rollout(*img, "--batch", "2", "--drain-timeout", "5", "--timeout", "300", "--json")
        assert cp.returncode == 0, cp.stderr
        summary = json.loads(cp.stdout)
        assert [s["nodes"] for s in summary["steps"]] == [["c001"], ["c002", "c003"], ["ctl"]]
        assert summary["steps"][0]["requeued"] == [running], summary
        for line in (
            "step 1/3 (canary: c001): draining",
            f"requeueing {running}",
            "step 1/3 (canary: c001): healthy; running `nodeforge verify`",
            "step 2/3 (batch: c002,c003): done in",
            "ctl: stopping slurmctld, slurmdbd, MariaDB (state kept)",
            "step 3/3 (controller: ctl): done in",
        ):
            assert line in cp.stderr, (line, cp.stderr)
        # `nodeforge verify` ran real checks on each step's nodes, none failed.
        verified = re.findall(r"\): verify: ([^\n]*) in [0-9.]+s", cp.stderr)
        assert len(verified) == 3, cp.stderr
        assert all("passed" in v and not re.search("failed|error", v) for v in verified), verified
        after = machine_ids()
        assert all(after[n] != before[n] for n in COMPUTES), (before, after)
        assert not [n for n, s in states().items() if s.startswith(("drain", "down", "fail"))], (
            states()
        )

        # A new controller machine, with the old one's queue and accounting database.
        assert cx("ctl", "cat", "/etc/machine-id").strip() != ctl_id
        assert cx("ctl", "squeue", "-h", "-j", held, "-o", "%T").strip() == "PENDING"
        cx("ctl", "scontrol", "release", held)
        # The requeued job ran again and completed; the queued jobs ran after the rollout.
        completes(running, "the requeued job to complete")
        completes(queued, "the queued job to complete")
        completes(held, "the held job to complete")
        runs = cx("ctl", "sacct", "-n", "-X", "-D", "-P", "-j", running, "-o", "State").split()
        assert runs[0] == "REQUEUED" and runs[-1] == "COMPLETED", runs
        hist = cx("ctl", "sacct", "-n", "-X", "-P", "-o", "JobID").split()
        assert {running, queued, held} <= set(hist), hist

        # A batch whose new machine fails its first boot: stopped, restored on the old image,
        # which is now the cluster's (the controller's): image-new. Rolled out: the first one.
        params = tmp_path / "fail.yaml"
        params.write_text(
            yaml.safe_dump({"hooks": [{"uri": "file:///dev/zero", "name": "50-dev"}],
                            "hook_retries": 0})
        )  # fmt: skip
        c002 = cx("c002", "cat", "/etc/machine-id").strip()
        bad = rollout(
            "--image", str(built_image), "--nodes", "c002", "--params", str(params),
            "--timeout", "240",
        )  # fmt: skip
        assert bad.returncode == 1, bad.stderr
        assert "rollout stopped at step 1/1 (canary: c002): node c002 is drained" in bad.stderr
        assert "hook 50-dev" in bad.stderr
        assert f"c002 restored on the old image {new_image.resolve()}" in bad.stderr
        st = {
            n["name"]: n
            for n in json.loads(nodeforge("cluster", "status", "--name", CLUSTER, "--json").stdout)[
                "nodes"
            ]
        }
        assert st["c002"]["agent"] == "ready" and st["c002"]["slurm_ready"], st["c002"]
        assert cx("c002", "cat", "/etc/machine-id").strip() != c002
        assert states()["c002"] == "idle", states()
    finally:
        nodeforge("cluster", "down", "--name", CLUSTER, check=False)
        for d in ("image-new", "image-2205"):
            shutil.rmtree(E2E_ROOT / f"{CLUSTER}-{d}", ignore_errors=True)
