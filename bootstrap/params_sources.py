"""Where params come from. First source found wins:

1. file          /etc/nodeforge/node.yaml
2. cmdline       nodeforge.* keys on the kernel command line (+ nodeforge.params=<url>)
3. user-data     cloud-init's copy (/var/lib/cloud/instance/user-data.txt), else EC2 IMDSv2
4. hyperpod      /opt/ml/config/resource_config.json + provisioning_parameters.json

A source that is present but invalid is an error (it does not fall through to the next one):
a typo in node.yaml must never silently turn a node into something else.
"""

from __future__ import annotations

import json
import logging
import shlex
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nodeforge.errors import NodeforgeError

from .params import Params, ParamsError, parse_params
from .paths import Paths

log = logging.getLogger("nodeforge.params")

IMDS_URL = "http://169.254.169.254"
IMDS_TOKEN_TTL = 21600


@dataclass(frozen=True)
class Loaded:
    params: Params
    source: str  # "file:/etc/nodeforge/node.yaml", "cmdline", "imds", "cloud-init", "hyperpod"


@dataclass
class SourceConfig:
    paths: Paths
    imds_url: str | None = IMDS_URL  # None disables IMDS (e.g. the local nspawn cluster)
    imds_timeout: float = 1.0
    own_addresses: Callable[[], Iterable[str]] | None = None  # for HyperPod self-lookup
    hostname: Callable[[], str] | None = None


def load_params(cfg: SourceConfig) -> Loaded:
    for _name, fn in (
        ("file", _from_file),
        ("cmdline", _from_cmdline),
        ("user-data", _from_user_data),
        ("hyperpod", _from_hyperpod),
    ):
        got = fn(cfg)
        if got is not None:
            log.info("params from %s", got.source)
            return got
    p = cfg.paths
    raise NodeforgeError(
        "no node params found. Provide one of: "
        f"{p.node_yaml} (see docs/agent.md), nodeforge.role=... on the kernel command line, "
        "EC2 user-data with a `nodeforge:` section, or HyperPod's "
        f"{p.hyperpod_resource_config} + {p.hyperpod_provisioning_parameters}"
    )


# -- 1. node.yaml ------------------------------------------------------------------------------
def _from_file(cfg: SourceConfig) -> Loaded | None:
    path = cfg.paths.node_yaml
    if not path.exists():
        return None
    data = _yaml(path.read_text(), str(path))
    return Loaded(parse_params(data, str(path)), f"file:{path}")


