"""Hook runner: baked scripts in /etc/nodeforge/on-init.d/ plus extension scripts from params.

Contract (extensions/README.md is the operator-facing copy):
- Order: all hooks sorted lexically by name (baked file name, or the extension's `name` /
  last URI segment); on a tie the baked one runs first. Names must be unique, never `.`/`..`.
- Trust: a baked hook must be a regular file owned by root and not group/world-writable, in a
  directory that is the same; a symlink may only point inside on-init.d. A remote extension
  must come over https (or s3) or carry a sha256. Anything else is refused before ANY hook
  runs, and the reason drains the node.
- Extension scripts are fetched (file://, http(s)://, s3://) through nodeforge.download into
  /var/lib/nodeforge/hooks/, checked (sha256, Content-Length) BEFORE they are renamed into
  place; a mismatch is refused. An S3 prefix + script (HyperPod's SourceS3Uri + OnCreate) is
  synced to /var/lib/nodeforge/hooks/<name>.d/ and the script runs there, with its siblings.
  Each fetch attempt is bounded as a whole (FETCH_DEADLINE): for s3://, the credentials from
  the metadata service, each name lookup and connect, the listing and every object together,
  request and body, whatever the per-read timeouts allow.
- s3:// credentials come from boto3's default chain (the instance role through IMDSv2), never
  params; a request S3 refuses as signed with expired credentials is made once more with a
  fresh set from that chain.
- Each attempt runs in its own transient systemd scope (or cgroup, or subreaper sweep, see
  bootstrap/contain.py's containment); when it exits or times out, EVERYTHING it started is stopped,
  setsid daemons included. A hook that needs a long-lived service installs a unit.
- A fetch failure is a failed attempt: retried with the same backoff (hook_backoff · 2^(n-1),
  capped at hook_backoff_max).
- Environment: NODEFORGE_ROLE/CLUSTER/NODE/CONTROLLER/PARAMS (+ HOOK, ATTEMPT, LOG_DIR).
- Output of every attempt goes to /var/log/nodeforge/hooks/<name>.log with a header line,
  capped per attempt (hook_output_max: head and tail kept, a marker says what was dropped).
- The first hook that fails for good stops the run; its reason drains the node.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodeforge import fsutil
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import UnsafeName, confined, safe_name, swap_dir

from . import contain
from .params import Params
from .paths import Paths

if TYPE_CHECKING:
    import socket

    from nodeforge import download

    from .host import Host

log = logging.getLogger("nodeforge.hooks")

_NAME_OK = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_SKIP_SUFFIXES = (".dpkg-old", ".dpkg-new", ".dpkg-dist", ".disabled", "~", ".swp", ".md")
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FETCH_TIMEOUT = 60.0  # seconds without a byte
FETCH_DEADLINE = 600.0  # one whole fetch
S3_CONNECT_TIMEOUT = 10.0  # one TCP connect to the S3 endpoint
# what the fetch was still doing, if the deadline passed while credentials were fetched
_GETTING_CREDENTIALS = (
    "getting credentials from boto3's default chain: on an instance, from its metadata service"
)
MAX_SCRIPT_BYTES = 64 << 20
MAX_PREFIX_OBJECTS = 1000
MAX_PREFIX_BYTES = 1 << 30


class Status:
    """HookResult.status values."""

    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    SIGNAL = "signal"
    REFUSED = "refused"  # sha256 mismatch: never run, never retried
    FETCH_FAILED = "fetch-failed"


@dataclass(frozen=True)
class Hook:
    name: str
    path: Path | None  # None until fetched (extension hooks)
    timeout: float
    retries: int
    origin: str  # "baked" or the URI
    sha256: str | None = None
    script: str | None = None  # origin is an S3 prefix; run this file of it
    s3_endpoint: str | None = None
    s3_ca_bundle: str | None = None  # params.s3_ca_bundle: PEM text or a path


@dataclass
class HookResult:
    name: str
    status: str  # a Status value
    attempts: int = 0
    exit_code: int | None = None
    signal: int | None = None
    duration: float = 0.0
    reason: str = ""  # for the drain reason (set when not ok)
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.status == Status.OK


@dataclass
class RunReport:
    results: list[HookResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failure(self) -> HookResult | None:
        return next((r for r in self.results if not r.ok), None)


@dataclass
class HookEnv:
    role: str
    cluster: str
    node: str
    controller: str
    params_file: Path


class HookError(NodeforgeError):
    pass


class ShaMismatch(HookError):
    pass


# -- discovery and trust ---------------------------------------------------------------------
def _trusted_owner(uid: int) -> bool:
    # root; or the user running the agent (root on a node; the tester in unit tests): a file
    # only that user can write gives it nothing it does not have.
    return uid in (0, os.geteuid())


def _check_owner_mode(st: os.stat_result, what: str, path: Path) -> None:
    if not _trusted_owner(st.st_uid):
        raise HookError(
            f"{what}: {path} is owned by uid {st.st_uid}, not root; refused "
            f"(chown root:root {path})"
        )
    if st.st_mode & 0o022:
        raise HookError(
            f"{what}: {path} is group- or world-writable (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); refused (chmod go-w {path})"
        )


def _check_dir_chain(paths: Paths, d: Path) -> bool:
    """on-init.d and every directory above it (from the node's root): no symlink, owned by
    root, not group/world-writable. Whoever can write an ancestor can swap on-init.d for a
    directory of their own, and a symlinked on-init.d is only as safe as wherever it points.
    False when on-init.d does not exist (no baked hooks)."""
    d = Path(os.path.abspath(d))
    root = Path(os.path.abspath(paths.root))
    top = root if d.is_relative_to(root) else Path(d.anchor)
    rel = d.relative_to(top).parts
    chain = [top.joinpath(*rel[:i]) for i in range(len(rel) + 1)]
    for p in chain:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return False  # on-init.d (or a directory above it) is absent: no baked hooks
        if stat.S_ISLNK(st.st_mode):
            where = "" if p == d else f" (above {d})"
            raise HookError(
                f"hooks: {p}{where} is a symlink; refused: baked hooks are read only through "
                f"real directories (replace the link with the directory it points to)"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise HookError(f"hooks: {p} is not a directory; refused")
        _check_owner_mode(st, "hooks", p)
    return True


def _baked(paths: Paths, params: Params) -> Iterator[Hook]:
    d = paths.on_init_d
    if not _check_dir_chain(paths, d):
        return
    real_dir = d.resolve()
    for p in sorted(d.iterdir()):
        if p.name.startswith(".") or p.name.endswith(_SKIP_SUFFIXES):
            continue
        what = f"hook {p.name} refused"
        lst = os.lstat(p)
        target = p
        if stat.S_ISLNK(lst.st_mode):
            target = p.resolve()
            if target.parent != real_dir:
                raise HookError(f"{what}: symlink to {target} points out of {d}")
        try:
            st = os.stat(target)
        except FileNotFoundError:
            raise HookError(f"{what}: dangling symlink to {target}") from None
        if stat.S_ISDIR(st.st_mode):
            continue  # like run-parts
        if not stat.S_ISREG(st.st_mode):
            raise HookError(f"{what}: {p} is not a regular file")
        _check_owner_mode(st, what, target)
        if not _NAME_OK.fullmatch(p.name):
            raise HookError(f"{what}: {p.name!r} is not a file name (A-Z a-z 0-9 _ . -)")
        if not os.access(target, os.X_OK):
            log.warning("skipping %s: not executable (chmod +x to run it)", p)
            continue
        yield Hook(p.name, target, params.hook_timeout, params.hook_retries, "baked")


def discover(paths: Paths, params: Params) -> list[Hook]:
    """Baked + extension hooks in run order. Raises HookError (nothing runs) on any refusal."""
    hooks: list[tuple[str, int, Hook]] = [(h.name, 0, h) for h in _baked(paths, params)]
    hooks += [(h.name, 1, h) for h in _extension_hooks(params)]
    _unique_names(hooks)
    _check_cache_names([h for _, _, h in hooks if h.path is None])
    hooks.sort(key=lambda t: (t[0], t[1]))
    return [h for _, _, h in hooks]


def extension_hooks(params: Params) -> list[Hook]:
    """The extension hooks that params ask for, with every trust rule that params alone decide
    (name grammar, plain http only with a sha256, unique names, cache names): the agent's
    discover() and `nodeforge params check` both apply these, so a file that passes the
    check is not refused at boot for what it says. Raises HookError."""
    out = _extension_hooks(params)
    _unique_names([(h.name, 1, h) for h in out])
    _check_cache_names(out)
    return out


def _extension_hooks(params: Params) -> list[Hook]:
    """The extension hooks of *params*, each checked on its own (discover() then checks the
    names against the baked hooks too)."""
    out: list[Hook] = []
    for i, spec in enumerate(params.hooks):
        name = spec.name or spec.script or _uri_name(spec.uri)
        if name.startswith(".") or not _NAME_OK.fullmatch(name):
            raise HookError(
                f"hooks[{i}]: cannot use {name!r} from {_dl().display_url(spec.uri)} as a "
                f"hook name; set hooks[{i}].name (A-Z a-z 0-9 _ . -, not starting with .)"
            )
        scheme = spec.uri.split("://", 1)[0]
        if scheme == "http" and spec.sha256 is None:
            raise HookError(
                f"hook {name} refused: {_dl().display_url(spec.uri)} is plain http without a "
                f"sha256; serve it over https:// or set hooks[{i}].sha256 (sha256sum <script>)"
            )
        out.append(
            Hook(
                name,
                None,
                spec.timeout if spec.timeout is not None else params.hook_timeout,
                spec.retries if spec.retries is not None else params.hook_retries,
                spec.uri,
                spec.sha256,
                spec.script,
                params.s3_endpoint_url,
                params.s3_ca_bundle,
            )
        )
    return out


def _unique_names(hooks: list[tuple[str, int, Hook]]) -> None:
    seen: dict[str, str] = {}
    for name, _, h in hooks:
        if name in seen:
            raise HookError(
                f"two hooks are named {name!r} ({seen[name]} and "
                f"{_dl().display_url(h.origin)}); give the extension "
                "hook a distinct `name` in params"
            )
        seen[name] = _dl().display_url(h.origin) if h.origin != "baked" else "baked"


def cache_name(hook: Hook) -> str:
    """The entry an extension hook owns in the hook cache: its name, or <name>.d for an S3
    prefix. The runner's own temporaries there start with `.`, which no hook name does."""
    return f"{hook.name}.d" if hook.script is not None else hook.name


def _check_cache_names(ext: list[Hook]) -> None:
    """Names are unique, so two entries can only meet as a hook named `<x>.d` beside the S3
    prefix hook `<x>`, whose synced copy is `<x>.d/`."""
    owner: dict[str, Hook] = {}
    for h in ext:
        other = owner.setdefault(cache_name(h), h)
        if other is not h:
            prefix, plain = (h, other) if h.script is not None else (other, h)
            raise HookError(
                f"hook {plain.name} refused: its cache entry {cache_name(plain)!r} is the one "
                f"hook {prefix.name} ({_dl().display_url(prefix.origin)}) uses for its S3 "
                "prefix; give one of them another `name` in params"
            )


def _uri_name(uri: str) -> str:
    tail = uri.split("://", 1)[-1].split("?", 1)[0].rstrip("/")
    return tail.rsplit("/", 1)[-1]


# -- fetching ----------------------------------------------------------------------------------
def _dl():
    """nodeforge.download (urllib, http.client, ssl: ~27 ms of imports), loaded only when an
    extension hook is named or fetched: a node without them never needs it, and `has_hooks`
    runs on every compute's path to ready (bench/README.md, agent start-up)."""
    from nodeforge import download

    return download


# None: the default below (tests set their own TLS context here)
_FETCH_POLICY: download.Policy | None = None


def _fetch_policy() -> download.Policy:
    if _FETCH_POLICY is not None:
        return _FETCH_POLICY
    return _dl().Policy(
        timeout=FETCH_TIMEOUT, deadline=FETCH_DEADLINE, attempts=1, max_bytes=MAX_SCRIPT_BYTES
    )  # the runner retries, with backoff


def fetch(hook: Hook, cache: Path) -> Path:
    """Bring an extension hook into *cache*, verified before it lands; return what to run.

    Raises ShaMismatch (never run, not retried) or HookError (a failed attempt).
    """
    download = _dl()
    uri = hook.origin
    label = f"hook {hook.name}"
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        dest = confined(cache, cache_name(hook), what=label)
        _clear_stale(dest, want_dir=hook.script is not None)
        if uri.startswith("s3://"):
            return _s3_fetch(hook, cache, dest)
        if uri.startswith(("file://", "http://", "https://")):
            return download.fetch(
                uri,
                dest,
                label=label,
                policy=_fetch_policy(),
                sha256=hook.sha256,
                mode=0o700,
            ).path
    except download.ChecksumMismatch as exc:
        raise ShaMismatch(
            f"hook {hook.name}: sha256 mismatch for {download.display_url(uri)}: expected "
            f"{exc.expected}, got {exc.got}; the script was NOT run. Fix hooks[].sha256 "
            "(sha256sum <script>) or the script"
        ) from exc
    except download.DownloadError as exc:
        raise HookError(f"{label}: {exc.reason}") from exc
    except UnsafeName as exc:
        raise HookError(str(exc)) from exc
    except OSError as exc:  # the node's own disk (full, read-only): a failed attempt, no traceback
        raise HookError(
            f"{label}: cannot write into the hook cache {cache}: {exc.strerror or exc}"
        ) from exc
    raise HookError(f"{label}: unsupported URI {download.display_url(uri)}")


def _clear_stale(dest: Path, *, want_dir: bool) -> None:
    """The cache is the runner's alone: an entry of the other kind, left by an earlier boot
    whose params used this name differently (a file where a prefix's directory goes, or the
    reverse), is removed rather than failing with a confusing rename error."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return
    is_dir = stat.S_ISDIR(st.st_mode)
    if is_dir and not want_dir:
        shutil.rmtree(dest)
    elif not is_dir and (want_dir or not stat.S_ISREG(st.st_mode)):
        dest.unlink()


def _s3_split(hook: Hook, uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket or (not key and hook.script is None):
        raise HookError(f"hook {hook.name}: {uri!r} is not s3://bucket/key")
    return bucket, key


def _s3_ca_file(hook: Hook, cache: Path) -> str | None:
    """The CA file boto3 verifies the S3 endpoint with (None: the system's CAs).

    PEM text from params lands in the hook cache; a path must be a root-owned regular file
    that nobody else can write (it decides whom the node trusts)."""
    ca = hook.s3_ca_bundle
    if ca is None:
        return None
    if ca.startswith("-----BEGIN"):
        from nodeforge.fsutil import write_atomic

        dest = cache / "s3-ca-bundle.pem"
        write_atomic(dest, ca, 0o644)
        return str(dest)
    try:
        st = os.stat(ca, follow_symlinks=False)
    except OSError as exc:
        raise HookError(
            f"hook {hook.name}: s3_ca_bundle: {ca}: {exc.strerror}; give an existing PEM file "
            "or the PEM text itself"
        ) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise HookError(
            f"hook {hook.name}: s3_ca_bundle: {ca} must be a regular file owned by root and "
            "not group/world-writable (chown root: …; chmod 644 …)"
        )
    return ca


def _s3_client(hook: Hook, cache: Path, guard: download.Deadline):
    try:
        import boto3  # Debian python3-boto3 in the image; 'nodeforge[s3]' elsewhere
        import botocore.session
        from botocore.config import Config
        from botocore.exceptions import NoCredentialsError
    except ImportError:
        raise HookError(
            f"hook {hook.name}: {hook.origin} needs boto3, which is not installed; install it "
            "into the agent (apt-get install python3-boto3, or /opt/nodeforge/bin/pip install "
            "'nodeforge[s3]') or serve the script over https:// instead"
        ) from None
    # Credentials: boto3's default chain only (on a node: the instance role through IMDSv2),
    # never params. The endpoint may be set by params (s3_endpoint_url, https or loopback).
    cfg = Config(
        connect_timeout=S3_CONNECT_TIMEOUT,
        read_timeout=FETCH_TIMEOUT,
        retries={"max_attempts": 2},
    )
    verify = _s3_ca_file(hook, cache)
    # A session of its own: boto3's module-level default session would cache credentials (and
    # an endpoint) across hooks.
    core = botocore.session.get_session()
    # The instance role through IMDS: botocore waits 1 s once by default, too little for a
    # busy or emulated machine at boot; 3 tries of 2 s, and all of it inside the deadline.
    core.set_config_variable("metadata_service_timeout", 2)
    core.set_config_variable("metadata_service_num_attempts", 3)

    def make():
        # The chain is resolved here, and its set frozen into the client: botocore's own
        # refreshable set would go back to the metadata service from a later request, outside
        # any bound. A set that expires within the fetch is S3's ExpiredToken, which
        # _S3Fetch.call answers with a new client (a fresh set).
        creds = core.get_credentials()
        if creds is None:
            raise NoCredentialsError()
        frozen = creds.get_frozen_credentials()
        return boto3.session.Session(botocore_session=core).client(
            "s3",
            endpoint_url=hook.s3_endpoint,
            config=cfg,
            verify=verify,
            aws_access_key_id=frozen.access_key,
            aws_secret_access_key=frozen.secret_key,
            aws_session_token=frozen.token,
        )

    # botocore's metadata requests have their own timeouts, not ours: the thread is waited on
    # no longer than the fetch deadline allows.
    return guard.within(make, _GETTING_CREDENTIALS)


def _watch_connections(client, guard: download.Deadline) -> bool:
    """Register every socket *client* opens with *guard*, as it is opened.

    botocore's timeouts bound each read, not a request (a server that sends a header byte
    every 59 s never trips them), and a listing parses its whole answer inside one call, so
    the deadline must reach the sockets themselves. botocore's http session picks urllib3
    pool classes from one per-session dict (``_pool_classes_by_scheme``; the unit tests run
    against botocore 1.44 and Debian trixie's 1.37); each is replaced by a subclass whose
    connections hand themselves to the guard when they open a socket. False without that dict
    (another botocore): then object bodies are still watched (_s3_get), and a warning says the
    rest is bounded per read only."""
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    pools = getattr(session, "_pool_classes_by_scheme", None)
    if not isinstance(pools, dict) or not pools:
        log.warning(
            "s3: this botocore's connections cannot be watched; S3 requests are bounded per "
            "read (%gs), object bodies by the fetch deadline",
            FETCH_TIMEOUT,
        )
        return False
    for scheme, base in list(pools.items()):
        pools[scheme] = _guarded_pool(base, guard)
    return True


def _guarded_pool(base: type, guard: download.Deadline) -> type:
    class Connection(base.ConnectionCls):  # type: ignore[name-defined,misc]
        def _new_conn(self):
            sock = _guarded_socket(self, guard)
            # Before TLS (urllib3 sets .sock to this socket, then wraps it): the handshake is
            # inside the deadline too. urllib3 still wraps it with the endpoint's host name
            # (SNI and the certificate check): only the socket is opened here.
            self._nodeforge_sock = sock
            guard.watch_holder(self, _conn_socket, now=sock)
            return sock

        def connect(self):
            try:
                super().connect()
            finally:
                self._nodeforge_sock = self.sock or getattr(self, "_nodeforge_sock", None)

    return type(base.__name__, (base,), {"ConnectionCls": Connection})


def _guarded_socket(conn, guard: download.Deadline):
    """urllib3's HTTPConnection._new_conn through the deadline: the name lookup (getaddrinfo
    has no timeout) and the connect are bounded by what is left, and a failure is the
    urllib3 exception urllib3 itself raises, so botocore's retries and errors stay the same.
    A connect that its own timeout ended says so, never "deadline"."""
    import socket

    from urllib3.exceptions import ConnectTimeoutError, NewConnectionError

    try:
        return guard.connect(
            (conn._dns_host, conn.port),
            conn.timeout,
            conn.source_address,
            socket_options=conn.socket_options or (),
            watch=False,  # watched through the connection (watch_holder): no descriptor kept
        )
    except socket.gaierror as exc:
        raise _name_error(conn, exc) from exc
    except TimeoutError as exc:
        if guard.expired:
            raise ConnectTimeoutError(conn, f"Connection to {conn.host}: {guard.reason()}") from exc
        raise ConnectTimeoutError(
            conn, f"Connection to {conn.host} timed out. (connect timeout={conn.timeout})"
        ) from exc
    except OSError as exc:
        raise NewConnectionError(conn, f"Failed to establish a new connection: {exc}") from exc


def _name_error(conn, exc: socket.gaierror) -> Exception:
    try:
        from urllib3.exceptions import NameResolutionError  # urllib3 2
    except ImportError:  # urllib3 1.26 reports a failed lookup this way
        from urllib3.exceptions import NewConnectionError

        return NewConnectionError(conn, f"Failed to resolve '{conn.host}' ({exc})")
    return NameResolutionError(conn.host, conn, exc)


def _conn_socket(conn: object):
    """The socket a watched connection reads from: .sock, or the one it opened last (http.client
    drops .sock when the server closes after the answer, while the answer is still read from
    it: a listing is read whole inside botocore's call)."""
    return getattr(conn, "sock", None) or getattr(conn, "_nodeforge_sock", None)


# S3's answers to a request signed with credentials that have expired.
_EXPIRED_CODES = frozenset({"ExpiredToken", "ExpiredTokenException", "RequestExpired"})


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    return code if isinstance(code, str) else None


@dataclass
class _S3Fetch:
    """One fetch attempt of an s3:// hook: one client, one deadline over all its requests."""

    hook: Hook
    cache: Path
    guard: download.Deadline
    client: Any = None  # a botocore S3 client

    def call(self, what: str, request: Callable):
        """*request*(client), made once more with a new client if S3 says its credentials have
        expired. A client signs with the one set it was made with (_s3_client), and botocore
        takes a set that expires soon as valid past its real expiry (its "static stability"
        window, 12-20 min), so S3 may stop taking it within a fetch; a new client asks the
        default chain (the metadata service) afresh, inside the deadline."""
        if self.client is None:
            self._new_client()
        try:
            return request(self.client)
        except Exception as exc:
            if _s3_code(exc) not in _EXPIRED_CODES or self.guard.expired:
                raise
            log.info("hook %s: %s: credentials expired; fetching a new set", self.hook.name, what)
        self._new_client()
        return request(self.client)

    def _new_client(self) -> None:
        self.client = _s3_client(self.hook, self.cache, self.guard)
        _watch_connections(self.client, self.guard)
        # Past the deadline botocore would still retry, after its backoff sleep (up to 1 s,
        # then 2 s): a handler that runs before its retry handler ends the call instead.
        self.client.meta.events.register_first("needs-retry.s3", self._no_retry_past_deadline)

    def _no_retry_past_deadline(self, **_kw) -> None:
        if self.guard.expired:
            raise TimeoutError(self.guard.reason())


def _s3_fetch(hook: Hook, cache: Path, dest: Path) -> Path:
    """An s3:// hook (one object, or a prefix + script) within one FETCH_DEADLINE in all."""
    download = _dl()
    with download.Deadline(FETCH_DEADLINE) as guard:
        s3 = _S3Fetch(hook, cache, guard)
        try:
            if hook.script is not None:
                return _sync_s3_prefix(s3, dest)
            bucket, key = _s3_split(hook, hook.origin)
            return _s3_get(s3, bucket, key, dest, hook.sha256)
        except (HookError, download.DownloadError) as exc:
            if guard.expired:
                raise HookError(
                    f"hook {hook.name}: cannot fetch {download.display_url(hook.origin)}: "
                    f"{guard.reason()}"
                ) from exc
            raise


def _s3_error(hook: Hook, what: str, exc: Exception) -> HookError:
    if "CERTIFICATE_VERIFY_FAILED" in str(exc) or type(exc).__name__ == "SSLError":
        return HookError(
            f"hook {hook.name}: cannot fetch {what}: TLS: the S3 endpoint's certificate is not "
            f"trusted ({exc}); give its CA as s3_ca_bundle in params"
        )
    code = _s3_code(exc)
    if code in _EXPIRED_CODES:
        return HookError(
            f"hook {hook.name}: cannot fetch {what}: {code}: S3 refused the instance role's "
            "credentials as expired, a fresh set from the metadata service too; check the "
            "instance's clock and its IAM role credentials (iam/security-credentials)"
        )
    if type(exc).__name__ == "NoCredentialsError":
        return HookError(
            f"hook {hook.name}: cannot fetch {what}: NoCredentialsError: no credentials in "
            "boto3's default chain; on a cloud instance they are its IAM role's, from the "
            "metadata service: give the instance a role (instance profile) and check that "
            "169.254.169.254 answers root on the node"
        )
    return HookError(f"hook {hook.name}: cannot fetch {what}: {type(exc).__name__}: {exc}")


def _s3_get(s3: _S3Fetch, bucket: str, key: str, dest: Path, sha256: str | None) -> Path:
    download = _dl()
    hook, guard = s3.hook, s3.guard
    uri = f"s3://{bucket}/{key}"
    try:
        obj = s3.call(uri, lambda c: c.get_object(Bucket=bucket, Key=key))
        body = obj["Body"]
        # The body's socket: http.client lets go of it on the connection (.sock is None) when
        # the server closes after this answer, so the response is watched too.
        guard.watch_holder(body, download.stream_socket)
        length = obj.get("ContentLength")
        chunks = iter(lambda: body.read(download.CHUNK), b"")
        return download.save(
            chunks,
            dest,
            label=f"hook {hook.name}",
            url=uri,
            expected_length=length,
            sha256=sha256,
            mode=0o700,
            max_bytes=MAX_SCRIPT_BYTES,
            deadline=guard.at,
        ).path
    except (HookError, download.DownloadError):
        raise
    except Exception as exc:  # botocore's errors are many; each is a failed attempt
        raise _s3_error(hook, uri, exc) from exc


def _s3_listing(hook: Hook, bucket: str, prefix: str, objects: list[dict]) -> list[str]:
    """The keys of *objects* below *prefix*, checked before anything is written: each a safe
    relative path (no `..`, no absolute path, no odd characters), within the count and size
    bounds, and no key that is also another key's folder (`a` and `a/b`: a file and a
    directory cannot share a name on disk)."""
    rels: list[str] = []
    total = 0
    for o in objects:
        key = o.get("Key")
        if not isinstance(key, str) or not key.startswith(prefix):
            raise HookError(f"hook {hook.name}: s3://{bucket}/{prefix}: the listing holds {key!r}")
        rel = key[len(prefix) :]
        if not rel or rel.endswith("/"):
            continue  # the "folder" marker objects consoles create
        try:
            safe_name(rel, what=f"hook {hook.name}: s3://{bucket}/{key}: key", nested=True)
        except UnsafeName as exc:
            raise HookError(f"{exc}; refused") from None
        rels.append(rel)
        total += int(o.get("Size", 0) or 0)
        if len(rels) > MAX_PREFIX_OBJECTS or total > MAX_PREFIX_BYTES:
            raise HookError(
                f"hook {hook.name}: {hook.origin} holds more than "
                f"{MAX_PREFIX_OBJECTS} objects or {MAX_PREFIX_BYTES} bytes"
            )
    files = set(rels)
    for rel in rels:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in files:
                raise HookError(
                    f"hook {hook.name}: s3://{bucket}/{prefix}{folder} is both an object and "
                    f"the folder of s3://{bucket}/{prefix}{rel}; a file and a directory cannot "
                    "share a name on the node: rename or delete one of them"
                )
    return rels


def _sync_s3_prefix(s3: _S3Fetch, final: Path) -> Path:
    """HyperPod's shape: every object under the prefix into <cache>/<name>.d/, then the script.

    The new copy is built beside the old one and swapped in whole, so a failed sync never leaves
    a mix of two versions. The whole listing is checked (_s3_listing) before the first object
    is fetched, and each path is placed with the one confinement helper."""
    hook, cache = s3.hook, s3.cache
    bucket, prefix = _s3_split(hook, hook.origin)

    def listing(client) -> list[dict]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o for page in pages for o in page.get("Contents", [])]

    try:
        objects = s3.call(hook.origin, listing)
    except HookError:
        raise
    except Exception as exc:
        raise _s3_error(hook, hook.origin, exc) from exc
    rels = _s3_listing(hook, bucket, prefix, objects)
    count = len(rels)
    work = Path(tempfile.mkdtemp(dir=cache, prefix=f".{hook.name}.d."))
    try:
        for rel in rels:
            dest = confined(
                work, rel, what=f"hook {hook.name}: s3://{bucket}/{prefix}", nested=True
            )
            dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            _s3_get(
                s3,
                bucket,
                prefix + rel,
                dest,
                hook.sha256 if rel == hook.script else None,
            )
        script = confined(work, str(hook.script), what=f"hook {hook.name}: script")
        if not script.is_file():
            raise HookError(
                f"hook {hook.name}: {hook.origin} has no {hook.script!r} (found {count} objects)"
            )
        old = confined(cache, f".{hook.name}.d.old", what=f"hook {hook.name}")
        swap_dir(work, final, old=old)
        return confined(final, str(hook.script), what=f"hook {hook.name}: script")
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)


