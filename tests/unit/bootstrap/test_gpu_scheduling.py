"""GPU scheduling in the agent: expected_gpus params, the pre-created node's Gres, gres.conf,
cgroup enforcement (VM/metal vs container) and the health check before RESUME."""

from __future__ import annotations

import math

import pytest

from nodeforge.bootstrap import gres
from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.errors import NodeforgeError
from tests.unit.support import COMPUTE, CTL, make

pytestmark = pytest.mark.unit

BASE = {"role": "compute", "cluster_name": "demo", "controller": {"host": "ctl"}}


@pytest.mark.parametrize("value", [-1, 65, 10**30, "8", "8\n", True, 8.0, math.nan, [8], {"n": 8}])
def test_bad_expected_gpus_names_the_field(value):
    with pytest.raises(ParamsError, match=r"node\.yaml: expected_gpus: "):
        parse_params({**BASE, "expected_gpus": value}, "node.yaml")


@pytest.mark.parametrize("value", [-1, 86401, "300", True, math.inf])
def test_bad_health_interval_names_the_field(value):
    with pytest.raises(ParamsError, match=r"node\.yaml: health_interval: "):
        parse_params({**BASE, "health_interval": value}, "node.yaml")


def test_expected_gpus_bounds_and_default():
    assert parse_params(BASE, "n").expected_gpus is None
    assert parse_params({**BASE, "expected_gpus": 0}, "n").expected_gpus == 0
    assert parse_params({**BASE, "expected_gpus": 64}, "n").expected_gpus == 64
    assert parse_params(BASE, "n").health_interval == 300


def test_node_gres_adds_expected_gpus_only_when_no_gpu_gres_given():
    p = parse_params({**BASE, "expected_gpus": 8}, "n")
    assert gres.node_gres(p) == ("gpu:8",)
    p = parse_params({**BASE, "expected_gpus": 8, "gres": ["gpu:h100:8", "nvme:1"]}, "n")
    assert gres.node_gres(p) == ("gpu:h100:8", "nvme:1")
    assert gres.node_gres(parse_params(BASE, "n")) == ()


def test_controller_on_a_vm_enforces_cgroups_and_serves_gres_conf(tmp_path):
    agent, fm, paths, _ = make(
        tmp_path, {**CTL, "gres_types": ["gpu"], "health_interval": 120}, slurm_version="24.11.5"
    )
    fm.fail_on["systemd-detect-virt"] = 1  # not a container: a VM or metal
    agent.init()
    conf = (paths.slurm_etc / "slurm.conf").read_text()
    cg = (paths.slurm_etc / "cgroup.conf").read_text()
    assert "GresTypes=gpu" in conf
    assert (paths.slurm_etc / "gres.conf").read_text().splitlines()[-1] == "AutoDetect=nvml"
    for line in ("ConstrainCores=yes", "ConstrainRAMSpace=yes", "ConstrainDevices=yes"):
        assert line in cg.splitlines()


def test_real_slurm_conf_template_with_enforcement_and_health(tmp_path):
    import shutil
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    agent, fm, paths, _ = make(
        tmp_path, {**CTL, "gres_types": ["gpu"], "health_interval": 120}, slurm_version="24.11.5"
    )
    shutil.copy(repo / "roles/slurm/templates/slurm.conf.j2", paths.templates / "slurm.conf.j2")
    fm.fail_on["systemd-detect-virt"] = 1
    agent.init()
    lines = (paths.slurm_etc / "slurm.conf").read_text().splitlines()
    for line in (
        "ProctrackType=proctrack/cgroup",
        "TaskPlugin=task/cgroup,task/affinity",
        "GresTypes=gpu",
        "HealthCheckProgram=/usr/local/sbin/nodeforge-health",
        "HealthCheckInterval=120",
        "HealthCheckNodeState=ANY,CYCLE",
    ):
        assert line in lines, line


def test_controller_in_a_container_keeps_what_works_in_nspawn(tmp_path):
    import shutil
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    agent, _fm, paths, _ = make(tmp_path, {**CTL, "health_interval": 0}, slurm_version="24.11.5")
    shutil.copy(repo / "roles/slurm/templates/slurm.conf.j2", paths.templates / "slurm.conf.j2")
    agent.init()  # FakeMachine: systemd-detect-virt --container exits 0
    lines = (paths.slurm_etc / "slurm.conf").read_text().splitlines()
    assert "ProctrackType=proctrack/linuxproc" in lines and "TaskPlugin=task/affinity" in lines
    assert not any(ln.startswith(("HealthCheck", "GresTypes")) for ln in lines)
    assert "ConstrainDevices=no" in (paths.slurm_etc / "cgroup.conf").read_text()
    assert not (paths.slurm_etc / "gres.conf").exists()


def test_gpu_image_controller_adds_gres_type_gpu(tmp_path):
    agent, _fm, paths, _ = make(tmp_path, CTL, slurm_version="24.11.5")
    (tmp_path / "etc/nodeforge").mkdir(parents=True, exist_ok=True)
    (tmp_path / "etc/nodeforge/gpu.json").write_text("{}")
    agent.init()
    assert (paths.slurm_etc / "gres.conf").exists()


