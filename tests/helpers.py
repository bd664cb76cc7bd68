"""Helpers shared by the tests (imported as tests.helpers)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import http.server
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

E2E_ROOT = Path(os.environ.get("NODEFORGE_E2E_DIR", "/var/tmp/nodeforge-e2e"))
REPO = Path(__file__).resolve().parents[1]
BUILD_TOOLS = (
    "packer",
    "mmdebstrap",
    "systemd-nspawn",
    "mkfs.ext4",
    "qemu-img",
    "ssh-keygen",
    "zstd",
    "dpkg-deb",
    "ip",
    "nsenter",
)


def nodeforge(
    *args: str, timeout: float = 3600, check: bool = True, **kw
) -> subprocess.CompletedProcess:
    cp = subprocess.run(
        [sys.executable, "-m", "nodeforge", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        **kw,
    )
    if check and cp.returncode != 0:
        pytest.fail(
            f"nodeforge {' '.join(args)} exited {cp.returncode}\nstdout:\n{cp.stdout}\n"
            f"stderr:\n{cp.stderr[-6000:]}",
            pytrace=False,
        )
    return cp


GIB = 1 << 30
BUILD_ROOM = 6 * GIB  # a build's rootfs tree, its disk and the compressed tarball side by side


def need_room(path: Path, need: int, what: str) -> None:
    """Fail `what` up front, naming the room, when the file system of `path` has less free.

    The e2e tier fills the disk step by step; failing first with the figures beats a tool's
    "Failure writing output" deep inside a build or `vagrant box add`.
    """
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        pytest.fail(
            f"{what} needs {need / GIB:.1f} GiB free under {path}, {free / GIB:.1f} GiB is free: "
            f"remove leftovers of earlier runs from {E2E_ROOT} and shrink the build cache "
            "(nodeforge cache prune --max-size 8G)",
            pytrace=False,
        )


def drop_outputs(*paths: Path) -> None:
    """Remove large test outputs no later test reads, so the tier's disk use stays bounded."""
    for p in paths:
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)


# The e2e lanes (scripts/test.sh, tests/e2e/lanes.txt) run side by side and share the build
# cache, which admits one build at a time: a second fails at once (images/cache.py `locked`).
# A test that builds, or checks what a build left in the cache, takes this turn first.
BUILD_LOCK = Path(os.environ.get("NODEFORGE_E2E_BUILD_LOCK", "/var/tmp/nodeforge-e2e.build.lock"))
BUILD_LOCK_WAIT_S = 2400.0  # longer than any one lane's builds together


@contextlib.contextmanager
def build_turn(what: str, wait_s: float = BUILD_LOCK_WAIT_S) -> Iterator[None]:
    """Hold the e2e tier's build turn for `what` (not re-entrant: one holder per test)."""
    BUILD_LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    pytest.fail(
                        f"{what}: another e2e lane held the build turn ({BUILD_LOCK}) for "
                        f"{wait_s:.0f}s; look for a hung `nodeforge build` (ps -ef)",
                        pytrace=False,
                    )
                time.sleep(2)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the turn


def build_image(output: Path, mirror: Path, versions: Path, *extra: str) -> tuple[dict, float]:
    need_room(output.parent, BUILD_ROOM, f"the build into {output}")
    with build_turn(f"the build into {output}"):
        t0 = time.monotonic()
        cp = nodeforge(
            "build", "--artifact-mirror", str(mirror), "--versions-file", str(versions),
            "--output", str(output), "--json", *extra,
        )  # fmt: skip
        return json.loads(cp.stdout), time.monotonic() - t0


def fake_image_tree(tmp_path: Path) -> Path:
    """The least an image tree has for the sealer and the scanner: dpkg's info dir and an
    empty machine-id."""
    t = tmp_path / "tree"
    (t / "var/lib/dpkg/info").mkdir(parents=True)
    (t / "etc").mkdir(exist_ok=True)
    (t / "etc/machine-id").write_text("")
    return t


def dpkg_ship(tree: Path, package: str, *rels: str) -> None:
    """Record files of an image tree as shipped by *package*, as dpkg does: the .list and the
    md5sums of their content now (the scanner treats them as public while unchanged)."""
    info = tree / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    with open(info / f"{package}.list", "a") as lst, open(info / f"{package}.md5sums", "a") as md5:
        for rel in rels:
            lst.write(f"/{rel}\n")
            md5.write(f"{hashlib.md5((tree / rel).read_bytes()).hexdigest()}  {rel}\n")


