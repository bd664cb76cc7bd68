"""An S3 endpoint over TLS for the lab: a private CA made at test time, and a TLS front that
forwards to moto's S3 server (``moto_server``, plain http on loopback).

Why a front: moto serves plain http and accepts any credentials. The front adds what the
node's path must prove: TLS with a CA that only the test knows (so an unknown CA fails), and
instance-role credentials that the metadata service (lab/imds.py) issued and that have not
expired (so a client that does not refresh them fails with S3's ``ExpiredToken``). It reads
the key id from the SigV4 ``Authorization`` header and the session token from
``X-Amz-Security-Token``, and recomputes the SigV4 signature with that set's secret key (moto
verifies none): a request signed with another secret is ``SignatureDoesNotMatch``.
``forbidden`` key prefixes answer 403 AccessDenied, as a bucket policy would. ``signed`` records
each request's (time on the metadata service's clock, access key id, method, path), so a test
can tell which credential set each request was signed with.

Everything listens on 127.0.0.1; a VM reaches it through a guestfwd rule (lab/vm.py CloudNet).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import http.client
import logging
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from nodeforge import proc
from nodeforge.errors import NodeforgeError

from .imds import IMDS

log = logging.getLogger("nodeforge.lab.s3front")

_CRED_RE = re.compile(r"AWS4-HMAC-SHA256 Credential=([A-Z0-9]{16,128})/")
_AUTH_RE = re.compile(
    r"AWS4-HMAC-SHA256 Credential=([A-Z0-9]{16,128})/([0-9]{8})/([a-z0-9-]{1,32})/s3/aws4_request,"
    r" ?SignedHeaders=([a-z0-9;-]{1,1024}), ?Signature=([0-9a-f]{64})"
)


def sigv4_valid(method: str, target: str, headers: dict[str, str], secret: str) -> bool:
    """Whether the request's SigV4 ``Authorization`` is the signature *secret* makes (S3's form:
    the path as sent, the query's pairs sorted as sent, the payload hash from
    x-amz-content-sha256). *headers* with lower-case names."""
    m = _AUTH_RE.fullmatch(headers.get("authorization", ""))
    amz_date = headers.get("x-amz-date", "")
    if m is None or not amz_date.startswith(m.group(2)):
        return False
    _key, day, region, signed, signature = m.groups()
    path, _, query = target.partition("?")
    pairs = sorted(tuple(p.partition("=")[::2]) for p in query.split("&")) if query else []
    names = signed.split(";")
    if any(n not in headers for n in names) or "host" not in names:
        return False
    canonical = "\n".join(
        [
            method,
            path,
            "&".join(f"{k}={v}" for k, v in pairs),
            "".join(f"{n}:{' '.join(headers[n].split())}\n" for n in names),
            signed,
            headers.get("x-amz-content-sha256", "UNSIGNED-PAYLOAD"),
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    want = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, signature)


_MAX_BODY = 64 << 20


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    ca: Path  # the CA certificate (PEM): what the node is given as s3_ca_bundle
    cert: Path  # the server certificate, signed by ca
    key: Path  # its private key (test only, in the test's work dir)


def make_ca(workdir: Path, ips: list[str], names: list[str] = (), tag: str = "s3") -> TLSFiles:  # type: ignore[assignment]
    """A CA and a server certificate for *ips*/*names* (subjectAltName), made with openssl."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca, ca_key = workdir / f"{tag}-ca.pem", workdir / f"{tag}-ca.key"
    cert, key = workdir / f"{tag}-cert.pem", workdir / f"{tag}-key.pem"
    csr, ext = workdir / f"{tag}.csr", workdir / f"{tag}.ext"
    run = proc.run
    run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
         "-subj", f"/CN=nodeforge lab {tag} CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"], timeout=60)  # fmt: skip
    run(["openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(key), "-out", str(csr),
         "-subj", f"/CN={(list(names) or ips)[0]}"], timeout=60)  # fmt: skip
    san = ",".join([f"IP:{i}" for i in ips] + [f"DNS:{n}" for n in names])
    ext.write_text(
        f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)],
        timeout=60)  # fmt: skip
    return TLSFiles(ca, cert, key)


class _Front(BaseHTTPRequestHandler):
    server: S3Front
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.request.settimeout(30)
        self.request.do_handshake()  # here, in this request's thread, not in accept()
        super().setup()

    def _refuse(self, status: int, code: str, message: str) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        srv = self.server
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > _MAX_BODY:
            return self._refuse(400, "InvalidRequest", "bad Content-Length")
        body = self.rfile.read(int(length)) if int(length) else b""
        srv.requests.append((self.command, self.path))
        if srv.imds is not None:
            m = _CRED_RE.match(self.headers.get("Authorization", ""))
            if m is None:
                return self._refuse(403, "AccessDenied", "Access Denied (anonymous)")
            srv.signed.append((srv.imds.clock(), m.group(1), self.command, self.path))
            why = srv.imds.credential_valid(m.group(1), self.headers.get("X-Amz-Security-Token"))
            if why == "expired":
                srv.refused.append("ExpiredToken")
                return self._refuse(400, "ExpiredToken", "The provided token has expired.")
            if why is not None:
                srv.refused.append("InvalidAccessKeyId")
                return self._refuse(
                    403, "InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist"
                )
            secret = srv.imds.secret_of(m.group(1), self.headers.get("X-Amz-Security-Token"))
            hdrs = {k.lower(): v for k, v in self.headers.items()}
            if secret is None or not sigv4_valid(self.command, self.path, hdrs, secret):
                srv.refused.append("SignatureDoesNotMatch")
                return self._refuse(
                    403,
                    "SignatureDoesNotMatch",
                    "The request signature we calculated does not match the signature you provided",
                )
        key = self.path.split("?", 1)[0]
        if any(key.startswith(p) for p in srv.forbidden):
            srv.refused.append("AccessDenied")
            return self._refuse(403, "AccessDenied", "Access Denied")
        up = http.client.HTTPConnection("127.0.0.1", srv.upstream, timeout=30)
        try:
            # Host is http.client's own (moto would read an endpoint's name as a bucket): the
            # signature over the client's Host was checked above.
            hdrs = {
                k: v for k, v in self.headers.items() if k.lower() not in ("connection", "host")
            }
            up.request(self.command, self.path, body=body or None, headers=hdrs)
            r = up.getresponse()
            data = r.read(_MAX_BODY)
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in (
                    "connection",
                    "transfer-encoding",
                    "content-length",
                    "server",
                    "date",
                ):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            up.close()

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("s3front " + format, *args)


class S3Front(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        upstream: int,
        tls: TLSFiles,
        *,
        imds: IMDS | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.upstream = upstream
        self.imds = imds
        self.forbidden: list[str] = []
        self.requests: list[tuple[str, str]] = []
        self.refused: list[str] = []
        self.signed: list[tuple[float, str, str, str]] = []  # (when, key id, method, path)
        self.server_names: list[str | None] = []  # the SNI name of each TLS handshake
        super().__init__((host, port), _Front)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
        ctx.sni_callback = lambda _sock, name, _ctx: self.server_names.append(name)
        self.socket = ctx.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that rejects our certificate shows up here as an SSL error: expected.
        log.debug("s3front: connection from %s ended with an error", client_address)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)


def moto(port: int = 0):
    """moto's S3 server on 127.0.0.1 (started); `.stop()` ends it."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise NodeforgeError("moto[server] is missing: pip install -e '.[dev]'") from exc
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    return srv
