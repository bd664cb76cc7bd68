"""Benchmark: time-to-schedulable of a compute node, three ways, in one run (run as root).

    sudo .venv/bin/python bench/time_to_ready.py [--image DIR] [--repeat 3] [--json]

One local cluster (`--name`, default bttr) with a controller from the image; then, N times in
interleaved (rotated) order, one compute node at a time, each measured from its
systemd-nspawn start to the first look at the controller that shows it READY by the one
definition (nodeforge.bootstrap.readiness.NodeState.ready, also used by `cluster up` and the
agent): IDLE/MIXED and no flag such as NOT_RESPONDING (`idle*` is not ready: `srun -w` refuses
it). Also recorded: when it was first seen IDLE with any flags (the old, dishonest measure).

  floor      the same image with the agent masked (nodeforge-init.service -> /dev/null in the
             node's overlay) and slurmd started directly by systemd: munge key, the agent's
             slurmd drop-in (`slurmd --systemd -Z --conf-server ctl:6817 -N <node>`), munge
             and slurmd enabled in the overlay. Boot + register, no agent work at all.
  baked      a normal compute (the same code path as `nodeforge cluster add`): boot, agent
             (params, identity, munge, role incl. the drained pre-create, hooks, RESUME).
             The agent's own share = the sum of its step durations in state.json.
  lifecycle  the bare base root filesystem the image was made from (the cached mmdebstrap
             tarball), booted as a node; when its sshd answers, the image's roles are applied
             to it at boot with ansible-playbook (images/site.yml without the bake-only `seal`
             role, plus removing the bake's policy-rc.d), with the build's extra vars; then
             the agent (installed by the roles) is started. FAVOURABLE case: packages come from
             the build's apt archive cache, bind-mounted read-only and served as a local
             `file:` repository: nothing is downloaded, not even package lists.

Experiments (bench/README.md, "The smallest gates"): `gate-systemctl`, `gate-python` and
`gate-imports` are the floor's node with munge + slurmd started not by systemd at boot but by
one oneshot unit at the agent's place in the boot order (After=network-online.target) that
does nothing else: `systemctl start munge slurmd`; the same from the image's Python; the same
after importing the agent's modules. Each is the floor plus the least that a gate of its kind
adds. `--munge-key-in-place` gives baked nodes the key before boot with munge.service enabled,
`--keep-file PATH` copies a file out of each node before it is removed.

Every node is removed after its trial, so each trial runs next to the controller only. Only
addresses inside the cluster's own namespaces are contacted (ansible reaches the lifecycle
node's sshd on 127.0.0.1 inside that node's network namespace). The cluster is always taken
down, also on failure or Ctrl-C. Goals on 2 cores: agent share <= 0.25 s, baked <= 1.3x floor,
lifecycle >= 5x baked.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


import yaml

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.images import build_proc, rootfs_tar
from nodeforge.images.ssh_args import throwaway_ssh_argv
from nodeforge.lab.localcluster import (
    Cluster,
    LocalCluster,
    Node,
    _agent_seconds,
    _alive,
    ensure_lower,
    node_exec,
)

VARIANTS = ("floor", "baked", "lifecycle")
# Experiments: the floor's node, but munge + slurmd started by a oneshot unit at the agent's
# place in the boot order (After=network-online.target), with nothing else in it. The floor
# plus the smallest gate each kind of program could be: what any agent of that kind costs.
GATE_START = ["/bin/systemctl", "start", "munge.service", "slurmd.service"]
GATES = {
    "gate-systemctl": GATE_START,
    "gate-python": [
        "/opt/nodeforge/bin/python",
        "-c",
        f"import subprocess; subprocess.run({GATE_START!r}, check=True)",
    ],
    "gate-imports": [
        "/opt/nodeforge/bin/python",
        "-c",
        "import nodeforge.cli, nodeforge.bootstrap.cli, nodeforge.bootstrap.agent, "
        f"nodeforge.bootstrap.node_roles.compute, subprocess; subprocess.run({GATE_START!r}, "
        "check=True)",
    ],
}
KEEP_FILE_PATH = re.compile(r"(/[A-Za-z0-9._+@-]+)+")
GOAL_AGENT_S = 0.25
GOAL_BAKED_OVER_FLOOR = 1.3
GOAL_LIFECYCLE_OVER_BAKED = 5.0
SLURMCTLD_PORT = 6817


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


# -- observation ------------------------------------------------------------------------
def slurm_state(lc: LocalCluster, cluster: Cluster, name: str) -> str:
    """The node's state as the controller shows it (the same call as `cluster up`), or ''."""
    sl = lc.slurm_nodes(cluster).get(name)
    return str(sl.state) if sl else ""


def wait_schedulable(
    lc: LocalCluster, cluster: Cluster, node: Node, timeout: float, poll: float
) -> tuple[float, float | None]:
    """Wall-clock times at which the controller first showed *node* READY (the one
    definition, readiness.NodeState.ready) and first showed it IDLE with any flags.

    The time recorded is when that look was issued, so the error is at most one poll
    interval (plus the call's own latency), the same for every variant.
    """
    deadline = time.monotonic() + timeout
    last = ""
    t_idle = None
    while True:
        t = time.time()
        sl = lc.slurm_nodes(cluster).get(node.name)
        if sl is not None:
            if t_idle is None and sl.state.base in ("IDLE", "MIXED"):
                t_idle = t
            if sl.state.ready:
                return t, t_idle
            last = str(sl.state)
        if not _alive(node.pid):
            raise NodeforgeError(f"node {node.name} exited; see {node.dir}/console.log")
        if time.monotonic() > deadline:
            raise NodeforgeError(
                f"node {node.name} not ready after {timeout:.0f}s "
                f"(last Slurm state: {last or 'unregistered'})"
            )
        time.sleep(poll)


