"""nodeforge.download against real servers on 127.0.0.1: truncated bodies, wrong lengths,
redirects (https->http refused), 500s then success, slow bodies, checks before the rename."""

from __future__ import annotations

import hashlib
import socket
import time
from pathlib import Path

import pytest

from nodeforge.download import (
    ChecksumMismatch,
    DownloadError,
    Policy,
    display_url,
    fetch,
    fetch_bytes,
)
from tests.helpers import QuietHandler, http_server, loopback_tls

pytestmark = pytest.mark.unit

BODY = bytes(range(256)) * 64  # 16 KiB
SHA = hashlib.sha256(BODY).hexdigest()
FAST = Policy(timeout=2, deadline=5, attempts=3, backoff=1, backoff_max=8)


class Handler(QuietHandler):
    protocol_version = "HTTP/1.1"
    counts: dict[str, int]
    other: str = ""  # base URL of the other server (for cross-scheme redirects)

    def do_GET(self):  # one route table
        n = self.counts[self.path] = self.counts.get(self.path, 0) + 1
        p = self.path
        if p == "/ok":
            self.send(200, BODY)
        elif p == "/truncated":  # promises more than it sends, then closes
            self.send(200, BODY[:1000], length=len(BODY))
            self.close_connection = True
        elif p == "/flaky":  # 500, 500, then the body
            self.send(500, b"oops") if n <= 2 else self.send(200, BODY)
        elif p == "/truncated-then-ok":
            if n == 1:
                self.send(200, BODY[:10], length=len(BODY))
                self.close_connection = True
            else:
                self.send(200, BODY)
        elif p == "/missing":
            self.send(404, b"nope")
        elif p == "/redirect-same":
            self.send(302, headers=[("Location", "/ok")])
        elif p == "/redirect-to-http":
            self.send(302, headers=[("Location", self.other + "/ok")])
        elif p == "/redirect-loop":
            self.send(302, headers=[("Location", "/redirect-loop")])
        elif p == "/drip":  # one byte every 50 ms: each read is quick, the whole is slow
            self.send_response(200)
            self.send_header("Content-Length", "200")
            self.end_headers()
            try:
                for _ in range(200):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
        elif p == "/stall":  # headers, then nothing
            self.send_response(200)
            self.send_header("Content-Length", "10")
            self.end_headers()
            self.wfile.flush()
            time.sleep(3)
        elif p == "/hangup":  # closes without any response: http.client.RemoteDisconnected
            self.close_connection = True
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        elif p == "/bad-length":
            self.send_response(200)
            self.send_header("Content-Length", "12abc")
            self.end_headers()
            self.close_connection = True
        else:
            self.send(404)


def _handler() -> type[Handler]:
    """A Handler subclass with its own request counts (one per server)."""
    return type("H", (Handler,), {"counts": {}})


@pytest.fixture
def server():
    h = _handler()
    with http_server(h) as base:
        yield base, h.counts


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory):
    """A self-signed cert for 127.0.0.1, made at run time (no key material in git)."""
    return loopback_tls(tmp_path_factory.mktemp("tls"))


def _dl(url, tmp_path, sleeps=None, policy=FAST, **kw):
    return fetch(
        url,
        tmp_path / "out" / "file.bin",
        label="artifact demo",
        policy=policy,
        sleep=(sleeps.append if sleeps is not None else (lambda s: None)),
        **kw,
    )


def test_ok_verified_and_renamed_into_place(server, tmp_path):
    base, _ = server
    seen: list[tuple[int, int | None]] = []
    res = _dl(
        base + "/ok",
        tmp_path,
        sha256=SHA,
        size=len(BODY),
        progress=lambda done, total: seen.append((done, total)),
    )
    assert res.path.read_bytes() == BODY and res.sha256 == SHA and res.size == len(BODY)
    assert seen[-1] == (len(BODY), len(BODY)) and len(seen) >= 1
    assert [p.name for p in res.path.parent.iterdir()] == ["file.bin"]  # no temp file left


