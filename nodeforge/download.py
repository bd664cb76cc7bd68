"""The one place nodeforge downloads files: `versions lock`, artifact fetch, hook fetch, params URL.

Standard library only (it ships to nodes). What every download gets:
- a body shorter (or longer) than its Content-Length is rejected, never kept (after the
  declared length the connection must end; bytes that follow within EXTRA_WAIT refuse it);
- the bytes land in a temp file in the destination's directory, are checked (size, sha256),
  fsynced, and only then renamed into place, so a reader never sees a partial or wrong file;
- bounded retries with exponential backoff (the sleep is injected) for what can heal: network
  errors, DNS, timeouts, truncated bodies, HTTP 5xx/408/429; never for 4xx or a wrong checksum;
- a total deadline per attempt over everything (DNS, connect, TLS, headers, redirects, body): a
  watchdog shuts the attempt's sockets when it passes, so a server that drips one byte at a
  time, in the headers or in the body, cannot hang us; `fetch` as a whole is bounded by
  attempts x deadline + the backoffs;
- redirects: at most MAX_REDIRECTS, only to http(s) with a host and no userinfo, never from
  https to anything else (a downgrade would let a network attacker swap the body). The opener
  has only the HTTP(S) handlers: urllib's FTP, file and data handlers are not in it;
- file:// (a mirror directory, a hook on the node): a regular file only, opened without
  blocking; a FIFO, device, socket or directory is refused (a FIFO would block forever);
- an optional progress callback (bytes done, total or None).
Messages name the label (artifact, hook, params source), the URL (credentials and query
redacted) and the reason.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import ssl
import stat
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from . import redact
from .errors import NodeforgeError

CHUNK = 1 << 16
MAX_REDIRECTS = 5
MAX_URL = 8192
# After a body of its Content-Length, how long to look for more: a server that honours our
# `Connection: close` ends at once; bytes that follow mean the length lied.
EXTRA_WAIT = 1.0
USER_AGENT = "nodeforge"

Progress = Callable[[int, int | None], None]
_T = TypeVar("_T")


class DownloadError(NodeforgeError):
    """A download failed; `reason` is short (for a drain reason), `retryable` says if retrying can help."""

    def __init__(self, label: str, url: str, reason: str, *, retryable: bool, hint: str = ""):
        reason = _scrub(reason, url)
        self.label, self.url, self.reason, self.retryable = label, url, reason, retryable
        msg = f"{label}: cannot download {display_url(url)}: {reason}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


class ChecksumMismatch(DownloadError):
    """The body arrived whole but is not the pinned file (not retried: the source is wrong)."""

    def __init__(self, label: str, url: str, expected: str, got: str):
        self.expected, self.got = expected, got
        super().__init__(
            label, url, f"sha256 mismatch: expected {expected}, got {got}", retryable=False
        )


@dataclass(frozen=True)
class Policy:
    """How hard to try. `timeout` bounds each socket operation, `deadline` a whole attempt."""

    timeout: float = 30.0
    deadline: float = 3600.0
    attempts: int = 3
    context: ssl.SSLContext | None = None  # None: the system's trusted CAs, hostname checked
    backoff: float = 1.0  # before retry n: backoff * 2^(n-1), capped at backoff_max
    backoff_max: float = 30.0
    max_bytes: int | None = None

    def delay(self, retry: int) -> float:
        return min(self.backoff * (2 ** (retry - 1)), self.backoff_max)


@dataclass(frozen=True)
class Result:
    path: Path
    sha256: str
    size: int
    url: str  # after redirects


def display_url(url: str) -> str:
    """*url* without user:password@ and with the query's values hidden (pre-signed tokens):
    the one redaction helper's rule (nodeforge/redact.py)."""
    return redact.url(url)


def _scrub(text: str, url: str) -> str:
    """*text* (an exception's words) with the URL's password and query values blanked."""
    try:
        u = urllib.parse.urlsplit(url)
    except ValueError:
        return text
    secrets = [v for _, v in urllib.parse.parse_qsl(u.query) if len(v) >= 3]
    if "@" in u.netloc:
        secrets.append(u.netloc.rsplit("@", 1)[0])
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, "***")
    return text


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def __init__(self, label: str):
        self.label = label

    def http_error_302(self, req, fp, code, msg, headers):
        # Checked here, before urllib's own handling (which would name ftp:// acceptable and
        # refuse file:// with a message about "redirection"), on the raw Location.
        location = headers.get("location") or headers.get("uri")
        if location is not None:
            self._check(req, urllib.parse.urljoin(req.full_url, location))
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self._check(req, urllib.parse.urljoin(req.full_url, newurl))
        return super().redirect_request(req, fp, code, msg, headers, newurl)

    def _check(self, req, target: str) -> None:
        why = _bad_redirect(req.full_url, target)
        if why:
            raise DownloadError(
                self.label,
                req.full_url,
                f"redirect to {display_url(target)} refused: {why}",
                retryable=False,
            )