def test_compute_precreate_carries_gpus_and_health_runs_before_resume(tmp_path):
    node_yaml = {**COMPUTE, "gres": [], "expected_gpus": 8}
    agent, fm, _paths, _ = make(tmp_path, node_yaml)
    state = agent.init()
    node = fm.nodes["c1"]
    assert node["Gres"] == "gpu:8"  # pre-created with its GPUs: never registered GPU-less
    # FixtureMachine's nvidia-smi answers no GPU: the gate keeps the node drained, with why.
    assert node["State"].endswith("+DRAIN")
    assert node["Reason"] == "nodeforge-health: gpu_count: 0 of 8 GPUs"
    assert state.steps["ready"].detail["slurm"].startswith("kept drained (nodeforge-health:")
    assert (tmp_path / "usr/local/sbin/nodeforge-health").stat().st_mode & 0o111
    assert any(c[0] == "nvidia-smi" for c in fm.calls)


def test_healthy_cpu_compute_resumes(tmp_path):
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    agent.init()
    assert fm.nodes["c1"]["State"] == "IDLE"
    assert not any(c[0] == "nvidia-smi" for c in fm.calls)  # no expected_gpus: no GPU checks
    assert (tmp_path / "var/lib/nodeforge/gang/health.json").exists()


NVML_LIB = "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"


def test_hardware_spec_env_preloads_nvml_only_where_installed(tmp_path):
    from nodeforge.bootstrap.paths import Paths

    paths = Paths.under(tmp_path)
    assert gres.hardware_spec_env(paths) == {}  # the CPU image: slurmd -C as it is
    (tmp_path / NVML_LIB).parent.mkdir(parents=True)
    (tmp_path / NVML_LIB).write_bytes(b"")
    assert gres.hardware_spec_env(paths) == {"LD_PRELOAD": "/" + NVML_LIB}


def test_gpu_image_compute_registers_although_slurmd_C_crashes_without_preload(tmp_path):
    """Root cause of the gpu_vm e2e failure (issue 11): on the gpu image `slurmd -C` died of
    SIGSEGV (exit -11, seen in qemu without a GPU), so the role step failed and the node was
    never created. The fake `slurmd -C` below does what the real one did there unless
    libnvidia-ml is preloaded."""
    (tmp_path / NVML_LIB).parent.mkdir(parents=True)
    (tmp_path / NVML_LIB).write_bytes(b"")
    agent, fm, _paths, _ = make(tmp_path, COMPUTE)
    seen: list[str | None] = []
    answer = fm.answer

    def slurmd_c_crashes_unless_preloaded(argv, timeout, env):
        if argv[:2] == ["slurmd", "-C"]:
            seen.append(env.get("LD_PRELOAD"))
            if env.get("LD_PRELOAD") != "/" + NVML_LIB:
                return -11, ""
        return answer(argv, timeout, env)

    fm.answer = slurmd_c_crashes_unless_preloaded
    state = agent.init()
    assert seen == ["/" + NVML_LIB]
    assert state.status == "ready", state.last_error
    assert fm.nodes["c1"]["CPUs"] == "4" and fm.nodes["c1"]["State"] == "IDLE"


def _gpu_image_tree(root):
    """A gpu image's marks under *root*: the gpu role's facts file and the NVML library."""
    facts = root / gres.GPU_IMAGE_FACTS.relative_to("/")
    facts.parent.mkdir(parents=True, exist_ok=True)
    facts.write_text("{}")
    lib = root / NVML_LIB
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_bytes(b"")
    (lib.parent / "libnvidia-ml.so.550.163.01").write_bytes(b"")


def _pci(root, slot, vendor, klass):
    d = root / "sys/bus/pci/devices" / slot
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(klass + "\n")


def test_gpu_image_without_a_gpu_hides_nvml_from_slurmd(tmp_path):
    """Without an NVIDIA GPU, slurmd's gpu/nvml logs three NVML errors at every start (seen in
    the gpu_vm e2e); hidden, it logs one info line and reports 0 GPUs."""
    _gpu_image_tree(tmp_path)
    _pci(tmp_path, "0000:00:02.0", "0x1234", "0x030000")  # qemu's VGA: not NVIDIA
    _pci(tmp_path, "0000:00:05.0", "0x10de", "0x068000")  # an NVIDIA bridge (NVSwitch): no GPU
    agent, _fm, paths, _ = make(tmp_path, COMPUTE)
    assert agent.init().status == "ready"
    dropin = (paths.systemd_etc / "slurmd.service.d/nodeforge.conf").read_text()
    hidden = [ln for ln in dropin.splitlines() if ln.startswith("InaccessiblePaths=")]
    assert hidden == [
        "InaccessiblePaths=-/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "InaccessiblePaths=-/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.163.01",
    ]


def test_a_gpu_on_the_bus_or_a_cpu_image_hides_nothing(tmp_path):
    from nodeforge.bootstrap.paths import Paths

    cpu = Paths.under(tmp_path / "cpu")
    assert gres.slurmd_hidden_paths(cpu) == []  # CPU image: no facts file
    gpu_root = tmp_path / "gpu"
    _gpu_image_tree(gpu_root)
    _pci(gpu_root, "0000:17:00.0", "0x10de", "0x030200")  # an H100/H200: 3D controller
    assert gres.slurmd_hidden_paths(Paths.under(gpu_root)) == []


@pytest.mark.parametrize(
    "bad",
    ["relative/lib.so", "/usr/lib/x y.so", "/usr/lib/a\nExecStart=/bin/sh", "/usr/../etc/shadow"],
)
def test_dropin_refuses_a_hidden_path_that_is_not_plain(tmp_path, bad):
    from nodeforge.bootstrap.paths import Paths
    from nodeforge.bootstrap.slurm_setup import dropin

    with pytest.raises(NodeforgeError, match="InaccessiblePaths"):
        dropin(Paths.under(tmp_path), "slurmd.service", ["/usr/sbin/slurmd"], ["/ok", bad])
    assert not (tmp_path / "etc/systemd/system/slurmd.service.d").exists()  # nothing written
