"""The Vagrant lab for real: vagrant-libvirt and a libvirtd of our own bring up the
repository's Vagrantfile (a controller and one compute from a box of the built disk, booted
from firmware), `nodeforge verify` runs through the hosts file its trigger writes, and
`vagrant destroy -f` plus the libvirtd stop leave nothing behind. Also: the Vagrantfile
validates offline.

Under TCG here (/dev/kvm opens, but nested guests do not run: `probe_accel`).
NODEFORGE_VAGRANT_DRIVER=kvm|qemu skips the probe.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nodeforge import proc
from nodeforge.images.qemu_host import probe_accel
from nodeforge.lab.vagrant_lab import (
    Libvirtd,
    bridges,
    firewall_state,
    running,
    vagrant_driver,
    write_box,
)
from tests.conftest import require_tools
from tests.helpers import E2E_ROOT, GIB, carries_secret, drop_outputs, need_room, nodeforge

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
IMAGE = Path(os.environ.get("NODEFORGE_E2E_IMAGE", E2E_ROOT / "image"))
# Names this test owns: the lab directory's name prefixes vagrant-libvirt's domain names.
LAB = "nfvagrant"
POOL = "nfvagrant"
NETWORKS = ("nodeforge-mgmt", "nodeforge-lab")
DOMAINS = (f"{LAB}_ctl", f"{LAB}_c1")
UP_TIMEOUT = 1500  # both VMs to SSH under TCG, box upload included
INIT_TIMEOUT = 900  # nodeforge-init on both, after SSH


def _validate(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    # A copy, so validation never writes .vagrant/ into the checkout.
    shutil.copy(REPO / "Vagrantfile", tmp_path / "Vagrantfile")
    base = {"VAGRANT_CHECKPOINT_DISABLE": "1", "HOME": str(tmp_path), "PATH": os.environ["PATH"]}
    return proc.run(
        ["vagrant", "validate", *args], cwd=tmp_path, timeout=180, check=False, env=base | env
    )


def test_vagrant_validate(tmp_path):
    require_tools("vagrant")
    cp = _validate(tmp_path, "--ignore-provider")
    assert cp.returncode == 0 and "validated successfully" in cp.stdout, cp.stdout
    for n in ("ctl", "c1", "c2"):
        assert f"{n}:" in cp.stdout, cp.stdout
    # With vagrant-libvirt, its provider blocks too (sysinfo OEM strings, networks, driver).
    cp = _validate(tmp_path)
    assert cp.returncode == 0 and "validated successfully" in cp.stdout, cp.stdout


@pytest.mark.parametrize(
    "var,value,says",
    [
        ("NODEFORGE_VAGRANT_DRIVER", "xen", "kvm or qemu"),
        ("NODEFORGE_LAB_NET", "10.77.0.1", "three octets"),
        ("NODEFORGE_COMPUTES", "0", "1 to 9 computes"),
        ("NODEFORGE_VAGRANT_MEMORY", "3072", "controller,compute MiB"),
        ("NODEFORGE_CLUSTER", "lab;rm", "a Slurm cluster name"),
    ],
)
def test_vagrant_refuses_a_bad_environment_value(tmp_path, var, value, says):
    require_tools("vagrant")
    cp = _validate(tmp_path, "--ignore-provider", **{var: value})
    assert cp.returncode != 0
    assert f"{var}={json.dumps(value)} is not valid: {says}" in cp.stdout, cp.stdout


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _ours(pid: int) -> bool:
    """A qemu of our domains or a dnsmasq of our networks (by its command line)."""
    try:
        cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return False
    return any(f"guest={d}," in cmd for d in DOMAINS) or any(f"/{n}.conf" in cmd for n in NETWORKS)


def _our_processes() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _ours(int(d.name))]


def _ssh(key: Path, spec_host: str, command: str, timeout: float) -> subprocess.CompletedProcess:
    return proc.run(
        ["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR",
         f"root@{spec_host}", command],
        timeout=timeout, check=False,
    )  # fmt: skip


WAIT_INIT = (
    "for i in $(seq 1 {n}); do s=$(systemctl show -P ActiveState nodeforge-init.service); "
    "j=$(systemctl list-jobs --no-legend nodeforge-init.service); "
    'case "$s" in active|failed) echo "$s"; exit 0;; inactive) [ -z "$j" ] && {{ echo "$s"; exit 0; }};; esac; '
    "sleep 3; done; echo still-$s; exit 1"
)


# What a user checks on a node: the params source, and who can read the seed's device.
SEED_CHECK = (
    "nodeforge node status; echo ==; cat /var/lib/nodeforge/state.json; echo ==; "
    "stat -c '%U %G %a' /dev/sr0; m=$(getent group cdrom | cut -d: -f4); echo ${m:--}; "
    "test -e /etc/nodeforge/node.yaml || echo no-node-yaml"
)


def test_vagrant_lab_up_verify_destroy(tmp_path):
    require_tools("vagrant", "libvirtd", "virtlogd", "virsh", "dnsmasq", "qemu-img", "qemu-system-x86_64",
                  "tar", "ssh", "ssh-keygen", "iptables")  # fmt: skip
    plugins = proc.run(["vagrant", "plugin", "list"], timeout=120, check=False,
                       env={"VAGRANT_CHECKPOINT_DISABLE": "1", "HOME": str(tmp_path), "PATH": os.environ["PATH"]})  # fmt: skip
    if "vagrant-libvirt" not in (plugins.stdout or ""):
        pytest.fail(
            f"vagrant-libvirt is not installed (apt install vagrant-libvirt): {plugins.stdout}",
            pytrace=False,
        )
    if not (IMAGE / "disk.qcow2").is_file():
        pytest.fail(
            f"no built image at {IMAGE} (set NODEFORGE_E2E_IMAGE or build first)", pytrace=False
        )
    stray = _our_processes()
    assert not stray, f"processes of an earlier run of this test still run: {stray}"

    # libvirt's qemu runs as libvirt-qemu: every directory it reads through must be traversable.
    work = E2E_ROOT / "vagrant"
    shutil.rmtree(work, ignore_errors=True)
    (work / LAB).mkdir(parents=True)
    for d in (E2E_ROOT, work):
        d.chmod(0o755)
    lab = work / LAB
    # The box file, the box vagrant unpacks, and the pool's copy of its disk (+ the overlays).
    need_room(work, 3 * (IMAGE / "disk.qcow2").stat().st_size + GIB, "the Vagrant lab")
    shutil.copy(REPO / "Vagrantfile", lab / "Vagrantfile")
    driver = vagrant_driver(
        os.environ, lambda: probe_accel(IMAGE / "vmlinuz", IMAGE / "initrd.img", work)
    )
    lv = Libvirtd(work / "libvirt")
    fw_before = set(firewall_state())
    br_before = set(bridges())
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(work),
        "VAGRANT_HOME": str(work / "vagrant.d"),
        "VAGRANT_CHECKPOINT_DISABLE": "1",
        "VAGRANT_DEFAULT_PROVIDER": "libvirt",
        "LIBVIRT_DEFAULT_URI": lv.uri,
        "NODEFORGE_VAGRANT_DRIVER": driver,
        "NODEFORGE_VAGRANT_POOL": POOL,
        "NODEFORGE_COMPUTES": "1",
        "NODEFORGE_CLUSTER": "vagrant",
        "NODEFORGE_LAB_NET": "10.79.0",
        "NODEFORGE_MGMT_NET": "10.80.0",
        "NODEFORGE_VAGRANT_CPUS": "1",
        "NODEFORGE_VAGRANT_MEMORY": "2048,1536",
    }
    times: dict[str, float] = {}
    t0 = time.monotonic()
    prev = signal.signal(signal.SIGTERM, _interrupt)  # a killed run still tears down
    failure = None
    known: dict[str, list[str]] = {}
    try:
        lv.start()
        times["libvirtd"] = time.monotonic() - t0
        known = lv.leftovers()  # what the host's libvirt config already defines (not ours)
        (work / "pool").mkdir(mode=0o755)
        lv.virsh("pool-create-as", POOL, "dir", "--target", str(work / "pool"))  # transient
        write_box(IMAGE, work / "nodeforge.box")
        proc.run(["vagrant", "box", "add", "--name", "nodeforge/slurm", str(work / "nodeforge.box")],
                 cwd=lab, env=env, timeout=600)  # fmt: skip
        (work / "nodeforge.box").unlink()
        times["box"] = time.monotonic() - t0
        up = proc.run(
            ["vagrant", "up", "--provider=libvirt"],
            cwd=lab,
            env=env,
            timeout=UP_TIMEOUT,
            check=False,
        )
        (work / "up.log").write_text(up.stdout or "")
        times["up"] = time.monotonic() - t0
        assert up.returncode == 0, (
            f"vagrant up failed ({up.returncode}):\n{(up.stdout or '')[-4000:]}"
        )
        assert f"Domain type:       {driver}" in up.stdout, up.stdout[-4000:]
        # The params ride on each node's NoCloud seed, of which vagrant-libvirt prints only the
        # path; nothing it printed carries the lab's munge key, plain or base64 at any depth
        # (the OEM strings it prints are base64 of base64).
        munge = (lab / ".vagrant" / "nodeforge_munge.key").read_bytes()
        for n in ("ctl", "c1"):
            assert f"{lab}/.vagrant/{n}-seed.iso" in up.stdout, up.stdout[-4000:]
        leak = carries_secret(up.stdout, munge)
        assert leak is None, f"`vagrant up` printed the lab's munge key: {leak}"

        hosts = (lab / ".vagrant" / "nodeforge-hosts").read_text().strip()
        specs = hosts.split(",")
        key = lab / ".vagrant" / "nodeforge_ed25519"
        ips: dict[str, str] = {}
        for s in specs:
            target = re.fullmatch(r"ssh://root@([0-9.]+):22\?key=.*&name=(\w+)", s)
            assert target, f"hosts file entry {s!r} is not ssh://root@IP:22?key=…&name=…"
            ip, name = target.groups()
            assert ip.startswith("10.80.0."), f"{s}: not on the isolated management net"
            ips[name] = ip
        assert sorted(ips) == ["c1", "ctl"], hosts
        for name, ip in ips.items():
            cp = _ssh(key, ip, WAIT_INIT.format(n=INIT_TIMEOUT // 3), INIT_TIMEOUT + 60)
            print(f"{name}: nodeforge-init.service {cp.stdout.strip()}")
        times["init"] = time.monotonic() - t0
        # Each node took its params from its seed (a CD-ROM only root reads), not a node.yaml.
        for name, ip in ips.items():
            out = _ssh(key, ip, SEED_CHECK, 120).stdout
            print(f"{name}:\n{out}")
            status, st_json, dev = out.split("\n==\n")
            assert "params from nocloud" in status, status
            st = json.loads(st_json)
            assert (st["source"], st["node"]) == ("nocloud", name), st
            owner, group, mode, members = dev.split()[:4]
            assert (owner, group, mode, members) == ("root", "cdrom", "660", "-"), dev
            assert "no-node-yaml" in dev, dev

        v = nodeforge("verify", "--hosts", hosts, "--json", timeout=900, check=False)
        times["verify"] = time.monotonic() - t0
        (work / "verify.json").write_text(v.stdout or "")
        assert v.stdout.startswith("{"), (
            f"verify printed no JSON ({v.returncode}): {v.stderr[-3000:]}"
        )
        report = json.loads(v.stdout)
        roles = {r["host"]: r["role"] for r in report["results"]}
        bad = [r for r in report["results"] if r["outcome"] in ("failed", "error")]
        assert roles == {"ctl": "controller", "c1": "compute"}, roles
        assert not report["unreachable"], report["unreachable"]
        assert v.returncode == 0 and report["ok"] and not bad, json.dumps(bad, indent=1)[:6000]
        # The lab network carries Slurm: the compute registered with the controller over it.
        sinfo = _ssh(key, ips["ctl"], "sinfo -h -N -o '%N %T'", 60)
        print("sinfo:", sinfo.stdout)
        assert re.search(r"^c1 (idle|mixed|allocated)", sinfo.stdout, re.M), sinfo.stdout
    except BaseException as exc:
        failure = exc
        raise
    finally:
        # Only what this test started is torn down: nothing when libvirtd was refused.
        started = bool(lv.pids)
        destroy = None
        left: dict[str, list[str]] = {}
        try:
            if started:
                destroy = proc.run(
                    ["vagrant", "destroy", "-f"], cwd=lab, env=env, timeout=300, check=False
                )
                times["destroy"] = time.monotonic() - t0
                lv.remove(domains=DOMAINS, networks=NETWORKS, pools=(POOL,))
                left = {
                    k: sorted(set(v) - set(known.get(k, []))) for k, v in lv.leftovers().items()
                }
        finally:
            lv.stop()
            if started:
                lv.clean_host(fw_before, NETWORKS, DOMAINS)
            signal.signal(signal.SIGTERM, prev)
        print(
            "vagrant lab timings (s since start):",
            json.dumps({k: round(v, 1) for k, v in times.items()}),
        )
        drop_outputs(work / "vagrant.d", work / "pool", work / "nodeforge.box")
        if failure is None:
            assert destroy is not None and destroy.returncode == 0, destroy and destroy.stdout
            assert not any(left.values()), f"libvirt objects left after destroy: {left}"
            assert not _our_processes(), f"processes left: {_our_processes()}"
            assert not running(), f"daemons left: {running()}"
            assert set(bridges()) <= br_before, f"bridges left: {set(bridges()) - br_before}"
            fw_after = set(firewall_state())
            assert fw_after <= fw_before, f"firewall rules left: {fw_after - fw_before}"
