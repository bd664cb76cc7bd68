"""A Slurm cluster on one machine, from a built image: systemd-nspawn nodes on a private bridge.

Every node boots the image's root filesystem through its own overlay (the image tree is the
shared lower layer, extracted once), in its own network namespace wired to a bridge that lives
in the cluster's fabric namespace. Params reach each node as /etc/nodeforge/node.yaml written
into its overlay before boot, exactly as an operator would provide them. Nodes outlive the
command that started them; `cluster down` removes every process, mount, namespace and file.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from nodeforge import fsutil, proc
from nodeforge.bootstrap import failures, readiness
from nodeforge.bootstrap.health import REASON_PREFIX as HEALTH_REASON_PREFIX
from nodeforge.bootstrap.paths import Paths
from nodeforge.bootstrap.readiness import NodeState
from nodeforge.bootstrap.slurm_setup import read_features
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic
from nodeforge.images import build_proc, rootfs_tar
from nodeforge.slurm_facts import controller_up, has, talks_to

from .netns import Fabric

log = logging.getLogger("nodeforge.cluster")

STATE_ROOT = Path("/var/lib/nodeforge/clusters")
IMAGE_CACHE = Path("/var/lib/nodeforge/images")
SUBNET = ipaddress.ip_network("10.213.0.0/24")  # exists only inside the fabric namespace
CONTROLLER_NAME = "ctl"
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STOP_TIMEOUT = 60.0
NODE_DATA_DIR = "/var/lib/enroot"  # bootstrap/health.py DATA_DIRS, on a node-private tmpfs
NODE_DATA_SIZE = "4G"  # an upper bound only: tmpfs takes memory as files are written
# The controller's state, on a per-cluster host directory bind-mounted into whichever machine is
# the controller, so that it outlives a replacement: StateSaveLocation (slurm.conf.j2) and
# MariaDB's data dir (the accounting database). The munge key is the cluster's munge.key,
# handed to every new machine in its params.
CONTROLLER_STATE = ("var/lib/slurm/slurmctld", "var/lib/mysql")
Progress = Callable[[str], None]


@dataclass
class Node:
    name: str
    role: str
    index: int
    address: str
    netns: str
    dir: str  # holds upper/, work/, merged/, console.log
    pid: int | None = None  # systemd-nspawn
    started: float = 0.0  # wall clock (epoch seconds)
    ready_at: float | None = None  # first seen schedulable (IDLE etc.) or controller answering

    @property
    def merged(self) -> Path:
        return Path(self.dir) / "merged"


@dataclass
class Cluster:
    name: str
    image: str
    lower: str
    fabric_ns: str
    created: float
    nodes: list[Node] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return STATE_ROOT / self.name

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise NodeforgeError(
            f"cluster {self.name} has no node '{name}' "
            f"(nodes: {', '.join(n.name for n in self.nodes)})"
        )

    @property
    def controller(self) -> Node:
        return self.node(CONTROLLER_NAME)

    def fabric(self) -> Fabric:
        return Fabric(self.fabric_ns, SUBNET)

    # -- persistence --------------------------------------------------------------------
    def save(self) -> None:
        # Root-only: the file sits beside the cluster's munge key.
        write_atomic(self.dir / "cluster.json", json.dumps(asdict(self), indent=2), 0o600)

    @classmethod
    def load(cls, name: str) -> Cluster:
        f = STATE_ROOT / name / "cluster.json"
        if not f.is_file():
            known = sorted(p.name for p in STATE_ROOT.iterdir()) if STATE_ROOT.is_dir() else []
            raise NodeforgeError(
                f"no local cluster named '{name}' (known: {', '.join(known) or 'none'}); "
                "start one with `nodeforge cluster up`"
            )
        data = json.loads(f.read_text())
        nodes = [Node(**n) for n in data.pop("nodes")]
        return cls(**data, nodes=nodes)


# -- helpers ----------------------------------------------------------------------------
def _require_root_and_tools() -> None:
    if os.geteuid() != 0:
        raise NodeforgeError(
            "local clusters need root (network namespaces, overlay mounts, "
            "systemd-nspawn); run with sudo"
        )
    for t in ("systemd-nspawn", "ip", "nsenter", "mount", "umount", "tar", "zstd"):
        proc.require_tool(t)


def _alive(pid: int | None) -> bool:
    # A zombie is not alive; nspawn is our child only while `cluster up` runs.
    return proc.pid_alive(pid)


def leader_pid(node: Node) -> int:
    """PID (on the host) of the node's init: the systemd that nspawn started."""
    if not _alive(node.pid):
        raise NodeforgeError(f"node {node.name} is not running (systemd-nspawn pid {node.pid})")
    for _ in range(50):
        for task in Path(f"/proc/{node.pid}/task").iterdir():
            kids = (task / "children").read_text().split()
            for k in kids:
                try:
                    comm = Path(f"/proc/{k}/comm").read_text().strip()
                except OSError:
                    continue
                if comm in ("systemd", "init"):
                    return int(k)
        time.sleep(0.1)
    raise NodeforgeError(
        f"cannot find the init process of node {node.name} (nspawn pid {node.pid})"
    )


