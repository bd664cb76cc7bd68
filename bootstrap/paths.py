"""Every filesystem location the agent touches, in one injectable object.

Production uses `Paths()` (root "/"); unit tests use `Paths.under(tmp_path)` so nothing needs root.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    root: Path = Path("/")
    # Inputs
    node_yaml: Path = Path("/etc/nodeforge/node.yaml")
    cmdline: Path = Path("/proc/cmdline")
    boot_id: Path = Path("/proc/sys/kernel/random/boot_id")  # new at every boot (and nspawn start)
    proc_uptime: Path = Path("/proc/uptime")  # CLOCK_BOOTTIME: no jumps when NTP steps the clock
    cloud_init_user_data: Path = Path("/var/lib/cloud/instance/user-data.txt")
    hyperpod_resource_config: Path = Path("/opt/ml/config/resource_config.json")
    hyperpod_provisioning_parameters: Path = Path("/opt/ml/config/provisioning_parameters.json")
    slurm_features: Path = Path("/etc/nodeforge/slurm-features.json")
    templates: Path = Path("/usr/share/nodeforge/templates")
    on_init_d: Path = Path("/etc/nodeforge/on-init.d")
    image_json: Path = Path("/etc/nodeforge/image.json")  # the image's manifest (every image)
    # Outputs
    state_file: Path = Path("/var/lib/nodeforge/state.json")
    params_json: Path = Path("/var/lib/nodeforge/params.json")
    # Written once this disk has registered its node in slurmctld (readiness.Gate.hold)
    slurm_registered: Path = Path("/var/lib/nodeforge/slurm-registered")
    # Present while the agent's last run failed because slurmctld did not answer: the
    # condition of nodeforge-rejoin.service (ConditionPathExists), so its timer costs nothing
    # on every other node (bootstrap/rejoin.py).
    rejoin_wanted: Path = Path("/var/lib/nodeforge/rejoin-wanted")
    hook_cache: Path = Path("/var/lib/nodeforge/hooks")
    log_dir: Path = Path("/var/log/nodeforge")
    secrets: Path = Path("/etc/nodeforge/secrets")
    # node_exporter's arguments from params (role metrics: its unit reads this file, and does
    # not start without it)
    metrics_env: Path = Path("/etc/nodeforge/metrics.env")
    # controller: the gang governor's config, written from params `gang` when they have it
    gang_yaml: Path = Path("/etc/nodeforge/gang.yaml")
    # node_exporter's textfile collector directory (metrics.TEXTFILE_DIR): health report,
    # gang metrics, the agent's bootstrap outcome (failures.PROM_FILE)
    textfile_dir: Path = Path("/var/lib/nodeforge/gang")
    run_dir: Path = Path("/run/nodeforge")
    # The agent's health pass, for slurmd's start-up HealthCheckProgram run (health.py, stamp).
    health_stamp: Path = Path("/run/nodeforge/health/passed")
    slurm_etc: Path = Path("/etc/slurm")
    munge_key: Path = Path("/etc/munge/munge.key")
    ssh_etc: Path = Path("/etc/ssh")
    root_ssh: Path = Path("/root/.ssh")  # the admin keys from IMDS public-keys
    machine_id: Path = Path("/etc/machine-id")
    hostname_file: Path = Path("/etc/hostname")
    hosts_file: Path = Path("/etc/hosts")
    systemd_etc: Path = Path("/etc/systemd/system")
    systemd_lib: tuple[Path, ...] = field(
        default=(Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
    )

    @classmethod
    def under(cls, root: str | Path) -> Paths:
        """All default paths re-rooted below *root* (for tests and for offline image trees)."""
        root = Path(root)
        base = cls()
        kw: dict[str, object] = {"root": root}
        for name in cls.__dataclass_fields__:  # type: ignore[attr-defined]
            if name == "root":
                continue
            default = getattr(base, name)
            if isinstance(default, tuple):
                kw[name] = tuple(root / p.relative_to("/") for p in default)
            else:
                kw[name] = root / Path(default).relative_to("/")
        return cls(**kw)  # type: ignore[arg-type]

    @property
    def hooks_log_dir(self) -> Path:
        return self.log_dir / "hooks"

    @property
    def slurm_client_conf(self) -> Path:
        """Minimal client slurm.conf the agent uses for scontrol before slurmd has the config."""
        return self.run_dir / "slurm-client.conf"

    def unit_exists(self, unit: str) -> bool:
        return any((d / unit).exists() for d in (self.systemd_etc, *self.systemd_lib))
