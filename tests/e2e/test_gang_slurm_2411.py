"""The gang cases of test_gang_slurm.py against the image's own Slurm (24.11), in a local
cluster built from the image (lab/gang_cluster.py: controller + computes gn1..gn4).

The case bodies are tests/e2e/gang_cases.py's, which the 22.05 module runs too (imported, not
copied); only the `lab` fixture differs.
Cases that stay on 22.05 only, and why:
- test_node_never_comes_up, test_never_booting_node_drained_after_two_gang_timeouts: they need
  CLOUD (power-saving) nodes with a ResumeProgram; the local cluster's nodes are dynamic nodes
  that are either running or not there,
- test_recovery_timeout_node_killed_after_ready: it kills a slurmd and waits for slurmctld to
  mark the node NOT_RESPONDING; the image's SlurmdTimeout is 300 s,
- test_slurmctld_restart: the lab stops and starts its own slurmctld process,
- test_cli_run_once_and_status: it runs the host's `nodeforge gang run` against the lab's
  SLURM_CONF; the host's 22.05 clients cannot talk to 24.11,
- test_prolog_fails: its expectations are what 22.05 without ForceRequeueOnFail does; the
  image's config sets PrologFlags=ForceRequeueOnFail, which changes Slurm's own reaction (not
  covered here yet).
Het jobs run only here: the 22.05 lab's select/linear refuses them, cons_tres accepts them.
"""

from __future__ import annotations

import re

import pytest

from nodeforge.lab.gang_cluster import ClusterLab
from tests.conftest import require_tools
from tests.e2e.gang_cases import (  # noqa: F401  (the cases, collected here too)
    test_array_gang_timeout_requeues_only_its_own_task,
    test_array_task_with_the_arrays_id_marks_only_itself_ready,
    test_array_tasks_are_tracked_as_arrayjob_task,
    test_block_admission_not_stalled_by_a_gang_waiting_for_its_dependency,
    test_block_admission_serializes,
    test_deactivation_is_final_until_an_operator_releases,
    test_drain_under_a_ready_job_is_not_lost_readiness,
    test_forged_job_name_is_still_a_two_node_gang,
    test_forged_workdir_and_comment_add_no_phantom_job,
    test_governor_restart_mid_countdown,
    test_happy_path_with_app_probe,
    test_not_requeueable_is_recorded,
    test_own_deadlines_judged_and_shown_to_the_owner,
    test_probe_never_signals_backoff_steps,
    test_prolog_hangs,
    test_real_node_output_is_read_node_by_node_through_the_cache,
    test_retry_limit_requeuehold_then_release_resets,
    test_time_limit_deactivates_after_t_seconds,
)
from tests.e2e.gang_support import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lab(built_image):
    require_tools("systemd-nspawn", "ip", "nsenter", "mount", "umount", "zstd")
    lab = ClusterLab(built_image, nodes=4)
    try:
        lab.start()
        yield lab
    finally:
        lab.close()


def test_slurm_is_24_11(lab):
    """The backend these cases ran against (what the module name promises)."""
    out = lab.run("scontrol", "--version").stdout
    assert re.fullmatch(r"slurm(-wlm)? 24\.11\.\d+\s*", out), out


def test_het_job_is_one_gang_requeued_by_its_leader(lab, gov):
    """A het job (one node per component), the second component's prolog hangs: the gang is
    not ready while any component is not; at the timeout the leader is requeued, and the
    whole het job with it (Slurm's Restarts on both components)."""
    lab.set_prolog("gn4", "hang")
    g = gov(timeout=3).start()
    out = lab.run(
        "sbatch",
        "--parsable",
        f"--output={lab.base}/log/het-%j.out",
        "-N1",
        "-w",
        "gn3",
        ":",
        "-N1",
        "-w",
        "gn4",
        input="#!/bin/sh\nsleep 60\n",
    ).stdout.strip()
    leader = out.split(";")[0]
    assert leader.isdigit(), out
    seen: dict[str, set[tuple[str, str]]] = {}  # component (leader+0, +1) -> (state, reason)

    def requeued() -> bool:
        out = lab.run("squeue", "-h", "-j", leader, "-o", "%i %T %r", check=False).stdout
        for line in out.splitlines():
            f = line.split(maxsplit=2)
            if len(f) == 3:
                seen.setdefault(f[0], set()).add((f[1], f[2]))
        return bool(g.events(leader, "requeue"))

    wait_for(requeued, 25, "requeue of the het job's leader")
    # The leader's own component ran with its prolog done (alone it would look ready); the
    # second one ran with Reason=Prolog until the timeout: the gang was not ready.
    assert ("RUNNING", "None") in seen.get(f"{leader}+0", set()), seen
    assert ("RUNNING", "Prolog") in seen.get(f"{leader}+1", set()), seen
    assert not [e for e in g.events(leader, "note") if e["reason"] == "PodsReady"], seen
    rec = g.rec(leader)
    assert rec is not None and rec.count == 1, rec
    # every command named the whole het job by the leader's id (not a component's)
    cmds = [e for e in g.events(leader) if e["action"] not in ("note", "strike")]
    assert cmds and {e.get("address") for e in cmds} == {leader}, cmds
    # one gang, keyed by the leader: no record for the second component's own id (Slurm
    # numbers the components leader, leader+1)
    assert str(int(leader) + 1) not in g.gov.state.jobs, sorted(g.gov.state.jobs)
    assert len(g.events(str(int(leader) + 1))) == 0
    lab.release_prologs()

    def components() -> dict[str, str]:
        out = lab.run("squeue", "-h", "-j", leader, "-o", "%i %T").stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    # both components back in the queue (the second one COMPLETING until its prolog ends)
    wait_for(
        lambda: components() == {f"{leader}+0": "PENDING", f"{leader}+1": "PENDING"},
        20,
        "both het components PENDING",
        components,
    )
    assert lab.job(leader)["Restarts"] == "1"
    assert len(g.events(leader, "requeue")) == 1