def url_problem(url: str) -> str:
    """Why *url* is no http(s) URL to fetch ("" when it is): a redirect target's checks."""
    why = _bad_redirect(url, url)
    return "credentials (user:password@) in the URL" if why.startswith("credentials") else why


def _bad_redirect(old_url: str, new_url: str) -> str:
    """Why *new_url* is no place to follow a redirect to ("" when it is)."""
    if len(new_url) > MAX_URL:
        return f"longer than {MAX_URL} characters"
    try:
        u = urllib.parse.urlsplit(new_url)
        host = u.hostname
        u.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        return "not a valid URL"
    old = urllib.parse.urlsplit(old_url).scheme
    if u.scheme not in ("http", "https"):
        return f"only http:// and https:// are followed, not {u.scheme or 'a scheme-less'}://"
    if old == "https" and u.scheme != "https":
        return f"a downgrade from https to {u.scheme}://"
    if not host:
        return "no host"
    if "@" in u.netloc:
        return "credentials in a redirect target"
    return ""


class Deadline:
    """One attempt's bound in time over everything it does.

    Socket timeouts bound each read, not their sum, and not the name lookup: a server sending a
    header byte every few seconds never trips them. So every socket the attempt opens is
    registered here, and a timer shuts them all down when the deadline passes: the blocked read
    returns at once and the attempt reports the deadline. What has no bound of its own (the name
    lookup, a library's credential fetch) runs through within(): a thread waited on no longer
    than what is left.
    """

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.expired = False
        self.stalled: str | None = None  # what within() was still waiting for at the deadline
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        # objects that hold a socket, each with how to find it then (held weakly)
        self._holders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        with self._lock:
            for s in self._socks:
                s.close()
            self._socks.clear()

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def watch(self, sock: socket.socket) -> None:
        # A duplicate of the descriptor: shutdown(2) through it reaches the same connection
        # even after ssl has taken the original socket object over.
        # os.dup, not sock.dup(): an SSLSocket (boto3's connection to an https S3) refuses dup().
        dup = socket.socket(fileno=os.dup(sock.fileno()))
        with self._lock:
            self._socks.append(dup)
            if self.expired:
                _shutdown(dup)

    def watch_holder(
        self,
        holder: object,
        find: Callable[[object], socket.socket | None],
        now: socket.socket | None = None,
    ) -> None:
        """Watch whatever socket *find*(*holder*) gives when the deadline passes: an http
        connection that opens (and may reopen) its own socket, a response streaming a body.
        *now*: the socket it holds now, if *find* cannot see it yet. Held weakly and nothing
        is duplicated, so a long fetch through many connections keeps no descriptor open."""
        with self._lock:
            self._holders[holder] = find
            if self.expired:
                sock = now if now is not None else find(holder)
                if sock is not None:
                    _shutdown(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for s in self._socks:
                _shutdown(s)
            for holder, find in list(self._holders.items()):
                sock = find(holder)
                if isinstance(sock, socket.socket):
                    _shutdown(sock)

    def reason(self) -> str:
        """What a caller says when the deadline has passed (the one wording: downloads, hooks)."""
        still = f" (still {self.stalled})" if self.stalled else ""
        return f"not finished within {self.seconds:g}s{still}"

    def _passed(self, what: str) -> TimeoutError:
        """The deadline's own error, with *what* was still running kept for reason()."""
        self._expire()
        if self.stalled is None:
            self.stalled = what
        return TimeoutError("deadline")

    def within(self, fn: Callable[[], _T], what: str) -> _T:
        """fn() for a call with no bound we can set (getaddrinfo; botocore's credential fetch
        from the metadata service), waited on no longer than what is left. It runs in a daemon
        thread; past the deadline that thread is left to end on its own, its result dropped,
        and the deadline's error is raised (*what*, e.g. "looking up s3.example.com", names
        what stalled in reason()). fn's own exception is raised here as it is."""
        if self.left() <= 0:
            raise self._passed(what)
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["r"] = fn()
            except BaseException as exc:  # handed to the caller's thread below
                box["e"] = exc

        t = threading.Thread(target=run, daemon=True, name="nodeforge-within")
        t.start()
        t.join(self.left())
        if t.is_alive():
            raise self._passed(what)
        if "e" in box:
            raise box["e"]
        return box["r"]

    def resolve(self, host: str, port: int) -> list:
        return self.within(
            lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), f"looking up {host}"
        )

    def connect(
        self,
        address: tuple[str, int],
        timeout,
        source_address=None,
        *,
        socket_options: Iterable[tuple] = (),
        watch: bool = True,
    ) -> socket.socket:
        """socket.create_connection, with the lookup and each connect inside the deadline.

        A connect that *timeout* ends raises the socket's own timeout ("timed out"); one the
        deadline ends raises the deadline's error. *socket_options*: setsockopt arguments
        applied before the connect (urllib3's TCP_NODELAY). watch=False: the caller watches
        the socket itself (watch_holder), so no descriptor is duplicated."""
        host, port = address
        if not isinstance(timeout, int | float):
            timeout = None  # socket._GLOBAL_DEFAULT_TIMEOUT: the deadline alone bounds it
        err: OSError | None = None
        for family, type_, proto, _, sa in self.resolve(host, port):
            if self.left() <= 0:
                raise self._passed(f"connecting to {host}")
            sock = socket.socket(family, type_, proto)
            try:
                for opt in socket_options:
                    sock.setsockopt(*opt)
                limit = self.left() if timeout is None else min(timeout, self.left())
                sock.settimeout(limit)
                if source_address:
                    sock.bind(source_address)
                sock.connect(sa)
                sock.settimeout(timeout)
                if watch:
                    self.watch(sock)
                return sock
            except OSError as exc:
                sock.close()
                if self.left() <= 0:  # the deadline ended it, not the per-connect timeout
                    raise self._passed(f"connecting to {host}") from exc
                err = exc
        raise err or OSError(f"no address for {host}")