def read_state(node: Node, want_ready: bool = True, timeout: float = 15.0) -> dict:
    """The node's /var/lib/nodeforge/state.json (waits briefly for status ready: the agent
    writes it right after RESUME)."""
    f = node.merged / "var/lib/nodeforge/state.json"
    deadline = time.monotonic() + timeout
    st: dict = {}
    while True:
        try:
            st = json.loads(f.read_text())
        except (OSError, ValueError):
            st = {}
        if not want_ready or st.get("status") in ("ready", "failed"):
            return st
        if time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def agent_waits(st: dict) -> float:
    """Seconds of the agent's steps spent waiting on slurmctld (controller answering, slurmd
    registered, the node seen ready): Slurm's time, not the agent's work."""
    steps = st.get("steps") or {}
    total = 0.0
    for name in ("role", "ready"):
        for k, v in ((steps.get(name) or {}).get("detail") or {}).items():
            if k.endswith("_wait_s") and isinstance(v, (int, float)):
                total += v
    return round(total, 2)


def agent_summary(st: dict, started: float) -> dict:
    steps = st.get("steps") or {}
    secs = _agent_seconds(st)
    waits = agent_waits(st)
    return {
        "agent_waits_s": waits,
        "agent_work_s": round(secs - waits, 2) if secs is not None else None,
        "agent_seconds": _agent_seconds(st),
        "agent_status": st.get("status"),
        "agent_started_after_s": round(st["first_started"] - started, 2)
        if st.get("first_started")
        else None,
        "agent_ready_after_s": round(st["ready_at"] - started, 2) if st.get("ready_at") else None,
        "steps": {k: v.get("duration") for k, v in steps.items() if isinstance(v, dict)},
        "role_detail": {
            k: v
            for k, v in ((steps.get("role") or {}).get("detail") or {}).items()
            if k.endswith("_s")
        },
        "ready_detail": (steps.get("ready") or {}).get("detail") or {},
    }


_SYSTEMD_US_UTC = re.compile(r"=\w{3} (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}) UTC")


def parse_us_utc(text: str) -> float | None:
    """`ActiveEnterTimestamp=Thu 2026-12-03 22:33:36.123456 UTC` (systemctl show
    --timestamp=us+utc) as epoch seconds, or None."""
    import datetime as dt

    m = _SYSTEMD_US_UTC.search(text)
    if m is None:
        return None
    t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f")
    return t.replace(tzinfo=dt.UTC).timestamp()


def unit_entered_at(node: Node, unit: str, prop: str = "ActiveEnterTimestamp") -> float | None:
    """When *unit* became active in the node (host and node share the clock), or another
    timestamp property *prop* of it, asked after the trial (not timed); None when it cannot be
    told."""
    cp = node_exec(
        node,
        ["systemctl", "show", "--timestamp=us+utc", "-p", prop, unit],
        check=False,
        timeout=30,
    )
    return parse_us_utc(cp.stdout or "") if cp.returncode == 0 else None


def boot_wait(st: dict, basic_at: float) -> float:
    """Seconds of the munge step spent before basic.target: an agent unit ordered before it
    (DefaultDependencies=no, e.g. an --init-unit/--init-dropin experiment) has its `systemctl
    start munge` wait for basic.target there. That is systemd's boot order, not the agent's
    work: with the default ordering the whole unit starts after basic.target (then it is 0)."""
    m = (st.get("steps") or {}).get("munge") or {}
    t0, t1 = m.get("started"), m.get("ended")
    if not isinstance(t0, (int, float)) or not isinstance(t1, (int, float)):
        return 0.0
    return round(max(0.0, min(t1, basic_at) - t0), 3)


