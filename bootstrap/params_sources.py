"""Where params come from. First source found wins:

1. file          /etc/nodeforge/node.yaml
2. cmdline       nodeforge.* keys on the kernel command line (+ nodeforge.params=<url>)
3. user-data     cloud-init's copy (/var/lib/cloud/instance/user-data.txt), else a seed device
                 (OpenStack config drive `config-2`, NoCloud `cidata`: params_seed.py), else
                 EC2 IMDSv2
4. hyperpod      /opt/ml/config/resource_config.json + provisioning_parameters.json

A source that is present but invalid is an error (it does not fall through to the next one):
a typo in node.yaml must never silently turn a node into something else.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from nodeforge import redact, scalars, strict_json, strict_yaml
from nodeforge.errors import NodeforgeError

from .params import SECRET_KEYS, Params, ParamsError, is_ip, parse_params, unusable_address
from .paths import Paths
from .private_read import UnsafeFileError, read_private

if TYPE_CHECKING:
    from nodeforge import download

    from .params_seed import SeedDevices

log = logging.getLogger("nodeforge.params")

IMDS_URL = "http://169.254.169.254"
IMDS_TOKEN_TTL = 21600


@dataclass(frozen=True)
class Loaded:
    params: Params
    # "file:/etc/nodeforge/node.yaml", "cmdline", "cloud-init", "config-drive", "nocloud",
    # "imds", "hyperpod"
    source: str
    # The instance's admin SSH keys (IMDS public-keys), read when params came from IMDS.
    ssh_keys: tuple[str, ...] = ()


@dataclass
class SourceConfig:
    paths: Paths
    imds_url: str | None = IMDS_URL  # None disables IMDS (e.g. the local nspawn cluster)
    imds_timeout: float = 1.0
    own_addresses: Callable[[], Iterable[str]] | None = None  # for HyperPod self-lookup
    hostname: Callable[[], str] | None = None
    imds_guarded: Callable[[], bool] | None = None  # None: imds_guard_installed(paths)
    # Seed devices (config drive, NoCloud). None: the machine's own (blkid, mount) when the
    # paths are the machine's (root "/"), none under a re-rooted tree (tests, offline trees).
    seed_devices: SeedDevices | None = None


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
        "user-data with a `nodeforge:` section (cloud-init's copy, an OpenStack config drive "
        "or NoCloud seed device, EC2's IMDSv2), or HyperPod's "
        f"{p.hyperpod_resource_config} + {p.hyperpod_provisioning_parameters}"
    )


# -- secrets ------------------------------------------------------------------------------------
SAFE_SECRET_HINT = (
    "give the key as munge_key_file: /path/to/a/root-only/file (mode 0400/0600, owner root; "
    "for example copied from an S3 URI by a HyperPod lifecycle script), or put the params in "
    "/etc/nodeforge/node.yaml with mode 0600"
)


def refuse_secrets(data: dict[str, Any], label: str, why: str) -> None:
    """A secret read from a source that unprivileged users can read is refused, by field."""
    for key in SECRET_KEYS:
        if data.get(key) is not None:
            raise ParamsError(
                f"{label}: {key}: refused, {why}; a secret must come from a root-only source: "
                + SAFE_SECRET_HINT
            )


def _read_params_file(path: Path, label: str) -> tuple[str, str | None]:
    """(text, exposure) of a params file; a symlink or a non-file is an error."""
    try:
        got = read_private(path, label)
        return got.text, got.exposure
    except UnsafeFileError as exc:
        raise ParamsError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ParamsError(f"{label}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


# -- 1. node.yaml ------------------------------------------------------------------------------
def _from_file(cfg: SourceConfig) -> Loaded | None:
    path = cfg.paths.node_yaml
    if not os.path.lexists(path):
        return None
    return Loaded(load_node_yaml(path), f"file:{path}")


def load_node_yaml(path: Path) -> Params:
    text, exposed = _read_params_file(path, str(path))
    data = _yaml(text, str(path))
    if exposed and isinstance(data, dict):
        refuse_secrets(data, str(path), f"the file is {exposed}")
    return parse_params(data, str(path))


def _yaml(text: str, label: str) -> Any:
    try:
        return strict_yaml.load(text)
    except strict_yaml.StrictYAMLError as exc:
        raise ParamsError(f"{label}: {exc}") from exc
    except yaml.YAMLError as exc:
        # from None: the parser's own text quotes the document (see _yaml_problem)
        raise ParamsError(f"{label}: not valid YAML: {_yaml_problem(exc)}") from None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's reason and position, without the snippet of the document it prints: the line
    may hold a secret (a munge key), and a snippet can cut it short of what redaction sees."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return type(exc).__name__
    parts = []
    for what, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark)):
        if what:
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            parts.append(f"{what}{at}")
    return "; ".join(parts) or type(exc).__name__


# -- 2. kernel command line ----------------------------------------------------------------------
# nodeforge.<field>=<value>; list fields are comma separated; nodeforge.params=<url> loads a YAML
# document (file://, http(s)://) that the other nodeforge.* keys then override.
_CMDLINE_LISTS = {"features", "gres", "gres_types"}
_CMDLINE_INTS = {"cpus", "real_memory", "max_node_count", "hook_retries"}
_CMDLINE_FLOATS = {"hook_timeout", "wait_timeout", "hook_backoff", "hook_backoff_max"}
_CMDLINE_BOOLS = {"accounting", "docker"}
_CMDLINE_ALIASES = {"cluster": "cluster_name", "node": "node_name"}
_FLOAT_RE = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,6})?")
# The kernel's isspace(): its ctype table also counts 0xA0 (Latin-1 NBSP) as space.
_KSPACE = " \t\n\v\f\r\xa0"


def kernel_args(text: str) -> list[tuple[str, str | None]]:
    """Split a kernel command line exactly like the kernel's parse_args()/next_arg().

    Only double quotes group words: `a="b c"` and `"a=b c"` are one argument; a quote inside a
    word toggles quoting without being removed; there is no escape character. `--` ends the
    kernel's arguments (the rest is init's). Returns (param, value) pairs; value None for a
    bare word.
    """
    out: list[tuple[str, str | None]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in _KSPACE:
            i += 1
        if i >= n:
            return out
        quoted = text[i] == '"'
        if quoted:
            i += 1
        start = i
        in_quote = quoted
        equals = 0
        j = i
        while j < n:
            ch = text[j]
            if ch in _KSPACE and not in_quote:
                break
            if equals == 0 and ch == "=":
                equals = j - start  # the kernel keeps 0 as "no '='" (a leading '=' is not one)
            if ch == '"':
                in_quote = not in_quote
            j += 1
        word_end = j  # text[start:j] is the argument, quotes and all
        if quoted and j > start and text[j - 1] == '"':
            word_end = j - 1
        if not equals:
            param, val = text[start:word_end], None
        else:
            param = text[start : start + equals]
            vstart = start + equals + 1
            vend = word_end
            if vstart < n and vstart < j and text[vstart] == '"':
                vstart += 1
                if not quoted and j > 0 and text[j - 1] == '"' and vend > vstart:
                    vend = j - 1
            val = text[vstart : max(vstart, vend)]
        if val is None and param == "--":
            return out
        out.append((param, val))
        i = j + 1 if j < n else j


def cmdline_bytes(text: str) -> bytes:
    """A command line given as a string (`params check --cmdline`) as the bytes a kernel would
    get: UTF-8, with the bytes that argv could not decode given back (surrogateescape)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no byte stands for: keep it non-ASCII
        return text.encode("utf-8", "surrogatepass")


