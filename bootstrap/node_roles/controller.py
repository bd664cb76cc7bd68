"""Controller role step.

Order (each waits for the previous to answer, every wait bounded by params.wait_timeout):
MariaDB → accounting database + `slurm` DB user with a generated password (root-only file) →
slurmdbd.conf → slurm.conf (sacctmgr reads it to find slurmdbd) → slurmdbd ANSWERING
(`sacctmgr -n show cluster`) → cluster registered (`sacctmgr -i add cluster`) → slurmctld →
nodeforge-gang.service. Starting slurmctld only after the cluster exists in slurmdbd prevents
the "no TRES" / CLUSTER ID MISMATCH race. With accounting: false, only slurmctld is started.
"""

from __future__ import annotations

import secrets

from nodeforge import slurmconf
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic
from nodeforge.slurm_facts import controller_up, has

from .. import gres
from ..host import private_dir
from ..slurm_setup import render
from . import RoleContext

DB_NAME = "slurm_acct_db"
DB_USER = "slurm"
PASS_FILE = "slurmdbd_storage_pass"
GANG_UNIT = "nodeforge-gang.service"


def password(ctx: RoleContext) -> str:
    """The DB password: generated once, kept in a root-only 0600 file, never logged."""
    path = ctx.paths.secrets / PASS_FILE
    try:
        pw = path.read_text().strip()
        if pw:
            return pw
    except FileNotFoundError:
        pass
    private_dir(ctx.paths.secrets)
    pw = secrets.token_urlsafe(32)  # [A-Za-z0-9_-]: safe inside SQL single quotes
    write_atomic(path, pw + "\n", 0o600)
    return pw


def slurm_conf_context(ctx: RoleContext) -> dict:
    p = ctx.params
    gres_types = list(p.gres_types) or sorted({g.split(":", 1)[0] for g in p.gres})
    # GPU clusters: GresTypes=gpu; cgroup enforcement and HealthCheckProgram (bootstrap/gres.py)
    gres_types, gpu_extra = gres.slurm_conf_extra(ctx.host, ctx.paths, p, gres_types)
    prolog_flags = ["Alloc"]
    if ctx.features.force_requeue_on_fail:
        prolog_flags.append("ForceRequeueOnFail")
    return {
        "cluster_name": p.cluster_name,
        "controller_host": ctx.node,
        "controller_addr": ctx.address,
        "max_node_count": p.max_node_count,
        "slurm_version": ctx.features.slurm_version,
        # From the one table of Slurm thresholds (nodeforge/slurm_versions.json).
        "force_requeue_on_fail": has(ctx.features.slurm_version, "prolog_force_requeue_on_fail"),
        "tree_width_65533": ctx.features.needs_tree_width,
        "partitions": [
            {"name": x.name, "default": x.default, "max_time": x.max_time} for x in p.partitions
        ],
        "gres_types": gres_types,
        "prolog_flags": prolog_flags,
        "accounting": p.accounting,
        "dbd_host": ctx.node,
        **gpu_extra,
    }