def console_tail(node: Node, n: int = 25) -> str:
    try:
        lines = (Path(node.dir) / "console.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


# -- floor ------------------------------------------------------------------------------
def _ids(root: Path, user: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        f = line.split(":")
        if f[0] == user:
            return int(f[2]), int(f[3])
    raise NodeforgeError(f"no user {user} in {root}/etc/passwd")


def _unit_path(root: Path, unit: str) -> str:
    for d in ("usr/lib/systemd/system", "lib/systemd/system"):
        if (root / d / unit).exists():
            return f"/{d}/{unit}"
    raise NodeforgeError(f"{unit} not found in {root}")


def agent_from_checkout(node: Node) -> None:
    """--agent-from-checkout: replace the image's agent (the nodeforge package in the node's
    venv) by this checkout's core and bootstrap packages in the node's overlay, compiled there
    with the image's own Python (chroot, before the node boots; not timed). Measures agent
    changes without a rebuild; the image's units and roles stay as built."""
    m = node.merged
    sites = sorted(m.glob("opt/nodeforge/lib/python3*/site-packages/nodeforge"))
    if not sites:
        raise NodeforgeError(f"no nodeforge package under {m}/opt/nodeforge/lib")
    site = sites[-1]
    for f in (REPO / "nodeforge").glob("*.py"):
        shutil.copy2(f, site / f.name)
    dest = site / "bootstrap"
    for f in (REPO / "bootstrap").rglob("*.py"):
        target = dest / f.relative_to(REPO / "bootstrap")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    proc.run(
        [
            "chroot",
            m,
            "/opt/nodeforge/bin/python",
            "-m",
            "compileall",
            "-q",
            "/" + str(site.relative_to(m)),
        ],
        timeout=120,
    )


def init_dropins(files: list[Path]):
    """--init-dropin FILE (experiment): FILE as a drop-in of baked nodes'
    nodeforge-init.service (/etc/systemd/system/nodeforge-init.service.d/, overlay only), e.g.
    another ExecStart= or a scheduling setting, measured without a rebuild."""
    texts = [(f.name, f.read_text()) for f in files]

    def install(node: Node) -> None:
        d = node.merged / "etc/systemd/system/nodeforge-init.service.d"
        d.mkdir(parents=True, exist_ok=True)
        for name, text in texts:
            (d / name).write_text(text)

    return install


def init_unit(path: Path):
    """--init-unit FILE (experiment): FILE replaces the image's nodeforge-init.service in baked
    nodes' overlay (/etc/systemd/system, where the role installs it): an ordering change
    that a drop-in cannot make (dependencies cannot be reset), measured without a rebuild."""
    text = path.read_text()

    def install(node: Node) -> None:
        (node.merged / "etc/systemd/system/nodeforge-init.service").write_text(text)

    return install


def mask_units(units: list[str]):
    """--mask-unit UNIT (experiment): UNIT masked (-> /dev/null) in baked nodes' overlay, e.g.
    to see what a unit that runs beside the agent at boot costs it."""

    def mask(node: Node) -> None:
        for unit in units:
            link = node.merged / "etc/systemd/system" / unit
            if link.exists() or link.is_symlink():
                link.unlink()
            link.symlink_to("/dev/null")

    return mask


def _enable(root: Path, unit: str) -> None:
    """*unit* wanted by multi-user.target in the node's overlay (as `systemctl enable`)."""
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / unit
    if not link.is_symlink():
        link.symlink_to(_unit_path(root, unit))


def place_munge_key(node: Node, key: bytes, enable: bool = False) -> None:
    """The cluster's key at /etc/munge/munge.key (0400 munge:munge) in the node's overlay, as a
    platform that hands the key over before boot would; *enable*: munge.service enabled."""
    m = node.merged
    uid, gid = _ids(m, "munge")
    kf = m / "etc/munge/munge.key"
    kf.write_bytes(key)
    os.chown(kf, uid, gid)
    os.chmod(kf, 0o400)
    if enable:
        _enable(m, "munge.service")


def munge_key_in_place(cluster: Cluster):
    """--munge-key-in-place (experiment): baked nodes get the key before boot (as the floor
    does) and munge.service enabled, so munged starts at basic.target beside the agent."""
    key = (cluster.dir / "munge.key").read_bytes()
    return lambda node: place_munge_key(node, key, enable=True)


def keep_files(paths: list[str], workdir: Path):
    """--keep-file PATH (experiment): copy PATH from the node's root before it is removed."""

    def keep(node: Node) -> None:
        for p in paths:
            parts = Path(p.lstrip("/")).parts
            src = node.merged.joinpath(*parts)
            # a regular file only: a link in the node's root would be followed on the host
            # (the components inside the node's root are the node's; those above are ours)
            inside = (node.merged.joinpath(*parts[: i + 1]) for i in range(len(parts)))
            if src.is_file() and not any(q.is_symlink() for q in inside):
                workdir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, workdir / f"{node.name}-{src.name}", follow_symlinks=False)

    return keep


def floor_prepare(cluster: Cluster, gate: list[str] | None = None):
    key = (cluster.dir / "munge.key").read_bytes()
    ctl = cluster.controller

    def prepare(node: Node) -> None:
        m = node.merged
        sysd = m / "etc/systemd/system"
        unit = sysd / "nodeforge-init.service"
        if unit.exists() or unit.is_symlink():
            unit.unlink()
        unit.symlink_to("/dev/null")  # masked: the agent never runs
        place_munge_key(node, key)
        d = sysd / "slurmd.service.d"
        d.mkdir(parents=True, exist_ok=True)
        # The agent's drop-in (bootstrap/node_roles/compute.py slurmd_exec), without --conf (no
        # features/gres in these params).
        (d / "nodeforge.conf").write_text(
            "[Service]\nExecStart=\n"
            f"ExecStart=/usr/sbin/slurmd --systemd -Z --conf-server {ctl.address}:{SLURMCTLD_PORT}"
            f" -N {node.name} $SLURMD_OPTIONS\n"
        )
        if gate is not None:
            wants = sysd / "multi-user.target.wants"
            wants.mkdir(parents=True, exist_ok=True)
            (sysd / "nf-gate.service").write_text(
                "[Unit]\nDescription=bench: the smallest gate\nWants=network-online.target\n"
                "After=network-online.target\n[Service]\nType=oneshot\nRemainAfterExit=yes\n"
                f"ExecStart={' '.join(a if ' ' not in a else chr(34) + a + chr(34) for a in gate)}\n"
            )
            (wants / "nf-gate.service").symlink_to("../nf-gate.service")
            return
        for u in ("munge.service", "slurmd.service"):
            _enable(m, u)

    return prepare


# -- lifecycle --------------------------------------------------------------------------
class Lifecycle:
    """Inputs of the lifecycle-script variant, made once per run (not timed)."""

    def __init__(self, args, manifest: dict, image_lower: Path):
        self.args = args
        self.manifest = manifest
        self.work = args.workdir
        self.image_lower = image_lower

    def setup(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.base_tree = self._base_tree()
        self.repo = self._apt_repo()
        self.wheel = self._wheel()
        self.sshdir, self.client_key = self._ssh()
        self.playbook = self._playbook()
        self.extra_vars = self._extra_vars()

    def _base_tree(self) -> Path:
        b = self.manifest["base"]
        tar = self.args.base_tar or (
            self.args.cache_dir
            / "base"
            / f"base-{b['suite']}-{self.manifest['arch']}-{b['key']}.tar"
        )
        if not tar.is_file():
            raise NodeforgeError(
                f"base tarball {tar} not found (the image says base key "
                f"{b['key']}); pass --base-tar"
            )
        root = self.work / f"base-{b['key']}" / "rootfs"
        done = root.parent / ".complete"
        if done.exists():
            return root
        log(f"extracting the bare base {tar.name} (once)")
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        rootfs_tar.untar(tar, root)
        done.write_text(str(tar))
        return root

    def _apt_repo(self) -> Path:
        """A flat `file:` repository over the build's apt archive cache (index made here)."""
        archives = self.args.cache_dir / "apt-archives"
        debs = sorted(p.name for p in archives.glob("*.deb"))
        if not debs:
            raise NodeforgeError(f"no .deb in {archives}: run a build first (it fills the cache)")
        key = hashlib.sha256("\n".join(debs).encode()).hexdigest()[:12]
        repo = self.work / f"apt-repo-{key}"
        (repo / "pool").mkdir(parents=True, exist_ok=True)  # mount point of the archive cache
        if (repo / "Release").exists():
            self.archives = archives
            return repo
        log(f"indexing {len(debs)} packages of {archives} (once)")
        gen = self.work / "apt-gen"
        if gen.exists():
            shutil.rmtree(gen)
        gen.mkdir()
        (gen / "pool").symlink_to(archives)
        cp = proc.run(
            ["dpkg-scanpackages", "--multiversion", "pool", "/dev/null"],
            cwd=gen,
            timeout=600,
            capture=True,
        )
        packages = (
            "\n".join(
                ln for ln in cp.stdout.splitlines() if not ln.startswith("dpkg-scanpackages:")
            )
            + "\n"
        )
        (repo / "Packages").write_text(packages)
        data = (repo / "Packages").read_bytes()
        (repo / "Release").write_text(
            "Origin: nodeforge-bench\nLabel: nodeforge-bench\n"
            f"Date: {time.strftime('%a, %d %b %Y %H:%M:%S UTC', time.gmtime())}\n"
            f"MD5Sum:\n {hashlib.md5(data).hexdigest()} {len(data)} Packages\n"
            f"SHA256:\n {hashlib.sha256(data).hexdigest()} {len(data)} Packages\n"
        )
        shutil.rmtree(gen)
        self.archives = archives
        return repo

    def _wheel(self) -> Path:
        """The agent wheel baked into the image, so both variants run the same agent code."""
        wheels = sorted((self.image_lower / "opt/nodeforge/wheels").glob("nodeforge-*.whl"))
        if not wheels:
            raise NodeforgeError(
                f"no nodeforge wheel under {self.image_lower}/opt/nodeforge/wheels"
            )
        dest = self.work / "wheel"
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir()
        shutil.copy2(wheels[-1], dest / wheels[-1].name)
        return dest / wheels[-1].name

    def _ssh(self) -> tuple[Path, Path]:
        d = self.work / "ssh-run"  # bind-mounted read-only at /run/nf-bench in the node
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(mode=0o700)
        client = self.work / "client_ed25519"
        for p in (client, Path(f"{client}.pub")):
            p.unlink(missing_ok=True)
        proc.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "nodeforge-bench", "-f", client]
        )
        proc.run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "nodeforge-bench-host",
                "-f",
                d / "ssh_host_ed25519_key",
            ]
        )
        ak = d / "authorized_keys"
        ak.write_text(Path(f"{client}.pub").read_text())
        os.chmod(ak, 0o600)
        return d, client

    def _playbook(self) -> Path:
        """images/site.yml with the bake-only seal role replaced by removing policy-rc.d.

        A node configured at boot is not sealed (seal removes per-node identity so that an
        image can be copied); what the seal role does that a running node needs is removing
        the policy-rc.d the roles install to keep package scripts from starting services.
        Dropping seal makes the lifecycle variant faster, i.e. favours it.
        """
        plays = yaml.safe_load((REPO / "images/site.yml").read_text())
        found = False
        for play in plays:
            roles = play.get("roles") or []
            keep = [r for r in roles if (r.get("role") if isinstance(r, dict) else r) != "seal"]
            if len(keep) != len(roles):
                found = True
                play["roles"] = keep
                play.setdefault("post_tasks", []).append(
                    {
                        "name": "Remove the bake's policy-rc.d (services may start on a live node)",
                        "ansible.builtin.file": {
                            "path": "/usr/sbin/policy-rc.d",
                            "state": "absent",
                        },
                    }
                )
        if not found:
            raise NodeforgeError("images/site.yml has no seal role any more; update the bench")
        # The roles find repo files relative to the playbook ({{ playbook_dir }}/../gang/…):
        # a mirror of the checkout's layout with the generated playbook in images/.
        tree = self.work / "playbook-tree"
        (tree / "images").mkdir(parents=True, exist_ok=True)
        for d in ("gang", "roles", "bootstrap", "extensions"):
            link = tree / d
            if (REPO / d).exists() and not link.is_symlink():
                link.symlink_to(REPO / d)
        pb = tree / "images" / "lifecycle-site.yml"
        pb.write_text(
            "# generated by bench/time_to_ready.py from images/site.yml\n"
            + yaml.safe_dump(plays, sort_keys=False)
        )
        return pb

    def _extra_vars(self) -> Path:
        """The extra vars `nodeforge build` passes (images/build.py), from the image manifest."""
        # The artifacts the image was built from (sha256 from its manifest), copied here so a
        # concurrent build refreshing the cache cannot change them under the run.
        art_dir = self.work / "artifacts"
        if art_dir.exists():
            shutil.rmtree(art_dir)
        art_dir.mkdir()
        sources = [self.args.cache_dir / "artifacts"]
        if self.args.artifact_mirror:
            sources.append(self.args.artifact_mirror)
        arts = {}
        for name, inp in self.manifest["inputs"].items():
            seen = []
            for src in sources:
                f = src / inp["file"]
                if not f.is_file():
                    continue
                sha = hashlib.sha256(f.read_bytes()).hexdigest()
                seen.append(f"{f}: {sha}")
                if not inp.get("sha256") or sha == inp["sha256"]:
                    shutil.copy2(f, art_dir / inp["file"])
                    break
            else:
                raise NodeforgeError(
                    f"artifact {inp['file']} (input {name}) with the image's sha256 "
                    f"{inp.get('sha256')} not found; seen: {seen or 'none'} "
                    "(pass --artifact-mirror DIR)"
                )
            arts[name] = inp["file"]
        ev = {
            "nodeforge_image_name": self.manifest["name"],
            "nodeforge_artifacts_dir": str(art_dir),
            "nodeforge_artifacts": arts,
            "nodeforge_wheel": str(self.wheel),
            "nodeforge_base": self.manifest["base"]["name"],
        }
        p = self.work / "lifecycle-extra-vars.json"
        p.write_text(json.dumps(ev, indent=2))
        return p

    # -- per node ---------------------------------------------------------------------
    def nspawn_args(self) -> list[str]:
        return [
            f"--bind-ro={self.sshdir}:/run/nf-bench",
            f"--bind-ro={self.repo}:/srv/nf-apt",
            f"--bind-ro={self.archives}:/srv/nf-apt/pool",
        ]

    def prepare(self, node: Node) -> None:
        m = node.merged
        conf = m / "etc/ssh/sshd_config.d/00-nf-bench.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        # Access that survives the ssh role removing /etc/ssh/ssh_host_* (docs/contracts.md).
        conf.write_text(
            "# nodeforge bench access (overlay only)\nListenAddress 127.0.0.1\n"
            "HostKey /run/nf-bench/ssh_host_ed25519_key\n"
            "AuthorizedKeysFile /run/nf-bench/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        )
        apt = m / "etc/apt"
        for f in (apt / "sources.list.d").glob("*"):
            f.unlink()
        (apt / "sources.list").write_text(
            "# nodeforge bench: the build's apt archive cache as a local repository\n"
            "deb [trusted=yes] file:/srv/nf-apt ./\n"
        )

    def _ssh_argv(self, node: Node, *opts: str) -> list[str]:
        return [
            "ip",
            "netns",
            "exec",
            node.netns,
            *throwaway_ssh_argv(self.client_key, connect_timeout=2, options=opts),
        ]

    def _close_masters(self, node: Node, cpdir: Path) -> None:
        """Stop the ssh ControlPersist masters ansible left (they live in the node's netns)."""
        for sock in cpdir.iterdir():
            proc.run(
                self._ssh_argv(node, "-o", f"ControlPath={sock}", "-O", "exit"),
                check=False,
                timeout=20,
            )

    def run(self, cluster: Cluster, node: Node, timeout: float, logf) -> dict:
        deadline = time.monotonic() + timeout
        cpdir = self.work / "cp" / node.name
        cpdir.mkdir(parents=True, exist_ok=True)
        # 1. the node boots; wait for its sshd (what starts a lifecycle script: the boot)
        while True:
            cp = proc.run(self._ssh_argv(node) + ["true"], check=False, timeout=20)
            if cp.returncode == 0:
                break
            if not _alive(node.pid):
                raise NodeforgeError(
                    f"lifecycle node {node.name} exited; see {node.dir}/console.log"
                )
            if time.monotonic() > deadline:
                raise NodeforgeError(
                    f"lifecycle node {node.name}: sshd not answering: {cp.stdout[-300:]}"
                )
            time.sleep(0.25)
        t_ssh = time.time()
        # 2. the roles, applied at boot
        env = {
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
            "ANSIBLE_HOST_KEY_CHECKING": "False",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
            # Our own control socket (one per node, closed below); ansible.cfg's 30 min
            # ControlPersist would otherwise outlive the node.
            "ANSIBLE_SSH_ARGS": "-o ControlMaster=auto -o ControlPersist=120s "
            "-o ServerAliveInterval=30",
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cpdir),
        }
        # A named inventory host: with "127.0.0.1" as the host, ansible would treat the node as
        # the implicit localhost and run the roles' delegate_to: localhost tasks on the node.
        inv = self.work / f"lifecycle-inventory-{node.name}.ini"
        inv.write_text(f"{node.name} ansible_host=127.0.0.1 ansible_port=22\n")
        argv = [
            "ip",
            "netns",
            "exec",
            node.netns,
            proc.require_tool("ansible-playbook"),
            "-i",
            str(inv),
            "-u",
            "root",
            "--private-key",
            str(self.client_key),
            "--ssh-common-args",
            "-o UserKnownHostsFile=/dev/null -o StrictHostKeyChecking=no",
            "--extra-vars",
            f"@{self.extra_vars}",
            str(self.playbook),
        ]
        t_a0 = time.time()
        try:
            build_proc.stream(
                argv,
                logfile=logf,
                env=env,
                timeout=max(10.0, deadline - time.monotonic()),
                hint="the roles failed on the lifecycle node; see the bench log",
            )
        finally:
            self._close_masters(node, cpdir)
        t_a1 = time.time()
        # 3. the agent (installed and enabled by the roles; the boot is past multi-user)
        node_exec(node, ["systemctl", "start", "--no-block", "nodeforge-init.service"], timeout=30)
        t_agent = time.time()
        return {
            "ssh_after_s": round(t_ssh - node.started, 2),
            "ansible_s": round(t_a1 - t_a0, 2),
            "agent_kicked_after_s": round(t_agent - node.started, 2),
            "deadline": deadline,
        }


