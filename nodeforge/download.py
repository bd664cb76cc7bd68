"""The one place nodeforge downloads files: `versions lock`, artifact fetch, hook fetch, params URL.

Standard library only (it ships to nodes). What every download gets:
- a body shorter (or longer) than its Content-Length is rejected, never kept;
- the bytes land in a temp file in the destination's directory, are checked (size, sha256),
  fsynced, and only then renamed into place, so a reader never sees a partial or wrong file;
- bounded retries with exponential backoff (the sleep is injected) for what can heal: network
  errors, DNS, timeouts, truncated bodies, HTTP 5xx/408/429; never for 4xx or a wrong checksum;
- a total deadline per attempt, so a server that drips one byte at a time cannot hang us;
- redirects: at most MAX_REDIRECTS, never from https to anything else (a downgrade would let a
  network attacker swap the body);
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
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from . import redact
from .errors import NodeforgeError

CHUNK = 1 << 16
MAX_REDIRECTS = 5
USER_AGENT = "nodeforge"

Progress = Callable[[int, int | None], None]


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

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old = urllib.parse.urlsplit(req.full_url).scheme
        new = urllib.parse.urlsplit(urllib.parse.urljoin(req.full_url, newurl)).scheme
        if old == "https" and new != "https":
            raise DownloadError(
                self.label,
                req.full_url,
                f"redirect from https to {new}:// ({display_url(newurl)}) refused",
                retryable=False,
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener(label: str, context: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    # file:// is read by us (same checks); urllib's FTP/data handlers are never reached because
    # the scheme is checked first.
    handlers: list[urllib.request.BaseHandler] = [_Redirects(label)]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    return urllib.request.build_opener(*handlers)


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


def _read_chunks(resp, deadline: float) -> Iterable[bytes]:
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("deadline")
        chunk = resp.read1(CHUNK)  # what has arrived: read() would wait for all CHUNK bytes
        if not chunk:
            return
        yield chunk


def _attempt(url: str, dest: Path, label: str, policy: Policy, **check) -> Result:
    scheme = urllib.parse.urlsplit(url).scheme
    deadline = time.monotonic() + policy.deadline
    if scheme == "file":
        src = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
        try:
            with open(src, "rb") as fh:
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
    try:
        with _opener(label, policy.context).open(req, timeout=policy.timeout) as resp:
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
            res = save(
                _read_chunks(resp, deadline),
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
        if isinstance(exc, TimeoutError) and str(exc) == "deadline":
            reason = f"not finished within {policy.deadline:g}s"
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