def _yaml(text: str, label: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ParamsError(f"{label}: not valid YAML: {exc}") from exc


# -- 2. kernel command line ----------------------------------------------------------------------
# nodeforge.<field>=<value>; list fields are comma separated; nodeforge.params=<url> loads a YAML
# document (file://, http(s)://) that the other nodeforge.* keys then override.
_CMDLINE_LISTS = {"features", "gres"}
_CMDLINE_INTS = {"cpus", "real_memory", "max_node_count", "hook_retries"}
_CMDLINE_FLOATS = {"hook_timeout", "wait_timeout", "hook_backoff", "hook_backoff_max"}
_CMDLINE_ALIASES = {"cluster": "cluster_name", "node": "node_name"}


def parse_cmdline(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    for w in words:
        if w.startswith("nodeforge.") and "=" in w:
            k, val = w[len("nodeforge.") :].split("=", 1)
            out[_CMDLINE_ALIASES.get(k, k)] = val
    return out


def _from_cmdline(cfg: SourceConfig) -> Loaded | None:
    try:
        text = cfg.paths.cmdline.read_text()
    except OSError:
        return None
    kv = parse_cmdline(text)
    if not kv:
        return None
    label = "kernel command line"
    data: dict[str, Any] = {}
    url = kv.pop("params", None)
    if url:
        data = (
            _yaml(_fetch_text(url, label + " nodeforge.params"), f"{label} nodeforge.params={url}")
            or {}
        )
        if not isinstance(data, dict):
            raise ParamsError(f"{label}: nodeforge.params={url}: expected a YAML mapping")
    for k, val in kv.items():
        path = f"nodeforge.{k}"
        if k in _CMDLINE_LISTS:
            data[k] = [s for s in val.split(",") if s]
        elif k in _CMDLINE_INTS:
            try:
                data[k] = int(val)
            except ValueError:
                raise ParamsError(f"{label}: {path}: expected an integer, got {val!r}") from None
        elif k in _CMDLINE_FLOATS:
            try:
                data[k] = float(val)
            except ValueError:
                raise ParamsError(f"{label}: {path}: expected a number, got {val!r}") from None
        elif k == "accounting":
            if val not in ("0", "1", "true", "false", "yes", "no"):
                raise ParamsError(f"{label}: {path}: expected true or false, got {val!r}")
            data[k] = val in ("1", "true", "yes")
        else:
            data[k] = val
    return Loaded(parse_params(data, label), "cmdline")


def _fetch_text(url: str, label: str, timeout: float = 10.0) -> str:
    if url.startswith("file://"):
        try:
            return Path(url[len("file://") :]).read_text()
        except OSError as exc:
            raise ParamsError(f"{label}: cannot read {url}: {exc.strerror}") from exc
    if url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            raise ParamsError(f"{label}: cannot fetch {url}: {exc}") from exc
    raise ParamsError(f"{label}: {url!r}: use a file:// or http(s):// URL")


# -- 3. cloud-init / EC2 user-data ---------------------------------------------------------------
def params_from_user_data(text: str, label: str) -> dict[str, Any] | None:
    """User-data is ours if it is a YAML mapping (optionally #cloud-config) with a `nodeforge:`
    section, or a plain YAML mapping with a `role` key. Scripts and other formats are not ours."""
    stripped = text.lstrip()
    if not stripped or stripped.startswith(("#!", "Content-Type:")):
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    if not isinstance(data, dict):
        return None
    if "nodeforge" in data:
        section = data["nodeforge"]
        if not isinstance(section, dict):
            raise ParamsError(f"{label}: nodeforge: expected a mapping of node params")
        return section
    if "role" in data and not stripped.startswith("#cloud-config"):
        return data
    return None


def _from_user_data(cfg: SourceConfig) -> Loaded | None:
    ci = cfg.paths.cloud_init_user_data
    if ci.exists():
        section = params_from_user_data(ci.read_text(errors="replace"), str(ci))
        if section is not None:
            return Loaded(parse_params(section, f"{ci} nodeforge"), "cloud-init")
    if not cfg.imds_url:
        return None
    text = imds_user_data(cfg.imds_url, cfg.imds_timeout)
    if text is None:
        return None
    label = "EC2 user-data (IMDSv2)"
    section = params_from_user_data(text, label)
    if section is None:
        return None
    return Loaded(parse_params(section, label + " nodeforge"), "imds")


def imds_user_data(base_url: str, timeout: float = 1.0) -> str | None:
    """IMDSv2: PUT a session token (TTL header), then GET user-data with it.

    Returns None when there is no IMDS (connection refused, unreachable, or no answer within
    *timeout* seconds) or no user-data (404). Never waits longer than about 2 × timeout.
    """
    base = base_url.rstrip("/")
    try:
        req = urllib.request.Request(
            f"{base}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL)},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            token = r.read().decode().strip()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        log.info("no IMDS at %s (%s)", base, exc)
        return None
    try:
        req = urllib.request.Request(
            f"{base}/latest/user-data", headers={"X-aws-ec2-metadata-token": token}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise NodeforgeError(f"IMDS user-data at {base}: HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError) as exc:
        log.info("IMDS user-data unavailable at %s (%s)", base, exc)
        return None


# -- 4. HyperPod ---------------------------------------------------------------------------------
def _from_hyperpod(cfg: SourceConfig) -> Loaded | None:
    rc_path = cfg.paths.hyperpod_resource_config
    pp_path = cfg.paths.hyperpod_provisioning_parameters
    if not (rc_path.exists() and pp_path.exists()):
        return None
    rc = _json(rc_path)
    pp = _json(pp_path)
    addrs = set(cfg.own_addresses() if cfg.own_addresses else _own_addresses())
    host = cfg.hostname() if cfg.hostname else _hostname()
    data = hyperpod_params(rc, pp, addrs, host, str(rc_path), str(pp_path))
    return Loaded(parse_params(data, f"{pp_path} (HyperPod)"), "hyperpod")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ParamsError(f"{path}: not valid JSON: {exc}") from exc


def hyperpod_params(
    rc: Any, pp: Any, own_addresses: set[str], hostname: str, rc_label: str, pp_label: str
) -> dict[str, Any]:
    """Map HyperPod's two files, read as they are, to a nodeforge params mapping.

    provisioning_parameters.json: {version, workload_manager, controller_group, login_group,
    worker_groups: [{instance_group_name, partition_name}], ...}; an optional `nodeforge` section
    carries any other params (munge_key_file, hooks, ...). resource_config.json:
    {InstanceGroups: [{Name, Instances: [{InstanceName, CustomerIpAddress, ...}]}]}.
    This node is the instance whose CustomerIpAddress is one of ours (or whose InstanceName is
    our hostname); its group picks the role.
    """
    if not isinstance(pp, dict):
        raise ParamsError(f"{pp_label}: expected a JSON object")
    if not isinstance(rc, dict) or not isinstance(rc.get("InstanceGroups"), list):
        raise ParamsError(f"{rc_label}: InstanceGroups: expected a list")
    wm = pp.get("workload_manager", "slurm")
    if wm != "slurm":
        raise ParamsError(f"{pp_label}: workload_manager: {wm!r} is not 'slurm'")
    ctl_group = pp.get("controller_group")
    if not isinstance(ctl_group, str) or not ctl_group:
        raise ParamsError(f"{pp_label}: controller_group: missing")
    login_group = pp.get("login_group")
    workers = pp.get("worker_groups") or []
    if not isinstance(workers, list):
        raise ParamsError(f"{pp_label}: worker_groups: expected a list")
    partition_of: dict[str, str] = {}
    for i, w in enumerate(workers):
        if (
            not isinstance(w, dict)
            or not w.get("instance_group_name")
            or not w.get("partition_name")
        ):
            raise ParamsError(
                f"{pp_label}: worker_groups[{i}]: expected {{instance_group_name, partition_name}}"
            )
        partition_of[w["instance_group_name"]] = w["partition_name"]

    groups: dict[str, list[dict[str, Any]]] = {}
    mine: tuple[str, dict[str, Any]] | None = None
    for gi, g in enumerate(rc["InstanceGroups"]):
        if not isinstance(g, dict) or not isinstance(g.get("Name"), str):
            raise ParamsError(f"{rc_label}: InstanceGroups[{gi}].Name: missing")
        insts = g.get("Instances") or []
        if not isinstance(insts, list):
            raise ParamsError(f"{rc_label}: InstanceGroups[{gi}].Instances: expected a list")
        groups[g["Name"]] = insts
        for inst in insts:
            if not isinstance(inst, dict):
                continue
            if inst.get("CustomerIpAddress") in own_addresses or (
                hostname and inst.get("InstanceName") == hostname
            ):
                mine = (g["Name"], inst)
    if mine is None:
        raise ParamsError(
            f"{rc_label}: this node (addresses {', '.join(sorted(own_addresses)) or 'none'}, "
            f"hostname {hostname!r}) is in no instance group's Instances"
        )
    ctl = [
        i for i in groups.get(ctl_group, []) if isinstance(i, dict) and i.get("CustomerIpAddress")
    ]
    if not ctl:
        raise ParamsError(
            f"{rc_label}: controller group {ctl_group!r} has no instance with a CustomerIpAddress"
        )
    group, inst = mine
    if group == ctl_group:
        role = "controller"
    elif login_group and group == login_group:
        role = "login"
    else:
        role = "compute"
    extra_section = pp.get("nodeforge") or {}
    if not isinstance(extra_section, dict):
        raise ParamsError(f"{pp_label}: nodeforge: expected a mapping of node params")
    data: dict[str, Any] = {
        "cluster_name": pp.get("cluster_name", "hyperpod"),
        "role": role,
        "controller": {"address": ctl[0]["CustomerIpAddress"]},
        "extra": {
            "hyperpod": {
                "instance_group": group,
                "instance_name": inst.get("InstanceName"),
                "address": inst.get("CustomerIpAddress"),
                **{k: pp[k] for k in ("fsx_dns_name", "fsx_mountname") if k in pp},
            }
        },
    }
    if role == "compute" and group in partition_of:
        data["features"] = [partition_of[group]]
    if role == "controller" and partition_of:
        names = list(dict.fromkeys(partition_of.values()))
        data["partitions"] = [{"name": n, "default": i == 0} for i, n in enumerate(names)]
    for k, val in extra_section.items():
        if k == "extra" and isinstance(val, dict):
            data["extra"].update(val)
        elif k == "features" and role == "compute":
            data["features"] = list(data.get("features", [])) + list(val or [])
        else:
            data[k] = val
    return data


def _own_addresses() -> list[str]:
    """This machine's IPv4 addresses, from /proc/net/fib_trie-free `socket` calls (no traffic)."""
    import socket

    out: set[str] = set()
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            out.add(str(info[4][0]))
    except OSError:
        pass
    try:
        from nodeforge import proc

        cp = proc.run(["ip", "-o", "-4", "addr", "show"], check=False, timeout=5)
        for line in cp.stdout.splitlines():
            parts = line.split()
            if "inet" in parts:
                out.add(parts[parts.index("inet") + 1].split("/")[0])
    except NodeforgeError:
        pass
    out.discard("127.0.0.1")
    return sorted(out)


def _hostname() -> str:
    import socket

    return socket.gethostname()
