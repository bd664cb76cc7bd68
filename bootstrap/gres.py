"""GPU scheduling: the node's Gres at pre-create, gres.conf and cgroup enforcement.

Configless: slurmctld serves slurm.conf, gres.conf and cgroup.conf to every slurmd, so the
controller renders them at first boot (templates shipped raw by the slurm role):
- `GresTypes=gpu` and gres.conf `AutoDetect=nvml` when the cluster has GPUs (params
  gres_types/gres name gpu, or the controller runs the gpu image). Each slurmd then asks NVML
  for its own GPUs; a node without GPUs reports none.
- cgroup enforcement (proctrack/cgroup, task/cgroup,task/affinity, ConstrainCores/RAMSpace/
  Devices) on VMs and metal. A controller inside a container (the local nspawn cluster, whose
  nodes have a read-only cgroup filesystem) keeps proctrack/linuxproc + task/affinity.
A compute node pre-creates itself with Gres=gpu:<expected_gpus> (readiness gate), because
slurmctld keeps the pre-created definition when slurmd registers: without it a GPU node
would register with no GPUs.
"""

from __future__ import annotations

from pathlib import Path

from nodeforge.fsutil import write_atomic

from .host import Host
from .params import Params
from .paths import Paths
from .slurm_setup import render

GPU = "gpu"
GPU_IMAGE_FACTS = Path("/etc/nodeforge/gpu.json")  # written by the gpu role (gpu variant)
HEALTH_PROGRAM = "/usr/local/sbin/nodeforge-health"
NVML_LIBRARY = "libnvidia-ml.so.1"


def node_gres(params: Params) -> tuple[str, ...]:
    """params.gres, plus gpu:<expected_gpus> when the node expects GPUs and names none."""
    if params.expected_gpus and not any(g.split(":", 1)[0] == GPU for g in params.gres):
        return (*params.gres, f"{GPU}:{params.expected_gpus}")
    return params.gres


def gpu_image(paths: Paths) -> bool:
    return (paths.root / GPU_IMAGE_FACTS.relative_to("/")).exists()


def hardware_spec_env(paths: Paths) -> dict[str, str]:
    """Environment for `slurmd -C` where NVML is installed: libnvidia-ml preloaded.

    `slurmd -C` probes every GPU plugin in turn (nvml, nvidia, rsmi, ...) and dlcloses each
    one; gpu/nvml had dlopened libnvidia-ml RTLD_GLOBAL. On the next probe's dlopen ld.so
    follows a stale link map into the unmapped library and slurmd dies of SIGSEGV before it
    prints the spec (Slurm 24.11.5, driver 550.163.01, glibc 2.41, in qemu without a GPU;
    LD_DEBUG=files shows the crash at the dlopen of librocm_smi64.so). Preloaded, the
    library is part of the initial namespace and never unmapped. Nothing else changes.
    """
    for lib in sorted((paths.root / "usr/lib").glob(f"*/{NVML_LIBRARY}")):
        return {"LD_PRELOAD": "/" + str(lib.relative_to(paths.root))}
    return {}


NVIDIA_PCI_VENDOR = "0x10de"


def nvidia_gpu_present(paths: Paths) -> bool:
    """An NVIDIA display-class PCI function (a GPU: class 0x03xxxx) is on this machine's bus."""
    for dev in sorted((paths.root / "sys/bus/pci/devices").glob("*")):
        try:
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
        except OSError:
            continue
        if vendor == NVIDIA_PCI_VENDOR and klass.startswith("0x03"):
            return True
    return False


def slurmd_hidden_paths(paths: Paths) -> list[str]:
    """NVML libraries slurmd must not see: on a gpu image booted without any NVIDIA GPU.

    There, gres.conf's AutoDetect=nvml makes slurmd's gpu/nvml plugin call nvmlInit, which
    fails ("error: Failed to initialize NVML: Driver Not Loaded" and two follow-ups at every
    start). Without the library the plugin is not loaded, slurmd logs one info line and
    reports 0 GPUs, which is the truth (Slurm's own path for GPU-less nodes). Decided at every
    boot, like the persistence daemon; a node with GPUs is never affected.
    """
    if not gpu_image(paths) or nvidia_gpu_present(paths):
        return []
    libs = (paths.root / "usr/lib").glob(f"*/{NVML_LIBRARY.removesuffix('.1')}*")
    return ["/" + str(p.relative_to(paths.root)) for p in sorted(libs)]


def in_container(host: Host) -> bool:
    # systemd-detect-virt --container exits 0 inside a container (nspawn, docker, lxc).
    return host.ok(["systemd-detect-virt", "--quiet", "--container"], timeout=10)


def slurm_conf_extra(
    host: Host, paths: Paths, params: Params, gres_types: list[str]
) -> tuple[list[str], dict]:
    """(GresTypes, extra slurm.conf.j2 variables) for this cluster."""
    types = list(gres_types)
    if GPU not in types and gpu_image(paths):
        types.append(GPU)
    enforce = not in_container(host)
    extra = {
        "proctrack_type": "proctrack/cgroup" if enforce else "proctrack/linuxproc",
        "task_plugin": "task/cgroup,task/affinity" if enforce else "task/affinity",
        "health_check_program": HEALTH_PROGRAM if params.health_interval else "",
        "health_check_interval": params.health_interval,
    }
    return types, extra


def write_confs(host: Host, paths: Paths, gres_types: list[str], enforce: bool) -> dict:
    """gres.conf (only with GPUs) and cgroup.conf in /etc/slurm, served to every slurmd."""
    detail: dict[str, object] = {"cgroup_enforce": enforce}
    gres_conf = paths.slurm_etc / "gres.conf"
    if GPU in gres_types:
        write_atomic(gres_conf, render(paths, "gres.conf.j2", {"autodetect": "nvml"}), 0o644)
        detail["gres_conf"] = "AutoDetect=nvml"
    else:
        gres_conf.unlink(missing_ok=True)
    text = render(paths, "cgroup-boot.conf.j2", {"constrain": enforce})
    write_atomic(paths.slurm_etc / "cgroup.conf", text, 0o644)
    return detail
