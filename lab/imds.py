"""A metadata service that behaves as EC2's IMDSv2, for the lab (a real server on loopback).

A VM reaches it at 169.254.169.254 through qemu's user-mode network (`lab/vm.py`,
``VMConfig.metadata``: ``guestfwd=tcp:169.254.169.254:80-tcp:127.0.0.1:PORT``), so the address
exists only inside that VM's emulated network and no packet to it leaves qemu.

The contract it implements (what the unit tests check, tests/unit/lab/test_lab_imds.py):

* ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: N`` (1..21600) answers a
  session token (text) and echoes the TTL header; a missing, non-integer or out-of-range TTL is
  400. A token PUT that carries ``X-Forwarded-For`` is 403: that is how EC2 refuses tokens to
  requests that came through a proxy.
* Hop limit: EC2 sends the token PUT's response with IP TTL = hop limit (1 by default), so it
  dies one hop past the instance (a container bridge, a proxy). Here the only path is qemu's
  guestfwd, which is no IP hop at all, so the hop limit is modelled by what a proxied request
  shows: ``X-Forwarded-For`` (or ``Forwarded`` / ``Via``) on the token PUT is refused (403),
  and a GET carrying them needs a token like any other (it cannot get one through the proxy).
* Every metadata GET needs a valid, unexpired ``X-aws-ec2-metadata-token`` (http_tokens =
  required): none, unknown or expired is 401. IMDSv1 (no token) is never served.
* ``/latest/user-data`` (404 when the instance has none), ``/latest/meta-data/`` and under it
  ``instance-id``, ``local-ipv4``, ``hostname``, ``local-hostname``, ``placement/availability-zone``,
  ``placement/region``, ``public-keys/`` (``0=NAME``), ``public-keys/0/openssh-key``,
  ``iam/info``, ``iam/security-credentials/`` (the role name) and
  ``iam/security-credentials/ROLE`` (JSON with ``AccessKeyId``, ``SecretAccessKey``, ``Token``,
  ``Expiration``): credentials are rotated every ``cred_ttl`` seconds, so a short TTL in a test
  makes the client refresh them. `IMDS.credential_valid` tells an S3 front whether a key it saw
  is one this service issued and still unexpired; `IMDS.expiry_of` when a set it issued expires.
  ``stale = True`` models a metadata service whose role credentials stopped rotating: it serves
  one set that has already expired (what a node "given only a stale key" sees).
  ``stall = S`` (seconds) makes every answer wait S seconds before it is sent: a slow or
  overloaded service, slower in all than a client's deadline though each answer is in time.
* Anything else is 404 (unknown path) or 405 (other method). Bounded: at most ``max_threads``
  requests at once (more wait up to 5 s, then 503), a request body is at most 1 KiB, a client
  that sends nothing for ``request_timeout`` seconds is dropped, at most ``max_tokens`` live
  tokens (the oldest expire first), and an access log of the last 1000 requests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("nodeforge.lab.imds")

TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TTL_MIN, TTL_MAX = 1, 21600
PROXY_HEADERS = ("X-Forwarded-For", "Forwarded", "Via")
_TTL_RE = re.compile(r"[0-9]{1,5}")
_ROLE_RE = re.compile(r"[A-Za-z0-9+=,.@_-]{1,64}")
_MAX_BODY = 1024


@dataclasses.dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    token: str
    issued: float  # wall clock
    expires: float  # wall clock

    def document(self) -> dict[str, str]:
        return {
            "Code": "Success",
            "LastUpdated": _iso(self.issued),
            "Type": "AWS-HMAC",
            "AccessKeyId": self.access_key_id,
            "SecretAccessKey": self.secret_access_key,
            "Token": self.token,
            "Expiration": _iso(self.expires),
        }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(int(t), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class Instance:
    """What the metadata service says about its one instance."""

    instance_id: str = "i-0123456789abcdef0"
    local_ipv4: str = "169.254.169.15"  # qemu's first DHCP address with net=169.254.169.0/24
    hostname: str = "ip-169-254-169-15.eu-west-1.compute.internal"
    availability_zone: str = "eu-west-1a"
    region: str = "eu-west-1"
    user_data: bytes | None = None
    public_keys: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, key)
    role: str | None = None  # instance profile role name; None: no IAM role
    cred_ttl: float = 3600.0  # seconds each credential set lives

    def __post_init__(self) -> None:
        if self.role is not None and not _ROLE_RE.fullmatch(self.role):
            raise ValueError(f"IMDS role name {self.role!r}: use A-Z a-z 0-9 +=,.@_- (1..64)")
        if not 1 <= self.cred_ttl <= 43200:
            raise ValueError(f"IMDS cred_ttl {self.cred_ttl}: give 1..43200 seconds")


class IMDS:
    """The metadata service's state and its answers; `serve()` puts it on a socket."""

    def __init__(
        self,
        instance: Instance,
        *,
        clock: Callable[[], float] = time.time,
        max_tokens: int = 1000,
    ) -> None:
        self.instance = instance
        self.clock = clock
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}  # token -> expiry (wall clock)
        self._creds: list[Credentials] = []  # every set issued, newest last
        self.log: deque[tuple[str, str, int]] = deque(maxlen=1000)  # (method, path, status)
        self.down = False  # True: answer nothing (the test's "metadata service is down")
        self.stale = False  # True: serve one already-expired credential set (never rotated)
        self.stall = 0.0  # seconds each answer waits before it is sent (a slow service)

    # -- tokens ------------------------------------------------------------------------------
    def new_token(self, ttl: int) -> str:
        now = self.clock()
        tok = secrets.token_urlsafe(40)
        with self._lock:
            for t, exp in list(self._tokens.items()):
                if exp <= now:
                    del self._tokens[t]
            while len(self._tokens) >= self.max_tokens:  # drop the one that expires first
                del self._tokens[min(self._tokens, key=self._tokens.__getitem__)]
            self._tokens[tok] = now + ttl
        return tok

    def token_valid(self, tok: str | None) -> bool:
        if not tok:
            return False
        with self._lock:
            exp = self._tokens.get(tok)
        return exp is not None and self.clock() < exp

    def revoke_tokens(self) -> None:
        with self._lock:
            self._tokens.clear()

    # -- credentials ---------------------------------------------------------------------------
    def credentials(self) -> Credentials:
        """The current set; a new one once the current has less than a fifth of its life left
        (EC2 also hands out the next set before the old one expires)."""
        now = self.clock()
        ttl = self.instance.cred_ttl
        with self._lock:
            if self.stale:
                return self._stale_set(now, ttl)
            cur = self._creds[-1] if self._creds else None
            if cur is None or now >= cur.expires - ttl / 5:
                cur = Credentials(
                    "ASIA" + secrets.token_hex(8).upper(),
                    secrets.token_urlsafe(30),
                    secrets.token_urlsafe(60),
                    now,
                    now + ttl,
                )
                self._creds.append(cur)
                del self._creds[:-100]
            return cur

    def _stale_set(self, now: float, ttl: float) -> Credentials:
        """The one expired set a stale service keeps serving (made once; lock held)."""
        for c in reversed(self._creds):
            if c.expires <= now and c.access_key_id.startswith("ASIASTALE"):
                return c
        c = Credentials(
            "ASIASTALE" + secrets.token_hex(6).upper(),
            secrets.token_urlsafe(30),
            secrets.token_urlsafe(60),
            now - 2 * ttl,
            now - ttl,
        )
        self._creds.append(c)
        return c

    def expiry_of(self, access_key_id: str) -> float | None:
        """When the set with *access_key_id* expires (wall clock); None if never issued here."""
        with self._lock:
            return next((c.expires for c in self._creds if c.access_key_id == access_key_id), None)

    def secret_of(self, access_key_id: str, token: str | None) -> str | None:
        """The secret key of the set (access_key_id, token) this service issued; None if none."""
        with self._lock:
            for c in self._creds:
                if c.access_key_id == access_key_id and c.token == token:
                    return c.secret_access_key
        return None

    def credential_valid(self, access_key_id: str, token: str | None) -> str | None:
        """None if (access_key_id, token) is a set this service issued and it has not expired;
        else the reason ("expired" or "unknown")."""
        now = self.clock()
        with self._lock:
            for c in self._creds:
                if c.access_key_id == access_key_id and c.token == token:
                    return None if now < c.expires else "expired"
        return "unknown"

    @property
    def credentials_issued(self) -> int:
        with self._lock:
            return len(self._creds)

    # -- answers -------------------------------------------------------------------------------
    def answer(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        """(status, content type, body) for one request; *headers* with lower-case names."""
        if method == "PUT":
            if path != "/latest/api/token":
                return 403, "text/plain", b"Forbidden\n"
            if any(h.lower() in headers for h in PROXY_HEADERS):
                return 403, "text/plain", b"Forbidden: token requests through a proxy\n"
            raw = headers.get(TTL_HEADER.lower())
            if raw is None or not _TTL_RE.fullmatch(raw) or not TTL_MIN <= int(raw) <= TTL_MAX:
                return 400, "text/plain", b"Bad Request: token TTL must be 1..21600 seconds\n"
            return 200, "text/plain", self.new_token(int(raw)).encode()
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"Method Not Allowed\n"
        if path == "/latest/api/token":
            return 405, "text/plain", b"Method Not Allowed\n"
        if not self.token_valid(headers.get(TOKEN_HEADER.lower())):
            return 401, "text/plain", b"Unauthorized\n"
        body = self._lookup(path)
        if body is None:
            return 404, "text/plain", b"Not Found\n"
        ctype = "application/json" if body.startswith(b"{") else "text/plain"
        return 200, ctype, body

    def _lookup(self, path: str) -> bytes | None:
        inst = self.instance
        if path == "/latest/user-data":
            return inst.user_data
        if path == "/latest":
            return b"dynamic\nmeta-data\nuser-data\n"
        prefix = "/latest/meta-data/"
        if not (path + "/").startswith(prefix):
            return None
        rel = path[len(prefix) :]
        leaves: dict[str, str] = {
            "instance-id": inst.instance_id,
            "local-ipv4": inst.local_ipv4,
            "hostname": inst.hostname,
            "local-hostname": inst.hostname,
            "placement/availability-zone": inst.availability_zone,
            "placement/region": inst.region,
        }
        for i, (_name, key) in enumerate(inst.public_keys):
            leaves[f"public-keys/{i}/openssh-key"] = key + "\n"
            leaves[f"public-keys/{i}"] = "openssh-key"
        if inst.public_keys:
            leaves["public-keys"] = "\n".join(
                f"{i}={name}" for i, (name, _) in enumerate(inst.public_keys)
            )
        if inst.role:
            leaves["iam/security-credentials"] = inst.role
            leaves["iam/info"] = json.dumps(
                {
                    "Code": "Success",
                    "LastUpdated": _iso(self.clock()),
                    "InstanceProfileArn": f"arn:aws:iam::123456789012:instance-profile/{inst.role}",
                    "InstanceProfileId": "AIPA0123456789EXAMPLE",
                }
            )
            if rel == f"iam/security-credentials/{inst.role}":
                return json.dumps(self.credentials().document(), indent=2).encode()
        key = rel.rstrip("/")
        if key in leaves:
            return leaves[key].encode()
        if rel == "" or rel.endswith("/"):  # a directory listing
            below = {
                k[len(key) + 1 :] if key else k
                for k in leaves
                if not key or k.startswith(key + "/")
            }
            if not below:
                return None
            names = sorted({b.split("/")[0] + ("/" if "/" in b else "") for b in below})
            return "\n".join(names).encode()
        return None

    # -- serving ---------------------------------------------------------------------------------
    def serve(
        self, host: str = "127.0.0.1", port: int = 0, *, max_threads: int = 16,
        request_timeout: float = 10.0,
    ) -> Server:  # fmt: skip
        """Listen now (so qemu's guestfwd finds the listener) and serve in a thread."""
        srv = Server(self, (host, port), max_threads=max_threads, request_timeout=request_timeout)
        srv.start()
        return srv


class _Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"
    server_version = "EC2ws"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.request_timeout)

    def _handle(self) -> None:
        imds = self.server.imds
        if imds.down:
            self.close_connection = True
            return  # no answer: the client sees the connection closed
        if imds.stall > 0:
            time.sleep(imds.stall)
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > _MAX_BODY:
            self._send(413, "text/plain", b"Payload Too Large\n", head=False)
            return
        if int(length):
            self.rfile.read(int(length))
        path = self.path.split("?", 1)[0]
        hdrs = {k.lower(): v for k, v in self.headers.items()}
        status, ctype, body = imds.answer(self.command, path, hdrs)
        extra = {}
        if status == 200 and self.command == "PUT":
            extra[TTL_HEADER] = hdrs[TTL_HEADER.lower()]
        imds.log.append((self.command, path, status))
        self._send(status, ctype, body, head=self.command == "HEAD", extra=extra)

    def _send(
        self, status: int, ctype: str, body: bytes, *, head: bool,
        extra: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = do_PATCH = _handle

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("imds %s " + format, self.client_address[0], *args)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, imds: IMDS, addr: tuple[str, int], *, max_threads: int, request_timeout: float
    ) -> None:
        self.imds = imds
        self.request_timeout = request_timeout
        self._slots = threading.BoundedSemaphore(max_threads)
        self._thread: threading.Thread | None = None
        super().__init__(addr, _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(timeout=5):
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True,
            name=f"imds-{self.port}",
        )  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