def parse_cmdline(raw: bytes | str, label: str = "kernel command line") -> dict[str, str]:
    """The nodeforge.* arguments of a kernel command line (aliases resolved).

    The one parser for /proc/cmdline (bytes) and `params check --cmdline` (a string, made
    bytes by `cmdline_bytes`): words are split on the bytes exactly as the kernel splits them,
    and a nodeforge.* word must be ASCII (any other byte, and so any invalid UTF-8, is refused
    with the word named), so both readers always agree.
    A key given twice is an error: which of two values the operator meant is not ours to guess.
    """
    if isinstance(raw, str):
        raw = cmdline_bytes(raw)
    out: dict[str, str] = {}
    # latin-1 maps each byte to one character: the kernel's own view, byte for byte.
    for param, val in kernel_args(raw.decode("latin-1")):
        if not param.startswith("nodeforge."):
            continue
        word = param if val is None else f"{param}={val}"
        if not word.isascii():
            pos = next(i for i, ch in enumerate(word) if ord(ch) > 0x7F)
            name = param if param.isascii() else ascii(param.encode("latin-1"))[2:-1]
            raise ParamsError(
                f"{label}: {name}: byte 0x{ord(word[pos]):02X} at offset {pos} of the word is "
                "not ASCII; nodeforge.* arguments take ASCII only (percent-encode a URL)"
            )
        if val is None:
            continue
        k = param[len("nodeforge.") :]
        k = _CMDLINE_ALIASES.get(k, k)
        if k in out:
            raise ParamsError(f"{label}: {param}: given twice; keep one")
        out[k] = val
    return out


def read_cmdline(path: Path) -> bytes:
    """The kernel command line as bytes (parse_cmdline decodes them the kernel's way)."""
    return path.read_bytes()


CMDLINE_MAX = 65536


