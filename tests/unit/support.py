"""Helpers and fixture values the unit tests share (imported as tests.unit.support; the pytest
fixtures are in conftest.py beside it). Test modules import these, never each other."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from nodeforge.bootstrap.agent import Agent
from nodeforge.bootstrap.hooks import HookEnv, Runner
from nodeforge.bootstrap.host import Host
from nodeforge.bootstrap.params import Params, parse_params
from nodeforge.bootstrap.params_sources import SourceConfig
from nodeforge.bootstrap.paths import Paths
from nodeforge.errors import CommandError, MissingToolError

REPO = Path(__file__).resolve().parents[2]
ROLES_DIR = REPO / "roles"
FIXTURES = REPO / "tests/fixtures"
# Fixture (tests/fixtures/slurm/README.md): 24.11's `scontrol show node --json` document.
SCONTROL_JSON_24_11 = FIXTURES / "slurm/scontrol-show-node-24.11.json"

# Fixture: a munge key as params carry it (base64 of 64 bytes, over munge's 32-byte minimum).
MUNGE_KEY = base64.b64encode(b"k" * 64).decode()

# Fixture: the smallest params of a compute node for the hook tests (no hook retries, so a
# failing hook fails at once).
HOOK_PARAMS: dict[str, object] = {
    "role": "compute",
    "cluster_name": "demo",
    "controller": "ctl",
    "munge_key": MUNGE_KEY,
    "hook_retries": 0,
}


def hook_params(**kw: object) -> Params:
    """HOOK_PARAMS with *kw* over them, parsed as the agent parses a params document."""
    return parse_params({**HOOK_PARAMS, **kw}, "test")


def script(path: Path, body: str, mode: int = 0o755) -> Path:
    """Fixture: a /bin/sh hook script at *path* with *body*, mode *mode* (0755: runnable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(mode)
    return path


def runner(paths: Paths, sleeps: list[float] | None = None, **kw: Any) -> Runner:
    """The hook runner of a compute node c1 of cluster demo: no real sleeps (they are appended
    to *sleeps* when given), a 0.5 s kill grace."""
    env = HookEnv("compute", "demo", "c1", "ctl", paths.params_json)
    return Runner(
        paths,
        env,
        sleep=(sleeps.append if sleeps is not None else (lambda s: None)),
        grace=0.5,
        **kw,
    )


def run_cli(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`python -m nodeforge ARGS` in a child process, as a user runs it (output captured,
    the exit status left to the caller to assert)."""
    return subprocess.run(
        [sys.executable, "-m", "nodeforge", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env if env is not None else dict(os.environ),
        timeout=timeout,
        check=False,
    )


def _trusted(v: Any) -> Any:
    """Role defaults are templates themselves (paths built from others): trusted as such."""
    from ansible.template import trust_as_template

    if isinstance(v, str):
        return trust_as_template(v)
    if isinstance(v, list):
        return [_trusted(x) for x in v]
    if isinstance(v, dict):
        return {k: _trusted(x) for k, x in v.items()}
    return v


def ansible_render(role: str, template: str, extra: dict | None = None) -> str:
    """Render a bake-time template the way Ansible does, with the role's defaults."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    defaults = yaml.safe_load((ROLES_DIR / role / "defaults/main.yml").read_text())
    variables = _trusted(defaults or {})
    variables.update(extra or {})
    variables.setdefault("ansible_managed", "Ansible managed")
    templar = Templar(loader=DataLoader(), variables=variables)
    source = (ROLES_DIR / role / "templates" / template).read_text()
    return templar.template(trust_as_template(source))


def fake_vm_runner(argv, **kw):
    """proc.run for the VM harness without qemu-img / ssh-keygen (fake overlay and key)."""
    if Path(argv[0]).name == "qemu-img":
        Path(argv[-1]).write_bytes(b"overlay")
        return None
    if argv[0] == "ssh-keygen":
        k = Path(argv[argv.index("-f") + 1])
        k.write_text("priv")
        k.with_suffix(".pub").write_text("ssh-ed25519 AAAA fake\n")
        return None
    from nodeforge import proc

    return proc.run(argv, **kw)


# -- the one stand-in for proc.run behind bootstrap.host.Host -----------------------------------
class FakeHost:
    """Fixture: `proc.run` for `Host(run=...)`. Records every command (as strings) and its
    input, answers from `answer` (the models below override it), fails the commands that
    `fail_on` names, and raises CommandError on a failure when *check* is set, as proc.run
    does. The base answers every command with exit 0 and no output."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.inputs: list[str] = []
        self.fail_on: dict[str, int] = {}  # argv prefix (joined) -> exit code

    def run(
        self,
        argv: Sequence[Any],
        check: bool = True,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
        input: str | None = None,
        **kw: Any,
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(a) for a in argv]
        self.calls.append(argv)
        if input is not None:
            self.inputs.append(input)
        rc, out = self.answer(argv, timeout, env or {})
        for prefix, code in self.fail_on.items():
            if " ".join(argv).startswith(prefix):
                rc, out = code, f"forced failure of {prefix}"
        if check and rc != 0:
            raise CommandError(argv, rc, out)
        return subprocess.CompletedProcess(argv, rc, out, "")

    def answer(self, a: list[str], timeout: float | None, env: dict[str, str]) -> tuple[int, str]:
        return 0, ""


def systemctl_is_active(active: set[str], a: list[str]) -> tuple[int, str]:
    """`systemctl is-active UNIT...` as systemd answers: one state per unit unless --quiet;
    exit 0 if any is active, else 3."""
    units = [u for u in a[2:] if not u.startswith("-")]
    states = ["active" if u in active else "inactive" for u in units]
    out = "" if "--quiet" in a else "".join(f"{st}\n" for st in states)
    return (0 if "active" in states else 3), out


def scontrol_json_doc() -> dict[str, Any]:
    """Fixture: the 24.11 `scontrol show node --json` document, parsed afresh."""
    return json.loads(SCONTROL_JSON_24_11.read_text())


def gpu_fixture(name: str) -> str:
    """Fixture: a file of tests/fixtures/gpu (nvidia-smi and kernel-log outputs, see its README)."""
    return (FIXTURES / "gpu" / name).read_text()


class FakeGpuNode(FakeHost):
    """Fixture: a GPU node for `nodeforge node health`: systemd units, nvidia-smi, the kernel
    log and slurmctld's node, which scontrol shows as 24.11's JSON (*json*: the fixture
    document's c001 with this node's name, state and reason) or as 22.05's `-o` line (a
    fixture line of that layout). Any other command fails the test."""

    def __init__(
        self,
        smi: str | None = "nvidia-smi-healthy-8gpu.csv",
        smi_rc: int = 0,
        kmsg: str = "",
        state: str = "IDLE",
        reason: str = "",
        json: bool = True,
    ):
        super().__init__()
        self.active = {"slurmd.service", "munge.service"}
        self.smi, self.smi_rc, self.kmsg = smi, smi_rc, kmsg
        self.state, self.reason, self.json = state, reason, json
        self.hang: threading.Event | None = None

    def answer(self, a: list[str], timeout: float | None, env: dict[str, str]) -> tuple[int, str]:
        cmd = a[0]
        if cmd == "systemctl" and a[1] == "is-active":
            return systemctl_is_active(self.active, a)
        if cmd == "systemctl":
            return (0 if a[-1] in self.active else 3), ""
        if cmd == "nvidia-smi":
            if self.hang is not None:
                self.hang.wait(5)
            if self.smi is None:
                raise MissingToolError("nvidia-smi", "nvidia-smi")
            if self.smi == "TIMEOUT":
                raise CommandError(a, -1, "", hint=f"timed out after {timeout}s")
            return self.smi_rc, gpu_fixture(self.smi)
        if cmd == "journalctl":
            return (0 if self.kmsg else 1), self.kmsg
        if cmd == "scontrol":
            return self._scontrol(a)
        raise AssertionError(f"unexpected command {a}")

    def _scontrol(self, a: list[str]) -> tuple[int, str]:
        if a[1:5] == ["--future", "show", "node", "--json"]:
            assert self.json and len(a) == 6, a
            return 0, self.node_json(a[5])
        if a[1:5] == ["--future", "-o", "show", "node"]:
            assert not self.json and len(a) == 6, a
            reason = f" Reason={self.reason}" if self.reason else ""
            line = (
                f"NodeName={a[5]} Arch=x86_64 State={self.state} Gres=gpu:8 Comment=(null){reason}"
            )
            return 0, line + "\n"
        if a[1] == "update":
            kv = dict(w.split("=", 1) for w in a[2:])
            if kv["State"] == "DRAIN":
                self.state, self.reason = "IDLE+DRAIN", kv["Reason"]
            else:
                self.state, self.reason = "IDLE", ""
            return 0, ""
        raise AssertionError(f"unexpected command {a}")

    def node_json(self, name: str) -> str:
        doc = scontrol_json_doc()
        node = {**doc["nodes"][0], "name": name, "state": self.state.split("+")}
        node["reason"] = self.reason
        return json.dumps({**doc, "nodes": [node]}, indent=2)


# -- the agent against a fake machine (no root, no systemd, no Slurm) ----------------------------
# Fixture: the agent tests' munge key (1 KiB, as `create-munge-key` makes it).
AGENT_MUNGE_KEY = base64.b64encode(b"m" * 1024).decode()

SLURM_CONF_J2 = """ClusterName={{ cluster_name }}
SlurmctldHost={{ controller_host }}({{ controller_addr }})
MaxNodeCount={{ max_node_count }}
{% if slurm_version.startswith('22.05') %}TreeWidth=65533
{% endif %}PrologFlags={{ prolog_flags | join(',') }}
{% if gres_types %}GresTypes={{ gres_types | join(',') }}
{% endif %}{% if accounting %}AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={{ dbd_host }}
{% endif %}{% for p in partitions %}PartitionName={{ p.name }} Nodes=ALL Default={{ 'YES' if p.default else 'NO' }} MaxTime={{ p.max_time }}
{% endfor %}"""
SLURMDBD_CONF_J2 = """DbdHost={{ dbd_host }}
StorageHost={{ storage_host }}
StorageUser={{ storage_user }}
StoragePass={{ storage_pass }}
StorageLoc={{ storage_loc }}
"""


class FakeMachine(FakeHost):
    """Fixture: the agent's machine for tests/unit/bootstrap/test_bootstrap.py and the agent tests beside
    it. Models just enough of systemd, MariaDB, slurmdbd/sacctmgr and slurmctld/scontrol to
    check ORDER, idempotence, resume after a reboot and the readiness gate."""

    def __init__(self, root: Path, hostname: str = "node1"):
        super().__init__()
        self.root = root
        self.hostname = hostname
        self.active: set[str] = set()
        self.clusters: set[str] = set()
        self.nodes: dict[str, dict[str, str]] = {}
        self.ctl_up = True  # for compute/login tests (the controller is elsewhere)
        self.dbd_polls_before_answer = 2
        self.events: list[str] = []
        # Slurm 24.11.5 (measured): RESUME sets NOT_RESPONDING until slurmctld's next ping of
        # the node answers; modelled as "answered after this many looks at the node".
        self.ping_after_shows = 2
        self.force_reload = False  # NeedDaemonReload=yes whatever the unit's state
        self.slurmd_c_started = threading.Event()
        self.ping_waits_for_slurmd_c = False  # set for computes (the only role that runs it)
        self.ping_saw_slurmd_c: list[bool] = []
        self.delete_refusals = 0  # `scontrol delete` answers "Node has active jobs" this often

    # -- what the agent calls --
    def answer(self, a: list[str], timeout: float | None, env: dict[str, str]) -> tuple[int, str]:
        j = " ".join(a)
        if a[0] == "systemctl":
            if a[1:4] == ["show", "-p", "NeedDaemonReload"]:
                # systemd: an inactive, unreferenced unit is loaded fresh from disk
                return 0, ("yes" if self.force_reload or a[-1] in self.active else "no") + "\n"
            if a[1] in ("start", "restart"):
                self.active.add(a[2])
                self.events.append(f"start {a[2]}")
                if a[2] == "slurmd.service":
                    self._register()
                return 0, ""
            if a[1] == "enable":
                self.active.add(a[-1])
                self.events.append(f"enable {a[-1]}")
                return 0, ""
            if a[1] == "is-active":
                return systemctl_is_active(self.active, a)
            return 0, ""
        if a[0] == "ssh-keygen":
            d = self.root / "etc/ssh"
            d.mkdir(parents=True, exist_ok=True)
            (d / "ssh_host_ed25519_key").write_text("k")
            return 0, ""
        if a[0] == "systemd-machine-id-setup":
            (self.root / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
            return 0, ""
        if a == ["hostname", "-I"]:
            return 0, "10.9.0.7 fd00::5\n"
        if a[0] == "munge":
            return (0 if "munge.service" in self.active else 1), "cred"
        if a[0] == "mariadb-admin":
            return (0 if "mariadb.service" in self.active else 1), "mysqld is alive"
        if a[0] == "mariadb":
            if "mariadb.service" not in self.active:
                return 1, "cannot connect"
            self.events.append("db+password")
            return 0, ""
        if a[0] == "sacctmgr":
            if "slurmdbd.service" not in self.active:
                return 1, "sacctmgr: error: slurmdbd: Connection refused"
            if a[1:4] == ["-n", "show", "cluster"]:
                if self.dbd_polls_before_answer > 0:
                    self.dbd_polls_before_answer -= 1
                    return 1, "Connection refused"
                self.events.append("slurmdbd answering")
                return 0, ""
            if "format=cluster" in j:
                return 0, "".join(c + "\n" for c in sorted(self.clusters))
            if a[1:4] == ["-i", "add", "cluster"]:
                self.clusters.add(a[4])
                self.events.append(f"cluster {a[4]} registered")
                return 0, ""
        if a[0] == "slurmd" and a[1] == "-C":
            self.slurmd_c_started.set()
            return (
                0,
                "NodeName=x CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=7900\nUpTime=0-00:01:00\n",
            )
        if a[0] == "scontrol":
            return self._scontrol(a[1:])
        return 0, ""

    def _scontrol(self, a):
        up = self.ctl_up or "slurmctld.service" in self.active
        if not up:
            return 1, "Slurmctld(primary) at ctl is DOWN"
        if a == ["ping"]:
            # The agent runs `slurmd -C` while it asks: proven by waiting here for it to start
            # (a serial agent would call slurmd -C only after this returns).
            if self.ping_waits_for_slurmd_c:
                self.ping_saw_slurmd_c.append(self.slurmd_c_started.wait(5))
            return 0, "Slurmctld(primary) at ctl is UP"
        as_json = a[:5] == ["--future", "show", "node", "--json", a[-1]]  # Slurm >= 23.02
        if a[:4] == ["--future", "-o", "show", "node"] or as_json:
            n = self.nodes.get(a[-1])
            if n is None:
                return 1, f"Node {a[-1]} not found"
            if "_pings" in n:
                if n["_pings"] <= 0:
                    n["State"] = n["State"].replace("+NOT_RESPONDING", "")
                    del n["_pings"]
                    self.events.append(f"ping answered {a[4]}")
                else:
                    n["_pings"] -= 1
            if as_json:  # fixture: the keys slurm_records reads, shaped as 24.11 prints them
                node = {
                    "name": a[-1],
                    "state": n["State"].split("+"),
                    "reason": n.get("Reason", ""),
                }
                return 0, json.dumps({"nodes": [node], "meta": {}, "errors": []}, indent=2)
            words = " ".join(f"{k}={v}" for k, v in n.items() if k != "Reason" and k[0] != "_")
            # 24.11 omits Reason= when there is none (registration clears it)
            reason = f" Reason={n['Reason']} [root@now]" if n.get("Reason") else ""
            return 0, f"NodeName={a[4]} {words}{reason}\n"
        if a[0] == "create":
            kv = dict(w.split("=", 1) for w in a[1:])
            name = kv.pop("NodeName")
            if name in self.nodes:
                # Slurm 24.11.5 (measured): a failed create of an existing node deletes it.
                del self.nodes[name]
                self.events.append(f"create of existing {name} DELETED it")
                return 1, "Node already exists in the node table"
            self.nodes[name] = {**kv, "State": "FUTURE"}
            self.events.append(f"create {name} FUTURE")
            return 0, ""
        if a[0] == "update":
            kv = dict(w.split("=", 1) for w in a[1:])
            if kv["NodeName"] not in self.nodes:
                return 1, "Invalid node name specified"
            n = self.nodes[kv["NodeName"]]
            if kv["State"] == "DRAIN":
                base = n["State"].split("+")[0]
                n["State"] = f"{base}+DRAIN"
                n["Reason"] = kv["Reason"]
                self.events.append(f"drain {kv['NodeName']}: {kv['Reason']}")
            elif kv["State"] == "DOWN":
                n["State"], n["Reason"] = "DOWN", kv["Reason"]
                self.events.append(f"down {kv['NodeName']}: {kv['Reason']}")
            elif kv["State"] == "RESUME":
                n["State"] = n["State"].split("+")[0] + "+NOT_RESPONDING"
                n["_pings"] = self.ping_after_shows
                n.pop("Reason", None)
                self.events.append(f"resume {kv['NodeName']}")
            return 0, ""
        if a[0] == "delete":
            name = a[1].split("=", 1)[1]
            if self.delete_refusals > 0:  # jobs still completing on the old machine
                self.delete_refusals -= 1
                return 1, "Node has active jobs"
            self.nodes.pop(name, None)
            self.events.append(f"delete {name}")
            return 0, ""
        return 0, ""

    def _register(self):
        # slurmd -Z registers: a FUTURE node becomes IDLE, keeps DRAIN, loses its Reason text
        # (what Slurm 22.05.8 does; see docs/agent.md).
        for name, n in self.nodes.items():
            flags = n["State"].split("+")[1:]
            n["State"] = "+".join(["IDLE", *flags])
            n.pop("Reason", None)
            self.events.append(f"slurmd registered {name}")

    def sethostname(self, name):
        self.hostname = name

    def reboot(self):
        self.active.clear()
        self.events.append("reboot")


REPO_SLURM_TEMPLATES = ROLES_DIR / "slurm/templates"


def make(tmp_path, node_yaml: dict, hostname="node1", slurm_version="22.05.8", sackd=False):
    """Fixture: an Agent on a FakeMachine, its node.yaml written under *tmp_path*; returns
    (agent, machine, paths, chowns)."""
    paths = Paths.under(tmp_path)
    fm = FakeMachine(tmp_path, hostname)
    fm.ping_waits_for_slurmd_c = node_yaml.get("role") == "compute"
    paths.node_yaml.parent.mkdir(parents=True, exist_ok=True)
    paths.node_yaml.write_text(json.dumps(node_yaml))
    paths.node_yaml.chmod(0o600)  # it carries the munge key: the agent refuses a readable one
    paths.slurm_features.write_text(
        json.dumps({"slurm_version": slurm_version, "sackd": sackd, "force_requeue_on_fail": False})
    )
    paths.templates.mkdir(parents=True)
    (paths.templates / "slurm.conf.j2").write_text(SLURM_CONF_J2)
    (paths.templates / "slurmdbd.conf.j2").write_text(SLURMDBD_CONF_J2)
    for t in ("gres.conf.j2", "cgroup-boot.conf.j2"):  # the real ones (roles/slurm, raw)
        (paths.templates / t).write_text((REPO_SLURM_TEMPLATES / t).read_text())
    paths.machine_id.write_text("")  # sealed: empty
    chowns: list = []
    host = Host(
        run=fm.run,
        chown=lambda p, u, g: chowns.append((str(p), u, g)),
        sleep=lambda s: None,
        source_address=lambda target: "10.9.0.5",
        sethostname=fm.sethostname,
    )
    agent = Agent(
        paths=paths,
        host=host,
        sources=SourceConfig(paths, imds_url=None),
        hostname=lambda: fm.hostname,
        hook_sleep=lambda s: None,
        hook_grace=0.5,
    )
    return agent, fm, paths, chowns


CTL = {
    "role": "controller",
    "cluster_name": "demo",
    "node_name": "ctl",
    "node_address": "10.9.0.2",
    "munge_key": AGENT_MUNGE_KEY,
    "max_node_count": 64,
}
COMPUTE = {
    "role": "compute",
    "cluster_name": "demo",
    "controller": {"host": "ctl", "address": "10.9.0.2"},
    "node_name": "c1",
    "munge_key": AGENT_MUNGE_KEY,
    "features": ["gpu", "nvme"],
    "gres": ["gpu:1"],
}