# -- running -----------------------------------------------------------------------------------
@dataclass
class Runner:
    paths: Paths
    env: HookEnv
    sleep: Callable[[float], None] = time.sleep
    backoff: float = 2.0
    backoff_max: float = 60.0
    grace: float = 5.0  # SIGTERM -> SIGKILL
    on_result: Callable[[HookResult], None] | None = None
    output_max: int = 1 << 20  # bytes of output kept per attempt

    def delay(self, attempt: int) -> float:
        """Wait before retry number *attempt* (1-based): backoff · 2^(attempt-1), capped."""
        return min(self.backoff * (2 ** (attempt - 1)), self.backoff_max)

    def run_all(self, hooks: list[Hook]) -> RunReport:
        report = RunReport()
        for hook in hooks:
            res = self.run_one(hook)
            report.results.append(res)
            if self.on_result:
                self.on_result(res)
            if not res.ok:
                break
        return report

    def run_one(self, hook: Hook) -> HookResult:
        logdir = self.paths.hooks_log_dir
        # Hook logs carry fetch errors and hook output: root-only (narrowed if wider).
        logdir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fsutil.restrict_mode(logdir, 0o700)
        logpath = confined(logdir, f"{hook.name}.log", what=f"hook {hook.name}")
        res = HookResult(hook.name, Status.OK, log=str(logpath))
        start = time.monotonic()
        attempts = hook.retries + 1
        for attempt in range(1, attempts + 1):
            res.attempts = attempt
            res.exit_code = res.signal = None
            path = hook.path
            if path is None:
                try:
                    path = fetch(hook, self.paths.hook_cache)
                except ShaMismatch as exc:
                    _append(logpath, f"=== {hook.name}: REFUSED: {exc}\n")
                    res.status = Status.REFUSED
                    res.reason = f"hook {hook.name} sha256 mismatch (not run)"
                    res.duration = time.monotonic() - start
                    return res
                except HookError as exc:
                    _append(
                        logpath,
                        f"=== {_now()} {hook.name} attempt {attempt}/{attempts}: "
                        f"FETCH FAILED: {exc}\n",
                    )
                    res.status = Status.FETCH_FAILED
                    why = str(exc).removeprefix(f"hook {hook.name}: ").splitlines()[0]
                    res.reason = f"hook {hook.name} could not be fetched: {why}"
                    if attempt < attempts:
                        self.sleep(self.delay(attempt))
                    continue
            gr = self._attempt(hook, path, attempt, attempts, logpath)
            res.duration = time.monotonic() - start
            if gr.returncode == 0 and not gr.timed_out:
                res.status, res.exit_code, res.reason = Status.OK, 0, ""
                return res
            res.exit_code = gr.returncode if gr.returncode >= 0 else None
            res.signal = gr.signal
            if gr.timed_out:
                res.status = Status.TIMEOUT
                res.reason = f"hook {hook.name} timed out after {hook.timeout:g}s"
            elif gr.signal is not None:
                res.status = Status.SIGNAL
                res.reason = f"hook {hook.name} killed by signal {_signame(gr.signal)}"
            else:
                res.status = Status.FAILED
                res.reason = f"hook {hook.name} failed (exit {gr.returncode})"
            if attempt < attempts:
                self.sleep(self.delay(attempt))
        if attempts > 1:
            res.reason += f" after {attempts} attempts"
        res.duration = time.monotonic() - start
        return res

    def _attempt(
        self, hook: Hook, path: Path, attempt: int, attempts: int, logpath: Path
    ) -> contain.GroupResult:
        # An S3 prefix hook runs in its synced directory (lifecycle scripts use ./siblings).
        cwd = str(path.parent) if hook.script is not None else "/"
        with fsutil.open_private_append(logpath) as out:
            out.write(
                f"=== {_now()} {hook.name} attempt {attempt}/{attempts} "
                f"(timeout {hook.timeout:g}s) {path}\n"
            )
            out.flush()
            gr = contain.run_group(
                [str(path)],
                timeout=hook.timeout,
                output=out,
                env=self._env(hook, attempt),
                replace_env=True,
                cwd=cwd,
                grace=self.grace,
                contain=f"hook-{hook.name}",
                output_cap=self.output_max,
            )
            extra = ""
            if gr.dropped:
                extra += f"; {gr.dropped} bytes of output dropped (hook_output_max)"
            if gr.leftovers and not gr.timed_out:
                extra += (
                    f"; processes it left running were stopped ({gr.containment}): "
                    "install a systemd unit for a long-lived service"
                )
            out.write(
                f"=== {hook.name} attempt {attempt}: {_describe(gr, hook.timeout)} "
                f"after {gr.duration:.1f}s{extra}\n"
            )
        return gr

    def _env(self, hook: Hook, attempt: int) -> dict[str, str]:
        e = self.env
        keep = {
            k: os.environ[k]
            for k in ("LANG", "LC_ALL", "TZ", "http_proxy", "https_proxy", "no_proxy")
            if k in os.environ
        }
        return {
            **keep,
            "PATH": SAFE_PATH,
            "HOME": "/root",
            "NODEFORGE_ROLE": e.role,
            "NODEFORGE_CLUSTER": e.cluster,
            "NODEFORGE_NODE": e.node,
            "NODEFORGE_CONTROLLER": e.controller,
            "NODEFORGE_PARAMS": str(e.params_file),
            "NODEFORGE_HOOK": hook.name,
            "NODEFORGE_HOOK_ATTEMPT": str(attempt),
            "NODEFORGE_LOG_DIR": str(self.paths.hooks_log_dir),
        }


