"""Collective preflight (`probe.mode: collective`): a bounded TCP all-reduce across exactly a
job's nodes, one participant per node (launched by `srun` from `nodeforge gang ready`).

Stdlib sockets only. Every participant listens on its own node's address (from the job's own
allocation) at `probe.port`; rank i connects to every rank j < i, so each pair has one
connection (a full mesh), and an accepted peer must come from the address its rank has in
the allocation. No other address is ever contacted.

Phases, each bounded by the one total deadline (every socket op has a timeout, every frame a
size cap):
1. latency: every rank pings every peer `pings` times (answering peers' pings at once);
   RTT per peer = the median.
2. all-reduce (XOR of each rank's deterministic vector, MPI_BXOR): reduce-scatter then
   all-gather by pairwise exchange, n-1 rounds each (round k: send to rank+k, receive from
   rank-k). The receiver times each payload (first byte after the header to the last), so
   each link direction gets a bandwidth; the result is checked against the expected XOR.
3. gather: every rank sends its figures to rank 0 (the rendezvous), which judges.

Verdict (rank 0): a link's RTT is the lower of its two ends' medians and its bandwidth the
lower of its two directions; a node's latency is its best link's and its bandwidth its best
link's. So a node is slow only when no link of it is fast: one slow node does not make its
peers slow. With two nodes there is one link and both ends are named (which end is at fault
cannot be told from one link).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import math
import selectors
import socket
import statistics
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

MAGIC = b"NFGP"
HEADER = struct.Struct("!4sBQ")  # magic, kind, payload length
HELLO, PING, PONG, DATA, RESULT = 1, 2, 3, 4, 5
HELLO_BODY = struct.Struct("!QII")  # job id, rank, size
MAX_RESULT = 64 * 1024
MAX_BYTES = 256 * 1024 * 1024  # probe.bytes upper bound (config enforces it too)
MAX_NODES = 1024
RESULT_PREFIX = "nfg-preflight-result "


class PreflightError(Exception):
    """A participant could not complete (peer gone, deadline, protocol): not ready."""


@dataclass(frozen=True)
class Plan:
    """What one participant needs; all of it from the job's own allocation."""

    job_id: int
    rank: int
    hosts: tuple[str, ...]  # node names, in the allocation's order (rank = index)
    addrs: tuple[str, ...]  # each node's address (NodeAddr)
    ports: tuple[int, ...]  # each rank's port (all probe.port on a cluster; tests vary it)
    nbytes: int  # the all-reduce vector size
    deadline: float  # time.monotonic() by which everything is over
    pings: int = 5

    @property
    def size(self) -> int:
        return len(self.hosts)


@dataclass
class RankReport:
    rank: int
    rtt_ms: dict[int, float] = field(default_factory=dict)  # peer -> median RTT
    mbps_in: dict[int, float] = field(default_factory=dict)  # peer -> MB/s received from it
    ok: bool = False  # the all-reduce result matched

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "rank": self.rank,
                "rtt_ms": {str(k): v for k, v in self.rtt_ms.items()},
                "mbps_in": {str(k): v for k, v in self.mbps_in.items()},
                "ok": self.ok,
            }
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, size: int, rank: int) -> RankReport:
        """A peer's figures, checked: right rank, peers in range, finite non-negative."""
        try:
            d = json.loads(raw)
        except ValueError:
            raise PreflightError(f"rank {rank}: result is not JSON") from None
        if not isinstance(d, dict) or d.get("rank") != rank or not isinstance(d.get("ok"), bool):
            raise PreflightError(f"rank {rank}: malformed result")
        out = cls(rank, ok=d["ok"])
        for key, dst in (("rtt_ms", out.rtt_ms), ("mbps_in", out.mbps_in)):
            m = d.get(key)
            if not isinstance(m, dict):
                raise PreflightError(f"rank {rank}: malformed {key}")
            for k, v in m.items():
                if not (k.isascii() and k.isdigit() and int(k) < size and int(k) != rank):
                    raise PreflightError(f"rank {rank}: {key} names peer {k!r:.20}")
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise PreflightError(f"rank {rank}: {key} value {v!r:.20}")
                if not (math.isfinite(v) and v >= 0):
                    raise PreflightError(f"rank {rank}: {key} value {v!r:.20}")
                dst[int(k)] = float(v)
        return out


