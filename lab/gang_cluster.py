"""The gang e2e's Slurm backend on the image's own Slurm (24.11): a local nspawn cluster.

Same interface as lab/slurm_netns.py's `Lab` (the host's Slurm 22.05), so the gang cases in
test_gang_slurm.py run unchanged against both. A cluster from the built image
(lab/localcluster.py): controller `ctl` and computes named `gn1..gnN` (the names the cases
pin jobs to), `accounting: false` (the cases need no slurmdbd; it only slows the start).

TEST FIXTURE changes to the image's rendered slurm.conf, made on the controller before any
compute joins (configless: the computes fetch it), and nothing else:
- Prolog/Epilog: the lab's scripts (slurm_netns.PROLOG/EPILOG), steered per node by files under
  LAB_DIR written from the host into each node's overlay (`hang`/`fail`, epilog sleep),
- SchedulerParameters=sched_interval=1 and bf_interval=1: a job whose backoff ended starts
  within a second, as in the 22.05 lab (the product's default waits up to 60 s),
- BatchStartTimeout=20 (the 22.05 lab's value).
The image's own governor (nodeforge-gang.service on the controller) is disabled and stopped:
the cases run their own, in-process, with their own settings; two governors would both act.

Every Slurm client runs inside the controller (`nsenter` into all its namespaces): the host's
22.05 clients cannot talk to a 24.11 slurmctld. Cleanup (`close`) is `cluster down`, which
removes every process, mount and namespace the cluster made.
"""

from __future__ import annotations

import atexit
import json
from pathlib import Path, PurePosixPath

from nodeforge import proc
from nodeforge.lab.localcluster import Cluster, LocalCluster, node_prefix
from nodeforge.lab.slurm_netns import EPILOG, PROLOG, LabError, SlurmClients
from nodeforge.slurm_facts import controller_up

