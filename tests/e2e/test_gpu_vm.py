"""VM tier for the gpu image on a machine WITHOUT a GPU (qemu): the stack must stay harmless.

Two VMs from the gpu image (controller with gres_types [gpu], a compute), as in test_vm.py.
Proven: the controller serves GresTypes=gpu + gres.conf AutoDetect=nvml and (a VM) cgroup
enforcement; slurmd on the compute runs with AutoDetect=nvml and reports 0 GPUs; a job runs
under proctrack/cgroup; `nodeforge node health` passes on this CPU node, drains it with a clear
reason once expected_gpus: 8 is set, and a passing run clears that drain again.
The image: $NODEFORGE_E2E_GPU_IMAGE or a gpu build (the `gpu_image` fixture, tests/e2e/conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from nodeforge import slurm_records
from nodeforge.bootstrap.readiness import from_record
from nodeforge.lab.vm import VM, BootTimeout, VMConfig, free_port
from tests.conftest import require_tools

# Its first runs failed: `slurmd -C` died of SIGSEGV on the gpu image (fixed: libnvidia-ml
# preloaded), then slurmd logged NVML's "Driver Not Loaded" errors (fixed: libnvidia-ml hidden
# from slurmd on a machine without an NVIDIA GPU). Both in bootstrap/gres.py.
pytestmark = pytest.mark.e2e
BOOT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_BOOT_TIMEOUT", "480"))
INIT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_INIT_TIMEOUT", "420"))
MUNGE_B64 = "bm9kZWZvcmdlLXZtLXRpZXItbXVuZ2Uta2V5LTMyLWJ5dGVzLW9r"  # 38 bytes, test only


def _yaml(role: str, name: str, ip: str, extra: str = "") -> str:
    return (
        f"role: {role}\ncluster_name: gputier\nnode_name: {name}\nnode_address: {ip}\n"
        "controller: {host: ctl, address: 10.78.0.10}\n"
        f"munge_key: {MUNGE_B64}\nwait_timeout: 360\n{extra}"
    )


def _cfg(image, work, name, role, ip, mac, extra="", **link) -> VMConfig:
    return VMConfig(
        image_dir=image,
        workdir=work / name,
        name=name,
        node_yaml=_yaml(role, name, ip, extra),
        boot_timeout=BOOT_TIMEOUT,
        keep=True,
        link_ip=f"{ip}/24",
        link_mac=mac,
        **link,
    )


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory, gpu_image):
    require_tools("qemu-system-x86_64", "qemu-img", "ssh", "ssh-keygen")
    work = tmp_path_factory.mktemp("gpuvm")
    port = free_port()
    ctl = VM(
        _cfg(
            gpu_image,
            work,
            "ctl",
            "controller",
            "10.78.0.10",
            "52:54:00:4e:47:10",
            "gres_types: [gpu]\nhealth_interval: 60\n",
            link_listen=port,
        )
    )
    c1 = VM(
        _cfg(gpu_image, work, "c1", "compute", "10.78.0.11", "52:54:00:4e:47:11", link_connect=port)
    )
    prev = signal.signal(signal.SIGTERM, _interrupt)
    try:
        ctl.start()
        c1.start()
        deadline = None
        for v in (ctl, c1):
            v.wait_ssh()
            print(f"\nVM {v.cfg.name}: SSH after {v.ready_after:.1f}s ({v.accel.accel})")
        deadline = time.monotonic() + INIT_TIMEOUT
        for v in (ctl, c1):
            try:
                state = v.wait_unit(
                    "nodeforge-init.service", timeout=max(10.0, deadline - time.monotonic())
                )
            except BootTimeout as exc:
                state = f"not finished: {str(exc).splitlines()[0]}"
            print(f"VM {v.cfg.name}: nodeforge-init.service {state} at {v.elapsed():.1f}s")
        yield {"ctl": ctl, "c1": c1}
    finally:
        c1.stop()
        ctl.stop()
        signal.signal(signal.SIGTERM, prev)


def test_gpu_image_without_gpu_schedules_and_health_drains(gpu_cluster):
    ctl, c1 = gpu_cluster["ctl"], gpu_cluster["c1"]
    conf = ctl.ssh("cat /etc/slurm/slurm.conf /etc/slurm/gres.conf /etc/slurm/cgroup.conf").stdout
    for line in (
        "GresTypes=gpu",
        "AutoDetect=nvml",
        "ProctrackType=proctrack/cgroup",
        "TaskPlugin=task/cgroup,task/affinity",
        "ConstrainDevices=yes",
        "HealthCheckProgram=/usr/local/sbin/nodeforge-health",
    ):
        assert line in conf.splitlines(), line
    node = ctl.ssh("scontrol -o show node c1").stdout
    print(node)
    # healthy CPU node: ready (the one definition: IDLE or MIXED, no flag but DYNAMIC_NORM & co)
    rec = slurm_records.parse_nodes(ctl.ssh("scontrol show node --json c1").stdout)["c1"]
    assert from_record(rec).ready, node
    assert "Gres=(null)" in node.split()  # NVML autodetect on a GPU-less node: 0 GPUs
    assert c1.ssh("systemctl is-active slurmd").stdout.strip() == "active"
    out = ctl.ssh("srun -N1 -w c1 -t 2 cat /proc/self/cgroup", timeout=180).stdout
    assert "job_" in out, out  # the step runs in a Slurm cgroup
    # health: passes on the CPU node, in well under a second of checks
    rep = json.loads(c1.ssh("nodeforge node health --json", check=False).stdout)
    assert rep["ok"] is True, rep
    print(f"health on a CPU node (VM): checks {rep['duration']}s")
    # expected_gpus: 8 on a machine without GPUs -> drained with a clear reason
    c1.ssh(
        "python3 - <<'EOF'\nimport json\np='/var/lib/nodeforge/params.json'\n"
        "d=json.load(open(p)); d['expected_gpus']=8; json.dump(d, open(p,'w'))\nEOF"
    )
    cp = c1.ssh("nodeforge node health", check=False)
    assert cp.returncode == 1, cp.stdout
    node = ctl.ssh("scontrol show node c1").stdout
    assert "DRAIN" in node and "Reason=nodeforge-health: nvml: nvidia-smi" in node, node
    # back to expected nothing: the passing run clears its own drain
    c1.ssh(
        "python3 - <<'EOF'\nimport json\np='/var/lib/nodeforge/params.json'\n"
        "d=json.load(open(p)); d.pop('expected_gpus'); json.dump(d, open(p,'w'))\nEOF"
    )
    assert c1.ssh("nodeforge node health", check=False).returncode == 0
    assert "DRAIN" not in ctl.ssh("scontrol show node c1").stdout
    prom = c1.ssh(
        # params' default metrics_listen, node:9100: the node's own address, not loopback
        "curl -sS http://10.78.0.11:9100/metrics | grep '^nodeforge_health_ok'",
        check=False,
    ).stdout
    assert prom.strip() == "nodeforge_health_ok 1", prom
    # Last, so that everything above is proven even while this fails: with AutoDetect=nvml and
    # no NVIDIA driver loaded, Slurm 24.11.5's gpu/nvml logs "error: Failed to initialize NVML:
    # Driver Not Loaded" (+2 follow-ups) at slurmd start (issue 11 note, 2026-12-03).
    # Fixed: on a GPU-less machine the agent hides libnvidia-ml from slurmd (gres.py).
    dropin = c1.ssh("cat /etc/systemd/system/slurmd.service.d/nodeforge.conf").stdout
    assert "InaccessiblePaths=-/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1" in dropin, dropin
    # Slurm's own level tags ("error:", "fatal:"), not the word: its info line about the
    # missing library says "Last error is".
    log = c1.ssh("grep -E '(error|fatal):' /var/log/slurm/slurmd.log || true").stdout
    print("slurmd errors/fatals:\n" + log)
    # Not Slurm's GPU plugin: slurmd's periodic HealthCheckProgram may run while this test
    # has set expected_gpus=8 above, and then logs the drain it provoked ("error:
    # health_check failed: ... nodeforge-health: nvml: ..."; seen in the CI dry run).
    plugin = [ln for ln in log.splitlines() if "health_check failed" not in ln]
    assert not [ln for ln in plugin if "gpu" in ln.lower() or "nvml" in ln.lower()], log