def stream_socket(resp: object) -> socket.socket | None:
    """The socket an http.client response (or botocore's StreamingBody around urllib3's around
    http.client's) reads from, or None: http.client keeps it only through its file object once
    the connection object has let go of it (`Connection: close`)."""
    for name in ("_raw_stream", "_fp"):  # botocore StreamingBody, urllib3 HTTPResponse
        resp = getattr(resp, name, resp)
    raw = getattr(getattr(resp, "fp", None), "raw", None)  # socket.SocketIO
    sock = getattr(raw, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the other side


def _connection(base: type[http.client.HTTPConnection], guard: Deadline):
    class Connection(base):  # type: ignore[valid-type,misc]
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._create_connection = guard.connect

    return Connection


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, guard: Deadline):
        super().__init__()
        self.guard = guard

    def http_open(self, req):
        return self.do_open(_connection(http.client.HTTPConnection, self.guard), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, guard: Deadline, context: ssl.SSLContext | None):
        super().__init__(context=context)
        self.guard, self.context = guard, context

    def https_open(self, req):
        return self.do_open(
            _connection(http.client.HTTPSConnection, self.guard),
            req,
            context=self.context,
        )


def _opener(
    label: str, context: ssl.SSLContext | None, guard: Deadline
) -> urllib.request.OpenerDirector:
    """Only what an HTTP(S) download needs. build_opener would add urllib's FTP, file and data
    handlers, and a redirect to ftp:// was followed through them; here UnknownHandler refuses
    any scheme but http(s), and _Redirects names the reason first. Proxies from the
    environment are kept for http and https only (an ftp_proxy would add an ftp opener)."""
    proxies = {k: v for k, v in urllib.request.getproxies().items() if k in ("http", "https")}
    opener = urllib.request.OpenerDirector()
    for h in (
        urllib.request.ProxyHandler(proxies),
        urllib.request.UnknownHandler(),
        _HTTP(guard),
        _HTTPS(guard, context),
        urllib.request.HTTPDefaultErrorHandler(),
        _Redirects(label),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(h)
    return opener


def _reason(exc: BaseException) -> tuple[str, bool]:
    """A short reason for *exc* and whether a retry may help."""
    if isinstance(exc, urllib.error.HTTPError):
        retry = exc.code >= 500 or exc.code in (408, 429)
        return f"HTTP {exc.code} {exc.reason}", retry
    if isinstance(exc, urllib.error.URLError):
        inner = exc.reason
        if isinstance(inner, socket.gaierror):
            return f"DNS lookup failed ({inner.strerror})", True
        if isinstance(inner, ssl.SSLCertVerificationError):
            return f"TLS certificate not trusted ({inner.verify_message})", False
        if isinstance(inner, ssl.SSLError):
            return f"TLS error ({inner.reason or inner})", True
        if isinstance(inner, BaseException):
            return _reason(inner)
        return str(inner), True
    if isinstance(exc, http.client.IncompleteRead):
        return f"truncated body ({len(exc.partial)} bytes, then the connection closed)", True
    if isinstance(exc, http.client.HTTPException):
        return f"bad HTTP response ({type(exc).__name__}: {exc})", True
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out", True
    if isinstance(exc, ConnectionError):
        return f"connection failed ({exc.strerror or type(exc).__name__})", True
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}", True
    return f"{type(exc).__name__}: {exc}", False


