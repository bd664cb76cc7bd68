"""`nodeforge cluster rollout`: a new image across a running local cluster, canary first.

Each step (lab/rollout_plan.py) drains its nodes in Slurm with a reason naming the rollout,
lets running jobs finish up to a bound and requeues the rest, replaces the machines
(LocalCluster.replace: fresh disks from the new image, same names), gates on health (the node
schedulable, its agent ready) and on `nodeforge verify`, then resumes what is still drained by
the rollout. The controller goes last: its services stopped, its machine replaced with its state
kept (LocalCluster.replace_controller), then the same gates. A failed step stops the rollout
and puts that step's nodes back on the old image.
Everything that can refuse is checked before the first drain. Clock and sleep are injected.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.slurm_facts import talks_to

from .localcluster import (
    CONTROLLER_NAME,
    Cluster,
    LocalCluster,
    check_image_for,
    image_slurm,
    node_exec,
)
from .rollout_plan import CONTROLLER, Step, check_batch, describe, plan

log = logging.getLogger("nodeforge.cluster")

REASON_PREFIX = "nodeforge-rollout"
POLL = 2.0  # seconds between two looks at a batch's running jobs
VERIFY_TIMEOUT = 900.0
_JOBID = re.compile(r"[0-9]{1,12}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


class RolloutError(NodeforgeError):
    """A step failed after the rollout began (its nodes were restored): exit 1, not 2."""

    exit_code = 1


@dataclass(frozen=True)
class Image:
    path: Path
    slurmd: str
    digest: str  # sha256 of rootfs.tar.zst, from the manifest

    @property
    def short(self) -> str:
        return f"{self.path} (rootfs sha256 {self.digest[:16]}, slurmd {self.slurmd})"


def read_image(path: Path) -> Image:
    """The image's identity from its manifest; refused without one (the file named)."""
    slurmd = image_slurm(path)  # refuses a missing/unreadable manifest, names the file
    f = Path(path) / "manifest.json"
    try:
        digest = json.loads(f.read_text())["artifacts"]["rootfs.tar.zst"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        digest = None
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise NodeforgeError(
            f"{f}: artifacts.rootfs.tar.zst.sha256 missing or not a sha256; give the output "
            "directory of `nodeforge build` (the lab boots its rootfs.tar.zst)"
        )
    if not (Path(path) / "rootfs.tar.zst").is_file():
        raise NodeforgeError(f"{Path(path) / 'rootfs.tar.zst'} not found: not a complete build")
    return Image(Path(path).resolve(), slurmd, digest)


@dataclass(frozen=True)
class Clock:
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


@dataclass
class StepResult:
    step: Step
    seconds: float = 0.0
    requeued: list[str] = field(default_factory=list)
    finished_in_bound: bool = True


# -- the phases of one step: each one small, each one Slurm command on the controller ------
def slurm(cluster: Cluster, argv: list[str], timeout: float = 30) -> str:
    """Run a Slurm command on the controller; a failure names the command and its output."""
    cp = node_exec(cluster.controller, argv, check=False, timeout=timeout)
    if cp.returncode != 0:
        raise NodeforgeError(
            f"`{' '.join(argv)}` on {CONTROLLER_NAME} exited {cp.returncode}: "
            f"{(cp.stdout or '').strip()[-400:]}"
        )
    return cp.stdout or ""


def drain(cluster: Cluster, nodes: Sequence[str], reason: str) -> None:
    slurm(
        cluster,
        ["scontrol", "update", f"NodeName={','.join(nodes)}", "State=DRAIN", f"Reason={reason}"],
    )


def parse_job_ids(text: str) -> list[str]:
    """squeue -h -o %A: one job id a line; anything else is refused (not guessed)."""
    ids = []
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if not _JOBID.fullmatch(s):
            raise NodeforgeError(f"squeue printed {s!r} where a job id was expected")
        ids.append(s)
    return sorted(set(ids), key=int)


def running_jobs(cluster: Cluster, nodes: Sequence[str]) -> list[str]:
    out = slurm(
        cluster,
        ["squeue", "-h", "-w", ",".join(nodes), "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%A"],
    )
    return parse_job_ids(out)


def wait_jobs(
    cluster: Cluster,
    nodes: Sequence[str],
    bound: float,
    clock: Clock,
    jobs: Callable[[Cluster, Sequence[str]], list[str]] | None = None,
) -> list[str]:
    """Let running jobs finish, up to *bound* seconds; return those still running."""
    jobs = jobs or running_jobs
    deadline = clock.now() + bound
    left = jobs(cluster, nodes)
    while left and clock.now() < deadline:
        clock.sleep(min(POLL, max(0.0, deadline - clock.now())))
        left = jobs(cluster, nodes)
    return left


def requeue(cluster: Cluster, job_ids: Sequence[str], progress: Callable[[str], None]) -> None:
    """`scontrol requeue`; a job Slurm will not requeue (not batch, --no-requeue) ends as the
    machine is replaced, per Slurm's policy: said, not hidden."""
    for j in job_ids:
        cp = node_exec(cluster.controller, ["scontrol", "requeue", j], check=False, timeout=30)
        if cp.returncode != 0:
            progress(
                f"job {j}: not requeued ({(cp.stdout or '').strip()[-200:]}); it ends when "
                "its node is replaced"
            )


def resume(lc: LocalCluster, cluster: Cluster, nodes: Sequence[str]) -> list[str]:
    """RESUME the nodes still drained by the rollout (a node drained by anyone else, e.g.
    its health check, keeps its drain). Returns the nodes resumed."""
    sn = lc.slurm_nodes(cluster)
    ours = [
        n
        for n in nodes
        if n in sn and sn[n].state.drained and sn[n].reason.startswith(REASON_PREFIX)
    ]
    if ours:
        slurm(cluster, ["scontrol", "update", f"NodeName={','.join(ours)}", "State=RESUME"])
    return ours


def replace_nodes(
    lc: LocalCluster,
    nodes: Sequence[str],
    image: Path,
    timeout: float,
    params: dict | None,
    copies: list[tuple[Path, str]] | None,
) -> None:
    """Replace every node of the step (boots in parallel), then wait until each is schedulable
    with its agent ready (the health gate: a node its init or health check drained fails it
    at once, with its reason)."""
    for n in nodes:
        lc.replace(n, image=image, params=params, copies=copies, wait=False)
    lc.wait_ready(Cluster.load(lc.name), list(nodes), timeout)


def replace_controller(
    lc: LocalCluster,
    image: Path,
    timeout: float,
    params: dict | None,
    copies: list[tuple[Path, str]] | None,
) -> None:
    """The controller's machine replaced, its state kept (LocalCluster.replace_controller);
    returns once slurmctld answers and the running computes are schedulable again."""
    lc.replace_controller(image=image, params=params, copies=copies, timeout=timeout)


def controller_reaches(lc: LocalCluster, timeout: float = 60.0) -> str:
    """After the controller's replacement: one job through the new slurmctld on every idle
    compute (munge and the slurmctld -> slurmd -> srun path, both ways). slurmctld starts from
    its saved node states, which look schedulable until SlurmdTimeout runs out, so only a job
    shows that the new controller can reach the computes (a controller with another munge key
    passed the node-state gate). Busy computes are named, not waited for. Returns the line for
    the progress output; a job that does not run raises, naming the nodes and srun's words."""
    cluster = Cluster.load(lc.name)
    computes = sorted(n.name for n in cluster.nodes if n.role == "compute")
    sn = lc.slurm_nodes(cluster)
    idle = [n for n in computes if n in sn and sn[n].state.ready and sn[n].state.base == "IDLE"]
    busy = [n for n in computes if n not in idle]
    if not idle:
        return f"no idle compute to run a job on ({','.join(busy) or 'none'} busy or not ready)"
    argv = ["srun", "-N", str(len(idle)), "-w", ",".join(idle), f"--immediate={int(timeout)}",
            "-t", "1", "-J", "nodeforge-rollout-check", "true"]  # fmt: skip
    try:
        slurm(cluster, argv, timeout=timeout + 30)
    except NodeforgeError as exc:
        raise NodeforgeError(
            f"the new controller cannot run a job on {','.join(idle)}: {exc} (is its munge "
            "key the cluster's? are the computes' slurmd reachable from it?)"
        ) from None
    return f"a job ran on {','.join(idle)}" + (f" ({','.join(busy)} busy)" if busy else "")


def run_verify(cluster_name: str, nodes: Sequence[str]) -> tuple[str | None, str]:
    """`nodeforge verify` on the nodes (its own process: testinfra's per-host caches start
    clean). (None when every check passed, else the first failure named; the counts)."""
    hosts = ",".join(f"nspawn://{cluster_name}/{n}" for n in nodes)
    argv = [sys.executable, "-m", "nodeforge", "verify", "--hosts", hosts, "--json"]
    cp = proc.run(argv, check=False, timeout=VERIFY_TIMEOUT)
    out = cp.stdout or ""
    return verify_failure(cp.returncode, out), verify_counts(out)


def _report(out: str) -> dict | None:
    # stderr (merged) may hold lines of its own; the report is the JSON object from a "{" line
    m = re.search(r"^\{$", out, re.M)
    try:
        doc = json.loads(out[m.start() :]) if m else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def verify_counts(out: str) -> str:
    """'31 passed, 12 skipped in 4.2s' from `nodeforge verify --json` (for the progress line)."""
    doc = _report(out) or {}
    outcomes = [r.get("outcome") for r in doc.get("results") or [] if isinstance(r, dict)]
    counts = ", ".join(f"{outcomes.count(o)} {o}" for o in sorted(set(map(str, outcomes))))
    return f"{counts or 'no checks'} in {doc.get('seconds', '?')}s"


def verify_failure(rc: int, out: str) -> str | None:
    """The first failure in `nodeforge verify --json` output (stderr merged in), or None."""
    doc = _report(out)
    if doc is None:
        return f"nodeforge verify exited {rc} without a report: {out.strip()[-400:]}"
    for u in doc.get("unreachable") or []:
        return f"verify: host {u.get('host')} unreachable: {u.get('reason')}"
    for r in doc.get("results") or []:
        if r.get("outcome") in ("failed", "error"):
            msg = (r.get("message") or "").strip().splitlines()
            return f"verify: host {r.get('host')} check {r.get('check')}: {msg[0] if msg else ''}"
    if rc != 0 or not doc.get("ok"):
        return f"nodeforge verify exited {rc}: {out.strip()[-400:]}"
    return None


# -- the rollout ------------------------------------------------------------------------
@dataclass
class Rollout:
    lc: LocalCluster
    image: Path
    batch: int = 1
    drain_timeout: float = 300.0
    ready_timeout: float = 300.0
    nodes: Sequence[str] | None = None  # default: every compute, then the controller
    params: dict | None = None
    copies: list[tuple[Path, str]] | None = None
    verify: Callable[[str, Sequence[str]], tuple[str | None, str]] = run_verify
    reaches: Callable[[LocalCluster], str] = controller_reaches
    clock: Clock = field(default_factory=Clock)

    def progress(self, msg: str) -> None:
        self.lc.progress(msg)

    def prepare(self) -> tuple[Image, Image, list[Step]]:
        """Every refusal, before anything is drained: batch, nodes, manifest, Slurm release."""
        check_batch(self.batch)
        for what, v in (("--drain-timeout", self.drain_timeout), ("--timeout", self.ready_timeout)):
            if not 0 <= v <= 86400:
                raise NodeforgeError(f"{what} {v}: give seconds, 0 to 86400")
        cluster = Cluster.load(self.lc.name)
        # Default: every compute and the controller (login nodes hold users' sessions).
        wanted = (
            list(self.nodes)
            if self.nodes
            else [n.name for n in cluster.nodes if n.role in ("compute", "controller")]
        )
        for n in wanted:
            cluster.node(n)  # an unknown node is refused, the known ones named
        roles = {n: cluster.node(n).role for n in wanted}
        odd = [n for n, r in roles.items() if r not in ("compute", "controller")]
        if odd:
            raise NodeforgeError(
                f"{', '.join(odd)}: rollout replaces computes and the controller; a login "
                "node is replaced by hand (`nodeforge cluster down`/`add`)"
            )
        new = read_image(self.image)
        old = read_image(Path(cluster.image))
        check_image_for(cluster, self.image)  # both Slurm versions named when refused
        if CONTROLLER_NAME in roles:
            # The new slurmctld must also accept the slurmd of every compute left on the old
            # image (an older release rolled onto the controller would not).
            why = talks_to(new.slurmd, old.slurmd)
            if why is not None:
                raise NodeforgeError(
                    f"{self.image}: its slurmctld {new.slurmd} cannot take over cluster "
                    f"{cluster.name}, whose computes run slurmd {old.slurmd}: {why}. Nothing "
                    "was drained or replaced."
                )
        steps = plan(
            [n for n, r in roles.items() if r == "compute"],
            self.batch,
            CONTROLLER_NAME if CONTROLLER_NAME in roles else None,
        )
        if not steps:
            raise NodeforgeError("nothing to roll out: the cluster has no computes")
        return old, new, steps

    def dry_run(self) -> list[str]:
        old, new, steps = self.prepare()
        lines = describe(steps, old.short, new.short)
        lines.append(
            f"  each step: drain (reason '{REASON_PREFIX} …'), jobs finish for up to "
            f"{self.drain_timeout:.0f}s then are requeued, replace, gate on health and "
            "`nodeforge verify`, resume; a failed step is restored on the old image"
        )
        if any(s.kind == CONTROLLER for s in steps):
            lines.append(
                "  controller: slurmctld, slurmdbd and MariaDB stopped, the machine replaced "
                "with its state (StateSaveLocation, MariaDB's data, the munge key) kept, "
                "computes schedulable again, `nodeforge verify`"
            )
        lines.append("dry run: nothing was drained or replaced")
        return lines

    def run(self) -> dict:
        old, new, steps = self.prepare()
        for line in describe(steps, old.short, new.short):
            self.progress(line)
        t0 = self.clock.now()
        results: list[StepResult] = []
        computes = sum(len(s.nodes) for s in steps if s.kind != CONTROLLER)
        for s in steps:
            results.append(self.step(s, len(steps), old, new))
        return self._summary(results, t0, computes, old, new)

    def step(self, s: Step, total: int, old: Image, new: Image) -> StepResult:
        name = f"step {s.number}/{total} ({s.label})"
        reason = f"{REASON_PREFIX}: step {s.number}/{total} to {new.digest[:16]}"
        started = self.clock.now()
        res = StepResult(s)
        replaced = False
        try:
            if s.kind == CONTROLLER:
                # Not a Slurm node: nothing to drain; running jobs stay with their slurmd.
                replaced = True
                self.progress(f"{name}: replacing from {new.path}")
                replace_controller(self.lc, new.path, self.ready_timeout, self.params, self.copies)
                self.progress(f"{name}: round trip: {self.reaches(self.lc)}")
                self.progress(f"{name}: healthy; running `nodeforge verify`")
                self.gate(name, s.nodes)
                res.seconds = round(self.clock.now() - started, 2)
                self.progress(f"{name}: done in {res.seconds:.1f}s")
                return res
            cluster = Cluster.load(self.lc.name)
            self.progress(f"{name}: draining")
            drain(cluster, s.nodes, reason)
            left = wait_jobs(cluster, s.nodes, self.drain_timeout, self.clock)
            if left:
                res.finished_in_bound = False
                self.progress(
                    f"{name}: {len(left)} job(s) still running after {self.drain_timeout:.0f}s: "
                    f"requeueing {','.join(left)}"
                )
                requeue(cluster, left, self.progress)
                res.requeued = left
            self.progress(f"{name}: replacing from {new.path}")
            replaced = True
            replace_nodes(self.lc, s.nodes, new.path, self.ready_timeout, self.params, self.copies)
            self.progress(f"{name}: healthy; running `nodeforge verify`")
            self.gate(name, s.nodes)
            done = resume(self.lc, Cluster.load(self.lc.name), s.nodes)
            res.seconds = round(self.clock.now() - started, 2)
            self.progress(
                f"{name}: done in {res.seconds:.1f}s"
                + (f" (resumed {','.join(done)})" if done else "")
            )
            return res
        except NodeforgeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            restored = self.restore(s, old, replaced)
            raise RolloutError(
                f"rollout stopped at {name}: {first}. {restored} Later steps were not started."
            ) from None

    def gate(self, name: str, nodes: Sequence[str]) -> None:
        """`nodeforge verify` on the step's nodes: its first failure fails the step."""
        why, counts = self.verify(self.lc.name, nodes)
        self.progress(f"{name}: verify: {counts}")
        if why is not None:
            raise NodeforgeError(why)

    def restore(self, s: Step, old: Image, replaced: bool) -> str:
        """Put the failed step's nodes back as they were: on the old image if they were
        replaced, else just resumed. Returns a sentence for the error."""
        nodes = ",".join(s.nodes)
        try:
            if replaced and s.kind == CONTROLLER:
                self.progress(f"{nodes}: restoring on the old image {old.path}")
                replace_controller(self.lc, old.path, self.ready_timeout, None, None)
                return f"{nodes} restored on the old image {old.path}"
            if replaced:
                self.progress(f"{nodes}: restoring on the old image {old.path}")
                # Drained first: a node the failed image left schedulable takes no new job.
                cluster = Cluster.load(self.lc.name)
                present = [n for n in s.nodes if n in self.lc.slurm_nodes(cluster)]
                if present:
                    drain(cluster, present, f"{REASON_PREFIX}: restoring the old image")
                replace_nodes(self.lc, s.nodes, old.path, self.ready_timeout, None, None)
            resume(self.lc, Cluster.load(self.lc.name), s.nodes)
        except NodeforgeError as exc:
            return (
                f"Restoring {nodes} on {old.path} FAILED too: {str(exc).splitlines()[0]}; "
                f"see `nodeforge cluster status --name {self.lc.name}`."
            )
        return f"{nodes} restored on the old image {old.path}" if replaced else f"{nodes} resumed."

    def _summary(
        self, results: list[StepResult], t0: float, computes: int, old: Image, new: Image
    ) -> dict:
        total = round(self.clock.now() - t0, 2)
        ideal = computes * total
        # A compute is out from its step's drain to the step's end. The controller's step
        # takes no compute out (running jobs go on), though no job starts while it is away:
        # its own seconds are in its step.
        lost = sum(len(r.step.nodes) * r.seconds for r in results if r.step.kind != CONTROLLER)
        return {
            "image": str(new.path),
            "from": str(old.path),
            "seconds": total,
            "steps": [
                {
                    "step": r.step.number,
                    "kind": r.step.kind,
                    "nodes": list(r.step.nodes),
                    "seconds": r.seconds,
                    "requeued": r.requeued,
                }
                for r in results
            ],
            # Capacity: computes schedulable over the rollout, against all of them all along.
            "capacity_node_seconds": round(ideal - lost, 2),
            "ideal_node_seconds": round(ideal, 2),
        }
