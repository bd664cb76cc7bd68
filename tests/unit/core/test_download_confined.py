"""Downloads are confined (issue 23, item 4), against real servers on 127.0.0.1: a redirect
goes to http(s) only, a body longer than its Content-Length is refused, a file:// source that
is not a regular file is refused without blocking, and an attempt is bounded in total time
(headers and name lookup included), not only per read."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from nodeforge import download
from nodeforge.download import DownloadError, Policy, fetch
from tests.helpers import QuietHandler, http_server, loopback_tls, unanswered_port

pytestmark = pytest.mark.unit

BODY = b"#!/bin/sh\necho pinned\n" * 50
SHA = hashlib.sha256(BODY).hexdigest()
ONE = Policy(timeout=2, deadline=5, attempts=1)


def _dl(url: str, tmp_path: Path, policy: Policy = ONE, **kw) -> download.Result:
    return fetch(url, tmp_path / "out" / "f.bin", label="artifact demo", policy=policy, **kw)


def _landed(tmp_path: Path) -> list[str]:
    out = tmp_path / "out"
    return sorted(p.name for p in out.iterdir()) if out.exists() else []


@pytest.fixture
def listener():
    """A TCP port on 127.0.0.1 that records whether anything connected (an FTP server stand-in)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    s.setblocking(False)
    yield s
    s.close()


def _connected(s: socket.socket) -> bool:
    try:
        conn, _ = s.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def _redirect_handler(location: str):
    class Redirect(QuietHandler):
        def do_GET(self):
            if self.path == "/ok":
                self.send(200, BODY)
            else:
                self.send(302, headers=[("Location", location)])

    return Redirect


@pytest.mark.parametrize(
    "target, why",
    [
        ("ftp://127.0.0.1:{port}/x.sh", "only http:// and https:// are followed, not ftp://"),
        ("file:///etc/passwd", "only http:// and https:// are followed, not file://"),
        ("data:text/plain,echo%20pwned", "only http:// and https:// are followed, not data://"),
        ("gopher://127.0.0.1:{port}/x", "only http:// and https:// are followed, not gopher://"),
        ("http://user:pw@127.0.0.1:{port}/x", "credentials in a redirect target"),
        ("https://:443/x.sh", "no host"),
        ("http://127.0.0.1:99999/x", "not a valid URL"),
    ],
)
def test_redirect_only_to_http_or_https(tmp_path, listener, target, why):
    """ftp:// was followed (urllib's default opener has an FTP handler): now refused by name,
    without a connection to the target, and nothing lands."""
    port = listener.getsockname()[1]
    with (
        http_server(_redirect_handler(target.format(port=port))) as base,
        pytest.raises(DownloadError, match="redirect to .* refused: ") as ei,
    ):
        _dl(base + "/go", tmp_path)
    assert ei.value.reason.endswith(why) and not ei.value.retryable
    assert "user:pw" not in str(ei.value)  # the userinfo target is shown redacted
    assert not _connected(listener)
    assert _landed(tmp_path) == []


def test_redirect_within_http_still_followed(tmp_path):
    with http_server(_redirect_handler("/ok")) as base:
        assert _dl(base + "/go", tmp_path, sha256=SHA).url.endswith("/ok")


def test_opener_has_no_ftp_file_or_data_handler():
    with download.Deadline(1) as guard:
        opener = download._opener("x", None, guard)
    schemes = {
        m.removesuffix("_open")
        for h in opener.handlers
        for m in dir(h)
        if m.endswith("_open") and not m.startswith("do_") and m != "unknown_open"
    }
    assert schemes <= {"http", "https"}, schemes


def test_ftp_proxy_from_the_environment_adds_no_ftp_opener(monkeypatch):
    monkeypatch.setenv("ftp_proxy", "http://127.0.0.1:9/")
    with download.Deadline(1) as guard:
        opener = download._opener("x", None, guard)
    assert not any(hasattr(h, "ftp_open") for h in opener.handlers)