def test_truncated_body_is_rejected_and_nothing_lands(server, tmp_path):
    base, counts = server
    sleeps: list[float] = []
    with pytest.raises(
        DownloadError,
        match=r"artifact demo: cannot download .*/truncated: "
        r"truncated body: got 1000 of 16384 bytes.*after 3 attempts",
    ) as ei:
        _dl(base + "/truncated", tmp_path, sleeps)
    assert ei.value.retryable and counts["/truncated"] == 3 and sleeps == [1, 2]
    assert list((tmp_path / "out").iterdir()) == []  # neither the file nor a .part


def test_truncated_once_then_ok_is_retried(server, tmp_path):
    base, counts = server
    res = _dl(base + "/truncated-then-ok", tmp_path, sha256=SHA)
    assert res.path.read_bytes() == BODY and counts["/truncated-then-ok"] == 2


def test_500s_then_success_with_backoff(server, tmp_path):
    base, counts = server
    sleeps: list[float] = []
    retries: list[str] = []
    res = fetch(
        base + "/flaky",
        tmp_path / "f",
        label="x",
        policy=FAST,
        sleep=sleeps.append,
        on_retry=lambda e, w: retries.append(e.reason),
    )
    assert res.size == len(BODY) and counts["/flaky"] == 3 and sleeps == [1, 2]
    assert retries == ["HTTP 500 Internal Server Error"] * 2


def test_404_is_not_retried(server, tmp_path):
    base, counts = server
    with pytest.raises(DownloadError, match=r"HTTP 404") as ei:
        _dl(base + "/missing", tmp_path)
    assert not ei.value.retryable and counts["/missing"] == 1


def test_checksum_mismatch_not_retried_and_not_renamed(server, tmp_path):
    base, counts = server
    dest = tmp_path / "out" / "file.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"previous good file")
    with pytest.raises(ChecksumMismatch, match=f"expected {'0' * 64}, got {SHA}"):
        _dl(base + "/ok", tmp_path, sha256="0" * 64)
    assert counts["/ok"] == 1 and dest.read_bytes() == b"previous good file"
    with pytest.raises(DownloadError, match="size 16384 bytes, expected 5"):
        _dl(base + "/ok", tmp_path, size=5)
    assert dest.read_bytes() == b"previous good file"


def test_max_bytes_refuses_big_body(server, tmp_path):
    base, _ = server
    with pytest.raises(DownloadError, match="over the limit of 100 bytes"):
        _dl(base + "/ok", tmp_path, policy=Policy(attempts=1, max_bytes=100))


def test_bad_content_length(server, tmp_path):
    base, _ = server
    with pytest.raises(DownloadError, match="bad Content-Length"):
        _dl(base + "/bad-length", tmp_path, policy=Policy(attempts=1, timeout=2))


def test_slow_drip_hits_the_deadline(server, tmp_path):
    base, _ = server
    t = time.monotonic()
    with pytest.raises(DownloadError, match=r"too slow|not finished within 0\.5s"):
        _dl(base + "/drip", tmp_path, policy=Policy(timeout=2, deadline=0.5, attempts=1))
    assert time.monotonic() - t < 3


def test_stalled_body_times_out(server, tmp_path):
    base, _ = server
    with pytest.raises(DownloadError, match=r"timed out \(no data for 0\.3s\)") as ei:
        _dl(base + "/stall", tmp_path, policy=Policy(timeout=0.3, attempts=1))
    assert ei.value.retryable


def test_connection_refused_and_dns(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError, match="connection failed") as ei:
        _dl(f"http://127.0.0.1:{port}/x", tmp_path, policy=Policy(attempts=1))
    assert ei.value.retryable
    # .invalid never resolves (RFC 2606); the resolver answers locally.
    with pytest.raises(DownloadError, match="DNS lookup failed"):
        _dl("http://nodeforge-test.invalid/x", tmp_path, policy=Policy(attempts=1, timeout=5))