def cmdline_params(
    raw: bytes | str,
    label: str = "kernel command line",
    url_reader: Callable[[str, str], dict[str, Any]] | None = None,
) -> dict[str, Any] | None:
    """The params mapping that a kernel command line gives, or None if it has no nodeforge.*."""
    if len(raw) > CMDLINE_MAX:  # the kernel's own limit is 2-4 KiB (COMMAND_LINE_SIZE)
        raise ParamsError(
            f"{label}: {len(raw)} characters; a kernel command line is at most {CMDLINE_MAX}"
        )
    kv = parse_cmdline(raw, label)
    if not kv:
        return None
    # /proc/cmdline is world-readable: a secret on it is public to every local user.
    refuse_secrets(kv, label, "the kernel command line is readable by every user (/proc/cmdline)")
    data: dict[str, Any] = {}
    url = kv.pop("params", None)
    if url:
        data = (url_reader or _params_url)(url, f"{label} nodeforge.params={url}")
    for k, val in kv.items():
        path = f"{label}: nodeforge.{k}"
        if k in _CMDLINE_LISTS:
            data[k] = [s for s in val.split(",") if s]
        elif k in _CMDLINE_INTS:
            try:  # the range is parse_params' to check, with the rest of the field's rules
                data[k] = scalars.integer_text(val, 0, 10**19)
            except scalars.ScalarError as exc:
                raise ParamsError(f"{path}: {exc}") from None
        elif k in _CMDLINE_FLOATS:
            if not _FLOAT_RE.fullmatch(val):
                raise ParamsError(
                    f"{path}: expected a number of seconds (e.g. 30 or 2.5), got {val!r}"
                )
            data[k] = float(val)
        elif k in _CMDLINE_BOOLS:
            if val not in ("0", "1", "true", "false", "yes", "no"):
                raise ParamsError(f"{path}: expected true or false, got {val!r}")
            data[k] = val in ("1", "true", "yes")
        else:
            data[k] = val
    return data


def _params_url(url: str, label: str) -> dict[str, Any]:
    if url.startswith("file://"):
        text, exposed = _read_params_file(Path(url[len("file://") :]), label)
        why = f"the file is {exposed}" if exposed else None
    elif url.startswith(("http://", "https://")):
        text = _fetch_text(url, label)
        why = "a params URL can be fetched by every user who can reach it"
    else:
        raise ParamsError(f"{label}: {redact.value(url)}: use a file:// or http(s):// URL")
    data = _yaml(text, label) or {}
    if not isinstance(data, dict):
        raise ParamsError(f"{label}: expected a YAML mapping")
    if why:
        refuse_secrets(data, label, why)
    return data


def _from_cmdline(cfg: SourceConfig) -> Loaded | None:
    try:
        raw = read_cmdline(cfg.paths.cmdline)
    except OSError:
        return None
    label = "kernel command line"
    data = cmdline_params(raw, label)
    if data is None:
        return None
    return Loaded(parse_params(data, label), "cmdline")


# A params document is small; a bigger body is not one. Retries heal a network that is still
# coming up at boot (1 s, then 2 s). None: the default below, made on first use.
PARAMS_URL_POLICY: download.Policy | None = None


def _params_url_policy() -> download.Policy:
    from nodeforge import download

    return PARAMS_URL_POLICY or download.Policy(
        timeout=10.0, deadline=60.0, attempts=3, backoff=1.0, max_bytes=strict_yaml.MAX_BYTES
    )