def ansible_tasks(log_text: str) -> list[tuple[str, str, float]]:
    """(role, task, seconds) from the stamped ansible log.

    ansible-core's default callback prints a task's banner when the task's first result
    arrives (here: one host, so when it ends), so a task's duration is the time from the
    previous banner to its own; the first one counts from the first PLAY banner (before it:
    ansible starting, "(ansible start)"). Tasks of the first play count as
    "(preconditions)". In the roles play, the unprefixed include ("Block service starts …")
    and the other role's task it pulls in count for the role that included them.
    """
    out: list[tuple[str, str, float]] = []
    prev: float | None = None
    plays = 0
    current = "(preconditions)"
    including: str | None = None
    for line in log_text.splitlines():
        m = re.match(
            r"\[\s*([\d.]+)s\] (PLAY RECAP|PLAY|TASK|RUNNING HANDLER) \[?(.*?)\]? \*", line
        )
        if not m:
            continue
        t, kind, name = float(m.group(1)), m.group(2), m.group(3)
        if kind == "PLAY RECAP":
            break
        if kind == "PLAY":
            plays += 1
            if prev is None:
                out.append(("(ansible start)", "", t))
                prev = t
            continue
        if " : " in name:
            role = name.split(" : ", 1)[0]
            if including and role != including:
                role = including  # a task file of another role, included by this one
            else:
                including = None
                current = role
        elif plays >= 2:
            role = including = current
        else:
            role = "(preconditions)"
        out.append((role, name, round(t - (prev or 0.0), 2)))
        prev = t
    return out