class Longer(QuietHandler):
    """Declares less than it sends: the old client stopped at the length and pinned the cut."""

    def do_GET(self):
        if self.path == "/longer":
            self.send(200, BODY + b"rm -rf --no-preserve-root /\n", length=len(BODY), close=True)
        elif self.path == "/exact-keepalive":  # honest length, connection left open
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.send_header("Connection", "keep-alive")
            self.end_headers()
            self.wfile.write(BODY)
            self.wfile.flush()
            time.sleep(3)
        elif self.path == "/chunked-longer":  # chunked body bigger than its Content-Length
            self.send_response(200)
            self.send_header("Content-Length", "10")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
            self.close_connection = True
        else:
            self.send(200, BODY, close=True)


@pytest.mark.parametrize("tls", [False, True])
def test_body_longer_than_content_length_refused(tmp_path, tls):
    server_ctx, client_ctx = loopback_tls(tmp_path) if tls else (None, None)
    pol = Policy(timeout=2, deadline=5, attempts=1, context=client_ctx)
    with http_server(type("H", (Longer,), {}), server_ctx) as base:
        with pytest.raises(DownloadError, match=r"body longer than its Content-Length \(1100\)"):
            _dl(base + "/longer", tmp_path, pol)
        assert _landed(tmp_path) == []  # not cut and kept
        assert _dl(base + "/plain", tmp_path, pol, sha256=SHA).size == len(BODY)


def test_chunked_body_held_to_its_content_length(tmp_path):
    with (
        http_server(type("H", (Longer,), {})) as base,
        pytest.raises(DownloadError, match=r"body longer than its Content-Length \(10\)"),
    ):
        _dl(base + "/chunked-longer", tmp_path)
    assert _landed(tmp_path) == []


def test_exact_length_on_a_connection_left_open_is_kept_after_a_short_wait(tmp_path):
    with http_server(type("H", (Longer,), {})) as base:
        t = time.monotonic()
        assert _dl(base + "/exact-keepalive", tmp_path, sha256=SHA).size == len(BODY)
        assert time.monotonic() - t < download.EXTRA_WAIT + 1.5


class SlowHeaders(QuietHandler):
    """Each header line arrives well within the per-read timeout; the whole never ends."""

    def do_GET(self):
        try:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for i in range(100):
                self.wfile.write(b"X-Drip-%d: 1\r\n" % i)
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass


@pytest.mark.parametrize("tls", [False, True])
def test_headers_dripping_forever_hit_the_attempt_deadline(tmp_path, tls):
    server_ctx, client_ctx = loopback_tls(tmp_path) if tls else (None, None)
    with http_server(SlowHeaders, server_ctx) as base:
        t = time.monotonic()
        with pytest.raises(DownloadError, match=r"not finished within 0\.5s") as ei:
            _dl(
                base + "/x",
                tmp_path,
                Policy(timeout=2, deadline=0.5, attempts=1, context=client_ctx),
            )
        took = time.monotonic() - t
    assert took < 1.5 and ei.value.retryable
    assert _landed(tmp_path) == []


def test_a_slow_name_lookup_is_inside_the_deadline(tmp_path, monkeypatch):
    """getaddrinfo has no timeout of its own; the attempt stops waiting for it at the deadline."""
    real = socket.getaddrinfo

    def slow(host, *a, **kw):
        if host == "slow.nodeforge-test.invalid":
            time.sleep(3)
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    t = time.monotonic()
    with pytest.raises(DownloadError) as ei:
        _dl(
            "http://slow.nodeforge-test.invalid/x",
            tmp_path,
            Policy(timeout=5, deadline=0.4, attempts=1),
        )
    assert time.monotonic() - t < 1.5
    assert (
        ei.value.reason == "not finished within 0.4s (still looking up slow.nodeforge-test.invalid)"
    )