@dataclass(frozen=True)
class NodeFigure:
    node: str
    latency_ms: float  # its best link's RTT
    bandwidth_mbps: float  # its best link's bandwidth, MB/s
    slow: bool
    why: str = ""


@dataclass(frozen=True)
class Verdict:
    nodes: tuple[NodeFigure, ...]
    transport: str = "tcp"

    @property
    def slow(self) -> tuple[str, ...]:
        return tuple(n.node for n in self.nodes if n.slow)

    def to_line(self) -> str:
        return RESULT_PREFIX + json.dumps(
            {
                "transport": self.transport,
                "slow": list(self.slow),
                "nodes": [
                    {
                        "node": n.node,
                        "latency_ms": _finite(n.latency_ms),
                        "bandwidth_mbps": _finite(n.bandwidth_mbps),
                        "why": n.why,
                    }
                    for n in self.nodes
                ],
            },
            sort_keys=True,
        )


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None  # one node has no link: no figure


def _base(nbytes: int) -> bytes:
    return hashlib.shake_256(b"nfg-preflight").digest(nbytes)


def _tile(word: bytes, nbytes: int) -> bytes:
    return (word * (nbytes // len(word) + 1))[:nbytes]


def _word(rank: int) -> bytes:
    return hashlib.shake_256(b"nfg-preflight-%d" % rank).digest(8)


def vector(rank: int, nbytes: int) -> bytes:
    """Rank's all-reduce input: a common random buffer XOR a rank word repeated, so that
    every rank can compute the expected XOR of all inputs in O(bytes), not O(n x bytes)."""
    return xor(_base(nbytes), _tile(_word(rank), nbytes))


def xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


def expected(size: int, nbytes: int) -> bytes:
    acc = bytes(8)
    for r in range(size):
        acc = xor(acc, _word(r))
    tiled = _tile(acc, nbytes)
    return xor(_base(nbytes), tiled) if size % 2 else tiled


def chunks(nbytes: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's chunk; the last ones may be one byte shorter."""
    base, extra = divmod(nbytes, size)
    out, pos = [], 0
    for r in range(size):
        n = base + (1 if r < extra else 0)
        out.append((pos, pos + n))
        pos += n
    return out


# ---- framing -------------------------------------------------------------------------------


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PreflightError("probe.timeout passed")
    return left


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        sock.settimeout(_left(deadline))
        try:
            k = sock.recv_into(view[got:], min(n - got, 1 << 20))
        except TimeoutError:
            raise PreflightError("probe.timeout passed while receiving") from None
        if k == 0:
            raise PreflightError("peer closed the connection")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, kind: int, body: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    try:
        sock.sendall(HEADER.pack(MAGIC, kind, len(body)) + body)
    except TimeoutError:
        raise PreflightError("probe.timeout passed while sending") from None


def _header(sock: socket.socket, deadline: float, cap: int) -> tuple[int, int]:
    magic, kind, length = HEADER.unpack(_recv_exact(sock, HEADER.size, deadline))
    if magic != MAGIC or length > cap:
        raise PreflightError(f"bad frame (magic {magic!r:.8}, length {length})")
    return kind, length


def _frame(sock: socket.socket, deadline: float, cap: int) -> tuple[int, bytes]:
    kind, length = _header(sock, deadline, cap)
    return kind, _recv_exact(sock, length, deadline)


# ---- the participant -----------------------------------------------------------------------


def _connect_mesh(plan: Plan, listener: socket.socket) -> dict[int, socket.socket]:
    """One connection per pair: connect to lower ranks (retrying until they listen), accept
    higher ranks (only from the address their rank has in the allocation)."""
    peers: dict[int, socket.socket] = {}
    hello = HELLO_BODY.pack(plan.job_id, plan.rank, plan.size)
    try:
        for j in range(plan.rank):
            while True:
                s = socket.socket(_family(plan.addrs[j]), socket.SOCK_STREAM)
                s.settimeout(min(_left(plan.deadline), 5.0))
                try:
                    # from our own allocation address: what the peer checks us by
                    s.bind((plan.addrs[plan.rank], 0))
                    s.connect((plan.addrs[j], plan.ports[j]))
                    break
                except OSError as exc:  # refused (not listening yet), timed out, ...
                    s.close()
                    if plan.deadline - time.monotonic() <= 0.1:
                        raise PreflightError(
                            f"cannot reach rank {j} ({plan.hosts[j]} at {plan.addrs[j]}:"
                            f"{plan.ports[j]}) before probe.timeout: {exc.strerror or exc}"
                        ) from None
                    time.sleep(0.1)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peers[j] = s
            _send(s, HELLO, hello, plan.deadline)
        want = set(range(plan.rank + 1, plan.size))
        while want:
            listener.settimeout(_left(plan.deadline))
            try:
                s, (ip, *_) = listener.accept()
            except TimeoutError:
                raise PreflightError(
                    f"ranks {sorted(want)} ({', '.join(plan.hosts[j] for j in sorted(want))}) "
                    "never connected"
                ) from None
            try:
                # a connection that says nothing holds the accept loop 5 s at most
                hello_by = min(plan.deadline, time.monotonic() + 5)
                kind, body = _frame(s, hello_by, HELLO_BODY.size)
                job, rank, size = (
                    HELLO_BODY.unpack(body) if len(body) == HELLO_BODY.size else (0,) * 3
                )
            except (PreflightError, OSError):
                s.close()
                continue
            # someone else's connection (not this job, not the rank's own address): dropped
            if kind != HELLO or job != plan.job_id or size != plan.size or rank not in want:
                s.close()
                continue
            if ipaddress.ip_address(ip) != ipaddress.ip_address(plan.addrs[rank]):
                s.close()
                continue
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peers[rank] = s
            want.discard(rank)
    except BaseException:
        for s in peers.values():
            s.close()
        raise
    return peers


def _family(addr: str) -> int:
    return socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET


def _latency(plan: Plan, peers: dict[int, socket.socket]) -> dict[int, float]:
    """Ping every peer `pings` times, answering every peer's pings at once (no peer's round
    delays another's answer); per peer the median RTT in ms."""
    sel = selectors.DefaultSelector()
    sent_at: dict[int, float] = {}
    rtts: dict[int, list[float]] = {j: [] for j in peers}
    answered = dict.fromkeys(peers, 0)
    try:
        for j, s in peers.items():
            sel.register(s, selectors.EVENT_READ, j)
            sent_at[j] = time.perf_counter()
            _send(s, PING, struct.pack("!I", 0), plan.deadline)
        active = set(peers)
        while active:
            events = sel.select(_left(plan.deadline))
            if not events:
                continue
            for key, _ in events:
                j = key.data
                s = peers[j]
                kind, body = _frame(s, plan.deadline, 8)
                if kind == PING:
                    _send(s, PONG, body, plan.deadline)
                    answered[j] += 1
                elif kind == PONG and j in sent_at:
                    rtts[j].append((time.perf_counter() - sent_at.pop(j)) * 1000)
                    if len(rtts[j]) < plan.pings:
                        sent_at[j] = time.perf_counter()
                        _send(s, PING, struct.pack("!I", len(rtts[j])), plan.deadline)
                else:
                    raise PreflightError(f"unexpected frame {kind} from rank {j}")
                if answered[j] >= plan.pings and len(rtts[j]) >= plan.pings:
                    sel.unregister(s)  # what it sends next belongs to the next phase
                    active.discard(j)
    finally:
        sel.close()
    return {j: statistics.median(v) for j, v in rtts.items()}


def _exchange(
    plan: Plan, to: socket.socket, frm: socket.socket, payload: bytes, cap: int
) -> tuple[bytes, float]:
    """Send *payload* to one peer (a thread) while receiving one from another; returns what
    was received and the receive's MB/s (payload bytes over the time from the header's
    arrival to the last byte)."""
    err: list[BaseException] = []

    def send() -> None:
        try:
            _send(to, DATA, payload, plan.deadline)
        except BaseException as exc:  # reported by the caller
            err.append(exc)

    t = threading.Thread(target=send, name=f"{threading.current_thread().name}-send", daemon=True)
    t.start()
    kind, length = _header(frm, plan.deadline, cap)
    if kind != DATA:
        raise PreflightError(f"unexpected frame {kind} in the all-reduce")
    t0 = time.perf_counter()
    body = _recv_exact(frm, length, plan.deadline)
    secs = time.perf_counter() - t0
    t.join(max(0.0, plan.deadline - time.monotonic()))
    if t.is_alive():
        raise PreflightError("probe.timeout passed while sending")
    if err:
        raise err[0] if isinstance(err[0], PreflightError) else PreflightError(str(err[0]))
    mbps = length / 1e6 / secs if secs > 0 else float(length) / 1e6 / 1e-6
    return body, mbps


def _allreduce(plan: Plan, peers: dict[int, socket.socket]) -> tuple[bytes, dict[int, float]]:
    n, r = plan.size, plan.rank
    spans = chunks(plan.nbytes, n)
    cap = spans[0][1] - spans[0][0]
    mine = vector(r, plan.nbytes)
    piece = {c: mine[a:b] for c, (a, b) in enumerate(spans)}
    bytes_in: dict[int, float] = dict.fromkeys(peers, 0.0)
    secs_in: dict[int, float] = dict.fromkeys(peers, 0.0)

    def note(j: int, nbytes: int, mbps: float) -> None:
        bytes_in[j] += nbytes
        secs_in[j] += nbytes / 1e6 / mbps if mbps > 0 else 0.0

    # reduce-scatter: rank r ends with chunk r reduced over all ranks
    for k in range(1, n):
        p, q = (r + k) % n, (r - k) % n
        got, mbps = _exchange(plan, peers[p], peers[q], piece[p], cap)
        if len(got) != len(piece[r]):
            raise PreflightError(f"rank {q} sent {len(got)} bytes for chunk {r}")
        piece[r] = xor(piece[r], got)
        note(q, len(got), mbps)
    # all-gather: every rank gets every reduced chunk
    out = {r: piece[r]}
    for k in range(1, n):
        p, q = (r + k) % n, (r - k) % n
        got, mbps = _exchange(plan, peers[p], peers[q], piece[r], cap)
        a, b = spans[q]
        if len(got) != b - a:
            raise PreflightError(f"rank {q} sent {len(got)} bytes for its chunk")
        out[q] = got
        note(q, len(got), mbps)
    result = b"".join(out[c] for c in range(n))
    rates = {j: (bytes_in[j] / 1e6 / secs_in[j] if secs_in[j] > 0 else 0.0) for j in peers}
    return result, rates


def participate(plan: Plan, listener: socket.socket | None = None) -> Verdict | None:
    """Run one rank. Rank 0 returns the verdict; the others None. Raises PreflightError when
    the check cannot complete within the deadline (the caller: not ready)."""
    if not 0 <= plan.rank < plan.size <= MAX_NODES or not 0 < plan.nbytes <= MAX_BYTES:
        raise PreflightError(f"bad plan: rank {plan.rank} of {plan.size}, {plan.nbytes} bytes")
    _enough_files(plan.size)
    own = listener is None
    if listener is None:
        listener = socket.socket(_family(plan.addrs[plan.rank]), socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((plan.addrs[plan.rank], plan.ports[plan.rank]))
        except OSError as exc:
            listener.close()
            raise PreflightError(
                f"cannot listen on {plan.addrs[plan.rank]}:{plan.ports[plan.rank]} "
                f"({plan.hosts[plan.rank]}): {exc.strerror} (probe.port in use, or NodeAddr "
                "is not this node's address)"
            ) from None
        listener.listen(min(plan.size, 128))
    peers: dict[int, socket.socket] = {}
    try:
        peers = _connect_mesh(plan, listener)
        if own:
            listener.close()
        rep = RankReport(plan.rank)
        if plan.size > 1:
            rep.rtt_ms = _latency(plan, peers)
            result, rep.mbps_in = _allreduce(plan, peers)
            rep.ok = result == expected(plan.size, plan.nbytes)
        else:
            rep.ok = True
        if plan.rank != 0:
            _send(peers[0], RESULT, rep.to_json(), plan.deadline)
            # wait for rank 0 to close: it has read every result by then
            peers[0].settimeout(_left(plan.deadline))
            try:
                peers[0].recv(1)
            except (TimeoutError, OSError):
                pass
            return None
        reports = {0: rep}
        for j in range(1, plan.size):
            kind, body = _frame(peers[j], plan.deadline, MAX_RESULT)
            if kind != RESULT:
                raise PreflightError(f"rank {j} sent frame {kind} instead of its result")
            reports[j] = RankReport.from_json(body, plan.size, j)
        return judge_reports(plan.hosts, reports)
    except OSError as exc:
        raise PreflightError(f"socket error: {exc}") from None
    finally:
        for s in peers.values():
            s.close()
        if own:
            listener.close()


def _enough_files(size: int) -> None:
    """The full mesh holds size-1 sockets: raise the soft open-files limit if it is short."""
    import resource

    need = size + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise PreflightError(
                f"{size} nodes need {need} open files, the hard limit is {hard} (ulimit -Hn)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


# thresholds are applied by the caller's judge(); participate() returns raw figures
def judge_reports(hosts: Sequence[str], reports: dict[int, RankReport]) -> Verdict:
    return Verdict(tuple(_figures(hosts, reports)))


def _figures(hosts: Sequence[str], reports: dict[int, RankReport]):
    n = len(hosts)
    for i in range(n):
        lat, bw = math.inf, 0.0
        for j in range(n):
            if j == i:
                continue
            rtt = min(reports[i].rtt_ms.get(j, math.inf), reports[j].rtt_ms.get(i, math.inf))
            link = min(reports[i].mbps_in.get(j, 0.0), reports[j].mbps_in.get(i, 0.0))
            lat, bw = min(lat, rtt), max(bw, link)
        if n == 1:
            lat, bw = 0.0, math.inf
        why = "" if reports[i].ok else "all-reduce result wrong"
        yield NodeFigure(hosts[i], lat, bw, bool(why), why)


def apply_thresholds(v: Verdict, min_mbps: float, max_latency_ms: float) -> Verdict:
    """Mark each node below the operator's thresholds, saying which figure failed."""
    out = []
    for f in v.nodes:
        why = [f.why] if f.why else []
        if min_mbps and f.bandwidth_mbps < min_mbps:
            why.append(f"bandwidth {f.bandwidth_mbps:.2f} MB/s < {min_mbps:g}")
        if max_latency_ms and f.latency_ms > max_latency_ms:
            why.append(f"latency {f.latency_ms:.1f} ms > {max_latency_ms:g}")
        out.append(NodeFigure(f.node, f.latency_ms, f.bandwidth_mbps, bool(why), "; ".join(why)))
    return Verdict(tuple(out), v.transport)