def ansible_role_times(log_text: str) -> dict[str, float]:
    """Seconds per role (see ansible_tasks)."""
    out: dict[str, float] = {}
    for role, _, d in ansible_tasks(log_text):
        out[role] = round(out.get(role, 0.0) + d, 1)
    return out


def ansible_package_seconds(log_text: str) -> float:
    """Seconds in the roles' package-install (ansible.builtin.apt) tasks."""
    return round(
        sum(
            d
            for _, task, d in ansible_tasks(log_text)
            if re.search(
                r": Install (the base packages|the OpenSSH server|munge$|Slurm|"
                r"MariaDB|the Docker|enroot and|the build packages|logrotate|"
                r"the agent's runtime)",
                task,
            )
        ),
        1,
    )


# -- one trial --------------------------------------------------------------------------
def trial(lc: LocalCluster, variant: str, name: str, args, lifecycle: Lifecycle | None) -> dict:
    cluster = Cluster.load(lc.name)
    res: dict = {"variant": variant, "node": name, "load_before": round(os.getloadavg()[0], 2)}
    node = None
    try:
        if variant == "floor" or variant in GATES:
            node = lc.start_node(name, prepare=floor_prepare(cluster, GATES.get(variant)))
        elif variant == "baked":
            steps = [
                f
                for f, on in (
                    (agent_from_checkout, args.agent_from_checkout),
                    (init_unit(args.init_unit) if args.init_unit else None, bool(args.init_unit)),
                    (init_dropins(args.init_dropin), bool(args.init_dropin)),
                    (mask_units(args.mask_unit), bool(args.mask_unit)),
                    (munge_key_in_place(cluster), args.munge_key_in_place),
                )
                if on
            ]
            node = lc.start_node(name, prepare=(lambda n: [f(n) for f in steps]) if steps else None)
        else:
            assert lifecycle is not None
            node = lc.start_node(
                name,
                lower=lifecycle.base_tree,
                prepare=lifecycle.prepare,
                nspawn_args=lifecycle.nspawn_args(),
            )
        cluster = Cluster.load(lc.name)
        timeout = args.timeout
        if variant == "lifecycle":
            logp = args.workdir / f"lifecycle-{name}.log"
            res["ansible_log"] = str(logp)
            with open(logp, "w", buffering=1) as logf:
                lres = lifecycle.run(cluster, node, args.lifecycle_timeout, logf)
            deadline = lres.pop("deadline")
            res.update(lres)
            res["ansible_roles_s"] = ansible_role_times(logp.read_text())
            res["ansible_package_install_s"] = ansible_package_seconds(logp.read_text())
            timeout = max(10.0, deadline - time.monotonic())
        t_ready, t_idle = wait_schedulable(lc, cluster, node, timeout, args.poll)
        res["seconds"] = round(t_ready - node.started, 2)
        if t_idle is not None:  # first IDLE with any flag (`idle*` counted): the old measure
            res["idle_any_flag_seconds"] = round(t_idle - node.started, 2)
        # where the agent's process began (before the interpreter start and imports) and
        # where munged was up (floor too): the boot timeline around the agent's path
        for key, unit, prop in (
            ("init_exec_after_s", "nodeforge-init.service", "ExecMainStartTimestamp"),
            ("munge_active_after_s", "munge.service", "ActiveEnterTimestamp"),
        ):
            at = unit_entered_at(node, unit, prop)
            if at is not None:
                res[key] = round(at - node.started, 3)
        if variant in ("baked", "lifecycle"):
            st = read_state(node)
            res.update(agent_summary(st, node.started))
            basic = unit_entered_at(node, "basic.target")
            if basic is not None:
                res["basic_target_after_s"] = round(basic - node.started, 3)
                res["agent_boot_wait_s"] = boot_wait(st, basic)
                if res.get("agent_seconds") is not None:
                    res["agent_own_s"] = round(res["agent_seconds"] - res["agent_boot_wait_s"], 3)
            if res.get("agent_ready_after_s") is not None:
                res["idle_seen_after_agent_ready_s"] = round(
                    res["seconds"] - res["agent_ready_after_s"], 2
                )
        res["ok"] = True
    except (NodeforgeError, subprocess.SubprocessError, OSError) as exc:
        res["ok"] = False
        res["error"] = str(exc)[-2000:]
        if node is not None:
            res["console_tail"] = console_tail(node)
            try:
                res["sinfo"] = slurm_state(lc, Cluster.load(lc.name), name)
                res["agent_state"] = agent_summary(read_state(node, want_ready=False), node.started)
            except (NodeforgeError, OSError, ValueError) as e2:  # diagnostics only
                res["diag_error"] = str(e2)
        log(f"{variant} {name} FAILED: {str(exc)[-500:]}")
    finally:
        res["load_after"] = round(os.getloadavg()[0], 2)
        if node is not None:
            if args.keep_file:
                keep_files(args.keep_file, args.workdir)(node)
            lc.remove_node(name)
    if res.get("ok"):
        extra = f"  agent {res['agent_seconds']}s" if res.get("agent_seconds") is not None else ""
        if variant == "lifecycle":
            extra += f"  ssh@{res['ssh_after_s']}s ansible {res['ansible_s']}s"
        log(
            f"{variant:<9} {name}: {res['seconds']:.2f}s to ready{extra}  "
            f"(load {res['load_before']}->{res['load_after']})"
        )
    return res