def process_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may linger where PID 1 does not reap)."""
    from nodeforge.proc import pid_alive

    return pid_alive(pid)


def qemu_image_manifest(**phases: float) -> dict:
    """An image manifest as the qemu target writes it before the disk seal (test input)."""
    return {
        "schema": 1,
        "name": "t",
        "target": "qemu",
        "created": "2026-12-03T00:00:00+00:00",
        "arch": "amd64",
        "base": {"name": "debian13", "suite": "trixie", "mirror": "m", "key": "k", "cached": True},
        "inputs": {},
        "tools": {"nodeforge": "0", "packer": "1.6.6", "ansible-core": "2.19"},
        "phases": phases or {"preflight": 1.0, "base": 1.0, "provision": 1.0},
    }


def debugfs_read(disk: Path, work: Path, request: str) -> str:
    """Run one debugfs request (`cat /etc/x`, `ls /root/.ssh`) on a qcow2 disk's root
    filesystem (the disk itself, or its largest partition), no mount.
    debugfs reports a missing path on stderr and exits 0: callers check the text."""
    from nodeforge.images.disk_seal import root_partition

    raw = work / "inspect.raw"
    subprocess.run(
        ["qemu-img", "convert", "-O", "raw", str(disk), str(raw)], check=True, timeout=600
    )
    try:
        part = root_partition(raw)  # a partitioned disk: its root filesystem (the largest)
        where = str(raw) if part is None else f"{raw}?offset={part[0]}"
        return subprocess.run(
            ["debugfs", "-R", request, where],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    finally:
        raw.unlink()


def ctrl_c_enabled() -> None:
    """preexec_fn for a child that the test interrupts with SIGINT, as Ctrl-C would: a test
    run started in the background (`cmd &` in a script) inherits SIGINT ignored, and Python
    then never raises KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


# -- loopback HTTP servers (the only network the unit tests touch) ----------------------------
class QuietHandler(http.server.BaseHTTPRequestHandler):
    """Base of the tests' HTTP handlers: no access log on stderr, one way to answer."""

    def log_message(self, *a):
        pass

    def send(
        self,
        code: int,
        body: bytes = b"",
        *,
        length: int | None = None,
        headers: Sequence[tuple[str, str]] = (),
        close: bool = False,
    ) -> None:
        """Answer *code* with *body*; *length* other than len(body) makes a truncated body."""
        self.send_response(code)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        if close:
            self.close_connection = True


def routes_handler(routes: dict[str, bytes]) -> type[QuietHandler]:
    """A handler that serves *routes* (path -> body) with GET and 404s everything else."""

    class Routes(QuietHandler):
        def do_GET(self):
            body = routes.get(self.path)
            self.send(404, close=True) if body is None else self.send(200, body, close=True)

    return Routes


@contextlib.contextmanager
def http_server(
    handler: type[http.server.BaseHTTPRequestHandler], tls: ssl.SSLContext | None = None
) -> Iterator[str]:
    """Serve *handler* on 127.0.0.1 (a free port) for the with-block; yields the base URL.
    The server is shut down and its socket closed on exit, also when the test fails."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    if tls is not None:
        srv.socket = tls.wrap_socket(srv.socket, server_side=True)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)


@contextlib.contextmanager
def unanswered_port() -> Iterator[tuple[str, int]]:
    """(host, port) on 127.0.0.1 where a connect hangs until its timeout: a listener with a
    backlog of 0 whose one queued connection is never accepted, so the kernel drops every
    further SYN (what a firewall that drops packets looks like, on loopback)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    filler = socket.create_connection(srv.getsockname(), timeout=5)
    try:
        yield srv.getsockname()
    finally:
        filler.close()
        srv.close()


def loopback_tls(directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A throwaway self-signed certificate for 127.0.0.1, made at run time in *directory* (no
    key material in git). Returns (server context, client context that trusts only it)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


def fake_command(bindir: Path, name: str, *, stdout: str = "", rc: int = 0) -> Path:
    """A stand-in *name* in *bindir* (put it first on PATH) that appends its arguments to the
    returned log file, prints *stdout* and exits *rc*. The log exists only once it ran."""
    import shlex

    bindir.mkdir(parents=True, exist_ok=True)
    log = bindir / f"{name}.calls"
    f = bindir / name
    f.write_text(
        f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\n'
        f"printf '%s' {shlex.quote(stdout)}\nexit {rc}\n"
    )
    f.chmod(0o755)
    return log


def linked_copy(src: Path, dest: Path, manifest: dict | None = None) -> Path:
    """FIXTURE: another image directory with the same files (hard links, no disk used);
    *manifest* replaces manifest.json when given. Beside the image: links need one filesystem."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "manifest.json":
            os.link(f, dest / f.name)
    doc = manifest if manifest is not None else json.loads((src / "manifest.json").read_text())
    (dest / "manifest.json").write_text(json.dumps(doc))
    return dest


_B64_TOKEN = re.compile(r"[A-Za-z0-9+/]{16,}={0,2}")


def carries_secret(text: str, secret: bytes, depth: int = 3) -> str | None:
    """Where *text* shows *secret*: plainly, as its base64, or inside a base64 token (decoded
    up to *depth* levels, as an OEM string's credential wraps a file's base64). None: nowhere."""
    b64 = base64.b64encode(secret).decode()
    if secret in text.encode(errors="surrogateescape") or b64 in text:
        return "as is" if secret in text.encode(errors="surrogateescape") else "as its base64"
    if depth == 0:
        return None
    for tok in _B64_TOKEN.findall(text):
        try:
            inner = base64.b64decode(tok + "=" * (-len(tok) % 4), validate=True)
        except (binascii.Error, ValueError):
            continue
        where = carries_secret(inner.decode(errors="surrogateescape"), secret, depth - 1)
        if where is not None:
            return f"{where}, inside base64 {tok[:24]}..."
    return None
