"""A real Slurm 22.05+ cluster on one host, for the gang governor's e2e tests and bench.

Everything lives in things this module creates and removes again:
- one network namespace `nfg-gang-<id>` (its own loopback; nothing outside it is contacted),
- a temp dir with slurm.conf, state/spool/log dirs, a munge key, socket and daemon,
- slurmctld on port 7817 and one slurmd per node on ports 7818+ (all on 10.231.0.1 *inside*
  the namespace, so they cannot collide with any other Slurm on the machine).

Debian's slurmd is built without --enable-multiple-slurmd, but `slurmd -N NAME` with a
distinct `Port=` per node and `%n` in the spool/pid/log paths works on 22.05.8 (verified).

Nodes `gn1..gnN` are ordinary; `gc1..gcM` are CLOUD (power-saving) nodes whose
ResumeProgram starts their slurmd unless `<lab>/never/<node>` exists: that is the "node that
never comes up" (the job's node stays POWERING_UP).

The Prolog reads `<lab>/prolog/<node>`: `hang` sleeps (up to 300 s), `fail` exits 1.

Cleanup (`Lab.close`) kills every process inside the namespace (all were started by us),
deletes the namespace and the temp dir. It runs from fixture finalizers and atexit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from nodeforge import data, proc
from nodeforge.errors import NodeforgeError
from nodeforge.images import build_proc
from nodeforge.slurm_facts import controller_up

REQUIRED_TOOLS = (
    "slurmctld",
    "slurmd",
    "scontrol",
    "squeue",
    "sbatch",
    "sinfo",
    "munged",
    "ip",
    "nsenter",
    "setpriv",
)
CTLD_PORT = 7817
SLURMD_PORT0 = 7818


class LabError(NodeforgeError):
    pass


def check_tools() -> None:
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        raise LabError(
            "missing tools for the Slurm lab: "
            + ", ".join(missing)
            + " (apt-get install slurmctld slurmd slurm-client munge iproute2)"
        )


PROLOG = """#!/bin/sh
# nodeforge gang e2e prolog: behaviour per node from {lab}/prolog/$SLURMD_NODENAME
m="$(cat {lab}/prolog/$SLURMD_NODENAME 2>/dev/null)"
echo "$(date +%s) job=$SLURM_JOB_ID node=$SLURMD_NODENAME mode=$m" >> {lab}/log/prolog.log
case "$m" in
  hang) i=0; while [ $i -lt 300 ] && [ ! -e {lab}/prolog/release ]; do sleep 1; i=$((i+1)); done ;;
  fail) exit 1 ;;
esac
exit 0
"""

EPILOG = """#!/bin/sh
# nodeforge gang e2e epilog: sleeps the seconds in {lab}/epilog/$SLURMD_NODENAME (a slow
# epilog keeps a requeued job COMPLETING that long)
s="$(cat {lab}/epilog/$SLURMD_NODENAME 2>/dev/null)"
echo "$(date +%s) job=$SLURM_JOB_ID node=$SLURMD_NODENAME epilog=$s" >> {lab}/log/epilog.log
[ -n "$s" ] && sleep "$s"
exit 0
"""

RESUME = """#!/bin/sh
# ResumeProgram: start slurmd for each node unless {lab}/never/<node> exists.
for n in $(SLURM_CONF={conf} scontrol show hostnames "$1"); do
  echo "$(date +%s) resume $n" >> {lab}/log/resume.log
  [ -e {lab}/never/$n ] && continue
  slurmd -f {conf} -N $n
done
exit 0
"""

SUSPEND = """#!/bin/sh
echo "$(date +%s) suspend $1" >> {lab}/log/resume.log
exit 0
"""


def _term_raises() -> None:
    """Make SIGTERM unwind the stack (SystemExit) so fixture finalizers and atexit clean up."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):

        def _raise(signum, frame):
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _raise)