# Every hook runs in a transient scope named nodeforge-hook-<name>-<pid>-<random>.scope when
# systemd is PID 1 (contain.run_group contain="hook-<name>"): outside the agent's own unit.
LEFTOVER_SCOPES = "nodeforge-hook-*.scope"


def stop_leftovers(host: Host, timeout: float = 120) -> None:
    """Stop the hooks an interrupted run of the agent left running (this boot only: scopes do
    not survive a reboot). A scope is PartOf= the agent's unit, but systemd's automatic
    restart of the unit after the agent was killed is no stop job, so the old hook kept
    running beside its rerun (e2e test_cluster_faults). `systemctl stop` waits until they are
    gone (TERM, then KILL after the scope's TimeoutStopSec); a pattern matching nothing is
    not an error. Without systemd as PID 1 hooks ran in the agent's own cgroup or as its
    children, which died with it: then there is nothing to stop, and a refusal only warns."""
    cp = host.run(["systemctl", "stop", LEFTOVER_SCOPES], check=False, timeout=timeout)
    if cp.returncode != 0:
        out = ((cp.stdout or "") + (cp.stderr or "")).strip()[-300:]
        log.warning("leftover hook scopes not stopped (exit %s): %s", cp.returncode, out)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _describe(gr: contain.GroupResult, timeout: float) -> str:
    if gr.timed_out:
        return f"TIMED OUT after {timeout:g}s (everything it started was stopped)"
    if gr.signal is not None:
        return f"killed by signal {_signame(gr.signal)}"
    return f"exit {gr.returncode}"


def _signame(sig: int) -> str:
    try:
        return f"{sig} ({signal.Signals(sig).name})"
    except ValueError:
        return str(sig)


def _append(path: Path, text: str) -> None:
    with fsutil.open_private_append(path) as f:
        f.write(text)
