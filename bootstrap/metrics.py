"""node_exporter serves the node's metrics where params say (`metrics_listen`), every boot.

The image bakes node_exporter enabled but conditioned on `/etc/nodeforge/metrics.env` and
ordered after nodeforge-init (role `metrics`): nothing is served before the agent has read
this node's params, and a changed `metrics_listen` takes effect at the next boot (or at once,
when the exporter already runs). Its textfile collector serves the health report and the gang
governor's metrics.
"""

from __future__ import annotations

from .host import Host
from .paths import Paths

UNIT = "prometheus-node-exporter.service"
TEXTFILE_DIR = "/var/lib/nodeforge/gang"  # bootstrap/health.py REPORT_DIR, gang metrics


def listen_address(listen: str, address: str) -> str | None:
    """node_exporter's --web.listen-address for params' *listen* (None: off)."""
    if listen == "off":
        return None
    host, _, port = listen.rpartition(":")
    if host == "*":
        return f":{port}"
    if host == "node":
        return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    return listen


def env_text(listen: str) -> str:
    return (
        "# written by nodeforge node init from params metrics_listen; do not edit\n"
        f"ARGS=--collector.textfile.directory={TEXTFILE_DIR} --web.listen-address={listen}\n"
    )


def apply(host: Host, paths: Paths, listen: str, address: str) -> str:
    """Write (or remove, for off) the exporter's arguments; restart it only if it runs and
    they changed. Returns what it serves, for the params step's record."""
    from nodeforge.fsutil import write_atomic

    target = listen_address(listen, address)
    if target is None:
        changed = paths.metrics_env.exists()
        paths.metrics_env.unlink(missing_ok=True)
        if changed and paths.unit_exists(UNIT):
            host.systemctl("stop", "--no-block", UNIT)
        return "off"
    if write_atomic(paths.metrics_env, env_text(target), 0o644) and paths.unit_exists(UNIT):
        # At boot the exporter waits for this agent (After=), so there is nothing to restart;
        # a rerun of `node init` with new params restarts a running one.
        host.systemctl("try-restart", "--no-block", UNIT)
    return target