def run(ctx: RoleContext) -> dict:
    h, paths, p = ctx.host, ctx.paths, ctx.params
    detail: dict[str, object] = {}
    if p.accounting:
        h.start("mariadb.service", timeout=p.wait_timeout)
        detail["mariadb_wait_s"] = round(
            h.wait_until(
                "MariaDB answering (mariadb-admin ping)",
                lambda: h.ok(["mariadb-admin", "--protocol=socket", "ping"], timeout=10),
                timeout=p.wait_timeout,
                hint="see `journalctl -u mariadb`",
            ),
            2,
        )
        pw = password(ctx)
        sql = (
            f"CREATE DATABASE IF NOT EXISTS {DB_NAME};\n"
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'localhost' IDENTIFIED BY '{pw}';\n"
            f"ALTER USER '{DB_USER}'@'localhost' IDENTIFIED BY '{pw}';\n"
            f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'localhost';\n"
            "FLUSH PRIVILEGES;\n"
        )
        # The password goes through stdin, never argv (visible in ps) nor a log line.
        h.run(["mariadb", "--protocol=socket", "-u", "root"], input=sql, timeout=60, redact=[pw])
        dbd = render(
            paths,
            "slurmdbd.conf.j2",
            {
                "dbd_host": ctx.node,
                "storage_host": "localhost",
                "storage_user": DB_USER,
                "storage_pass": pw,
                "storage_loc": DB_NAME,
            },
        )
        dbd_path = paths.slurm_etc / "slurmdbd.conf"
        write_atomic(dbd_path, dbd, 0o600)
        h.chown(dbd_path, "slurm", "slurm")
    _write_slurm_conf(ctx)
    if p.accounting:
        h.start("slurmdbd.service", timeout=p.wait_timeout)
        detail["slurmdbd_wait_s"] = round(
            h.wait_until(
                "slurmdbd answering (sacctmgr -n show cluster)",
                lambda: h.ok(["sacctmgr", "-n", "show", "cluster"], timeout=15),
                timeout=p.wait_timeout,
                interval=1.0,
                hint="see `journalctl -u slurmdbd` and /var/log/slurm/slurmdbd.log",
            ),
            2,
        )
        if not cluster_registered(ctx):
            h.run(["sacctmgr", "-i", "add", "cluster", p.cluster_name], timeout=60)
            detail["cluster"] = "registered"
        else:
            detail["cluster"] = "already registered"
    h.start("slurmctld.service", timeout=p.wait_timeout)
    detail["slurmctld_wait_s"] = round(
        h.wait_until(
            "slurmctld answering (scontrol ping)",
            lambda: _ping(ctx),
            timeout=p.wait_timeout,
            hint="see `journalctl -u slurmctld` and /var/log/slurm/slurmctld.log",
        ),
        2,
    )
    changed = write_gang_yaml(ctx)
    if changed is not None:
        detail["gang_yaml"] = "written" if changed else "unchanged"
    if paths.unit_exists(GANG_UNIT):
        if changed:
            # a governor already running (`node init` run again by hand) reads the new file;
            # a stopped one is left stopped (try-restart), and starts below or after us
            h.systemctl("try-restart", "--no-block", GANG_UNIT)
        # --no-block: the gang unit is ordered After=nodeforge-init.service, i.e. after us
        h.systemctl("enable", "--now", "--no-block", GANG_UNIT)
        detail["gang"] = "enabled"
    else:
        detail["gang"] = f"{GANG_UNIT} not installed"
    return detail


def write_gang_yaml(ctx: RoleContext) -> bool | None:
    """Params `gang` -> /etc/nodeforge/gang.yaml (atomic, 0644: no secrets in it). The keys
    were validated at the params step by gang.yaml's own parser; they are written as given, so
    a default the operator did not set stays the governor's default. Returns whether the file
    changed, or None when params have no `gang` (an existing file is then left as it is)."""
    import yaml

    gang = ctx.params.gang
    if gang is None:
        return None
    text = (
        "# Written by `nodeforge node init` from the node params' `gang` section; it is\n"
        "# rewritten at every boot: change the params, not this file (docs/gang.md).\n"
        + yaml.safe_dump(gang, sort_keys=False, default_flow_style=False)
    )
    return write_atomic(ctx.paths.gang_yaml, text, 0o644)


def _checked(context: dict) -> dict:
    """Every value the template writes as a Slurm value passes the one Slurm value writer
    (defence in depth: params grammar already refuses these)."""
    for key, val in (
        ("ClusterName", context["cluster_name"]),
        ("SlurmctldHost", f"{context['controller_host']}({context['controller_addr']})"),
        ("AccountingStorageHost", context["dbd_host"]),
        *(("GresTypes", g) for g in context["gres_types"]),
        *(("PartitionName", p["name"]) for p in context["partitions"]),
        *(("MaxTime", p["max_time"]) for p in context["partitions"]),
    ):
        if slurmconf.value(key, val) != str(val):
            raise slurmconf.SlurmConfError(f"slurm.conf: {key}={val!r} needs quoting; refused")
    return context


def _write_slurm_conf(ctx: RoleContext) -> None:
    conf = _checked(slurm_conf_context(ctx))
    text = render(ctx.paths, "slurm.conf.j2", conf)
    write_atomic(ctx.paths.slurm_etc / "slurm.conf", text, 0o644)
    gres.write_confs(
        ctx.host, ctx.paths, conf["gres_types"], conf["proctrack_type"] == "proctrack/cgroup"
    )


def cluster_registered(ctx: RoleContext) -> bool:
    cp = ctx.host.run(
        ["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"], timeout=30, check=False
    )
    if cp.returncode != 0:
        raise NodeforgeError(f"sacctmgr show cluster failed: {(cp.stdout or '').strip()}")
    return ctx.params.cluster_name in {line.strip() for line in (cp.stdout or "").splitlines()}


def _ping(ctx: RoleContext) -> bool:
    return controller_up(lambda argv: ctx.host.run(argv, check=False, timeout=15))


def verify(ctx: RoleContext) -> bool:
    h = ctx.host
    units = ["slurmctld.service"]
    if ctx.params.accounting:
        units = ["mariadb.service", "slurmdbd.service", *units]
    return all(h.is_active(u) for u in units) and _ping(ctx)