def test_redirect_same_scheme_followed_and_loop_bounded(server, tmp_path):
    base, counts = server
    res = _dl(base + "/redirect-same", tmp_path, sha256=SHA)
    assert res.url.endswith("/ok")
    with pytest.raises(DownloadError, match="HTTP 302"):
        _dl(base + "/redirect-loop", tmp_path, policy=Policy(attempts=1))
    assert counts["/redirect-loop"] <= 6


def test_https_to_http_redirect_refused(tls_pair, tmp_path):
    server_ctx, client_ctx = tls_pair
    plain, tls = _handler(), _handler()
    with http_server(plain) as plain_base, http_server(tls, server_ctx) as tls_base:
        tls.other = plain_base
        pol = Policy(attempts=3, timeout=5, context=client_ctx)
        assert _dl(tls_base + "/ok", tmp_path, policy=pol, sha256=SHA).size == len(BODY)
        with pytest.raises(
            DownloadError,
            match=r"redirect to http://\S+/ok refused: a downgrade from https to http://",
        ) as ei:
            _dl(tls_base + "/redirect-to-http", tmp_path, policy=pol)
        assert not ei.value.retryable and "/ok" not in plain.counts
        # An untrusted certificate is a TLS error, not a silent fallback.
        with pytest.raises(DownloadError, match="TLS certificate not trusted"):
            _dl(tls_base + "/ok", tmp_path, policy=Policy(attempts=1, timeout=5))


def test_file_url_and_unknown_scheme(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(BODY)
    res = _dl(src.as_uri(), tmp_path, sha256=SHA)
    assert res.path.read_bytes() == BODY
    with pytest.raises(DownloadError, match="cannot read .*nope"):
        _dl((tmp_path / "nope").as_uri(), tmp_path)
    with pytest.raises(DownloadError, match="only file://, http:// and https://"):
        _dl("ftp://example.invalid/x", tmp_path)


def test_fetch_bytes_bounded(server):
    base, _ = server
    assert fetch_bytes(base + "/ok", label="params", policy=FAST) == BODY
    with pytest.raises(DownloadError, match="params: .*over the limit"):
        fetch_bytes(base + "/ok", label="params", policy=Policy(attempts=1, max_bytes=10))


def test_display_url_hides_credentials_and_query():
    shown = display_url("https://user:hunter2@h.example/p/x.sh?X-Amz-Signature=abc&t=1")
    assert "hunter2" not in shown and "abc" not in shown
    assert shown == "https://h.example/p/x.sh?X-Amz-Signature=…&t=…"


def test_error_message_never_shows_the_password(tmp_path):
    with pytest.raises(DownloadError) as ei:
        _dl(
            "http://user:s3cr3t@nodeforge-test.invalid/x?token=s3cr3t",
            tmp_path,
            policy=Policy(attempts=1, timeout=5),
        )
    assert "s3cr3t" not in str(ei.value)


def test_destination_dir_has_no_leftovers_after_interrupt(server, tmp_path):
    base, _ = server

    def boom(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _dl(base + "/ok", tmp_path, progress=boom)
    assert list((tmp_path / "out").iterdir()) == []


def test_policy_delay_is_bounded():
    p = Policy(backoff=2, backoff_max=10)
    assert [p.delay(n) for n in (1, 2, 3, 4, 5)] == [2, 4, 8, 10, 10]


def test_dest_path_type(tmp_path, server):
    base, _ = server
    assert isinstance(_dl(base + "/ok", tmp_path).path, Path)


def test_connection_closed_without_response_is_retried(server, tmp_path):
    base, counts = server
    sleeps: list[float] = []
    with pytest.raises(DownloadError, match=r"bad HTTP response \(RemoteDisconnected") as ei:
        _dl(base + "/hangup", tmp_path, sleeps)
    assert ei.value.retryable and counts["/hangup"] == 3 and sleeps == [1, 2]