def test_within_returns_raises_or_stops_at_the_deadline():
    """Deadline.within: fn's value, fn's own error, or (fn still running when the deadline
    passes) the deadline's error at the deadline, naming what was still running."""
    with download.Deadline(5) as guard:
        assert guard.within(lambda: 42, "adding") == 42
        with pytest.raises(KeyError, match="nope"):
            guard.within(lambda: {}["nope"], "looking")
        assert not guard.expired and guard.stalled is None
    with download.Deadline(0.3) as guard:
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="^deadline$"):
            guard.within(lambda: time.sleep(3), "sleeping on purpose")
        assert 0.25 < time.monotonic() - t < 1.0
        assert guard.expired
        assert guard.reason() == "not finished within 0.3s (still sleeping on purpose)"
        with pytest.raises(TimeoutError, match="^deadline$"):  # nothing left: not even started
            guard.within(lambda: 1, "late")
        assert guard.stalled == "sleeping on purpose"


def test_connect_timeout_is_not_the_deadline_and_the_deadline_is():
    """A connect that its own timeout ends is the socket's "timed out" (the deadline left
    untouched); one that the deadline ends is the deadline's error, naming the host."""
    with unanswered_port() as (host, port):
        with download.Deadline(5) as guard:
            t = time.monotonic()
            with pytest.raises(TimeoutError) as ei:
                guard.connect((host, port), 0.3)
            assert str(ei.value) == "timed out" and not guard.expired
            assert time.monotonic() - t < 1.0
        with download.Deadline(0.3) as guard:
            t = time.monotonic()
            with pytest.raises(TimeoutError, match="^deadline$"):
                guard.connect((host, port), 5)
            assert time.monotonic() - t < 1.0
            assert guard.reason() == "not finished within 0.3s (still connecting to 127.0.0.1)"


def test_whole_fetch_bounded_by_attempts_deadline_and_backoff(tmp_path):
    sleeps: list[float] = []
    pol = Policy(timeout=2, deadline=0.3, attempts=3, backoff=0.1, backoff_max=0.2)
    with http_server(SlowHeaders) as base:
        t = time.monotonic()
        with pytest.raises(DownloadError, match=r"after 3 attempts"):
            _dl(base + "/x", tmp_path, pol, sleep=sleeps.append)
        took = time.monotonic() - t
    assert sleeps == [0.1, 0.2] and took < 3 * 0.3 + 1.5


# -- file:// sources -----------------------------------------------------------------------------
def _in_thread(fn, seconds: float):
    """Run *fn* in a thread; (finished, exception) after at most *seconds*."""
    box: dict[str, BaseException | None] = {"exc": None}

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), box["exc"], t


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "hook.sh"
    os.mkfifo(fifo)
    done, exc, t = _in_thread(lambda: _dl(fifo.as_uri(), tmp_path), 3)
    if not done:  # the old code: open() waits for a writer forever; release it
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5)
    assert done, "fetching a FIFO blocked"
    assert isinstance(exc, DownloadError)
    assert f"cannot read {fifo}: not a regular file (a FIFO)" in str(exc)
    assert _landed(tmp_path) == []


def test_device_directory_and_socket_are_refused(tmp_path):
    sock_path = tmp_path / "s.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(sock_path))
    try:
        for src, kind in (
            (Path("/dev/null"), "a character device"),  # read as an empty file before
            (tmp_path, "a directory"),
            (sock_path, "a socket"),
        ):
            with pytest.raises(DownloadError, match=f"not a regular file \\({kind}\\)"):
                _dl(src.as_uri(), tmp_path)
    finally:
        srv.close()
    assert _landed(tmp_path) == []


def test_regular_file_through_a_symlink_still_works(tmp_path):
    real = tmp_path / "real.sh"
    real.write_bytes(BODY)
    (tmp_path / "link.sh").symlink_to(real)
    assert _dl((tmp_path / "link.sh").as_uri(), tmp_path, sha256=SHA).size == len(BODY)