def save(
    chunks: Iterable[bytes],
    dest: Path,
    *,
    label: str,
    url: str,
    expected_length: int | None = None,
    sha256: str | None = None,
    size: int | None = None,
    max_bytes: int | None = None,
    mode: int = 0o644,
    progress: Progress | None = None,
    deadline: float | None = None,
) -> Result:
    """Write *chunks* to a temp file beside *dest*, check, fsync, rename. Nothing half-applied.

    Also used for bodies that do not come over HTTP (boto3's S3 stream, a local mirror file).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    h = hashlib.sha256()
    n = 0
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                n += len(chunk)
                if max_bytes is not None and n > max_bytes:
                    raise DownloadError(
                        label, url, f"larger than the limit of {max_bytes} bytes", retryable=False
                    )
                if expected_length is not None and n > expected_length:
                    raise DownloadError(
                        label,
                        url,
                        f"body longer than its Content-Length ({expected_length})",
                        retryable=True,
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise DownloadError(
                        label, url, f"too slow: {n} bytes before the deadline", retryable=True
                    )
                h.update(chunk)
                f.write(chunk)
                if progress is not None:
                    progress(n, expected_length)
            if expected_length is not None and n != expected_length:
                raise DownloadError(
                    label,
                    url,
                    f"truncated body: got {n} of {expected_length} bytes (Content-Length)",
                    retryable=True,
                )
            got = h.hexdigest()
            if size is not None and n != size:
                raise DownloadError(label, url, f"size {n} bytes, expected {size}", retryable=False)
            if sha256 is not None and got != sha256.lower():
                raise ChecksumMismatch(label, url, sha256.lower(), got)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return Result(dest, got, n, url)


def _read_chunks(resp, deadline: float, guard: Deadline | None = None) -> Iterable[bytes]:
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("deadline")
        chunk = resp.read1(CHUNK)  # what has arrived: read() would wait for all CHUNK bytes
        if not chunk:
            if guard is not None and guard.expired:
                raise TimeoutError("deadline")  # the watchdog ended it, not the server
            return
        yield chunk


def _read_exact(resp, length: int, guard: Deadline) -> Iterable[bytes]:
    """A body of a declared *length*, then a look for more.

    http.client stops at Content-Length and closes, so a longer body would be cut silently and
    the cut file pinned. Here the body is read from the connection itself; after *length* bytes
    the server must end the connection (we sent `Connection: close`): a byte within EXTRA_WAIT
    means the length lied. A server that keeps the connection open is let go after the wait.
    """
    fp, left = resp.fp, length
    while left:
        chunk = fp.read1(min(CHUNK, left))
        if not chunk:
            if guard.expired:
                raise TimeoutError("deadline")
            return  # short: save() reports the truncation
        left -= len(chunk)
        yield chunk
    sock = stream_socket(resp)
    if sock is None:
        return
    try:
        sock.settimeout(min(EXTRA_WAIT, max(guard.left(), 0.01)))
        extra = fp.read1(1)
    except OSError:  # timeout, reset, or a TLS close without notify: nothing more came
        return
    if extra:
        yield extra  # save() refuses it: longer than its Content-Length


def _open_regular(src: Path) -> int:
    """A descriptor of the regular file *src*, never blocking: stat first (opening a device can
    act on it, a FIFO blocks until a writer comes), then open O_NONBLOCK and check that what
    was opened is still a regular file (it may have been swapped in between)."""
    st = os.stat(src)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(0, f"not a regular file ({_kind(st.st_mode)})")
    fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(0, f"not a regular file ({_kind(st.st_mode)})")
    return fd


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"file type {stat.S_IFMT(mode):o}"


def _attempt(url: str, dest: Path, label: str, policy: Policy, **check) -> Result:
    scheme = urllib.parse.urlsplit(url).scheme
    deadline = time.monotonic() + policy.deadline
    if scheme == "file":
        src = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
        try:
            with os.fdopen(_open_regular(src), "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                return save(
                    iter(lambda: fh.read(CHUNK), b""),
                    dest,
                    label=label,
                    url=url,
                    expected_length=size,
                    max_bytes=policy.max_bytes,
                    deadline=deadline,
                    **check,
                )
        except OSError as exc:
            raise DownloadError(
                label, url, f"cannot read {src}: {exc.strerror}", retryable=False
            ) from exc
    if scheme not in ("http", "https"):
        raise DownloadError(
            label, url, "only file://, http:// and https:// can be downloaded", retryable=False
        )
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    guard = Deadline(policy.deadline)
    try:
        with guard, _opener(label, policy.context, guard).open(req, timeout=policy.timeout) as resp:
            cl = resp.headers.get("Content-Length")
            length: int | None = None
            if cl is not None:
                if not cl.strip().isdigit():
                    raise DownloadError(label, url, f"bad Content-Length {cl!r}", retryable=True)
                length = int(cl)
                if policy.max_bytes is not None and length > policy.max_bytes:
                    raise DownloadError(
                        label,
                        url,
                        f"Content-Length {length} is over the limit of {policy.max_bytes} bytes",
                        retryable=False,
                    )
            if length is not None and resp.length == length:
                body = _read_exact(resp, length, guard)
            else:  # chunked (its decoded size is still held to a Content-Length) or to the close
                body = _read_chunks(resp, deadline, guard)
            res = save(
                body,
                dest,
                label=label,
                url=url,
                expected_length=length,
                max_bytes=policy.max_bytes,
                deadline=deadline,
                **check,
            )
            return Result(res.path, res.sha256, res.size, resp.geturl())
    except DownloadError:
        raise
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason, retry = _reason(exc)
        if guard.expired or (isinstance(exc, TimeoutError) and str(exc) == "deadline"):
            reason, retry = guard.reason(), True
        elif reason == "timed out":
            reason = f"timed out (no data for {policy.timeout:g}s)"
        raise DownloadError(label, url, reason, retryable=retry) from exc


def fetch(
    url: str,
    dest: Path,
    *,
    label: str,
    policy: Policy = Policy(),
    sha256: str | None = None,
    size: int | None = None,
    mode: int = 0o644,
    progress: Progress | None = None,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[DownloadError, float], None] | None = None,
) -> Result:
    """Download *url* to *dest*, verified; retry what can heal with backoff. Raises DownloadError."""
    attempt = 1
    while True:
        try:
            return _attempt(
                url, dest, label, policy, sha256=sha256, size=size, mode=mode, progress=progress
            )
        except DownloadError as exc:
            if not exc.retryable or attempt >= policy.attempts:
                if attempt > 1:
                    exc.args = (f"{exc.args[0]} (after {attempt} attempts)",)
                raise
            wait = policy.delay(attempt)
            if on_retry is not None:
                on_retry(exc, wait)
            sleep(wait)
            attempt += 1


def fetch_bytes(
    url: str,
    *,
    label: str,
    policy: Policy,
    sleep: Callable[[float], None] = time.sleep,
    sha256: str | None = None,
) -> bytes:
    """Small documents (a params file): same checks, returned as bytes (policy.max_bytes bounds it)."""
    with tempfile.TemporaryDirectory(prefix="nodeforge-dl-") as tmp:
        res = fetch(
            url,
            Path(tmp) / "body",
            label=label,
            policy=policy,
            sleep=sleep,
            sha256=sha256,
            mode=0o600,
        )
        return res.path.read_bytes()


def copy_file(src: Path, dest: Path, *, label: str, **check) -> Result:
    """A local file (mirror directory) into *dest* with the same checks and atomic rename."""
    return fetch(src.resolve().as_uri(), dest, label=label, policy=Policy(attempts=1), **check)
