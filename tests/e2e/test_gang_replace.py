"""The gang governor across a node replacement (issue 28 item 1), on the image's own Slurm.

A 2-node gang runs, governed and ready, when one of its machines is replaced
(`LocalCluster.replace`, what `nodeforge cluster replace` runs): a fresh disk, the same name.
The new machine's agent sets the old registration DOWN, so Slurm requeues the job itself; the
governor records that as `RequeuedBySlurm` and does not count it as its own eviction (as Kueue
counts only its own evictions against backoffLimitCount: docs/gang.md), strikes no node, and
the job runs again to completion on the new machine.

The lab is lab/gang_cluster.py's (its own cluster name, two computes gn1 and gn2); the
governor runs in-process with the case's settings (the `gov` fixture, tests/e2e/conftest.py).
"""

from __future__ import annotations

import pytest

from nodeforge.gang.events import decode_admin
from nodeforge.lab.gang_cluster import LAB_DIR, ClusterLab
from tests.conftest import require_tools
from tests.e2e.gang_support import wait_for

pytestmark = pytest.mark.e2e
NAME = "e2egrepl"
# FIXTURE job: each run appends one line per node (name, machine-id, Slurm's restart count)
# to its output (opened in append mode, so the first run's lines stay), then sleeps.
JOB = """#!/bin/sh
srun -N2 -l sh -c 'echo "$SLURMD_NODENAME $(cat /etc/machine-id) restart=${{SLURM_RESTART_COUNT:-0}}"'
sleep {secs}
"""


@pytest.fixture(scope="module")
def lab(built_image):
    require_tools("systemd-nspawn", "ip", "nsenter", "mount", "umount", "zstd")
    lab = ClusterLab(built_image, nodes=2, name=NAME)
    try:
        lab.start()
        yield lab
    finally:
        lab.close()


def machine_id(lab: ClusterLab, node: str) -> str:
    return lab._host_path(node, "/etc/machine-id").read_text().strip()


def test_replaced_node_under_a_ready_gang_is_slurms_requeue(lab, gov):
    g = gov(timeout=20).start()
    out = f"{LAB_DIR}/log/replace-%j.out"
    j = lab.sbatch("-N2", "-w", "gn1,gn2", "--open-mode=append", f"--output={out}",
                   script=JOB.format(secs=20))  # fmt: skip
    wait_for(
        lambda: any(e["reason"] == "PodsReady" for e in g.events(j, "note")),
        90,
        "the gang ready (PodsReady)",
        lambda: (lab.job(j), g.events(j)),
    )
    old_id = machine_id(lab, "gn2")
    _, secs = lab.lc.replace(
        "gn2",
        prepare=lambda node: lab._write_lab_files(node.merged / str(LAB_DIR).lstrip("/")),
        timeout=300,
    )
    new_id = machine_id(lab, "gn2")
    assert new_id != old_id
    # Slurm's requeue (the old registration set DOWN by the new machine's agent), seen as such
    wait_for(
        lambda: any(e["reason"] == "RequeuedBySlurm" for e in g.events(j, "note")),
        60,
        "the governor's note of Slurm's requeue",
        lambda: (lab.job(j), g.events(j)),
    )
    # Slurm holds a requeued job off ~120 s (its own hold-off; the governor's backoff replaces
    # it only for its own requeues), then it runs again on both nodes
    wait_for(
        lambda: lab.job(j)["JobState"] == "COMPLETED",
        300,
        "the job COMPLETED after the replacement",
        lambda: (lab.job(j), g.events(j)),
    )
    info = lab.job(j)
    assert int(info["Restarts"]) >= 1, info
    # not the governor's eviction: no requeue of its own, no count, no AdminComment count
    assert g.events(j, "requeue") == [], g.events(j)
    assert g.rec(j).count == 0, g.rec(j)
    assert not decode_admin(info.get("AdminComment", "")), info.get("AdminComment")
    # the governor blamed no node: Slurm's requeue is no gang timeout
    assert g.events(action="strike") == [] and g.events(action="drain") == [], g.events()
    wait_for(  # the governor's next cycle after Slurm's COMPLETED
        lambda: any(e["reason"] == "Finished" for e in g.events(j, "note")),
        30,
        "the governor's Finished note",
        lambda: g.events(j),
    )
    notes = [e["reason"] for e in g.events(j, "note")]
    assert notes == ["PodsReady", "RequeuedBySlurm", "PodsReady", "Finished"], notes
    # the second run ran on the new machine (its machine-id), the first on the old one
    batch = info["BatchHost"]
    text = lab._host_path(batch, f"{LAB_DIR}/log/replace-{j}.out").read_text()
    assert f"gn2 {new_id} restart=1" in text, text
    if batch == "gn1":  # the old gn2's lines are in gn1's file only when gn1 ran both batches
        assert f"gn2 {old_id} restart=0" in text, text
    nodes = lab.node_states()
    assert nodes["gn2"].split("+")[0] == "IDLE" and "DRAIN" not in nodes["gn2"], nodes
    print(f"replace: gn2 schedulable {secs}s after the old machine's loss; notes {notes}")