def _fetch_text(url: str, label: str) -> str:
    # file:// never gets here: it is read with the root-only checks (_read_params_file).
    if not url.startswith(("http://", "https://")):
        raise ParamsError(f"{label}: {redact.value(url)}: use a file:// or http(s):// URL")
    from nodeforge import download  # http/ssl/email: only when params come from a URL

    try:
        return download.fetch_bytes(url, label=label, policy=_params_url_policy()).decode()
    except download.DownloadError as exc:
        raise ParamsError(str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise ParamsError(f"{label}: {download.display_url(url)}: not UTF-8 text") from exc


# -- 3. cloud-init / EC2 user-data ---------------------------------------------------------------
USER_DATA_EXPOSURE = (
    "EC2 user-data can be read by every local user from the instance metadata service "
    "(enable the image's node_agent_imds_root_only to block that)"
)


def params_from_user_data(text: str, label: str) -> dict[str, Any] | None:
    """User-data is ours if it is a YAML mapping (optionally #cloud-config) with a `nodeforge:`
    section, or a plain YAML mapping with a `role` key. Scripts and other formats are not ours;
    a document that is ours but breaks the strict YAML rules is an error."""
    stripped = text.lstrip()
    if not stripped or stripped.startswith(("#!", "Content-Type:", "MIME-Version:")):
        return None
    try:
        data = strict_yaml.load(text)
    except strict_yaml.StrictYAMLError as exc:
        # Someone else's YAML may use anchors (or be big); it only matters when it is ours.
        if not _looks_ours(text, stripped):
            return None
        raise ParamsError(f"{label}: {exc}") from exc
    except yaml.YAMLError:
        return None  # not YAML at all: some other tool's user-data
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


# A top-level `nodeforge:` or `role:` line: what says "ours" in a document too large or too
# deep to walk.
_OURS_LINE = re.compile(r"^(nodeforge|role)[ \t]*:", re.MULTILINE)


def _looks_ours(text: str, stripped: str) -> bool:
    """Whether a document that broke a strict rule was meant for nodeforge: its top-level
    keys, read from the bounded event stream without building anything."""
    try:
        keys = strict_yaml.top_level_keys(text)
    except strict_yaml.StrictYAMLError:
        keys = frozenset(_OURS_LINE.findall(text))
    except yaml.YAMLError:
        return False
    return keys is not None and (
        "nodeforge" in keys or ("role" in keys and not stripped.startswith("#cloud-config"))
    )


def _user_data_section(text: str, label: str, guarded: bool) -> dict[str, Any] | None:
    section = params_from_user_data(text, label)
    if section is not None and not guarded:
        refuse_secrets(section, label, USER_DATA_EXPOSURE)
    return section


def _from_user_data(cfg: SourceConfig) -> Loaded | None:
    guarded = cfg.imds_guarded() if cfg.imds_guarded else imds_guard_installed(cfg.paths)
    ci = cfg.paths.cloud_init_user_data
    if ci.exists():
        section = _user_data_section(_read_capped(ci), str(ci), guarded)
        if section is not None:
            return Loaded(parse_params(section, f"{ci} nodeforge"), "cloud-init")
    seeded = _from_seed(cfg, guarded)
    if seeded is not None:
        return seeded
    if not cfg.imds_url:
        return None
    session = ImdsSession.open(cfg.imds_url, cfg.imds_timeout)
    if session is None:
        return None
    text = session.get("latest/user-data", "user-data")
    if text is None:
        return None
    label = "EC2 user-data (IMDSv2)"
    section = _user_data_section(text, label, guarded)
    if section is None:
        return None
    if section.get("node_name") is None:
        # EC2's own name for the instance, before the guest's hostname (an image default, the
        # same on every node, until something sets it).
        name = imds_node_name(session)
        if name is not None:
            section = {**section, "node_name": name}
    params = parse_params(section, label + " nodeforge")
    return Loaded(params, "imds", imds_public_keys(session))


# OpenStack serves the config drive's user-data from its metadata service as well, to every
# local user unless the image blocks it (the IMDS guard covers 169.254.169.254).
METADATA_EXPOSURE = (
    "OpenStack's metadata service serves the same user-data to every local user (enable the "
    "image's node_agent_imds_root_only to block that)"
)


def _from_seed(cfg: SourceConfig, guarded: bool) -> Loaded | None:
    """User-data from a seed device (params_seed.py). Two seeds are an error: which one the
    platform meant is not ours to guess."""
    devices = cfg.seed_devices
    if devices is None:
        if cfg.paths.root != Path("/"):
            return None
        from .params_seed import SeedDevices

        devices = SeedDevices(workdir=cfg.paths.run_dir)
    seeds = devices.find()
    if not seeds:
        return None
    if len(seeds) > 1:
        raise ParamsError(
            "seed devices: more than one ("
            + ", ".join(f"{s.device} {s.kind}" for s in seeds)
            + "); attach one config drive or NoCloud seed"
        )
    seed = seeds[0]
    text = devices.read(seed)
    if text is None:
        return None
    section = params_from_user_data(text, seed.label)
    if section is None:
        return None
    exposed = devices.device_exposure(seed.device)
    if exposed is None and seed.kind == "config-drive" and not guarded:
        exposed = METADATA_EXPOSURE
    if exposed is not None:
        refuse_secrets(section, seed.label, exposed)
    return Loaded(parse_params(section, f"{seed.label} nodeforge"), seed.kind)


def _read_capped(path: Path) -> str:
    """A user-data file, at most one byte past the document cap (enough to refuse it)."""
    try:
        with path.open("rb") as fh:
            return fh.read(strict_yaml.MAX_BYTES + 1).decode(errors="replace")
    except OSError as exc:
        raise ParamsError(f"{path}: cannot read: {exc.strerror}") from None


IMDS_GUARD_RULES = Path("/etc/nodeforge/imds-root-only.nft")


def imds_guard_installed(paths: Paths) -> bool:
    """The image blocks non-root access to IMDS (role node_agent, node_agent_imds_root_only)."""
    return (paths.root / IMDS_GUARD_RULES.relative_to("/")).is_file()


class ImdsSession:
    """One IMDSv2 session: a token from PUT /latest/api/token, then GETs with it.

    Bounded: every request waits at most *timeout* seconds. No metadata service (refused,
    unreachable, no answer, the connection dropped) is `open` returning None, so the next
    params source is tried. A service that answers but refuses the token (a proxy in the path:
    the hop limit; a bad TTL) or a GET (401: the token is wrong or expired) is a clear error:
    params that exist but cannot be read must not turn the node into something else.
    """

    def __init__(self, base: str, token: str, timeout: float) -> None:
        self.base, self.token, self.timeout = base, token, timeout

    @classmethod
    def open(cls, base_url: str, timeout: float = 1.0) -> ImdsSession | None:
        import urllib.error  # only when IMDS is asked (a node.yaml or cmdline params skip it)
        import urllib.request

        base = base_url.rstrip("/")
        req = urllib.request.Request(
            f"{base}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_TTL)},
        )
        try:
            token = cls._put_token(req, timeout)
        except urllib.error.HTTPError as exc:
            raise NodeforgeError(
                f"IMDS at {base}: the token request (PUT /latest/api/token) was refused with HTTP "
                f"{exc.code}; "
                + (
                    "the metadata service sees a proxy in between (its hop limit): run the agent "
                    "on the instance itself, or raise the instance's HttpPutResponseHopLimit"
                    if exc.code == 403
                    else "the metadata service does not speak IMDSv2 as expected"
                )
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.info("no IMDS at %s (%s)", base, exc)
            return None
        if not _IMDS_TOKEN_RE.fullmatch(token):
            raise NodeforgeError(f"IMDS at {base}: the session token is not printable text")
        return cls(base, token, timeout)

    @staticmethod
    def _put_token(req: Any, timeout: float) -> str:
        """The token PUT: once more, with a longer wait, when the first got no answer in time
        (a slow guest or a busy host, not an absent service: refused and unreachable fail at
        once). At most *timeout* × (1 + IMDS_RETRY_FACTOR) seconds in all."""
        import socket
        import urllib.error
        import urllib.request

        for wait in (timeout, timeout * IMDS_RETRY_FACTOR):
            try:
                with urllib.request.urlopen(req, timeout=wait) as r:
                    return r.read(4096).decode("ascii", errors="replace").strip()
            except urllib.error.HTTPError:
                raise
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                if not isinstance(reason, (TimeoutError, socket.timeout, ConnectionResetError)):
                    raise
                last = exc
        raise last

    def get(self, path: str, what: str) -> str | None:
        """The text at /*path*, or None for 404 (absent) or a service that went away."""
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            f"{self.base}/{path}", headers={"X-aws-ec2-metadata-token": self.token}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                # One byte over the bound, never cut: the strict loader refuses an oversize
                # document rather than parse a truncated one.
                return r.read(IMDS_MAX_BYTES + 1).decode(errors="replace")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            why = (
                "the session token was refused (wrong or expired)"
                if exc.code == 401
                else "the metadata service failed"
            )
            raise NodeforgeError(f"IMDS {what} at {self.base}: HTTP {exc.code}: {why}") from None
        except (urllib.error.URLError, OSError) as exc:
            log.info("IMDS %s unavailable at %s (%s)", what, self.base, exc)
            return None


_IMDS_TOKEN_RE = re.compile(r"[!-~]{1,4096}")
IMDS_RETRY_FACTOR = 3.0  # the token PUT's second try waits this many times the timeout
IMDS_MAX_BYTES = strict_yaml.MAX_BYTES  # user-data's bound (EC2's own is 16 KB)
_KEY_INDEX_RE = re.compile(r"([0-9]{1,3})=[!-~]{0,255}")
IMDS_MAX_KEYS = 16


def imds_user_data(base_url: str, timeout: float = 1.0) -> str | None:
    """IMDSv2 user-data, or None when there is no IMDS or no user-data (see `ImdsSession`)."""
    session = ImdsSession.open(base_url, timeout)
    return None if session is None else session.get("latest/user-data", "user-data")


def imds_node_name(session: ImdsSession) -> str | None:
    """The node name EC2 gives the instance: the first label of meta-data/local-hostname
    (ip-10-0-0-5 of ip-10-0-0-5.eu-west-1.compute.internal), else of meta-data/hostname; None
    when neither is served (then the guest's hostname, identity.node_name)."""
    for what in ("local-hostname", "hostname"):
        text = session.get(f"latest/meta-data/{what}", what)
        if text is not None:
            return node_name_from_hostname(text, f"IMDS {what}")
    return None


def node_name_from_hostname(text: str, what: str) -> str:
    """The first label of the hostname *text* as a node name, or an error naming *what*."""
    from .params import is_hostname, is_node_name, unusable_address

    host = text.strip()
    label = host.split(".", 1)[0]
    if not (is_hostname(host) and is_node_name(label)):
        raise NodeforgeError(
            f"{what}: {host[:80]!r} is not a hostname whose first label is a usable node name "
            "(RFC 1123 labels: letters, digits, inner '-'); set node_name in user-data"
        )
    why = unusable_address(label)
    if why is not None:  # the node_name rule of params (localhost and the like)
        raise NodeforgeError(f"{what}: {label!r} is {why}; set node_name in user-data")
    return label


def imds_public_keys(session: ImdsSession) -> tuple[str, ...]:
    """The instance's OpenSSH public keys (meta-data/public-keys), each checked as one key line.

    A listing or key that is not in EC2's shape is an error naming it (never written anywhere)."""
    from .params import _SSH_PUB_RE

    listing = session.get("latest/meta-data/public-keys/", "public-keys")
    if not listing:
        return ()
    keys: list[str] = []
    for n, line in enumerate(listing.splitlines()[:IMDS_MAX_KEYS]):
        m = _KEY_INDEX_RE.fullmatch(line.strip())
        if m is None:
            raise NodeforgeError(
                f"IMDS public-keys: line {n + 1} is not INDEX=NAME; the metadata service is not "
                "EC2's shape"
            )
        what = f"public-keys/{m.group(1)}/openssh-key"
        key = session.get(f"latest/meta-data/{what}", what)
        if key is None:
            continue
        key = key.strip()
        if not _SSH_PUB_RE.fullmatch(key):
            raise NodeforgeError(
                f"IMDS {what}: not one OpenSSH public key line (ssh-ed25519 AAAA... comment)"
            )
        keys.append(key)
    return tuple(dict.fromkeys(keys))


# -- 4. HyperPod ---------------------------------------------------------------------------------
def _from_hyperpod(cfg: SourceConfig) -> Loaded | None:
    rc_path = cfg.paths.hyperpod_resource_config
    pp_path = cfg.paths.hyperpod_provisioning_parameters
    if not (rc_path.exists() and pp_path.exists()):
        return None
    addrs = set(cfg.own_addresses() if cfg.own_addresses else _own_addresses())
    host = cfg.hostname() if cfg.hostname else _hostname()
    return Loaded(load_hyperpod(rc_path, pp_path, addrs, host), "hyperpod")


def load_hyperpod(rc_path: Path, pp_path: Path, addrs: set[str], hostname: str) -> Params:
    rc, _ = _json(rc_path)
    pp, exposed = _json(pp_path)
    data = hyperpod_params(rc, pp, addrs, hostname, str(rc_path), str(pp_path))
    if exposed:
        refuse_secrets(data, f"{pp_path} nodeforge", f"the file is {exposed}")
    return parse_params(data, f"{pp_path} (HyperPod)")


def _json(path: Path) -> tuple[Any, str | None]:
    text, exposed = _read_params_file(path, str(path))
    try:
        strict_json.check(text)  # size, depth and values, before json.loads builds anything
        doc = json.loads(
            text,
            parse_constant=_NonFinite,
            parse_float=_json_float,
            object_pairs_hook=_no_dup(path),
            parse_int=strict_json.bounded_int,
        )
    except json.JSONDecodeError as exc:
        raise ParamsError(f"{path}: not valid JSON: {exc}") from exc
    except ParamsError as exc:  # from the hooks, which do not know the file
        if str(exc).startswith(f"{path}: "):
            raise
        raise ParamsError(f"{path}: {exc}") from None
    except (strict_json.BoundsError, RecursionError) as exc:
        raise ParamsError(f"{path}: {exc}") from None
    _refuse_non_finite(doc, str(path))
    return doc, exposed


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")


class _NonFinite:
    """Stands in for NaN, Infinity or a number that overflows to inf while the document is
    parsed, so the refusal can name the field (the parser's hook does not know where it is)."""

    def __init__(self, text: str):
        self.text = text


def _json_float(text: str) -> float | _NonFinite:
    f = float(text)
    return f if math.isfinite(f) else _NonFinite(text)


def _refuse_non_finite(doc: Any, label: str) -> None:
    """Raise, naming the file and the field, at the first NaN/Infinity in *doc* (iterative:
    no recursion limit to hit)."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, _NonFinite):
            shown = v.text if len(v.text) <= 24 else v.text[:24] + "…"
            raise ParamsError(
                f"{label}: {where or '(top level)'}: {shown} is not a finite JSON number; "
                "give a finite value"
            )
        if isinstance(v, dict):
            for k, x in reversed(v.items()):
                k = k if _PLAIN_KEY.fullmatch(k) else redact.value(k, 40)
                stack.append((f"{where}.{k}" if where else k, x))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))


def _no_dup(path: Path) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, val in pairs:
            if k in out:
                raise ParamsError(f"{path}: duplicate key {k!r}; keep one")
            out[k] = val
        return out

    return hook


def _hp_str(v: Any, label: str, field: str, required: bool = True) -> str | None:
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v:
        raise ParamsError(f"{label}: {field}: expected a non-empty string, got {_tn(v)}")
    return v


# The params that HyperPod's own fields give: a `nodeforge:` section may add other params, never
# these (docs/agent.md "HyperPod").
HYPERPOD_DECIDES = {
    "role": "the instance group of this node in resource_config.json",
    "controller": "the controller_group's instance address in resource_config.json",
    "cluster_name": "cluster_name in provisioning_parameters.json, default 'hyperpod'",
}


def hyperpod_params(
    rc: Any, pp: Any, own_addresses: set[str], hostname: str, rc_label: str, pp_label: str
) -> dict[str, Any]:
    """Map HyperPod's two files, read as they are, to a nodeforge params mapping.

    provisioning_parameters.json: {version, workload_manager, controller_group, login_group,
    worker_groups: [{instance_group_name, partition_name}], ...}; an optional `nodeforge` section
    carries any other params (munge_key_file, hooks, ...). resource_config.json:
    {InstanceGroups: [{Name, Instances: [{InstanceName, CustomerIpAddress, ...}]}]}.
    This node is the instance whose CustomerIpAddress is one of ours; only when no address
    matches, the instance whose InstanceName is our hostname. Its group picks the role.

    Phases, in the order their errors are reported: read provisioning_parameters.json's groups,
    read resource_config.json's instances, pick this node's instance, map the fields, merge the
    `nodeforge` section.
    """
    if not isinstance(pp, dict):
        raise ParamsError(f"{pp_label}: expected a JSON object")
    if not isinstance(rc, dict) or not isinstance(rc.get("InstanceGroups"), list):
        raise ParamsError(f"{rc_label}: InstanceGroups: expected a list")
    prov = _hp_provisioning(pp, pp_label)
    found = _hp_instances(rc["InstanceGroups"], rc_label, own_addresses, hostname)
    group, inst = _hp_this_node(found, rc_label, own_addresses, hostname)
    ctl = [i for i in found.groups.get(prov.ctl_group, []) if i.get("CustomerIpAddress")]
    if not ctl:
        raise ParamsError(
            f"{rc_label}: controller group {prov.ctl_group!r} has no instance with a "
            "CustomerIpAddress"
        )
    if group == prov.ctl_group:
        role = "controller"
    elif prov.login_group and group == prov.login_group:
        role = "login"
    else:
        role = "compute"
    section = pp.get("nodeforge") or {}
    if not isinstance(section, dict):
        raise ParamsError(f"{pp_label}: nodeforge: expected a mapping of node params")
    data = _hp_fields(pp, prov, role, group, inst, ctl[0]["CustomerIpAddress"])
    _hp_merge_section(data, section, role, pp_label)
    return data


@dataclass(frozen=True)
class _HpProvisioning:
    """provisioning_parameters.json's groups: which is the controller's, which the login's,
    and each worker group's partition."""

    ctl_group: str
    login_group: str | None
    partition_of: dict[str, str]


@dataclass(frozen=True)
class _HpInstances:
    """resource_config.json's instances by group, and those that may be this node."""

    groups: dict[str, list[dict[str, Any]]]
    by_addr: list[tuple[str, dict[str, Any]]]  # (group, instance) with one of our addresses
    by_name: list[tuple[str, dict[str, Any]]]  # (group, instance) named as our hostname


def _hp_provisioning(pp: dict[str, Any], pp_label: str) -> _HpProvisioning:
    wm = pp.get("workload_manager", "slurm")
    if wm != "slurm":
        raise ParamsError(f"{pp_label}: workload_manager: {wm!r} is not 'slurm'")
    if pp.get("controller_group") is None:
        raise ParamsError(f"{pp_label}: controller_group: missing")
    ctl_group = _hp_str(pp.get("controller_group"), pp_label, "controller_group")
    login_group = _hp_str(pp.get("login_group"), pp_label, "login_group", required=False)
    assert ctl_group is not None
    workers = pp.get("worker_groups") or []
    if not isinstance(workers, list):
        raise ParamsError(f"{pp_label}: worker_groups: expected a list, got {_tn(workers)}")
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
        g = _hp_str(w["instance_group_name"], pp_label, f"worker_groups[{i}].instance_group_name")
        part = _hp_str(w["partition_name"], pp_label, f"worker_groups[{i}].partition_name")
        assert g is not None and part is not None
        if g in partition_of:
            raise ParamsError(
                f"{pp_label}: worker_groups[{i}].instance_group_name: {g!r} given twice"
            )
        partition_of[g] = part
    return _HpProvisioning(ctl_group, login_group, partition_of)


def _hp_instances(
    instance_groups: list[Any], rc_label: str, own_addresses: set[str], hostname: str
) -> _HpInstances:
    found = _HpInstances({}, [], [])
    group_of_addr: dict[str, str] = {}
    for gi, g in enumerate(instance_groups):
        gpath = f"InstanceGroups[{gi}]"
        if not isinstance(g, dict):
            raise ParamsError(f"{rc_label}: {gpath}: expected an object, got {_tn(g)}")
        if g.get("Name") is None:
            raise ParamsError(f"{rc_label}: {gpath}.Name: missing")
        name = _hp_str(g.get("Name"), rc_label, f"{gpath}.Name")
        assert name is not None
        if name in found.groups:
            raise ParamsError(f"{rc_label}: {gpath}.Name: duplicate group name {name!r}")
        insts = g.get("Instances") or []
        if not isinstance(insts, list):
            raise ParamsError(f"{rc_label}: {gpath}.Instances: expected a list, got {_tn(insts)}")
        valid = []
        for ii, inst in enumerate(insts):
            ipath = f"{gpath}.Instances[{ii}]"
            if not isinstance(inst, dict):
                raise ParamsError(f"{rc_label}: {ipath}: expected an object, got {_tn(inst)}")
            _hp_instance(
                inst, name, (rc_label, ipath), group_of_addr, own_addresses, hostname, found
            )
            valid.append(inst)
        found.groups[name] = valid
    return found


def _hp_instance(
    inst: dict[str, Any],
    group: str,
    where: tuple[str, str],
    group_of_addr: dict[str, str],
    own_addresses: set[str],
    hostname: str,
    found: _HpInstances,
) -> None:
    """Check one instance's address and name; note it in *found* when it may be this node."""
    rc_label, ipath = where  # the file, and the instance's path in it
    addr = _hp_str(inst.get("CustomerIpAddress"), rc_label, f"{ipath}.CustomerIpAddress", False)
    iname = _hp_str(inst.get("InstanceName"), rc_label, f"{ipath}.InstanceName", False)
    if addr is not None:
        why = None if is_ip(addr) else "not an IP address"
        why = why or unusable_address(addr)
        if why is not None:
            raise ParamsError(
                f"{rc_label}: {ipath}.CustomerIpAddress: {redact.value(addr)} is {why}"
            )
        if addr in group_of_addr and group_of_addr[addr] != group:
            raise ParamsError(
                f"{rc_label}: {ipath}.CustomerIpAddress: {addr} is in two groups, "
                f"{group_of_addr[addr]!r} and {group!r}"
            )
        group_of_addr[addr] = group
        if addr in own_addresses:
            found.by_addr.append((group, inst))
    if hostname and iname == hostname:
        found.by_name.append((group, inst))


def _hp_this_node(
    found: _HpInstances, rc_label: str, own_addresses: set[str], hostname: str
) -> tuple[str, dict[str, Any]]:
    # An address is ours for sure; a hostname can be stale or reused, so it only breaks a tie
    # when no address matched.
    matches = found.by_addr or found.by_name
    if not matches:
        raise ParamsError(
            f"{rc_label}: this node (addresses {', '.join(sorted(own_addresses)) or 'none'}, "
            f"hostname {hostname!r}) is in no instance group's Instances"
        )
    if len(matches) > 1:
        what = "addresses" if found.by_addr else "hostname"
        raise ParamsError(
            f"{rc_label}: this node's {what} match {len(matches)} instances "
            f"(groups {', '.join(repr(g) for g, _ in matches)}); each instance must be listed once"
        )
    return matches[0]


def _hp_fields(
    pp: dict[str, Any],
    prov: _HpProvisioning,
    role: str,
    group: str,
    inst: dict[str, Any],
    ctl_address: str,
) -> dict[str, Any]:
    """The params that HyperPod's own fields give (HYPERPOD_DECIDES, extra.hyperpod, and the
    partitions or features that the worker groups imply)."""
    data: dict[str, Any] = {
        "cluster_name": pp.get("cluster_name", "hyperpod"),
        "role": role,
        "controller": {"address": ctl_address},
        "extra": {
            "hyperpod": {
                "instance_group": group,
                "instance_name": inst.get("InstanceName"),
                "address": inst.get("CustomerIpAddress"),
                **{k: pp[k] for k in ("fsx_dns_name", "fsx_mountname") if k in pp},
            }
        },
    }
    if role == "compute" and group in prov.partition_of:
        data["features"] = [prov.partition_of[group]]
    if role == "controller" and prov.partition_of:
        names = list(dict.fromkeys(prov.partition_of.values()))
        data["partitions"] = [{"name": n, "default": i == 0} for i, n in enumerate(names)]
    return data


def _hp_merge_section(
    data: dict[str, Any], section: dict[str, Any], role: str, pp_label: str
) -> None:
    """Add provisioning_parameters.json's `nodeforge` section to *data*, never over what
    HyperPod's own fields decide."""
    for k, val in section.items():
        if k in HYPERPOD_DECIDES:
            raise ParamsError(
                f"{pp_label}: nodeforge.{k}: refused; HyperPod's own fields decide it "
                f"({HYPERPOD_DECIDES[k]}), so a compute can never be turned into a controller "
                "or sent to another controller; remove the key"
            )
        if k == "extra":
            if not isinstance(val, dict):
                raise ParamsError(
                    f"{pp_label}: nodeforge.extra: expected a mapping, got {_tn(val)}"
                )
            if "hyperpod" in val:
                raise ParamsError(
                    f"{pp_label}: nodeforge.extra.hyperpod: refused; the agent fills it from "
                    "HyperPod's files (instance group, name, address); use another key"
                )
            data["extra"].update(val)
        elif k == "features" and role == "compute":
            if isinstance(val, str):
                val = [s.strip() for s in val.split(",") if s.strip()]
            if val is not None and not isinstance(val, list):
                raise ParamsError(
                    f"{pp_label}: nodeforge.features: expected a list or a comma-separated string, "
                    f"got {_tn(val)}"
                )
            data["features"] = list(data.get("features", [])) + list(val or [])
        else:
            data[k] = val


def _tn(v: Any) -> str:
    return "null" if v is None else type(v).__name__


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
