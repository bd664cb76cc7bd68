"""What the agent needs to know about and do with the installed Slurm.

- `SlurmFeatures` from /etc/nodeforge/slurm-features.json (written at bake by role slurm).
- Rendering the first-boot templates (Jinja2 imported lazily: it is a node-only dependency).
- A minimal client slurm.conf so `scontrol` can reach slurmctld from a configless node before
  slurmd has fetched the real config.
- systemd drop-ins for slurmd / sackd that override ExecStart (keeping `--systemd`).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeforge import slurmconf
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic
from nodeforge.slurm_facts import has, version_tuple

from .host import Host
from .params import Params, control_char
from .paths import Paths

SLURMCTLD_PORT = 6817
SLURM_USER = "slurm"  # contracts.md: SlurmUser=slurm (Debian's slurmctld unit runs as slurm)
DROPIN_NAME = "nodeforge.conf"


@dataclass(frozen=True)
class SlurmFeatures:
    slurm_version: str
    sackd: bool
    force_requeue_on_fail: bool

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return version_tuple(self.slurm_version)

    @property
    def has_sackd(self) -> bool:
        return self.sackd and has(self.slurm_version, "sackd")

    @property
    def needs_tree_width(self) -> bool:
        """22.05 dynamic nodes need TreeWidth=65533 (fixed in 23.02)."""
        return not has(self.slurm_version, "dynamic_nodes_without_tree_width")


def read_features(paths: Paths) -> SlurmFeatures:
    p = paths.slurm_features
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise NodeforgeError(
            f"{p}: missing; the image's slurm role writes it at bake time "
            '({"slurm_version": "24.11.5", "sackd": true, "force_requeue_on_fail": true}); rebuild the image'
        ) from None
    except json.JSONDecodeError as exc:
        raise NodeforgeError(f"{p}: not valid JSON ({exc}); rebuild the image") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("slurm_version"), str):
        raise NodeforgeError(f'{p}: slurm_version: expected a string like "24.11.5"')
    return SlurmFeatures(
        raw["slurm_version"],
        bool(raw.get("sackd", False)),
        bool(raw.get("force_requeue_on_fail", False)),
    )


def render(paths: Paths, template: str, context: dict[str, Any]) -> str:
    import jinja2  # node dependency (python3-jinja2); imported here to keep cli import light

    tdir = paths.templates
    if not (tdir / template).exists():
        raise NodeforgeError(
            f"{tdir / template}: missing template; the image's roles install it; rebuild the image"
        )
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(tdir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    try:
        return env.get_template(template).render(**context)
    except jinja2.TemplateError as exc:
        raise NodeforgeError(f"{tdir / template}: cannot render: {exc}") from exc


def client_conf(paths: Paths, params: Params) -> Path:
    """A minimal slurm.conf for scontrol on a compute/login node (0644, /run/nodeforge).

    SlurmUser matters: clients restrict their munge credential to SlurmUser's uid, so without
    it slurmctld (running as slurm) rejects them ("Unauthorized credential for client").
    """
    c = params.controller
    host = c.host or c.address
    ctl = f"{host}({c.address})" if c.address and c.host else host
    text = (
        "# written by nodeforge node init: lets scontrol reach slurmctld before slurmd has the config\n"
        + "".join(
            slurmconf.line({k: val}) + "\n"
            for k, val in (
                ("ClusterName", params.cluster_name),
                ("SlurmctldHost", ctl),
                ("SlurmUser", SLURM_USER),
                ("AuthType", "auth/munge"),
            )
        )
    )
    write_atomic(paths.slurm_client_conf, text, 0o644)
    return paths.slurm_client_conf


def conf_server(params: Params) -> str:
    target = params.controller.target
    if ":" in target:  # IPv6: [addr]:port, as Slurm writes host:port for v6
        target = f"[{target}]"
    return f"{target}:{SLURMCTLD_PORT}"


_SD_PATH_RE = re.compile(r"/[A-Za-z0-9_./+-]{1,255}")


def dropin(paths: Paths, unit: str, exec_start: list[str], hide: Sequence[str] = ()) -> bool:
    """Write /etc/systemd/system/<unit>.d/nodeforge.conf overriding ExecStart, with the files in
    *hide* made inaccessible to the service (`-`: a missing one is no error). True if changed."""
    cmd = " ".join(_sd_quote(a) for a in exec_start)
    for p in hide:
        if not _SD_PATH_RE.fullmatch(p) or "/../" in p or p.endswith("/.."):
            raise NodeforgeError(f"systemd InaccessiblePaths: {p!r} is not a plain absolute path")
    text = (
        "# written by nodeforge node init (role step); do not edit, rerun `nodeforge node init`\n"
        # Debian 12's units only start with a local slurm.conf; configless nodes have none.
        "[Unit]\nConditionPathExists=\n\n"
        "[Service]\nExecStart=\n"
        f"ExecStart={cmd}\n" + "".join(f"InaccessiblePaths=-{p}\n" for p in hide)
    )
    return write_atomic(paths.systemd_etc / f"{unit}.d" / DROPIN_NAME, text, 0o644)


_SD_ENV_RE = re.compile(
    r"\$[A-Z_][A-Z0-9_]{0,63}"
)  # "$SLURMD_OPTIONS": an EnvironmentFile= variable
_SD_PLAIN_RE = re.compile(r"[A-Za-z0-9_./:=,@+\[\]-]+")


def _sd_quote(arg: str) -> str:
    """One ExecStart= word that systemd reads back as exactly *arg*.

    systemd expands `%` specifiers on the whole line, splits words (C-style quotes and
    escapes), then expands `$VAR`; so a literal `%` is written `%%` and a literal `$` is `$$`.
    Only a whole word `$NAME` stays an environment expansion (the intended one).
    """
    if _SD_ENV_RE.fullmatch(arg):
        return arg
    if not arg or control_char(arg) is not None:
        raise NodeforgeError(
            f"systemd ExecStart: argument {arg!r} is empty or has a control character"
        )
    if _SD_PLAIN_RE.fullmatch(arg):
        return arg
    quoted = '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return quoted.replace("%", "%%").replace("$", "$$")


def node_conf(params: Params, extra_features: tuple[str, ...] = ()) -> str:
    """The --conf string for `slurmd -Z`: features, gres, and optional CPUs/RealMemory."""
    conf: dict[str, object] = {}
    feats = list(dict.fromkeys([*params.features, *extra_features]))
    if feats:
        conf["Feature"] = ",".join(feats)
    if params.gres:
        conf["Gres"] = ",".join(params.gres)
    if params.cpus:
        conf["CPUs"] = params.cpus
    if params.real_memory:
        conf["RealMemory"] = params.real_memory
    return slurmconf.line(conf)


def hardware_spec(host: Host, params: Params, env: dict[str, str] | None = None) -> dict[str, str]:
    """`slurmd -C` (this node's detected hardware, *env* added) with params overrides."""
    cp = host.run(["slurmd", "-C"], timeout=60, env=env or None)
    spec: dict[str, str] = {}
    for word in shlex.split(cp.stdout.splitlines()[0] if cp.stdout else ""):
        if "=" in word:
            k, v = word.split("=", 1)
            if k in (
                "CPUs",
                "Boards",
                "SocketsPerBoard",
                "CoresPerSocket",
                "ThreadsPerCore",
                "RealMemory",
            ):
                spec[k] = v
    if params.cpus:
        spec["CPUs"] = str(params.cpus)
    if params.real_memory:
        spec["RealMemory"] = str(params.real_memory)
    return spec
