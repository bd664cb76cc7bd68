"""Node params: the typed shape and its validation.

Every source (node.yaml, kernel command line, EC2 user-data, HyperPod files) produces a plain
mapping; `parse_params` turns it into `Params` or raises a NodeforgeError that names the source
and the field, e.g. ``/etc/nodeforge/node.yaml: hooks[1].sha256: expected 64 hex chars``.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from nodeforge.errors import NodeforgeError

ROLES = ("controller", "compute", "login")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_FEATURE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_GRES_RE = re.compile(r"^[A-Za-z0-9_]+(:[A-Za-z0-9_.-]+)*(:\d+)?$")
_HOOK_SCHEMES = ("file", "http", "https", "s3")
_SECRET_FIELDS = ("munge_key",)


class ParamsError(NodeforgeError):
    """A params document is invalid; the message names the source and the field."""


@dataclass(frozen=True)
class Controller:
    host: str = ""  # hostname of the controller (SlurmctldHost)
    address: str = ""  # IP or resolvable name used to reach it (--conf-server)

    @property
    def target(self) -> str:
        """What a client dials: the address if known, else the hostname."""
        return self.address or self.host


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool = False
    max_time: str = "INFINITE"


@dataclass(frozen=True)
class HookSpec:
    uri: str
    sha256: str | None = None
    timeout: float | None = None  # None: Params.hook_timeout
    retries: int | None = None  # None: Params.hook_retries
    name: str | None = None  # None: the last path segment of uri


@dataclass(frozen=True)
class UsersKeypair:
    public: str
    private: str


@dataclass(frozen=True)
class Params:
    role: str
    cluster_name: str
    controller: Controller
    node_name: str = ""  # "" = the hostname
    node_address: str = ""  # "" = the source address of the route to the controller
    munge_key: str | None = None  # base64
    munge_key_file: str | None = None
    features: tuple[str, ...] = ()
    gres: tuple[str, ...] = ()
    gres_types: tuple[str, ...] = ()  # controller: GresTypes (default: the names in `gres`)
    cpus: int | None = None
    real_memory: int | None = None  # MiB
    partitions: tuple[Partition, ...] = (Partition("main", True, "INFINITE"),)
    max_node_count: int = 1024
    accounting: bool = True
    docker: bool = True  # compute: run dockerd + containerd (off where the host cannot, e.g. nspawn)
    hooks: tuple[HookSpec, ...] = ()
    hook_timeout: float = 600.0
    hook_retries: int = 2
    hook_backoff: float = 2.0  # first retry delay, doubled each time
    hook_backoff_max: float = 60.0
    wait_timeout: float = 300.0  # bound for every "wait for X to answer"
    users_keypair: UsersKeypair | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    expected_gpus: int | None = None  # GPU node: `node health` requires exactly this many
    health_interval: int = 300  # controller: Slurm HealthCheckInterval (s); 0 = off

    def munge_key_bytes(self) -> bytes | None:
        if self.munge_key is None:
            return None
        return base64.b64decode(self.munge_key)

    def public_dict(self) -> dict[str, Any]:
        """The params without secrets (what hooks get as NODEFORGE_PARAMS)."""
        d = asdict(self)
        for k in _SECRET_FIELDS:
            if d.get(k) is not None:
                d[k] = "<redacted>"
        if self.users_keypair is not None:
            d["users_keypair"] = {"public": self.users_keypair.public, "private": "<redacted>"}
        return d


# --------------------------------------------------------------------------------------------
class _V:
    """Field-path aware checks; every failure raises ParamsError naming source + field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, msg: str) -> None:
        raise ParamsError(f"{self.source}: {path}: {msg}")

    def mapping(self, v: Any, path: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            self.fail(path, f"expected a mapping, got {type(v).__name__}")
        for k in v:
            if not isinstance(k, str):
                self.fail(path, f"keys must be strings, got {k!r}")
        return v

    def unknown(self, d: dict[str, Any], allowed: set[str], path: str) -> None:
        extra = sorted(set(d) - allowed)
        if extra:
            where = f"{path}.{extra[0]}" if path else extra[0]
            self.fail(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def string(
        self, v: Any, path: str, pattern: re.Pattern[str] | None = None, what: str = ""
    ) -> str:
        if not isinstance(v, str) or not v:
            self.fail(path, f"expected a non-empty string, got {_tn(v)}")
        if pattern is not None and not pattern.match(v):
            self.fail(path, f"{v!r} is not {what or 'valid'}")
        return v

    def integer(self, v: Any, path: str, lo: int = 0, hi: int | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(path, f"expected an integer, got {_tn(v)}")
        if v < lo or (hi is not None and v > hi):
            self.fail(path, f"{v} out of range [{lo}, {hi if hi is not None else '∞'}]")
        return v

    def number(self, v: Any, path: str, lo: float = 0.0) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(path, f"expected a number (seconds), got {_tn(v)}")
        if v <= lo:
            self.fail(path, f"must be > {lo:g}")
        return float(v)

    def boolean(self, v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            self.fail(path, f"expected true or false, got {_tn(v)}")
        return v

    def str_list(self, v: Any, path: str, pattern: re.Pattern[str], what: str) -> tuple[str, ...]:
        if isinstance(v, str):  # "gpu,nvme" is accepted for features/gres
            v = [s.strip() for s in v.split(",") if s.strip()]
        if not isinstance(v, list):
            self.fail(path, f"expected a list of strings, got {_tn(v)}")
        return tuple(self.string(x, f"{path}[{i}]", pattern, what) for i, x in enumerate(v))


def _tn(v: Any) -> str:
    return "null" if v is None else type(v).__name__


_TOP = {
    "role", "cluster_name", "controller", "node_name", "node_address", "munge_key", "munge_key_file", "features",
    "gres", "gres_types", "cpus", "real_memory", "partitions", "max_node_count", "accounting", "docker", "hooks",
    "hook_timeout", "hook_retries", "hook_backoff", "hook_backoff_max", "wait_timeout",
    "users_keypair", "extra", "expected_gpus", "health_interval",
}  # fmt: skip


def parse_params(data: Any, source: str) -> Params:
    """Validate a params mapping from *source* (a path or a source label) into `Params`."""
    v = _V(source)
    d = v.mapping(data, "(top level)")
    v.unknown(d, _TOP, "")
    kw: dict[str, Any] = {}

    if "role" not in d:
        v.fail("role", f"missing; set one of {', '.join(ROLES)}")
    role = v.string(d["role"], "role")
    if role not in ROLES:
        v.fail("role", f"{role!r} is not one of {', '.join(ROLES)}")
    kw["role"] = role

    if "cluster_name" not in d:
        v.fail("cluster_name", "missing; set the Slurm ClusterName (lowercase, e.g. demo)")
    kw["cluster_name"] = v.string(
        d["cluster_name"], "cluster_name", _NAME_RE, "a cluster name (lowercase a-z0-9_-, max 40)"
    )

    kw["controller"] = _controller(v, d.get("controller"), role)

    if d.get("node_name") is not None:
        kw["node_name"] = v.string(d["node_name"], "node_name", _NODE_RE, "a node name")

    if d.get("node_address") is not None:
        kw["node_address"] = v.string(d["node_address"], "node_address")
        if not _looks_like_ip(kw["node_address"]):
            v.fail("node_address", f"{kw['node_address']!r} is not an IP address")

    if d.get("munge_key") is not None and d.get("munge_key_file") is not None:
        v.fail("munge_key", "give munge_key or munge_key_file, not both")
    if d.get("munge_key") is not None:
        key = v.string(d["munge_key"], "munge_key")
        try:
            raw = base64.b64decode(key, validate=True)
        except (binascii.Error, ValueError):
            v.fail("munge_key", "not valid base64 (encode the key with: base64 -w0 munge.key)")
        if len(raw) < 32:
            v.fail("munge_key", f"decodes to {len(raw)} bytes; munge needs at least 32")
        kw["munge_key"] = key
    if d.get("munge_key_file") is not None:
        kw["munge_key_file"] = v.string(d["munge_key_file"], "munge_key_file")

    if "features" in d:
        kw["features"] = v.str_list(d["features"], "features", _FEATURE_RE, "a feature name")
    if "gres" in d:
        kw["gres"] = v.str_list(d["gres"], "gres", _GRES_RE, "a gres spec (name[:type][:count])")
    if "gres_types" in d:
        kw["gres_types"] = v.str_list(
            d["gres_types"], "gres_types", _FEATURE_RE, "a gres type name"
        )
    if d.get("cpus") is not None:
        kw["cpus"] = v.integer(d["cpus"], "cpus", 1)
    if d.get("real_memory") is not None:
        kw["real_memory"] = v.integer(d["real_memory"], "real_memory", 1)
    if "partitions" in d:
        kw["partitions"] = _partitions(v, d["partitions"])
    if "max_node_count" in d:
        kw["max_node_count"] = v.integer(d["max_node_count"], "max_node_count", 1, 65533)
    if "accounting" in d:
        kw["accounting"] = v.boolean(d["accounting"], "accounting")
    if "docker" in d:
        kw["docker"] = v.boolean(d["docker"], "docker")
    if "hooks" in d:
        kw["hooks"] = _hooks(v, d["hooks"])
    for k in ("hook_timeout", "hook_backoff", "hook_backoff_max", "wait_timeout"):
        if k in d:
            kw[k] = v.number(d[k], k)
    if "hook_retries" in d:
        kw["hook_retries"] = v.integer(d["hook_retries"], "hook_retries", 0, 20)
    if d.get("users_keypair") is not None:
        kp = v.mapping(d["users_keypair"], "users_keypair")
        v.unknown(kp, {"public", "private"}, "users_keypair")
        for k in ("public", "private"):
            if k not in kp:
                v.fail(f"users_keypair.{k}", "missing")
        pub = v.string(kp["public"], "users_keypair.public")
        if not pub.startswith(("ssh-", "ecdsa-", "sk-")):
            v.fail("users_keypair.public", "expected an OpenSSH public key line (ssh-ed25519 ...)")
        priv = v.string(kp["private"], "users_keypair.private")
        if "PRIVATE KEY-----" not in priv:
            v.fail("users_keypair.private", "expected an OpenSSH private key (-----BEGIN ...)")
        kw["users_keypair"] = UsersKeypair(pub.strip(), priv.strip() + "\n")
    if d.get("expected_gpus") is not None:
        kw["expected_gpus"] = v.integer(d["expected_gpus"], "expected_gpus", 0, 64)
    if "health_interval" in d:
        kw["health_interval"] = v.integer(d["health_interval"], "health_interval", 0, 86400)
    if "extra" in d:
        kw["extra"] = dict(v.mapping(d["extra"] if d["extra"] is not None else {}, "extra"))
    return Params(**kw)


def _controller(v: _V, raw: Any, role: str) -> Controller:
    if raw is None:
        if role == "controller":
            return Controller()
        v.fail("controller", "missing; a compute/login node needs the controller's host or address")
    if isinstance(raw, str):
        # "host" or "host(address)" like SlurmctldHost, or a bare address
        m = re.match(r"^([^()\s]+)\(([^()\s]+)\)$", raw)
        if m:
            return Controller(m.group(1), m.group(2))
        v.string(raw, "controller")
        return Controller(host=raw) if not _looks_like_ip(raw) else Controller(address=raw)
    c = v.mapping(raw, "controller")
    v.unknown(c, {"host", "address"}, "controller")
    host = v.string(c["host"], "controller.host", _NODE_RE, "a hostname") if c.get("host") else ""
    addr = v.string(c["address"], "controller.address") if c.get("address") else ""
    if not host and not addr and role != "controller":
        v.fail("controller", "give controller.host or controller.address")
    return Controller(host, addr)


def _looks_like_ip(s: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(s)
    except ValueError:
        return False
    return True


def _partitions(v: _V, raw: Any) -> tuple[Partition, ...]:
    if not isinstance(raw, list) or not raw:
        v.fail("partitions", f"expected a non-empty list, got {_tn(raw)}")
    out = []
    names = set()
    for i, p in enumerate(raw):
        path = f"partitions[{i}]"
        if isinstance(p, str):
            p = {"name": p}
        p = v.mapping(p, path)
        v.unknown(p, {"name", "default", "max_time"}, path)
        name = v.string(p.get("name"), f"{path}.name", _NODE_RE, "a partition name")
        if name in names:
            v.fail(f"{path}.name", f"duplicate partition {name!r}")
        names.add(name)
        default = v.boolean(p["default"], f"{path}.default") if "default" in p else False
        max_time = p.get("max_time", "INFINITE")
        if isinstance(max_time, int) and not isinstance(max_time, bool):
            max_time = str(max_time)
        max_time = v.string(
            max_time,
            f"{path}.max_time",
            re.compile(r"^[0-9:-]+$|^INFINITE$|^UNLIMITED$"),
            "a Slurm time (INFINITE, minutes, D-HH:MM:SS)",
        )
        out.append(Partition(name, default, max_time))
    if not any(p.default for p in out):
        out[0] = Partition(out[0].name, True, out[0].max_time)
    return tuple(out)


def _hooks(v: _V, raw: Any) -> tuple[HookSpec, ...]:
    if not isinstance(raw, list):
        v.fail("hooks", f"expected a list, got {_tn(raw)}")
    out = []
    for i, h in enumerate(raw):
        path = f"hooks[{i}]"
        if isinstance(h, str):
            h = {"uri": h}
        h = v.mapping(h, path)
        v.unknown(h, {"uri", "sha256", "timeout", "retries", "name"}, path)
        uri = v.string(h.get("uri"), f"{path}.uri")
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        if scheme not in _HOOK_SCHEMES:
            v.fail(
                f"{path}.uri",
                f"{uri!r}: scheme must be one of {', '.join(s + '://' for s in _HOOK_SCHEMES)}",
            )
        sha = None
        if h.get("sha256") is not None:
            sha = h["sha256"]
            if not isinstance(sha, str) or not _HEX64.match(sha):
                v.fail(f"{path}.sha256", "expected 64 hex chars (sha256sum of the script)")
            sha = sha.lower()
        timeout = (
            v.number(h["timeout"], f"{path}.timeout") if h.get("timeout") is not None else None
        )
        retries = (
            v.integer(h["retries"], f"{path}.retries", 0, 20)
            if h.get("retries") is not None
            else None
        )
        name = None
        if h.get("name") is not None:
            name = v.string(
                h["name"], f"{path}.name", re.compile(r"^[A-Za-z0-9_.-]+$"), "a file name"
            )
        out.append(HookSpec(uri, sha, timeout, retries, name))
    return tuple(out)