class SlurmClients:
    """What the gang cases read from any Slurm backend through its clients (`run`): this lab
    (22.05) and lab/gang_cluster.py (the image's 24.11)."""

    def run(self, *argv: str, check: bool = True, timeout: float = 15):
        raise NotImplementedError

    @staticmethod
    def wait(pred, timeout: float, what: str, interval: float = 0.2):
        deadline = time.monotonic() + timeout
        last_exc: Exception | None = None
        while time.monotonic() < deadline:
            try:
                v = pred()
                if v:
                    return v
            except NodeforgeError as exc:  # transient client errors while daemons start
                last_exc = exc
            time.sleep(interval)
        raise LabError(
            f"timed out after {timeout}s waiting for {what}" + (f": {last_exc}" if last_exc else "")
        )

    def node_states(self) -> dict[str, str]:
        out = self.run("scontrol", "show", "node", "-o").stdout
        res = {}
        for line in out.splitlines():
            f = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
            if "NodeName" in f:
                res[f["NodeName"]] = f.get("State", "")
        return res

    def wait_nodes_idle(self, nodes: list[str], timeout: float) -> None:
        def ok():
            st = self.node_states()
            return all(
                st.get(n, "").split("+")[0] == "IDLE"
                and "NOT_RESPONDING" not in st.get(n, "")
                and "DRAIN" not in st.get(n, "")
                for n in nodes
            )

        self.wait(ok, timeout, f"nodes {nodes} IDLE")

    def job(self, job_id: int | str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        f: dict[str, str] = {}
        # AdminComment/Comment may contain spaces only if we put them there; we don't.
        for tok in out.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                f.setdefault(k, v)
        return f


@dataclass
class Lab(SlurmClients):
    nodes: int = 4
    cloud_nodes: int = 1
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="nfg-gang-lab-")))
    netns: str = ""
    started: bool = False

    def __post_init__(self) -> None:
        if not self.netns:
            self.netns = f"nfg-gang-{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.addr = "10.231.0.1"  # exists only inside our namespace
        self.conf = self.base / "etc" / "slurm.conf"
        self.munge_socket = self.base / "munge" / "munge.socket"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._closed = False
        atexit.register(self.close)

    # ---- names --------------------------------------------------------------------------
    @property
    def node_names(self) -> list[str]:
        return [f"gn{i}" for i in range(1, self.nodes + 1)]

    @property
    def cloud_names(self) -> list[str]:
        return [f"gc{i}" for i in range(1, self.cloud_nodes + 1)]

    def prefix(self) -> list[str]:
        """Command prefix that runs a client inside the lab's namespace."""
        # nsenter (not `ip netns exec`): it enters only the network namespace, so /sys and
        # its cgroup mounts stay visible (slurmd refuses to start without them).
        return ["nsenter", f"--net=/run/netns/{self.netns}"]

    # ---- setup --------------------------------------------------------------------------
    def write_config(self) -> None:
        self._write_files()
        self.conf.write_text("\n".join(self._conf_lines()) + "\n")

    def _write_files(self) -> None:
        """The lab's folders, munge key and Prolog/Epilog/Resume/Suspend scripts."""
        b = self.base
        for d in ("etc", "munge", "state", "spool", "log", "prolog", "epilog", "never", "run"):
            (b / d).mkdir(parents=True, exist_ok=True)
        os.chmod(b / "munge", 0o700)
        for n in self.node_names + self.cloud_names:
            (b / "spool" / n).mkdir(exist_ok=True)
        key = b / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        (b / "prolog.sh").write_text(PROLOG.format(lab=b))
        (b / "epilog.sh").write_text(EPILOG.format(lab=b))
        (b / "resume.sh").write_text(RESUME.format(lab=b, conf=self.conf))
        (b / "suspend.sh").write_text(SUSPEND.format(lab=b))
        for s in ("prolog.sh", "epilog.sh", "resume.sh", "suspend.sh"):
            os.chmod(b / s, 0o755)

    def _conf_lines(self) -> list[str]:
        """slurm.conf: the lab's fixed settings, then its nodes and its one partition."""
        b = self.base
        lines = [
            "ClusterName=nfggang",
            f"SlurmctldHost={socket.gethostname()}({self.addr})",
            f"SlurmctldPort={CTLD_PORT}",
            f"SlurmdPort={SLURMD_PORT0}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"AuthInfo=socket={self.munge_socket}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"StateSaveLocation={b}/state",
            f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/run/slurmctld.pid",
            f"SlurmdPidFile={b}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={b}/log/slurmctld.log",
            f"SlurmdLogFile={b}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/linear",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=6",
            "SlurmctldTimeout=10",
            "MessageTimeout=3",
            "InactiveLimit=0",
            "KillWait=2",
            "MinJobAge=600",
            "JobRequeue=1",
            "TreeWidth=65533",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1,defer_batch",
            "SlurmctldParameters=idle_on_node_suspend,cloud_dns",
            "PrologFlags=Alloc",
            f"Prolog={b}/prolog.sh",
            f"Epilog={b}/epilog.sh",
            "BatchStartTimeout=20",
            f"ResumeProgram={b}/resume.sh",
            f"SuspendProgram={b}/suspend.sh",
            "SuspendTime=3600",
            "ResumeTimeout=120",
            "SuspendTimeout=10",
            "ResumeRate=0",
            "SuspendRate=0",
        ]
        for i, n in enumerate(self.node_names):
            lines.append(
                f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr={self.addr} Port={SLURMD_PORT0 + 1 + i}"
                " CPUs=1 RealMemory=100 State=UNKNOWN"
            )
        for i, n in enumerate(self.cloud_names):
            lines.append(
                f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr={self.addr}"
                f" Port={SLURMD_PORT0 + 50 + i} CPUs=1 RealMemory=100 State=CLOUD"
            )
        # Cloud nodes start powered down; a job needing one triggers ResumeProgram.
        if self.cloud_names:
            lines.append("SuspendExcNodes=" + ",".join(self.node_names))
        all_nodes = ",".join(self.node_names + self.cloud_names)
        lines.append(f"PartitionName=main Nodes={all_nodes} Default=YES MaxTime=INFINITE State=UP")
        return lines

    def run(self, *argv: str, check: bool = True, timeout: float = 15):
        return proc.run([*self.prefix(), *argv], env=self.env, check=check, timeout=timeout)

    def start(self) -> Lab:
        check_tools()
        _term_raises()
        self.write_config()
        proc.run(["ip", "netns", "add", self.netns], timeout=10)
        self.started = True
        self.run("ip", "link", "set", "lo", "up")
        # Slurm resolves addresses with AI_ADDRCONFIG, which ignores loopback: give the
        # namespace a veth interface with an address that exists only inside it.
        # (a veth pair with both ends inside: the host kernel may lack the dummy module).
        self.run("ip", "link", "add", "nfg0", "type", "veth", "peer", "name", "nfg1")
        self.run("ip", "addr", "add", f"{self.addr}/24", "dev", "nfg0")
        self.run("ip", "link", "set", "nfg0", "up")
        self.run("ip", "link", "set", "nfg1", "up")
        b = self.base
        self.run(
            "munged",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={b}/munge/munge.key",
            f"--pid-file={b}/munge/munged.pid",
            f"--log-file={b}/log/munged.log",
            f"--seed-file={b}/munge/seed",
        )
        self.start_ctld(clear=True)
        for n in self.node_names:
            self.start_slurmd(n)
        self.wait_nodes_idle(self.node_names, timeout=30)
        return self

    def start_ctld(self, clear: bool = False) -> None:
        args = ["slurmctld", "-f", str(self.conf)]
        if clear:
            args.append("-c")
        self.run(*args, timeout=30)
        self.wait(
            lambda: controller_up(lambda argv: self.run(*argv, check=False, timeout=5)),
            30,
            "slurmctld answering scontrol ping",
        )

    def stop_ctld(self) -> None:
        pid = self._pid(self.base / "run" / "slurmctld.pid")
        if pid:
            proc.stop_group(pid, 20, group=False)

    def start_slurmd(self, node: str) -> None:
        self.run("slurmd", "-f", str(self.conf), "-N", node, timeout=20)

    def kill_slurmd(self, node: str) -> None:
        pid = self._pid(self.base / "run" / f"slurmd-{node}.pid")
        if pid:
            build_proc.kill_now(pid)  # a crash on purpose: no SIGTERM it could handle
            self._wait_gone(pid, 10)

    def set_prolog(self, node: str, mode: str | None) -> None:
        p = self.base / "prolog" / node
        if mode is None:
            p.unlink(missing_ok=True)
        else:
            p.write_text(mode)

    def set_epilog_sleep(self, node: str, seconds: int | None) -> None:
        p = self.base / "epilog" / node
        if seconds is None:
            p.unlink(missing_ok=True)
        else:
            p.write_text(str(seconds))

    def open_to_users(self) -> None:
        """Let an unprivileged user (nobody) talk to munge and read the config: for tests of
        what a job's owner can undo. The munge key stays 0600 root."""
        os.chmod(self.base, 0o755)
        os.chmod(self.base / "munge", 0o755)
        os.chmod(self.base / "log", 0o1777)

    def as_user(self, *argv: str, uid: int = 65534, timeout: float = 15):
        """Run a Slurm client as *uid* (default nobody) inside the lab's namespace."""
        return proc.run(
            [
                *self.prefix(),
                "setpriv",
                f"--reuid={uid}",
                f"--regid={uid}",
                "--clear-groups",
                *argv,
            ],
            env=self.env,
            check=False,
            timeout=timeout,
        )

    def release_prologs(self) -> None:
        (self.base / "prolog" / "release").touch()

    def rearm_prologs(self) -> None:
        (self.base / "prolog" / "release").unlink(missing_ok=True)

    def make_dir(self, name: str) -> str:
        """A directory *name* in the lab, writable by all (a job's --chdir); its path."""
        d = self.base / name
        d.mkdir()
        d.chmod(0o777)
        return str(d)

    # what a batch script runs to call nodeforge on a node: this checkout
    @property
    def nodeforge_cmd(self) -> str:
        import sys

        repo = data.checkout()  # the editable install's checkout (tests/e2e ran from there)
        path = f"PYTHONPATH={repo} " if repo is not None else ""
        return f"{path}{sys.executable} -m nodeforge.cli"

    def slurmd_alive(self, node: str) -> bool:
        pid = self._pid(self.base / "run" / f"slurmd-{node}.pid")
        return proc.pid_alive(pid)

    def reset(self) -> None:
        """Between cases: cancel jobs, end hung prologs, revive killed slurmds, resume drained
        nodes, power cloud nodes back down (undrained, able to boot)."""
        self.release_prologs()
        self.run("scancel", "--partition=main", check=False)
        for n in self.node_names:
            self.set_prolog(n, None)
            self.set_epilog_sleep(n, None)
            if not self.slurmd_alive(n):
                self.start_slurmd(n)

        def no_live_job() -> bool:
            out = self.run("squeue", "-h", "-p", "main", "-o", "%T", check=False).stdout.split()
            return all(s in ("COMPLETED", "CANCELLED", "FAILED") for s in out)

        self.wait(no_live_job, 40, "all jobs gone")
        for n in self.node_names:
            st = self.node_states().get(n, "")
            if "DRAIN" in st or "DOWN" in st:
                self.run("scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)
        self.wait_nodes_idle(self.node_names, timeout=40)
        for n in self.cloud_names:
            self.reset_cloud(n)
        self.rearm_prologs()

    def set_never(self, node: str) -> None:
        (self.base / "never" / node).touch()

    def reset_cloud(self, node: str, timeout: float = 30) -> None:
        """Back to powered down, IDLE, not drained, able to boot: a test whose cloud node
        never came up (and was maybe drained) must not leave that to the next test."""
        (self.base / "never" / node).unlink(missing_ok=True)
        self.kill_slurmd(node)
        # RESUME clears a drain or DOWN (refused, harmlessly, when there is none); first,
        # because it would also cancel a power-down under way.
        self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        if not self.listed(node):
            return  # powered down already: Slurm hides powered-down CLOUD nodes
        self.run("scontrol", "update", f"NodeName={node}", "State=POWER_DOWN_FORCE", check=False)
        # POWERING_DOWN lasts SuspendTimeout (10 s); then the node is hidden again
        self.wait(lambda: not self.listed(node), timeout, f"{node} powered down")

    def listed(self, node: str) -> bool:
        """Does slurmctld show *node*? Not when it is a powered-down CLOUD node (22.05 hides
        those from `scontrol show node`, even with -a)."""
        out = self.run("scontrol", "show", "node", "-o", node, check=False).stdout
        return out.startswith("NodeName=")

    # ---- helpers ------------------------------------------------------------------------
    def job_json(self, job_id: int | str) -> dict:
        """The job as the governor reads it (22.05: squeue --json), {} if not listed."""
        import json

        doc = json.loads(self.run("squeue", "--json", "--states=all").stdout)
        return next((j for j in doc["jobs"] if str(j["job_id"]) == str(job_id)), {})

    def sbatch(self, *args: str, script: str = "#!/bin/sh\nsleep 30\n") -> int:
        path = self.base / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        out = self.run(
            "sbatch",
            "--parsable",
            f"--chdir={self.base}",
            f"--output={self.base}/log/job-%j.out",
            *args,
            str(path),
        ).stdout
        return int(out.strip().split(";")[0])

    @staticmethod
    def _pid(pidfile: Path) -> int | None:
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _wait_gone(pid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while proc.pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def ns_pids(self) -> list[int]:
        cp = proc.run(["ip", "netns", "pids", self.netns], check=False, timeout=10)
        return (
            [int(x) for x in cp.stdout.split() if x.strip().isdigit()] if cp.returncode == 0 else []
        )

    def close(self) -> None:
        """Kill everything in our namespace, remove it and the temp dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.started:
            (self.base / "prolog" / "release").touch()
            # SIGTERM to all, 3 s, then SIGKILL to what is left, 3 s (all at once, not one
            # stop_group per process: a dozen daemons would take a grace each)
            for last, wait_s in ((False, 3.0), (True, 3.0)):
                pids = self.ns_pids()
                if not pids:
                    break
                for p in pids:
                    if last:
                        build_proc.kill_now(p)
                        continue
                    try:
                        os.kill(p, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and self.ns_pids():
                    time.sleep(0.1)
            proc.run(["ip", "netns", "del", self.netns], check=False, timeout=10)
        shutil.rmtree(self.base, ignore_errors=True)


if __name__ == "__main__":  # manual poking: python lab/slurm_netns.py
    import sys

    lab = Lab().start()
    print("lab up:", lab.base, lab.netns, file=sys.stderr)
    print(lab.run("sinfo").stdout)
    try:
        input("enter to tear down ")
    finally:
        lab.close()
