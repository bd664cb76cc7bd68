"""Node params: the typed shape and its validation.

Every source (node.yaml, kernel command line, EC2 user-data, HyperPod files) produces a plain
mapping; `parse_params` turns it into `Params` or raises a NodeforgeError that names the source
and the field, e.g. ``/etc/nodeforge/node.yaml: hooks[1].sha256: expected 64 hex chars``.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from nodeforge import gang_config, redact, scalars
from nodeforge.errors import NodeforgeError

ROLES = ("controller", "compute", "login")
# Every grammar is applied with re.fullmatch (a `$` would let a trailing newline through).
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
# One RFC 1123 label: the node name becomes the hostname and an /etc/hosts name.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
# One label that the resolver cannot read as an IPv4 address (all digits, or 0x-hex).
_NODE_RE = re.compile(rf"(?![0-9]+\Z)(?!0[xX][0-9a-fA-F]*\Z){_LABEL}")
# A DNS name: dot-separated labels, no trailing dot, <= 253 chars, last label not all digits
# (so "1.2.3.999" is neither an IP nor a name).
_HOSTNAME_RE = re.compile(
    rf"(?=.{{1,253}}\Z)(?:{_LABEL}\.)*(?=[A-Za-z0-9-]*[A-Za-z-]){_LABEL}", re.DOTALL
)
# What inet_aton(3) (and so getaddrinfo) reads as an IPv4 address: 1-4 parts, each decimal,
# octal or 0x-hex. "0", "0x7f" or "1.0x7f" must never be a host or node name: `ssh 0` goes to
# 0.0.0.0, whatever /etc/hosts says.
_INET_ATON_RE = re.compile(r"(?:(?:0[xX][0-9a-fA-F]*|[0-9]+)\.){0,3}(?:0[xX][0-9a-fA-F]*|[0-9]+)")
_PARTITION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_FEATURE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_GRES_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}(?::[A-Za-z0-9_.-]{1,64})?(?::[0-9]{1,6})?")
_B64_RE = re.compile(r"[A-Za-z0-9+/]{4,}={0,2}")
_ABS_PATH_RE = re.compile(r"/(?:[A-Za-z0-9_.+@-]+/?)*")
_HOOK_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_HOOK_SCHEMES = ("file", "http", "https", "s3")
_URI_RE = re.compile(r"(?:file|https?|s3)://[!-~]{1,2040}")  # printable ASCII, no space
_SSH_PUB_RE = re.compile(
    r"(?:ssh-(?:ed25519|rsa|dss)|ecdsa-sha2-nistp(?:256|384|521)|sk-[a-z0-9@.-]{1,64})"
    r" [A-Za-z0-9+/]{16,16384}={0,3}(?: [ -~]{0,256})?"
)
_SSH_PRIV_RE = re.compile(
    r"-----BEGIN [A-Z ]{1,40}PRIVATE KEY-----\n[A-Za-z0-9+/=:, \n-]{16,65536}"
    r"-----END [A-Z ]{1,40}PRIVATE KEY-----\n?"
)
# Any C0 control, DEL or C1 control (U+0080-U+009F), plus the Unicode line/paragraph
# separators that some parsers treat as newlines.
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_SECRET_FIELDS = ("munge_key",)
SECRET_KEYS = ("munge_key", "users_keypair")  # fields that must come from a root-only source

# Documented bounds (docs/agent.md "Params reference").
SECONDS_MAX = 86400.0  # timeouts and backoffs: at most a day
CPUS_MAX = 65535  # Slurm's CPUs is a uint16
REAL_MEMORY_MAX = 1 << 40  # MiB (1 EiB)
MUNGE_KEY_MIN, MUNGE_KEY_MAX = 32, 1024  # bytes (munge's own limits)
EXTRA_DEPTH_MAX, EXTRA_ITEMS_MAX = 8, 10000
HOOKS_MAX = 64
PARTITIONS_MAX = 64
LIST_MAX = 64  # features / gres / gres_types


def is_ip(s: str) -> bool:
    """An IPv4 or IPv6 address without a zone (``fe80::1%eth0`` is refused: ``%`` is a
    systemd specifier and Slurm cannot use a scoped address)."""
    try:
        ipaddress.ip_address(s)
    except ValueError:
        return False
    return "%" not in s


def is_hostname(s: str) -> bool:
    """A DNS name per RFC 1123 (labels of letters, digits and inner hyphens; no trailing dot)."""
    return bool(_HOSTNAME_RE.fullmatch(s)) and not is_ip(s) and not _INET_ATON_RE.fullmatch(s)


def is_node_name(s: str) -> bool:
    """A Slurm node name that is also a hostname: one RFC 1123 label, not all digits and not
    0x-hex (the resolver would read either as an IPv4 address)."""
    return bool(_NODE_RE.fullmatch(s))


_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_BROADCAST = ipaddress.ip_address("255.255.255.255")


def unusable_address(
    s: str, networks: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network] = ()
) -> str | None:
    """Why a node cannot use *s* as the controller's or its own address or name, or None.

    Refused: the name localhost (any case, a trailing dot, or a name under .localhost: each
    machine resolves it to itself), the unspecified address (0.0.0.0 and 0.0.0.0/8, ::),
    the limited broadcast 255.255.255.255, multicast, and the broadcast address of any of
    *networks* (the subnets whose prefix is known). IPv4-mapped IPv6 forms count as IPv4.
    """
    name = s[:-1] if s.endswith(".") else s
    if name.lower() == "localhost" or name.lower().endswith(".localhost"):
        return (
            "the name localhost, which every machine resolves to itself; give the node's own "
            "name or IP address"
        )
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(s)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return "the unspecified address ('any host'), not one a node can be reached at"
    if ip.version == 4 and ip in _THIS_NETWORK:
        return "in 0.0.0.0/8 ('this network'), not an address a node can be reached at"
    if ip == _BROADCAST:
        return "the broadcast address, not one host"
    if ip.is_multicast:
        return "a multicast address, not one host"
    for net in networks:
        # /31 and /32 (RFC 3021) and IPv6 have no broadcast address.
        if net.version == 4 and net.prefixlen < 31 and ip == net.broadcast_address:
            return f"the broadcast address of {net}, not one host"
    return None


def control_char(s: str) -> str | None:
    m = _CONTROL_RE.search(s)
    return None if m is None else f"U+{ord(m.group()):04X}"


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
    script: str | None = None  # uri is an S3 prefix (ends in /): synced, this file runs there


@dataclass(frozen=True)
class UsersKeypair:
    public: str
    private: str = field(repr=False)  # never in a repr (a log line or a traceback)


@dataclass(frozen=True)
class Params:
    role: str
    cluster_name: str
    controller: Controller
    node_name: str = ""  # "" = the hostname
    node_address: str = ""  # "" = the source address of the route to the controller
    munge_key: str | None = field(default=None, repr=False)  # base64; never in a repr
    munge_key_file: str | None = None
    features: tuple[str, ...] = ()
    gres: tuple[str, ...] = ()
    gres_types: tuple[str, ...] = ()  # controller: GresTypes (default: the names in `gres`)
    cpus: int | None = None
    real_memory: int | None = None  # MiB
    partitions: tuple[Partition, ...] = (Partition("main", True, "INFINITE"),)
    max_node_count: int = 1024
    accounting: bool = True
    docker: bool = (
        True  # compute: run dockerd + containerd (off where the host cannot, e.g. nspawn)
    )
    hooks: tuple[HookSpec, ...] = ()
    hook_timeout: float = 600.0
    hook_retries: int = 2
    hook_backoff: float = 2.0  # first retry delay, doubled each time
    hook_backoff_max: float = 60.0
    hook_output_max: int = 1 << 20  # bytes of output kept per attempt (head + tail)
    s3_endpoint_url: str | None = None  # None: AWS's regional endpoint (boto3's default)
    # CA certificates that s3:// hooks trust (a private CA, on-prem S3): PEM text or an
    # absolute path to a root-owned PEM file. None: the system's CAs.
    s3_ca_bundle: str | None = None
    wait_timeout: float = 300.0  # bound for every "wait for X to answer"
    users_keypair: UsersKeypair | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    expected_gpus: int | None = None  # GPU node: `node health` requires exactly this many
    health_interval: int = 300  # controller: Slurm HealthCheckInterval (s); 0 = off
    # node_exporter's listen address: "node:PORT" (this node's address), "*:PORT" (every
    # interface), "ADDR:PORT" / "[ADDR6]:PORT" (an IP of this node), or "off"
    metrics_listen: str = "node:9100"
    # controller: the gang governor's config (gang.yaml's keys), as given and validated; the
    # agent writes it to /etc/nodeforge/gang.yaml. None: that file is left as it is.
    gang: dict[str, Any] | None = None

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
        # The agent fetches the hooks; nothing downstream needs a URI's credentials or token.
        for h in d["hooks"]:
            h["uri"] = redact.url(h["uri"]) if "@" in h["uri"] or "?" in h["uri"] else h["uri"]
        return d


# --------------------------------------------------------------------------------------------
class _V:
    """Field-path aware checks; every failure raises ParamsError naming source + field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, msg: str) -> NoReturn:
        raise ParamsError(f"{self.source}: {path}: {msg}")

    def mapping(self, v: Any, path: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            self.fail(path, f"expected a mapping, got {_tn(v)}")
        for k in v:
            if not isinstance(k, str):
                self.fail(path, f"keys must be strings, got {redact.value(k)}")
        return v

    def unknown(self, d: dict[str, Any], allowed: set[str], path: str) -> None:
        extra = sorted(set(d) - allowed)
        if extra:
            k = extra[0] if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", extra[0]) else None
            k = redact.value(extra[0]) if k is None or redact.text(k) != k else k
            where = f"{path}.{k}" if path else k
            self.fail(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def string(
        self,
        v: Any,
        path: str,
        pattern: re.Pattern[str] | None = None,
        what: str = "",
        max_len: int = 4096,
        *,
        secret: bool = False,
    ) -> str:
        """A string field. A *secret* one is never shown in an error, whole or in part: the
        error names the field and the rule (the value would reach logs and state.json)."""
        if not isinstance(v, str) or not v:
            self.fail(path, f"expected a non-empty string, got {_tn(v)}")
        if len(v) > max_len:
            self.fail(path, f"{len(v)} characters; at most {max_len}")
        m = _CONTROL_RE.search(v)
        if m is not None:
            cc = f"U+{ord(m.group()):04X}"
            if secret:
                where = "at the end" if m.start() == len(v) - 1 else f"at character {m.start()}"
                self.fail(
                    path,
                    f"contains a control character ({cc}) {where}; remove it (the value is a "
                    "secret and is not shown; a YAML block scalar (|) adds a trailing newline: "
                    "give the value as one quoted line)",
                )
            self.fail(path, f"{redact.value(v)} contains a control character ({cc}); remove it")
        if pattern is not None and not pattern.fullmatch(v):
            shown = "the value (a secret, not shown)" if secret else redact.value(v)
            self.fail(path, f"{shown} is not {what or 'valid'}")
        return v

    def integer(self, v: Any, path: str, lo: int, hi: int) -> int:
        try:
            return scalars.integer(v, lo, hi)
        except scalars.ScalarError as exc:
            self.fail(path, str(exc))

    def number(self, v: Any, path: str, hi: float = SECONDS_MAX) -> float:
        """Seconds: a finite number in (0, hi]. NaN/inf would unbound every wait."""
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(
                path, f"expected a number (seconds), got {_tn(v)}{scalars.why_not_seconds(v)}"
            )
        if isinstance(v, int) and abs(v) > 1 << 53:
            self.fail(path, f"{v} out of range (0, {hi:g}] seconds")
        f = float(v)
        if not math.isfinite(f):
            self.fail(path, f"{v!r} is not a finite number; give seconds in (0, {hi:g}]")
        if f <= 0 or f > hi:
            self.fail(path, f"{v:g} out of range (0, {hi:g}] seconds")
        return f

    def boolean(self, v: Any, path: str) -> bool:
        if not isinstance(v, bool):
            self.fail(path, f"expected true or false, got {_tn(v)}")
        return v

    def str_list(self, v: Any, path: str, pattern: re.Pattern[str], what: str) -> tuple[str, ...]:
        if isinstance(v, str):  # "gpu,nvme" is accepted for features/gres
            self.string(v, path, max_len=LIST_MAX * 80)
            v = [s.strip() for s in v.split(",") if s.strip()]
        if not isinstance(v, list):
            self.fail(path, f"expected a list of strings, got {_tn(v)}")
        if len(v) > LIST_MAX:
            self.fail(path, f"{len(v)} items; at most {LIST_MAX}")
        out = tuple(self.string(x, f"{path}[{i}]", pattern, what) for i, x in enumerate(v))
        return tuple(dict.fromkeys(out))

    def plain(self, v: Any, path: str, depth: int = 0, budget: list[int] | None = None) -> Any:
        """Free-form data (extra): strings without control characters, finite numbers,
        bounded depth and size. It reaches hooks (params.json), never a config file."""
        budget = budget if budget is not None else [EXTRA_ITEMS_MAX]
        budget[0] -= 1
        if budget[0] < 0:
            self.fail(path, f"more than {EXTRA_ITEMS_MAX} items")
        if depth > EXTRA_DEPTH_MAX:
            self.fail(path, f"nested deeper than {EXTRA_DEPTH_MAX} levels")
        if isinstance(v, str):
            cc = control_char(v)
            if cc is not None:
                self.fail(
                    path, f"{redact.value(v, 40)} contains a control character ({cc}); remove it"
                )
            return v
        if isinstance(v, float) and not math.isfinite(v):
            self.fail(path, f"{v!r} is not a finite number")
        if v is None or isinstance(v, (bool, int, float)):
            return v
        if isinstance(v, list):
            return [self.plain(x, f"{path}[{i}]", depth + 1, budget) for i, x in enumerate(v)]
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    self.fail(path, f"keys must be strings, got {redact.value(k)}")
                self.string(k, f"{path}.{redact.value(k, 40)}", max_len=256)
                out[k] = self.plain(x, f"{path}.{k}", depth + 1, budget)
            return out
        self.fail(path, f"unsupported value of type {_tn(v)}")


def _tn(v: Any) -> str:
    return "null" if v is None else type(v).__name__


_TOP = {
    "role", "cluster_name", "controller", "node_name", "node_address", "munge_key", "munge_key_file", "features",
    "gres", "gres_types", "cpus", "real_memory", "partitions", "max_node_count", "accounting", "docker", "hooks",
    "hook_timeout", "hook_retries", "hook_backoff", "hook_backoff_max", "wait_timeout",
    "users_keypair", "extra", "hook_output_max", "s3_endpoint_url", "s3_ca_bundle", "expected_gpus",
    "health_interval", "metrics_listen", "gang",
}  # fmt: skip


def parse_params(data: Any, source: str) -> Params:
    """Validate a params mapping from *source* (a path or a source label) into `Params`.

    One phase per group of fields, in this order: the first error found is the one reported,
    so the order is part of the behaviour."""
    v = _V(source)
    d = v.mapping(data, "(top level)")
    v.unknown(d, _TOP, "")
    kw: dict[str, Any] = {}
    kw.update(_identity(v, d))
    kw.update(_munge(v, d))
    kw.update(_slurm_node(v, d))
    kw.update(_hook_fields(v, d))
    if d.get("users_keypair") is not None:
        kw["users_keypair"] = _users_keypair(v, d["users_keypair"])
    kw.update(_health(v, d))
    if "extra" in d:
        kw["extra"] = dict(v.plain(v.mapping(d["extra"] or {}, "extra"), "extra"))
    if d.get("gang") is not None:
        kw["gang"] = _gang(v, d["gang"])
    return Params(**kw)


def _identity(v: _V, d: dict[str, Any]) -> dict[str, Any]:
    """role, cluster_name, controller, node_name, node_address."""
    kw: dict[str, Any] = {}
    if "role" not in d:
        v.fail("role", f"missing; set one of {', '.join(ROLES)}")
    role = v.string(d["role"], "role", max_len=20)
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
        kw["node_name"] = v.string(
            d["node_name"],
            "node_name",
            _NODE_RE,
            "a node name (one hostname label: a-z, 0-9, inner '-', at most 63 characters, not "
            "all digits or 0x-hex, which resolvers read as an IPv4 address)",
        )
        _usable(v, kw["node_name"], "node_name")

    if d.get("node_address") is not None:
        kw["node_address"] = _ip(v, d["node_address"], "node_address")
    return kw


def _munge(v: _V, d: dict[str, Any]) -> dict[str, Any]:
    """munge_key (base64 of the key itself) or munge_key_file, never both."""
    kw: dict[str, Any] = {}
    if d.get("munge_key") is not None and d.get("munge_key_file") is not None:
        v.fail("munge_key", "give munge_key or munge_key_file, not both")
    if d.get("munge_key") is not None:
        kw["munge_key"] = _munge_key(v, d["munge_key"])
    if d.get("munge_key_file") is not None:
        kw["munge_key_file"] = _abs_path(v, d["munge_key_file"], "munge_key_file")
    return kw


def _munge_key(v: _V, raw: Any) -> str:
    key = v.string(raw, "munge_key", max_len=2 * MUNGE_KEY_MAX, secret=True)
    if not _B64_RE.fullmatch(key):
        v.fail("munge_key", "not valid base64 (encode the key with: base64 -w0 munge.key)")
    try:
        decoded = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        v.fail("munge_key", "not valid base64 (encode the key with: base64 -w0 munge.key)")
    if not MUNGE_KEY_MIN <= len(decoded) <= MUNGE_KEY_MAX:
        v.fail(
            "munge_key",
            f"decodes to {len(decoded)} bytes; munge needs at least {MUNGE_KEY_MIN} "
            f"and at most {MUNGE_KEY_MAX}",
        )
    return key


def _slurm_node(v: _V, d: dict[str, Any]) -> dict[str, Any]:
    """What slurm.conf says of this node and the cluster: features, gres, sizes, partitions."""
    kw: dict[str, Any] = {}
    if "features" in d:
        kw["features"] = v.str_list(
            d["features"], "features", _FEATURE_RE, "a feature name (A-Za-z0-9_.-, max 64)"
        )
    if "gres" in d:
        kw["gres"] = v.str_list(d["gres"], "gres", _GRES_RE, "a gres spec (name[:type][:count])")
    if "gres_types" in d:
        kw["gres_types"] = v.str_list(
            d["gres_types"], "gres_types", _FEATURE_RE, "a gres type name"
        )
    if d.get("cpus") is not None:
        kw["cpus"] = v.integer(d["cpus"], "cpus", 1, CPUS_MAX)
    if d.get("real_memory") is not None:
        kw["real_memory"] = v.integer(d["real_memory"], "real_memory", 1, REAL_MEMORY_MAX)
    if "partitions" in d:
        kw["partitions"] = _partitions(v, d["partitions"])
    if "max_node_count" in d:
        kw["max_node_count"] = v.integer(d["max_node_count"], "max_node_count", 1, 65533)
    if "accounting" in d:
        kw["accounting"] = v.boolean(d["accounting"], "accounting")
    if "docker" in d:
        kw["docker"] = v.boolean(d["docker"], "docker")
    return kw


def _hook_fields(v: _V, d: dict[str, Any]) -> dict[str, Any]:
    """hooks and how they run: timeouts, retries, output bound, the S3 endpoint and CA."""
    kw: dict[str, Any] = {}
    if "hooks" in d:
        kw["hooks"] = _hooks(v, d["hooks"])
    for k in ("hook_timeout", "hook_backoff", "hook_backoff_max", "wait_timeout"):
        if k in d:
            kw[k] = v.number(d[k], k)
    if "hook_retries" in d:
        kw["hook_retries"] = v.integer(d["hook_retries"], "hook_retries", 0, 20)
    if "hook_output_max" in d:
        kw["hook_output_max"] = v.integer(d["hook_output_max"], "hook_output_max", 4096, 64 << 20)
    if d.get("s3_endpoint_url") is not None:
        kw["s3_endpoint_url"] = _s3_endpoint(v, d["s3_endpoint_url"])
    if d.get("s3_ca_bundle") is not None:
        kw["s3_ca_bundle"] = _ca_bundle(v, d["s3_ca_bundle"])
    return kw


def _users_keypair(v: _V, raw: Any) -> UsersKeypair:
    kp = v.mapping(raw, "users_keypair")
    v.unknown(kp, {"public", "private"}, "users_keypair")
    for k in ("public", "private"):
        if k not in kp:
            v.fail(f"users_keypair.{k}", "missing")
    pub = kp["public"].strip() if isinstance(kp["public"], str) else kp["public"]
    pub = v.string(
        pub, "users_keypair.public", _SSH_PUB_RE, "an OpenSSH public key line (ssh-ed25519 ...)"
    )
    priv = kp["private"]
    if not isinstance(priv, str) or not priv.strip():
        v.fail("users_keypair.private", f"expected a non-empty string, got {_tn(priv)}")
    priv = priv.strip() + "\n"
    # The one field where newlines belong: a PEM block, nothing else.
    if not _SSH_PRIV_RE.fullmatch(priv):
        v.fail("users_keypair.private", "expected an OpenSSH private key (-----BEGIN ...)")
    return UsersKeypair(pub, priv)


def _health(v: _V, d: dict[str, Any]) -> dict[str, Any]:
    """The GPU count the health check expects, its interval, and where metrics are served."""
    kw: dict[str, Any] = {}
    if d.get("expected_gpus") is not None:
        kw["expected_gpus"] = v.integer(d["expected_gpus"], "expected_gpus", 0, 64)
    if "health_interval" in d:
        kw["health_interval"] = v.integer(d["health_interval"], "health_interval", 0, 86400)
    if "metrics_listen" in d:
        kw["metrics_listen"] = _metrics_listen(v, d["metrics_listen"])
    return kw


def _gang(v: _V, raw: Any) -> dict[str, Any]:
    """gang.yaml's keys, by gang.yaml's own rules (nodeforge/gang_config.py). Checked on every
    role, so one params document shared by all roles (a HyperPod `nodeforge` section, a launch
    template's user-data) fails on every node when it is wrong; only the controller uses it."""
    d = v.mapping(raw, "gang")
    try:
        gang_config.from_dict(d, v.source, prefix="gang.")
    except gang_config.ConfigError as exc:
        raise ParamsError(str(exc)) from None
    return d


_LISTEN_RE = re.compile(
    r"(?P<host>node|\*|[0-9.]{7,15}|\[[0-9A-Fa-f:.]{2,45}\]):(?P<port>[1-9][0-9]{0,4})"
)


def _metrics_listen(v: _V, raw: Any) -> str:
    """`off`, or HOST:PORT where HOST is `node`, `*`, an IPv4 address or a [bracketed] IPv6."""
    what = "off, node:PORT, *:PORT, IPV4:PORT or [IPV6]:PORT (e.g. node:9100)"
    s = v.string(raw, "metrics_listen", max_len=64)
    if s == "off":
        return s
    m = _LISTEN_RE.fullmatch(s)
    if m is None:
        v.fail("metrics_listen", f"{s!r} is not {what}")
    port = int(m["port"])
    if port > 65535:
        v.fail("metrics_listen", f"port {port} is out of range 1..65535")
    host = m["host"].strip("[]")
    if host not in ("node", "*"):
        if not is_ip(host) or "%" in host:
            v.fail("metrics_listen", f"{host!r} is not an IP address ({what})")
        ip = ipaddress.ip_address(host)
        if ip.is_unspecified or ip.is_multicast or str(ip) == "255.255.255.255":
            v.fail(
                "metrics_listen",
                f"{host!r} is not an address of this node; use *:{port} for every interface",
            )
    return s


def _ip(v: _V, raw: Any, path: str) -> str:
    s = v.string(raw, path, max_len=64)
    if "%" in s:
        v.fail(path, f"{s!r}: an IPv6 zone (%...) is not supported; give a global address")
    if not is_ip(s):
        v.fail(path, f"{redact.value(s)} is not an IP address")
    _usable(v, s, path)
    return s


def _usable(v: _V, s: str, path: str) -> None:
    why = unusable_address(s)
    if why is not None:
        v.fail(path, f"{redact.value(s)} is {why}")


def _abs_path(v: _V, raw: Any, path: str) -> str:
    s = v.string(raw, path, _ABS_PATH_RE, "an absolute path (/a/b, letters digits _.+@-)")
    if any(part in (".", "..") for part in s.split("/")):
        v.fail(path, f"{s!r}: '.' and '..' segments are not allowed")
    return s


def _host_or_address(v: _V, s: str, path: str) -> Controller:
    _usable(v, s, path)
    if "%" in s:
        v.fail(path, f"{s!r}: an IPv6 zone (%...) is not supported; give a global address")
    if is_ip(s):
        return Controller(address=s)
    if s.endswith("."):
        v.fail(path, f"{s!r}: drop the trailing dot (Slurm and /etc/hosts want the plain name)")
    if not is_hostname(s):
        v.fail(path, f"{s!r} is neither an IP address nor a DNS name (RFC 1123)")
    return Controller(host=s)


def _controller(v: _V, raw: Any, role: str) -> Controller:
    if raw is None:
        if role == "controller":
            return Controller()
        v.fail("controller", "missing; a compute/login node needs the controller's host or address")
    if isinstance(raw, str):
        s = v.string(raw, "controller", max_len=320)
        # "host(address)" like SlurmctldHost, or a bare host or address
        m = re.fullmatch(r"([^()]+)\(([^()]+)\)", s)
        if m:
            raw = {"host": m.group(1), "address": m.group(2)}
        else:
            return _host_or_address(v, s, "controller")
    c = v.mapping(raw, "controller")
    v.unknown(c, {"host", "address"}, "controller")
    host = addr = ""
    if c.get("host") is not None:
        host = v.string(c["host"], "controller.host", max_len=253)
        _usable(v, host, "controller.host")
        if host.endswith("."):
            v.fail("controller.host", f"{host!r}: drop the trailing dot")
        if not is_hostname(host):
            v.fail("controller.host", f"{host!r} is not a hostname (RFC 1123: a-z, 0-9, '-', '.')")
    if c.get("address") is not None:
        addr_c = _host_or_address(v, v.string(c["address"], "controller.address", max_len=253),
                                  "controller.address")  # fmt: skip
        addr = addr_c.address or addr_c.host
        if host and not addr_c.address:
            # host(address) goes to /etc/hosts, which maps a name to an address, not to a name.
            v.fail("controller.address", f"{addr!r}: with controller.host, give an IP address")
    if not host and not addr and role != "controller":
        v.fail("controller", "give controller.host or controller.address")
    return Controller(host, addr)


def _partitions(v: _V, raw: Any) -> tuple[Partition, ...]:
    if not isinstance(raw, list) or not raw:
        v.fail("partitions", f"expected a non-empty list, got {_tn(raw)}")
    if len(raw) > PARTITIONS_MAX:
        v.fail("partitions", f"{len(raw)} partitions; at most {PARTITIONS_MAX}")
    out = []
    names = set()
    for i, p in enumerate(raw):
        path = f"partitions[{i}]"
        if isinstance(p, str):
            p = {"name": p}
        p = v.mapping(p, path)
        v.unknown(p, {"name", "default", "max_time"}, path)
        name = v.string(
            p.get("name"), f"{path}.name", _PARTITION_RE, "a partition name (A-Za-z0-9_.-)"
        )
        if name in names:
            v.fail(f"{path}.name", f"duplicate partition {name!r}")
        names.add(name)
        default = v.boolean(p["default"], f"{path}.default") if "default" in p else False
        try:
            max_time = scalars.slurm_time(p.get("max_time", "INFINITE"))
        except scalars.ScalarError as exc:
            v.fail(f"{path}.max_time", str(exc))
        out.append(Partition(name, default, max_time))
    if not any(p.default for p in out):
        out[0] = Partition(out[0].name, True, out[0].max_time)
    return tuple(out)


def _hooks(v: _V, raw: Any) -> tuple[HookSpec, ...]:
    if not isinstance(raw, list):
        v.fail("hooks", f"expected a list, got {_tn(raw)}")
    if len(raw) > HOOKS_MAX:
        v.fail("hooks", f"{len(raw)} hooks; at most {HOOKS_MAX}")
    out = []
    for i, h in enumerate(raw):
        path = f"hooks[{i}]"
        if isinstance(h, str):
            h = {"uri": h}
        h = v.mapping(h, path)
        v.unknown(h, {"uri", "sha256", "timeout", "retries", "name", "script"}, path)
        uri = v.string(h.get("uri"), f"{path}.uri", max_len=2048)
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        if scheme not in _HOOK_SCHEMES:
            v.fail(
                f"{path}.uri",
                f"{redact.value(uri)}: scheme must be one of {', '.join(s + '://' for s in _HOOK_SCHEMES)}",
            )
        if not _URI_RE.fullmatch(uri):
            v.fail(
                f"{path}.uri",
                f"{redact.value(uri)}: only printable ASCII without spaces (percent-encode)",
            )
        sha = None
        if h.get("sha256") is not None:
            sha = h["sha256"]
            if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
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
                h["name"], f"{path}.name", _HOOK_NAME_RE, "a file name (A-Za-z0-9_.-, not . or ..)"
            )
        script = None
        if h.get("script") is not None:
            script = v.string(h["script"], f"{path}.script")
            if not _FILE_NAME.fullmatch(script) or script in (".", ".."):
                v.fail(f"{path}.script", f"{script!r} is not a file name (A-Z a-z 0-9 _ . -)")
            if scheme != "s3" or not uri.endswith("/"):
                v.fail(
                    f"{path}.script",
                    "only with an s3:// prefix uri ending in / (HyperPod's "
                    "SourceS3Uri + OnCreate shape)",
                )
        elif uri.endswith("/"):
            v.fail(
                f"{path}.script", f"{redact.value(uri)} is a prefix; name the script to run in it"
            )
        out.append(HookSpec(uri, sha, timeout, retries, name, script))
    return tuple(out)


_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_ENDPOINT = re.compile(r"(https?)://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253})(:[0-9]{1,5})?/?")


_PEM_CERT = r"-----BEGIN CERTIFICATE-----\n(?:[A-Za-z0-9+/]{1,76}={0,2}\n){1,400}-----END CERTIFICATE-----\n"
_CA_BUNDLE_RE = re.compile(rf"(?:\n*{_PEM_CERT}){{1,32}}\n*")
CA_BUNDLE_MAX = 128 << 10


def _ca_bundle(v: _V, raw: Any) -> str:
    """PEM text (CERTIFICATE blocks only, nothing around them) or an absolute path."""
    if isinstance(raw, str) and raw.lstrip().startswith("-----BEGIN"):
        if len(raw) > CA_BUNDLE_MAX:
            v.fail("s3_ca_bundle", f"{len(raw)} characters; at most {CA_BUNDLE_MAX}")
        text = raw.replace("\r\n", "\n").strip("\n") + "\n"
        if not _CA_BUNDLE_RE.fullmatch(text):
            v.fail(
                "s3_ca_bundle",
                "not a PEM bundle: give one or more -----BEGIN CERTIFICATE----- blocks "
                "(base64 lines of at most 76 characters) and nothing else, or an absolute path",
            )
        import base64
        import binascii

        for block in text.split("-----BEGIN CERTIFICATE-----\n")[1:]:
            body = block.split("-----END CERTIFICATE-----", 1)[0].replace("\n", "")
            try:
                base64.b64decode(body, validate=True)
            except (binascii.Error, ValueError):
                v.fail("s3_ca_bundle", "a CERTIFICATE block is not valid base64")
        return text
    return _abs_path(v, raw, "s3_ca_bundle")


def _s3_endpoint(v: _V, raw: Any) -> str:
    """https://host[:port], or http:// to this machine only (a local S3 server)."""
    import ipaddress

    url = v.string(raw, "s3_endpoint_url")
    m = _ENDPOINT.fullmatch(url)
    if m is None:
        v.fail("s3_endpoint_url", f"{redact.value(url)} is not https://host[:port]")
    host = m.group(2).strip("[]")
    if (
        m.group(1) == "http"
        and host != "localhost"
        and not (is_ip(host) and ipaddress.ip_address(host).is_loopback)
    ):
        v.fail(
            "s3_endpoint_url",
            f"{redact.value(url)}: plain http:// is only accepted to this machine "
            "(127.0.0.1, ::1, localhost); use https://",
        )
    return url.rstrip("/")