# -- run --------------------------------------------------------------------------------
def check_image(image: Path) -> tuple[dict, Path]:
    mf = image / "manifest.json"
    deadline = time.monotonic() + 900
    while not mf.is_file():  # the image may be mid-rebuild
        if time.monotonic() > deadline:
            raise NodeforgeError(f"{mf} did not appear within 15 min")
        log(f"waiting for {mf} (image being rebuilt?)")
        time.sleep(10)
    manifest = json.loads(mf.read_text())
    lower = ensure_lower(image)
    unit = (lower / "etc/systemd/system/nodeforge-init.service").read_text()
    if re.search(r"^Before=.*slurm", unit, re.MULTILINE):
        raise NodeforgeError(
            f"{image} (created {manifest.get('created')}) has Before= on the "
            "Slurm units in nodeforge-init.service: the agent deadlocks; "
            "rebuild the image"
        )
    return manifest, lower


def ratio_verdict(num: float, den: float, poll: float, bound: float, at_most: bool) -> bool | None:
    """Whether num/den <= bound (*at_most*) or >= bound holds, given that each time is a first
    look at the controller: the true time lies up to one poll interval before the measured
    one. True or False only when that holds (or fails) for every true time the polls allow;
    None when the poll is too coarse to tell (with a 0.25 s poll, a 0.27 s floor and a 0.45 s
    baked node both read as the same look, 1.0x)."""
    lo_num, lo_den = max(num - poll, 0.0), max(den - poll, 0.0)
    if at_most:
        if lo_den > 0 and num / lo_den <= bound:
            return True
        return False if lo_num / den > bound else None
    if lo_num / den >= bound:
        return True
    return False if lo_den > 0 and num / lo_den < bound else None