LAB_DIR = PurePosixPath("/var/tmp/nfg-e2e")  # inside every node
SLURM_CONF = "/etc/slurm/slurm.conf"
CONF_FIXTURE = """
# ---- nodeforge gang e2e TEST FIXTURE (lab/gang_cluster.py), not the product's config ----
Prolog={lab}/prolog.sh
Epilog={lab}/epilog.sh
SchedulerParameters=sched_interval=1,bf_interval=1
BatchStartTimeout=20
"""
# Slurm's base job states and the flags scontrol shows instead of the base state (its order)
_BASE = {"PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT"}
_BASE |= {"NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
_SHOWN = ("COMPLETING", "CONFIGURING", "RESIZING", "REQUEUED", "STAGE_OUT", "SIGNALING")


class ClusterLab(SlurmClients):
    """A local cluster from *image* with computes gn1..gn*nodes*; see the module doc."""

    @property
    def cloud_names(self) -> list[str]:
        return []  # no power-saving nodes here (the cases needing them stay on 22.05)

    def __init__(self, image: Path, nodes: int = 4, name: str = "nfg2411", extra_conf: str = ""):
        self.image = Path(image)
        self.nodes = nodes
        self.extra_conf = extra_conf  # more FIXTURE slurm.conf lines (a bench's queue limits)
        self.lc = LocalCluster(name, progress=lambda msg: None)
        self.base = Path(LAB_DIR)  # the path jobs see (cases put --chdir/--output under it)
        self.env: dict[str, str] | None = None  # clients read the controller's own slurm.conf
        self._prefix: list[str] = []
        self._closed = False
        atexit.register(self.close)

    # ---- names --------------------------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        return [f"gn{i}" for i in range(1, self.nodes + 1)]

    # what a batch script runs to call nodeforge on a compute: the image's own install
    nodeforge_cmd = "nodeforge"

    def prefix(self) -> list[str]:
        """Command prefix that runs a client inside the controller."""
        return self._prefix

    def _cluster(self) -> Cluster:
        return Cluster.load(self.lc.name)

    def _host_path(self, node: str, path: PurePosixPath | str) -> Path:
        """*path* inside *node*, as the host sees it (the node's overlay)."""
        return self._cluster().node(node).merged / str(path).lstrip("/")

    # ---- setup --------------------------------------------------------------------------
    def start(self, timeout: float = 400) -> ClusterLab:
        self.lc.down()  # a cluster left by an interrupted run of this module
        params = {"accounting": False}
        self.lc.up(self.image, 0, params=params, timeout=timeout)
        ctl = self._cluster().controller
        self._prefix = node_prefix(ctl)
        # The image's governor would act on the cases' jobs too (see the module doc).
        # (disabled and stopped: nothing starts it again; the agent enables it at first boot only)
        self.run("systemctl", "disable", "--now", "nodeforge-gang.service", timeout=60)
        self._write_lab_files(self._host_path("ctl", LAB_DIR))
        conf = self._host_path("ctl", SLURM_CONF)
        conf.write_text(conf.read_text() + CONF_FIXTURE.format(lab=LAB_DIR) + self.extra_conf)
        self.run("systemctl", "restart", "slurmctld.service", timeout=90)
        self.wait(
            lambda: controller_up(lambda argv: self.run(*argv, check=False, timeout=10)),
            60,
            "slurmctld answering after the fixture config",
        )
        for n in self.node_names:
            self.lc.start_node(
                n,
                params=params,
                prepare=lambda node: self._write_lab_files(node.merged / str(LAB_DIR).lstrip("/")),
            )
        self.lc.wait_ready(self._cluster(), self.node_names, timeout)
        self.wait_nodes_idle(self.node_names, timeout=60)
        return self

    @staticmethod
    def _write_lab_files(root: Path) -> None:
        """LAB_DIR in one node (*root*: its host path): the scripts and their control dirs."""
        for d in ("prolog", "epilog", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        (root / "log").chmod(0o1777)  # jobs of the unprivileged user write their output here
        for f, body in (("prolog.sh", PROLOG), ("epilog.sh", EPILOG)):
            (root / f).write_text(body.format(lab=LAB_DIR))
            (root / f).chmod(0o755)

    def open_to_users(self) -> None:
        """Nothing to open: the image's munge socket and slurm.conf serve every user."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.lc.down()

    # ---- clients ------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 15, input: str | None = None):
        if not self._prefix:
            raise LabError("the cluster is not started")
        return proc.run([*self._prefix, *argv], check=check, timeout=timeout, input=input)

    def as_user(self, *argv: str, uid: int = 65534, timeout: float = 15):
        """Run a Slurm client as *uid* (default nobody) on the controller."""
        return self.run(
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            *argv,
            check=False,
            timeout=timeout,
        )

    def sbatch(self, *args: str, script: str = "#!/bin/sh\nsleep 30\n") -> int:
        out = self.run(
            "sbatch",
            "--parsable",
            f"--chdir={LAB_DIR}",
            f"--output={LAB_DIR}/log/job-%j.out",
            *args,
            input=script,  # sbatch reads the script from stdin: nothing to copy in
        ).stdout
        return int(out.strip().split(";")[0])

    def job_json(self, job_id: int | str) -> dict:
        """The job from `squeue --json` with job_state as scontrol shows it (24.11 lists the
        base state and its flags; the cases compare the shown state, as on 22.05)."""
        doc = json.loads(self.run("squeue", "--json", "--states=all").stdout)
        rec = next((j for j in doc["jobs"] if str(j["job_id"]) == str(job_id)), {})
        st = rec.get("job_state")
        if isinstance(st, list):
            shown = next((f for f in _SHOWN if f in st), None)
            rec = {
                **rec,
                "job_state": shown or next((s for s in st if s in _BASE), ""),
                "job_state_flags": st,
            }
        return rec

    # ---- per-node behaviour -------------------------------------------------------------
    def set_prolog(self, node: str, mode: str | None) -> None:
        p = self._host_path(node, LAB_DIR / "prolog" / node)
        if mode is None:
            p.unlink(missing_ok=True)
        else:
            p.write_text(mode)

    def set_epilog_sleep(self, node: str, seconds: int | None) -> None:
        p = self._host_path(node, LAB_DIR / "epilog" / node)
        if seconds is None:
            p.unlink(missing_ok=True)
        else:
            p.write_text(str(seconds))

    def release_prologs(self) -> None:
        for n in self.node_names:
            self._host_path(n, LAB_DIR / "prolog" / "release").touch()

    def rearm_prologs(self) -> None:
        for n in self.node_names:
            self._host_path(n, LAB_DIR / "prolog" / "release").unlink(missing_ok=True)

    def make_dir(self, name: str) -> str:
        """A directory LAB_DIR/*name* on every node, writable by all (a job's --chdir)."""
        for n in ["ctl", *self.node_names]:
            d = self._host_path(n, LAB_DIR / name)
            d.mkdir(exist_ok=True)
            d.chmod(0o777)
        return str(LAB_DIR / name)

    # ---- between cases ------------------------------------------------------------------
    def reset(self) -> None:
        """No job left, no prolog/epilog behaviour, every node IDLE and undrained."""
        self.release_prologs()
        ids = self.run("squeue", "-h", "-t", "all", "-o", "%i", check=False).stdout.split()
        if ids:
            self.run("scancel", *ids, check=False)
        for n in self.node_names:
            self.set_prolog(n, None)
            self.set_epilog_sleep(n, None)

        def no_live_job() -> bool:
            out = self.run("squeue", "-h", "-o", "%T", check=False).stdout.split()
            return all(s in ("COMPLETED", "CANCELLED", "FAILED") for s in out)

        self.wait(no_live_job, 60, "all jobs gone")
        for n, st in self.node_states().items():
            if n in self.node_names and ("DRAIN" in st or "DOWN" in st):
                self.run("scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)
        self.wait_nodes_idle(self.node_names, timeout=60)
        self.rearm_prologs()
