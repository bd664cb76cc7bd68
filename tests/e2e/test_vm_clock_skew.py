"""A compute whose clock is skewed beyond munge's TTL joins (issue 28 item 3), in the VM tier.

An nspawn node shares the host's CLOCK_REALTIME (time namespaces offset only the monotonic
and boot-time clocks), so this case needs its own kernel: two VMs from the built disk, a
controller with the host's time and a compute whose RTC starts SKEW_S ahead (qemu `-rtc
base=`; no time server is reachable to correct it). munged stamps every credential with its
machine's wall clock and refuses one from more than its TTL (300 s) away, so the compute can
neither be talked to nor talk to slurmctld. What it must not be is schedulable: it waits out
of Slurm with its agent failed, the reason in `node status`. Then its clock is set right (as
NTP would) and it joins by itself: nodeforge-rejoin.timer's next `scontrol ping` is accepted
and the agent starts again (docs/agent.md "Controller away").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nodeforge.lab.vm import VM, VMConfig, free_port
from tests.conftest import require_tools

pytestmark = pytest.mark.e2e
SKEW_S = 1200  # 20 min: four times munge's default TTL
MUNGE_B64 = "bm9kZWZvcmdlLXZtLXRpZXItbXVuZ2Uta2V5LTMyLWJ5dGVzLW9r"  # FIXTURE key, test only
BOOT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_BOOT_TIMEOUT", "480"))


def _cfg(image: Path, work: Path, name: str, role: str, ip: str, mac: str, **kw) -> VMConfig:
    yaml = (
        f"role: {role}\ncluster_name: vmskew\nnode_name: {name}\nnode_address: {ip}\n"
        "controller: {host: ctl, address: 10.77.0.10}\n"
        # the compute's wait for slurmctld is what the skew defeats: bounded short here
        f"munge_key: {MUNGE_B64}\nwait_timeout: {360 if role == 'controller' else 60}\n"
        "accounting: false\n"
    )
    return VMConfig(
        image_dir=image, workdir=work / name, name=name, node_yaml=yaml,
        boot_timeout=BOOT_TIMEOUT, keep=True, link_ip=f"{ip}/24", link_mac=mac, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory, built_image):
    require_tools("qemu-system-x86_64", "qemu-img", "ssh", "ssh-keygen")
    work = tmp_path_factory.mktemp("vmskew")
    port = free_port()
    ctl = VM(_cfg(built_image, work, "ctl", "controller", "10.77.0.10", "52:54:00:4e:47:10",
                  link_listen=port))  # fmt: skip
    c1 = VM(_cfg(built_image, work, "c1", "compute", "10.77.0.11", "52:54:00:4e:47:11",
                 link_connect=port, rtc_offset_s=SKEW_S))  # fmt: skip
    try:
        ctl.start()
        c1.start()
        for v in (ctl, c1):
            v.wait_ssh()
        yield ctl, c1
    finally:
        c1.stop()
        ctl.stop()


def test_skewed_compute_is_refused_and_never_schedulable(pair):
    ctl, c1 = pair
    assert ctl.wait_unit("nodeforge-init.service", timeout=420) == "active"
    skew = int(c1.ssh("date +%s").stdout) - int(ctl.ssh("date +%s").stdout)
    assert skew > 900, f"the compute's clock is only {skew}s ahead: no skew to test"
    # munge itself refuses the compute's credential on the controller
    cred = c1.ssh("munge -n").stdout.strip()
    un = ctl.ssh(f"echo '{cred}' | unmunge", check=False)
    said = (un.stdout or "") + (un.stderr or "")
    assert un.returncode != 0 and "credential" in said.lower(), said
    # the agent waits its bound for slurmctld, fails the role step, says why
    state = c1.wait_unit("nodeforge-init.service", timeout=300)
    st = json.loads(c1.ssh("nodeforge node status --json", check=False).stdout)
    print("compute agent:", state, st.get("last_error"))
    assert state == "failed" and st["status"] == "failed", st
    assert st["steps"]["role"]["status"] == "failed", st["steps"]["role"]
    assert st.get("retry") == "controller-away", st
    # never schedulable while skewed: slurmctld has no such node (nothing could reach it), and
    # the rejoin timer's looks (every 30 s) are refused the same way
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        out = ctl.ssh("sinfo -h -N -n c1 -o '%N %t'", check=False).stdout.strip()
        assert out == "", out
        time.sleep(5)
    assert (
        json.loads(c1.ssh("nodeforge node status --json", check=False).stdout)["status"] == "failed"
    )

    # The clock set right, as NTP would: the node joins by itself, no one reruns anything.
    c1.ssh(f"date -s @{int(ctl.ssh('date +%s').stdout)}")
    fixed = time.monotonic()
    deadline = fixed + 300
    out = ""
    while time.monotonic() < deadline:
        out = ctl.ssh("sinfo -h -N -n c1 -o '%N %t'", check=False).stdout.strip()
        st = json.loads(c1.ssh("nodeforge node status --json", check=False).stdout or "{}")
        if out == "c1 idle" and st.get("status") == "ready":
            break
        time.sleep(5)
    assert out == "c1 idle" and st.get("status") == "ready", (out, st.get("last_error"))
    assert st["steps"]["role"]["runs"] == 2 and st.get("retry") is None, st["steps"]["role"]
    log = c1.ssh("journalctl -u nodeforge-rejoin.service --no-pager -o cat").stdout
    assert "slurmctld answers: starting nodeforge-init.service again" in log, log
    print(f"c1: clock set right, idle in Slurm {time.monotonic() - fixed:.1f}s later")