def summarize(results: list[dict], variants: list[str], poll: float = 0.0) -> dict:
    ok = {v: [r for r in results if r["variant"] == v and r.get("ok")] for v in variants}
    med = {v: median([r["seconds"] for r in ok[v]]) for v in variants}
    out: dict = {
        "median_seconds": med,
        "median_idle_any_flag_seconds": {
            v: median(
                [
                    r["idle_any_flag_seconds"]
                    for r in ok[v]
                    if r.get("idle_any_flag_seconds") is not None
                ]
            )
            for v in variants
        },
        "runs_ok": {v: len(ok[v]) for v in variants},
        "runs_failed": {
            v: sum(1 for r in results if r["variant"] == v and not r.get("ok")) for v in variants
        },
    }
    for v in ("baked", "lifecycle"):
        if v in variants:
            out[f"median_agent_seconds_{v}"] = median(
                [r["agent_seconds"] for r in ok[v] if r.get("agent_seconds") is not None]
            )
            out[f"median_agent_work_s_{v}"] = median(
                [r["agent_work_s"] for r in ok[v] if r.get("agent_work_s") is not None]
            )
            out[f"median_agent_waits_s_{v}"] = median(
                [r["agent_waits_s"] for r in ok[v] if r.get("agent_waits_s") is not None]
            )
    if "baked" in variants:
        steps: dict[str, list[float]] = {}
        for r in ok["baked"]:
            for k, d in (r.get("steps") or {}).items():
                if isinstance(d, (int, float)):
                    steps.setdefault(k, []).append(d)
        out["median_agent_steps_baked"] = {k: median(v) for k, v in steps.items()}
        out["median_agent_started_after_s_baked"] = median(
            [r["agent_started_after_s"] for r in ok["baked"] if r.get("agent_started_after_s")]
        )
        # the agent's share without the munge step's wait for basic.target (boot_wait)
        out["median_agent_own_s_baked"] = median(
            [r["agent_own_s"] for r in ok["baked"] if r.get("agent_own_s") is not None]
        )
        out["median_basic_target_after_s_baked"] = median(
            [r["basic_target_after_s"] for r in ok["baked"] if r.get("basic_target_after_s")]
        )
    if "lifecycle" in variants:
        out["median_lifecycle_ansible_s"] = median([r["ansible_s"] for r in ok["lifecycle"]])
        out["median_lifecycle_ssh_after_s"] = median([r["ssh_after_s"] for r in ok["lifecycle"]])
        out["median_lifecycle_package_install_s"] = median(
            [r["ansible_package_install_s"] for r in ok["lifecycle"]]
        )
        roles: dict[str, list[float]] = {}
        for r in ok["lifecycle"]:
            for k, d in (r.get("ansible_roles_s") or {}).items():
                roles.setdefault(k, []).append(d)
        out["median_lifecycle_ansible_roles_s"] = {k: median(v) for k, v in roles.items()}
    ratios, goals = {}, {}
    for v in variants:
        if v in GATES and med.get(v) and med.get("floor"):
            ratios[f"{v}_over_floor"] = round(med[v] / med["floor"], 2)
    if med.get("floor") and med.get("baked"):
        ratios["baked_over_floor"] = round(med["baked"] / med["floor"], 2)
        goals["baked_within_1.3x_floor"] = ratio_verdict(
            med["baked"], med["floor"], poll, GOAL_BAKED_OVER_FLOOR, at_most=True
        )
    if med.get("baked") and med.get("lifecycle"):
        ratios["lifecycle_over_baked"] = round(med["lifecycle"] / med["baked"], 2)
        goals["lifecycle_5x_slower_than_baked"] = ratio_verdict(
            med["lifecycle"], med["baked"], poll, GOAL_LIFECYCLE_OVER_BAKED, at_most=False
        )
    a = out.get("median_agent_seconds_baked")
    if a is not None:
        goals["agent_share_le_0.25s"] = a <= GOAL_AGENT_S
    own = out.get("median_agent_own_s_baked")
    if own is not None:
        goals["agent_own_share_le_0.25s"] = own <= GOAL_AGENT_S
    out["ratios"] = ratios
    out["goals_met"] = goals
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--image",
        type=Path,
        default=Path("/var/tmp/nodeforge-e2e/image"),
        help="output directory of `nodeforge build` (default: %(default)s)",
    )
    ap.add_argument("--name", default="bttr", help="cluster name (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3, help="trials per variant (default: 3)")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of floor,baked,lifecycle (experiments: "
        + ",".join(GATES)
        + ")",
    )
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("/var/cache/nodeforge"),
        help="the build's cache: base/, apt-archives/, artifacts/ (default: %(default)s)",
    )
    ap.add_argument("--base-tar", type=Path, help="bare base tarball (default: from the manifest)")
    ap.add_argument(
        "--artifact-mirror",
        type=Path,
        default=Path("/var/tmp/nodeforge-e2e/mirror"),
        help="second place to look for the image's artifacts (default: %(default)s)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=Path("/var/tmp/nodeforge-bench"),
        help="bench files: extracted base, apt index, logs (default: %(default)s)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="bound per floor/baked node and for the controller (default: %(default)ss)",
    )
    ap.add_argument(
        "--lifecycle-timeout",
        type=float,
        default=900.0,
        help="bound per lifecycle node (default: %(default)ss)",
    )
    ap.add_argument(
        "--agent-from-checkout",
        action="store_true",
        help="baked nodes run this checkout's agent (copied into their overlay and "
        "compiled before boot) instead of the image's",
    )
    ap.add_argument(
        "--mask-unit",
        action="append",
        default=[],
        metavar="UNIT",
        help="experiment: UNIT masked in baked nodes' overlay (repeatable)",
    )
    ap.add_argument(
        "--init-dropin",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="experiment: FILE as a drop-in of baked nodes' nodeforge-init.service "
        "(overlay only; repeatable)",
    )
    ap.add_argument(
        "--init-unit",
        type=Path,
        default=None,
        metavar="FILE",
        help="experiment: FILE replaces baked nodes' nodeforge-init.service (overlay only)",
    )
    ap.add_argument(
        "--munge-key-in-place",
        action="store_true",
        help="experiment: baked nodes get the munge key before boot (as the floor does) and "
        "munge.service enabled (overlay only)",
    )
    ap.add_argument(
        "--keep-file",
        action="append",
        default=[],
        metavar="PATH",
        help="experiment: copy PATH from each node's root into --workdir before it is removed",
    )
    ap.add_argument(
        "--lifecycle-repeat",
        type=int,
        default=None,
        metavar="K",
        help="run the lifecycle variant only in the first K rounds (default: all)",
    )
    ap.add_argument(
        "--poll",
        type=float,
        default=0.05,
        help="controller poll interval (s); a ratio goal is judged only where the polls can "
        "tell (goals_met null otherwise): 0.25 s read floor and baked as the same look",
    )
    ap.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = ap.parse_args()
    if not 0 < args.poll <= 5:  # (NaN fails too) a zero poll would spin on the controller
        ap.error(f"--poll must be > 0 and <= 5 seconds, got {args.poll}")
    for kf in args.keep_file:  # a path in the node's root: never out of it
        if not KEEP_FILE_PATH.fullmatch(kf) or ".." in kf.split("/"):
            ap.error(
                f"--keep-file {kf!r}: give an absolute path inside the node (letters, digits, "
                "'._-+@' and '/', no '..'), e.g. /var/log/nodeforge/importtime.log"
            )
    if os.geteuid() != 0:
        sys.exit("run as root (network namespaces, overlays, systemd-nspawn)")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS and v not in GATES]
    if bad or not variants or args.repeat < 1:
        sys.exit(f"--variants: choose from {', '.join(VARIANTS)}; --repeat >= 1")

    image = args.image.resolve()
    manifest, lower = check_image(image)
    log(f"image {image} created {manifest.get('created')}")
    lifecycle = None
    if "lifecycle" in variants:
        lifecycle = Lifecycle(args, manifest, lower)
        lifecycle.setup()

    lc = LocalCluster(args.name)
    results: list[dict] = []
    t_run = time.time()
    report: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:],
        "load_at_start": os.getloadavg(),
        "agent": "this checkout (--agent-from-checkout)"
        if args.agent_from_checkout
        else "the image's",
        "image": str(image),
        "image_created": manifest.get("created"),
        "image_rootfs_sha256": manifest["artifacts"]["rootfs.tar.zst"]["sha256"],
        "host": {"cpus": os.cpu_count(), "user": pwd.getpwuid(os.getuid()).pw_name},
        "repeat": args.repeat,
        "poll_s": args.poll,
        "lifecycle_case": "favourable: apt archive cache bind-mounted read-only as a local file: "
        "repository (no package or list downloads); site.yml without seal",
    }
    try:
        t0 = time.time()
        lc.up(image, 0, timeout=args.timeout)
        report["controller_up_s"] = round(time.time() - t0, 2)
        log(f"controller up in {report['controller_up_s']}s")
        k = 0
        for r in range(args.repeat):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            if args.lifecycle_repeat is not None and r >= args.lifecycle_repeat:
                order = [v for v in order if v != "lifecycle"]  # minutes each; ratio is ~50x
            for v in order:
                k += 1
                results.append(trial(lc, v, f"c{k:03d}", args, lifecycle))
    finally:
        log(f"cluster down {args.name}")
        lc.down()
    report["wall_seconds"] = round(time.time() - t_run, 1)
    report["summary"] = summarize(results, variants, args.poll)
    report["trials"] = results
    (args.workdir).mkdir(parents=True, exist_ok=True)
    (args.workdir / "time_to_ready.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        s = report["summary"]
        print(
            f"time to ready (nspawn start -> controller shows it ready: IDLE, no flag), "
            f"medians of {args.repeat}:"
        )
        for v in variants:
            print(
                f"  {v:<10} {s['median_seconds'][v]!s:>7} s   ok {s['runs_ok'][v]}, "
                f"failed {s['runs_failed'][v]}"
            )
        print(f"  first seen IDLE with any flag (old measure): {s['median_idle_any_flag_seconds']}")
        if "median_agent_seconds_baked" in s:
            print(
                f"  agent's own share (baked): {s['median_agent_seconds_baked']} s, of which "
                f"waiting on slurmctld {s['median_agent_waits_s_baked']} s, work "
                f"{s['median_agent_work_s_baked']} s; steps {s['median_agent_steps_baked']}"
            )
        if "median_lifecycle_ansible_s" in s:
            print(
                f"  lifecycle: sshd after {s['median_lifecycle_ssh_after_s']} s, roles "
                f"{s['median_lifecycle_ansible_s']} s (package installs "
                f"{s['median_lifecycle_package_install_s']} s) "
                f"{s['median_lifecycle_ansible_roles_s']}"
            )
        for k2, v2 in s["ratios"].items():
            print(f"  {k2}: {v2}")
        print(f"  goals met: {s['goals_met']}")
        print(f"  full result: {args.workdir / 'time_to_ready.json'}")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