def node_prefix(node: Node) -> list[str]:
    """argv prefix that runs a command inside *node*: all its namespaces and its root
    filesystem, with a clean environment (nothing of the caller's leaks in)."""
    return ["nsenter", "-t", str(leader_pid(node)), "-a", "--", "env", "-i", f"PATH={NODE_PATH}", "LANG=C.UTF-8"]  # fmt: skip


def node_exec(
    node: Node,
    argv: list[str],
    *,
    check: bool = True,
    timeout: float = 60,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """Run a command inside a node (all its namespaces, its root filesystem)."""
    return proc.run(
        [*node_prefix(node), *argv],
        check=check,
        timeout=timeout,
        input=input,
    )


def ensure_lower(image_dir: Path) -> Path:
    """Extract the image's root filesystem once per image (keyed by the archive's sha256)."""
    manifest = image_dir / "manifest.json"
    rootfs = image_dir / "rootfs.tar.zst"
    for p in (manifest, rootfs):
        if not p.is_file():
            raise NodeforgeError(
                f"{p} not found: --image must be the output directory of "
                "`nodeforge build` (default output/local)"
            )
    m = json.loads(manifest.read_text())
    sha = m["artifacts"]["rootfs.tar.zst"]["sha256"]
    lower = IMAGE_CACHE / sha[:16] / "rootfs"
    done = lower.parent / ".complete"
    if done.exists():
        return lower
    if lower.exists():
        shutil.rmtree(lower)
    lower.mkdir(parents=True)
    rootfs_tar.untar(
        rootfs,
        lower,
        zstd=True,
    )
    done.write_text(sha)
    return lower


def _mount_overlay(lower: Path, node_dir: Path) -> None:
    for d in ("upper", "work", "merged"):
        (node_dir / d).mkdir(parents=True, exist_ok=True)
    merged = node_dir / "merged"
    if os.path.ismount(merged):
        return
    proc.run(
        [
            "mount",
            "-t",
            "overlay",
            f"nf-{node_dir.name}",
            "-o",
            f"lowerdir={lower},upperdir={node_dir / 'upper'},workdir={node_dir / 'work'}",
            merged,
        ]
    )


def _hosts_text(cluster: Cluster) -> str:
    """Every node's /etc/hosts: localhost plus all cluster nodes (rewritten when nodes join)."""
    lines = [
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "# nodeforge local cluster: managed block, rewritten when nodes join",
    ]
    lines += [f"{n.address}\t{n.name}" for n in cluster.nodes]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SlurmNode:
    """One node as the controller sees it: readiness.NodeState (the one definition of ready),
    sinfo's short form for people, and the reason."""

    state: NodeState
    shown: str
    reason: str = ""


def slurm_json(lower: str | Path) -> bool:
    """Slurm >= 23.02 in the image prints node state flags as a JSON list (preferred)."""
    try:
        return has(read_features(Paths.under(lower)).version_tuple, "json_records")
    except NodeforgeError:
        return False


def parse_nodes_json(text: str) -> dict[str, SlurmNode]:
    """`scontrol show node --json`; raises ValueError on a body that is not that shape."""
    states = readiness.from_json(text)
    reasons = {n.get("name"): n.get("reason") for n in json.loads(text)["nodes"]}
    out = {}
    for name, st in states.items():
        reason = reasons.get(name)
        out[name] = SlurmNode(st, st.short(), reason if isinstance(reason, str) else "")
    return out


def parse_nodes_sinfo(text: str) -> dict[str, SlurmNode]:
    """`sinfo -h -N -o %N|%t|%E` (Slurm 22.05: no JSON flags)."""
    out = {}
    for line in text.splitlines():
        parts = line.split("|", 2)
        if len(parts) == 3 and parts[0]:
            out[parts[0]] = SlurmNode(
                readiness.from_sinfo(parts[1]), parts[1], parts[2] if parts[2] != "none" else ""
            )
    return out


class LocalCluster:
    """Operations on one named local cluster."""

    def __init__(self, name: str = "nf", progress: Progress | None = None):
        if not name.isalnum() or len(name) > 8:
            raise NodeforgeError(
                f"cluster name '{name}' must be 1-8 letters/digits "
                "(it prefixes namespace and interface names)"
            )
        self.name = name
        self.progress = progress or (lambda msg: log.info("%s", msg))

    # -- lifecycle ----------------------------------------------------------------------
    def up(
        self,
        image: Path,
        computes: int,
        *,
        join_interval: float = 0.0,
        params: dict | None = None,
        copies: list[tuple[Path, str]] | None = None,
        wait: bool = True,
        timeout: float = 300.0,
    ) -> Cluster:
        _require_root_and_tools()
        if (STATE_ROOT / self.name / "cluster.json").exists():
            raise NodeforgeError(
                f"cluster '{self.name}' already exists; add nodes with "
                f"`nodeforge cluster add`, or remove it with "
                f"`nodeforge cluster down --name {self.name}`"
            )
        lower = ensure_lower(Path(image).resolve())
        cluster = Cluster(
            self.name, str(Path(image).resolve()), str(lower), f"nfc-{self.name}", time.time()
        )
        cluster.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(cluster.dir, 0o700)
        # The cluster's munge key: generated here, root-only, handed to nodes as params.
        key = cluster.dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o600)
        cluster.save()
        try:
            cluster.fabric().create()
            self._start(cluster, "controller", CONTROLLER_NAME, params, copies)
            if wait:
                self.wait_ready(cluster, [CONTROLLER_NAME], timeout)
            self._add(cluster, computes, join_interval, params, copies, wait, timeout)
        except BaseException:
            log.error("cluster up failed; removing what it made")
            self.down()
            raise
        return cluster

    def add(
        self,
        count: int,
        *,
        join_interval: float = 0.0,
        params: dict | None = None,
        copies: list[tuple[Path, str]] | None = None,
        wait: bool = True,
        timeout: float = 300.0,
        role: str = "compute",
    ) -> list[str]:
        _require_root_and_tools()
        cluster = Cluster.load(self.name)
        return self._add(cluster, count, join_interval, params, copies, wait, timeout, role)

    def _add(
        self, cluster, count, join_interval, params, copies, wait, timeout, role: str = "compute"
    ) -> list[str]:
        prefix = "c" if role == "compute" else "login"
        used = {n.name for n in cluster.nodes}
        names = []
        i = 1
        while len(names) < count:
            cand = f"{prefix}{i:03d}"
            if cand not in used:
                names.append(cand)
            i += 1
        for k, name in enumerate(names):
            if k and join_interval > 0:
                time.sleep(join_interval)  # capacity arrives a few nodes at a time
            self._start(cluster, role, name, params, copies)
        if wait and names:
            self.wait_ready(cluster, names, timeout)
        return names

    def _start(
        self,
        cluster: Cluster,
        role: str,
        name: str,
        params: dict | None,
        copies: list[tuple[Path, str]] | None,
        *,
        lower: Path | None = None,
        prepare: Callable[[Node], None] | None = None,
        nspawn_args: list[str] | None = None,
    ) -> Node:
        used_idx = {n.index for n in cluster.nodes}
        index = next(i for i in range(2, 250) if i not in used_idx)
        address = str(SUBNET.network_address + index)
        node_dir = cluster.dir / "nodes" / name
        node = Node(name, role, index, address, f"nfc-{cluster.name}-{name}", str(node_dir))
        cluster.nodes.append(node)
        cluster.save()
        _mount_overlay(Path(lower or cluster.lower), node_dir)
        merged = node.merged
        ctl = cluster.controller
        doc = {
            "role": role,
            "cluster_name": cluster.name,
            "controller": {"host": ctl.name, "address": ctl.address},
            "node_name": name,
            "node_address": address,
            "munge_key": base64.b64encode((cluster.dir / "munge.key").read_bytes()).decode(),
            # dockerd cannot run in an nspawn node (no iptables/nf_tables, read-only cgroups);
            # the VM tier proves Docker on a real boot of the same image.
            "docker": False,
        }
        for k, v in (params or {}).items():
            if role == "controller" and k in ("hooks", "features", "gres"):
                continue  # test/operator hooks target the joining nodes
            doc[k] = v
        etc = merged / "etc/nodeforge"
        etc.mkdir(parents=True, exist_ok=True)
        nf = etc / "node.yaml"
        nf.write_text(yaml.safe_dump(doc, sort_keys=False))
        os.chmod(nf, 0o600)  # it carries the munge key
        for src, dest in copies or []:
            # confined: a link in the image (or a '..') never leads the copy onto the host
            target = fsutil.confined(merged, dest.lstrip("/"), what=f"copy to {dest}", nested=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
        (merged / "etc/hosts").write_text(_hosts_text(cluster))
        if prepare is not None:
            prepare(node)  # bench hook: edit the node's overlay before it boots
        if role == "controller":
            nspawn_args = [*controller_state(cluster, Path(lower or cluster.lower)), *(nspawn_args or [])]  # fmt: skip
        cluster.fabric().attach(node.netns, index, ipaddress.ip_address(address))
        self._boot(cluster, node, nspawn_args)
        self.progress(f"{name}: started ({role}, {address})")
        self._refresh_hosts(cluster, skip=name)
        return node

    def _boot(self, cluster: Cluster, node: Node, nspawn_args: list[str] | None) -> None:
        """Boot *node*'s overlay (mounted, its namespace wired) with systemd-nspawn."""
        name, merged = node.name, node.merged
        console = open(Path(node.dir) / "console.log", "ab")
        argv = [
            proc.require_tool("systemd-nspawn"),
            "--quiet",
            "-D",
            str(merged),
            "--boot",
            "--register=no",
            "--keep-unit",
            f"--machine={name}",
            f"--network-namespace-path=/run/netns/{node.netns}",
            "--link-journal=no",
            "--resolv-conf=off",
            "--timezone=off",
            "--console=read-only",
            "--setenv=SYSTEMD_COLORS=0",
            # The node's own data disk for Enroot (what `node health` measures and a hook's
            # import fills): the overlay upper dir is the host's disk, shared by every node and
            # whatever else the host holds, so a full host would drain every lab node.
            f"--tmpfs={NODE_DATA_DIR}:mode=1777,size={NODE_DATA_SIZE}",
            *(nspawn_args or []),
        ]
        log.info("run: %s", " ".join(argv))
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        console.close()
        node.pid = p.pid
        node.started = time.time()
        cluster.save()

    # -- single nodes (bench/time_to_ready.py) -----------------------------------------
    def start_node(
        self,
        name: str,
        role: str = "compute",
        *,
        params: dict | None = None,
        copies: list[tuple[Path, str]] | None = None,
        lower: Path | None = None,
        prepare: Callable[[Node], None] | None = None,
        nspawn_args: list[str] | None = None,
    ) -> Node:
        """Start one node by name without waiting; the same path as `cluster add`.

        Hooks for benchmarks: *lower* boots another tree (e.g. the bare base) through the
        overlay instead of the image, *prepare(node)* edits the node's overlay (node.merged)
        after node.yaml and /etc/hosts are written and before it boots (e.g. mask the agent),
        *nspawn_args* are appended to systemd-nspawn's command line (e.g. --bind-ro=…).
        """
        _require_root_and_tools()
        cluster = Cluster.load(self.name)
        if any(n.name == name for n in cluster.nodes):
            raise NodeforgeError(f"cluster {self.name} already has a node '{name}'")
        return self._start(
            cluster,
            role,
            name,
            params,
            copies,
            lower=lower,
            prepare=prepare,
            nspawn_args=nspawn_args,
        )

    def power_cycle(self, name: str, *, nspawn_args: list[str] | None = None) -> Node:
        """Cut a compute's power and boot it again on the same disk (its overlay): its init
        (the PID namespace's PID 1) is SIGKILLed, which kills every process in the node at
        once, as a power cut does (nothing is flushed or stopped cleanly); then the same
        overlay boots again, in the same network namespace, with the same address."""
        _require_root_and_tools()
        cluster = Cluster.load(self.name)
        node = cluster.node(name)
        if node.role == "controller":
            raise NodeforgeError(f"{name} is the controller; power_cycle takes a compute")
        if _alive(node.pid):
            build_proc.kill_now(leader_pid(node))
            deadline = time.monotonic() + STOP_TIMEOUT
            while _alive(node.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(node.pid):
                raise NodeforgeError(
                    f"node {name}: systemd-nspawn (pid {node.pid}) did not exit within "
                    f"{STOP_TIMEOUT:.0f}s of its init being killed"
                )
        node.ready_at = None
        self._boot(cluster, node, nspawn_args)
        self.progress(f"{name}: power cycled (same disk, {node.address})")
        return node

    def remove_node(self, name: str) -> None:
        """Stop one node and remove its overlay, namespace, record and Slurm node."""
        cluster = Cluster.load(self.name)
        if name == CONTROLLER_NAME:
            raise NodeforgeError("the controller is removed with `nodeforge cluster down`")
        node = cluster.node(name)
        self._discard_machine(cluster, node)
        if node.role == "compute" and _alive(cluster.controller.pid):
            try:  # a dynamic node; deleting it keeps sinfo to the nodes that exist
                node_exec(
                    cluster.controller,
                    ["scontrol", "delete", f"NodeName={name}"],
                    check=False,
                    timeout=20,
                )
            except NodeforgeError as exc:
                log.warning("could not delete Slurm node %s: %s", name, exc)

    def _discard_machine(self, cluster: Cluster, node: Node) -> None:
        """The machine is gone: its process, disk (overlay), namespace and record. Slurm's
        registration of its name is left as a lost machine leaves it."""
        _stop_nspawn(node.pid)
        merged = node.merged
        if os.path.ismount(merged):
            proc.run(["umount", merged], check=False)
            if os.path.ismount(merged):
                proc.run(["umount", "--lazy", merged], check=False)
        fabric = cluster.fabric()
        fabric.detach(node.netns)
        # The bridge side of the veth goes away only when the node's namespace is freed, which
        # can lag behind `ip netns delete`; the next node may reuse this index at once.
        proc.run(
            ["ip", "-n", fabric.ns, "link", "del", f"nfv{node.index}"], check=False, timeout=30
        )
        shutil.rmtree(node.dir, ignore_errors=True)
        cluster.nodes.remove(node)
        cluster.save()

    def replace(
        self,
        name: str,
        *,
        image: Path | None = None,
        params: dict | None = None,
        copies: list[tuple[Path, str]] | None = None,
        wait: bool = True,
        timeout: float = 300.0,
        prepare: Callable[[Node], None] | None = None,
    ) -> tuple[Node, float | None]:
        """Replace compute *name* with a fresh machine of the same name: a new disk (from the
        cluster's image, or *image*), new host keys and machine-id, a new address. Its agent
        replaces Slurm's old registration (readiness.Gate.hold). Returns the new node and the
        seconds from the old machine's loss to the new one schedulable (None with no wait).
        *prepare(node)* edits the new machine's overlay before it boots (as in start_node).

        Everything that can refuse is checked before the old machine is touched."""
        _require_root_and_tools()
        cluster = Cluster.load(self.name)
        node = cluster.node(name)
        if node.role != "compute":
            raise NodeforgeError(
                f"{name} is the cluster's {node.role}; `cluster replace` takes a compute (the "
                "controller's state must outlive its machine: see docs/operate.md)"
            )
        lower = None
        if image is not None:
            check_image_for(cluster, Path(image))
            lower = ensure_lower(Path(image).resolve())
        lost = time.time()
        self.progress(f"{name}: machine lost (replacing it{f' from {image}' if image else ''})")
        self._discard_machine(cluster, node)
        new = self._start(cluster, node.role, name, params, copies, lower=lower, prepare=prepare)
        if not wait:
            return new, None
        self.wait_ready(cluster, [name], timeout)
        return new, round((new.ready_at or time.time()) - lost, 2)

    def replace_controller(
        self,
        *,
        image: Path | None = None,
        params: dict | None = None,
        copies: list[tuple[Path, str]] | None = None,
        timeout: float = 300.0,
    ) -> Node:
        """Replace the controller with a fresh machine (a new disk from *image*, same name and
        address) whose state is the old one's: StateSaveLocation and MariaDB's data dir live
        on the cluster's controller-state directory (CONTROLLER_STATE), the munge key is the
        cluster's. Its services are stopped first so that both are consistent on disk; jobs
        keep running on the computes meanwhile (slurmd holds them). Returns the new node once
        slurmctld answers and every running compute is schedulable again."""
        _require_root_and_tools()
        cluster = Cluster.load(self.name)
        old = cluster.controller
        image = Path(image or cluster.image).resolve()
        lower = ensure_lower(image)
        if _alive(old.pid):
            self.progress(f"{old.name}: stopping slurmctld, slurmdbd, MariaDB (state kept)")
            node_exec(
                old,
                ["systemctl", "stop", "nodeforge-gang.service", "slurmctld.service",
                 "slurmdbd.service", "mariadb.service"],
                check=False,
                timeout=180,
            )  # fmt: skip
        self.progress(f"{old.name}: machine replaced from {image}")
        self._discard_machine(cluster, old)
        new = self._start(cluster, "controller", CONTROLLER_NAME, params, copies, lower=lower)
        if new.address != old.address:
            raise NodeforgeError(
                f"the new controller got {new.address}, not {old.address}: another node took "
                "its address; the computes cannot find it"
            )
        cluster.image, cluster.lower = str(image), str(lower)
        cluster.save()
        self.wait_ready(cluster, [CONTROLLER_NAME], timeout)
        computes = [n.name for n in cluster.nodes if n.role == "compute" and _alive(n.pid)]
        if computes:
            self.wait_ready(cluster, computes, timeout)
        return new

    def _refresh_hosts(self, cluster: Cluster, skip: str) -> None:
        """Tell running nodes about a newcomer (Slurm resolves node names via /etc/hosts).

        Written from the host into each node's overlay (its root filesystem), atomically: no
        process per node, so the 32nd join does not cost 31 nsenter calls.
        """
        text = _hosts_text(cluster)
        for n in cluster.nodes:
            if n.name == skip or not _alive(n.pid):
                continue
            etc = n.merged / "etc"
            if etc.is_symlink() or not etc.is_dir():
                log.warning("not updating /etc/hosts on %s: %s is not a directory", n.name, etc)
                continue
            try:
                write_atomic(etc / "hosts", text, 0o644)
            except OSError as exc:
                log.warning("could not update /etc/hosts on %s: %s", n.name, exc)

    # -- observation --------------------------------------------------------------------
    def slurm_nodes(self, cluster: Cluster) -> dict[str, SlurmNode]:
        """Every node as the controller sees it, one call: `scontrol show node --json` where
        the image's Slurm has it (>= 23.02), else `sinfo -h -N -o %N|%t|%E`. {} if slurmctld
        does not answer."""
        use_json = slurm_json(cluster.lower)
        argv = (
            ["scontrol", "show", "node", "--json"]
            if use_json
            else ["sinfo", "-h", "-N", "-o", "%N|%t|%E"]
        )
        try:
            cp = node_exec(cluster.controller, argv, check=False, timeout=20)
        except NodeforgeError:
            return {}
        if cp.returncode != 0:
            return {}
        if not use_json:
            return parse_nodes_sinfo(cp.stdout)
        try:
            return parse_nodes_json(cp.stdout)
        except ValueError as exc:
            log.warning("scontrol show node --json: unexpected output (%s)", exc)
            return {}

    def agent_state(self, node: Node) -> dict:
        f = node.merged / "var/lib/nodeforge/state.json"
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError):
            return {}

    def _controller_ready(self, cluster: Cluster) -> bool:
        ctl = cluster.controller
        return controller_up(lambda argv: node_exec(ctl, argv, check=False, timeout=15))

    def wait_ready(self, cluster: Cluster, names: list[str], timeout: float) -> None:
        """Wait until each node is schedulable (controller: slurmctld answering), bounded.

        A node that is DRAINED because its init failed is reported with its reason at once.
        """
        deadline = time.monotonic() + timeout
        pending = list(names)
        last: dict[str, str] = {}
        next_note = time.monotonic() + 10.0
        while pending:
            # The agents' records are read BEFORE Slurm's view: an agent drains its node with
            # the failure's reason and only then records `failed`, so a `failed` read here is
            # always matched by a view that already holds that reason (the other order once
            # reported the transient "nodeforge: running hooks" as the reason).
            agents = {name: self.agent_state(cluster.node(name)) for name in pending}
            sn = self.slurm_nodes(cluster) if any(n != CONTROLLER_NAME for n in pending) else {}
            for name in list(pending):
                node = cluster.node(name)
                if not _alive(node.pid):
                    raise NodeforgeError(f"node {name} exited; see {node.dir}/console.log")
                agent = agents[name]
                if name == CONTROLLER_NAME:
                    ok = agent.get("status") == "ready" and self._controller_ready(cluster)
                    shown = "slurmctld answering" if ok else "slurmctld starting"
                else:
                    # Ready = a job pinned to it would start now (readiness.NodeState.ready):
                    # IDLE+NOT_RESPONDING (`idle*`) is NOT ready, srun -w refuses it.
                    sl = sn.get(name)
                    st = sl.state if sl else NodeState("")
                    ok = st.ready and agent.get("status") == "ready"
                    shown = str(st) if sl else "unregistered"
                    reason = sl.reason if sl else ""
                    if st.drained and reason and reason != "none":
                        shown += f" reason={reason!r}"
                    # Drained by its failed init, or by the health check after it: neither
                    # clears by waiting, so say why at once.
                    if st.drained and (
                        agent.get("status") == "failed" or reason.startswith(HEALTH_REASON_PREFIX)
                    ):
                        raise NodeforgeError(_drained_message(name, reason, agent))
                last[name] = f"{shown}, agent {agent.get('status', 'not started')}"
                if ok:
                    node.ready_at = time.time()
                    pending.remove(name)
                    cluster.save()
                    secs = _agent_seconds(agent)
                    self.progress(
                        f"{name}: ready after {node.ready_at - node.started:.1f}s "
                        f"({shown}; agent {secs if secs is not None else '?'}s)"
                    )
            if not pending:
                break
            if time.monotonic() > deadline:
                waiting = "; ".join(f"{n} ({last.get(n, '?')})" for n in pending)
                raise NodeforgeError(
                    f"nodes not ready after {timeout:.0f}s: {waiting}; see "
                    f"`nodeforge cluster status --name {cluster.name}` and "
                    f"{cluster.dir}/nodes/<node>/console.log"
                )
            if time.monotonic() > next_note:
                next_note = time.monotonic() + 10.0
                self.progress(
                    "waiting for " + "; ".join(f"{n} ({last.get(n, '?')})" for n in pending)
                )
            time.sleep(0.25)

    def status(self) -> dict:
        cluster = Cluster.load(self.name)
        sn = self.slurm_nodes(cluster) if _alive(cluster.controller.pid) else {}
        rows = []
        states = {}
        for n in cluster.nodes:
            ast = self.agent_state(n)
            states[n.name] = ast
            slurm = sn.get(n.name)
            rows.append(
                {
                    "name": n.name,
                    "role": n.role,
                    "address": n.address,
                    "running": _alive(n.pid),
                    "agent": ast.get("status", "unknown"),
                    "slurm_state": slurm.shown
                    if slurm
                    else ("-" if n.role != "compute" else "unregistered"),
                    "slurm_ready": slurm.state.ready if slurm else None,
                    "reason": (slurm.reason if slurm else "") or ast.get("last_error") or "",
                    "time_to_ready_s": round(n.ready_at - n.started, 2) if n.ready_at else None,
                    "agent_seconds": _agent_seconds(ast),
                }
            )
        return {
            "cluster": cluster.name,
            "image": cluster.image,
            "nodes": rows,
            # many nodes failing the same first-boot step, said once (failures.py)
            "bootstrap_failures": [s.to_dict() for s in failures.summarize(states)],
        }

    # -- teardown -----------------------------------------------------------------------
    def down(self) -> list[str]:
        """Remove every node, mount, namespace and file of the cluster. Idempotent."""
        removed: list[str] = []
        cdir = STATE_ROOT / self.name
        try:
            cluster = Cluster.load(self.name)
            nodes = cluster.nodes
        except (NodeforgeError, ValueError, TypeError):
            cluster, nodes = None, []
        for n in reversed(nodes):
            _stop_nspawn(n.pid)
            removed.append(n.name)
        for n in nodes:
            merged = Path(n.dir) / "merged"
            if os.path.ismount(merged):
                proc.run(["umount", merged], check=False)
                if os.path.ismount(merged):
                    proc.run(["umount", "--lazy", merged], check=False)
        from .netns import list_namespaces

        fabric = Fabric(f"nfc-{self.name}", SUBNET)
        for ns in list_namespaces(f"nfc-{self.name}-"):
            fabric.detach(ns)
        fabric.destroy()
        if cdir.exists():
            shutil.rmtree(cdir)
        return removed


def controller_state(cluster: Cluster, lower: Path) -> list[str]:
    """systemd-nspawn --bind arguments for CONTROLLER_STATE, from the cluster's
    controller-state directory. Seeded from the image the first time (the packages' own
    initial state: MariaDB's system tables); later images get the kept state, handed to the
    image's own owners (a new image may number the mysql/slurm users differently)."""
    base = cluster.dir / "controller-state"
    base.mkdir(mode=0o700, exist_ok=True)
    args = []
    for rel in CONTROLLER_STATE:
        src = lower / rel
        dest = base / rel.replace("/", "_")
        if not src.is_dir() or src.is_symlink():
            raise NodeforgeError(
                f"the image at {lower} has no directory /{rel} (the controller's state); "
                "rebuild it with `nodeforge build`"
            )
        if not dest.exists():
            proc.run(["cp", "-a", "--", src, dest], timeout=300)
        else:
            st, have = src.stat(), dest.stat()
            if (st.st_uid, st.st_gid) != (have.st_uid, have.st_gid):
                proc.run(["chown", "-R", f"{st.st_uid}:{st.st_gid}", "--", dest], timeout=300)
        args.append(f"--bind={dest}:/{rel}")
    return args


def image_slurm(image: Path) -> str:
    """The slurmd version an image ships, from its manifest; refused without one."""
    f = Path(image) / "manifest.json"
    try:
        manifest = json.loads(f.read_text())
        version = manifest["packages"]["slurmd"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = "missing" if isinstance(exc, FileNotFoundError) else f"unreadable ({exc})"
        raise NodeforgeError(
            f"{f}: {why}; give the output directory of `nodeforge build` (its manifest names "
            "the Slurm it ships)"
        ) from None
    if not isinstance(version, str) or not re.fullmatch(
        r"[0-9]{1,4}(\.[0-9]{1,4}){1,2}[A-Za-z0-9.+~:-]{0,40}", version
    ):
        raise NodeforgeError(f"{f}: packages.slurmd {version!r} is not a Slurm version")
    return version


def check_image_for(cluster: Cluster, image: Path) -> None:
    """Refuse an image whose slurmd the running controller cannot talk to (both named)."""
    new = image_slurm(image)
    running = image_slurm(Path(cluster.image))
    why = talks_to(running, new)
    if why is not None:
        raise NodeforgeError(
            f"{image}: its slurmd {new} cannot join cluster {cluster.name}, whose slurmctld is "
            f"{running}: {why}. Nothing was drained or replaced."
        )


def _drained_message(name: str, reason: str, agent: dict) -> str:
    """Why a drained node will not become ready: Slurm's reason, or, where that is still one of
    the agent's in-progress reasons (its drain with the failure's reason did not get through),
    the step its agent recorded as failed, with that step's first error line."""
    transient = reason in ("", "none", readiness.INITIALIZING, readiness.RUNNING_HOOKS)
    failed = failures.failure_of(name, agent)
    if not transient or failed is None:
        return f"node {name} is drained: {reason}"
    return (
        f"node {name} is drained (reason still {reason!r}): its agent failed in step "
        f"{failed.step}: {failed.error}"
    )


def _agent_seconds(state: dict) -> float | None:
    """The agent's own share of time-to-ready: the sum of its step durations."""
    steps = state.get("steps") or {}
    durs = [s.get("duration") for s in steps.values() if isinstance(s, dict)]
    durs = [d for d in durs if isinstance(d, (int, float))]
    return round(sum(durs), 2) if durs else None


def _stop_nspawn(pid: int | None) -> None:
    if _alive(pid):
        # SIGTERM: nspawn asks the node's systemd to power off cleanly.
        proc.stop_group(pid, STOP_TIMEOUT)
