"""The collective preflight (gang/collective.py, gang/preflight.py, the nfg-slow token and
the governor's strike). Participants are real sockets on loopback addresses (127.0.0.x),
one thread per rank."""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from nodeforge.gang import collective as col
from nodeforge.gang import config as gcfg
from nodeforge.gang import preflight as pf
from nodeforge.gang import readiness
from nodeforge.gang.policy import decide
from nodeforge.gang.slurm_view import JobObs, Snapshot
from nodeforge.gang.state import GovState

pytestmark = pytest.mark.unit
T0 = 1_000_000.0
OK = frozenset({"ALLOCATED"})


def _ports(n: int) -> tuple[int, ...]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = tuple(s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    return ports


def _run(n, nbytes=1 << 18, secs=20.0, addrs=None, ranks=None, job=7):
    """Ranks of one check in threads named rank-<r>; {rank: Verdict | None | exception}."""
    hosts = tuple(f"n{i}" for i in range(n))
    addrs = addrs or ("127.0.0.1",) * n
    ports = _ports(n)
    deadline = time.monotonic() + secs
    out: dict[int, object] = {}

    def one(r):
        plan = col.Plan(job, r, hosts, addrs, ports, nbytes, deadline, pings=3)
        try:
            out[r] = col.participate(plan)
        except col.PreflightError as exc:
            out[r] = exc

    threads = [
        threading.Thread(target=one, args=(r,), name=f"rank-{r}")
        for r in (ranks if ranks is not None else range(n))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(secs + 5)
    return out


# ---- the all-reduce ----------------------------------------------------------------------


def test_chunks_cover_the_vector_exactly():
    for nbytes in (1, 7, 1000, 1 << 16):
        for n in (1, 2, 3, 7):
            spans = col.chunks(nbytes, n)
            assert spans[0][0] == 0 and spans[-1][1] == nbytes
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_xor_reduction_matches_a_byte_by_byte_reference():
    n, nbytes = 4, 999
    ref = bytearray(nbytes)
    for r in range(n):
        for i, b in enumerate(col.vector(r, nbytes)):
            ref[i] ^= b
    assert col.expected(n, nbytes) == bytes(ref)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_over_loopback_every_node_measured(n):
    out = _run(n, nbytes=100_003)  # not a multiple of n: uneven chunks
    assert all(out[r] is None for r in range(1, n)), out
    v = out[0]
    assert isinstance(v, col.Verdict), v
    assert [f.node for f in v.nodes] == [f"n{i}" for i in range(n)]
    for f in v.nodes:
        assert not f.slow, f  # the result matched on every rank
        assert 0 < f.latency_ms < 1000 and 1 < f.bandwidth_mbps < math.inf
    judged = col.apply_thresholds(v, min_mbps=1, max_latency_ms=1000)
    assert judged.slow == ()


def test_corrupted_data_fails_the_check_on_every_node(monkeypatch):
    """Rank 1 flips a byte of every payload it sends (a bad NIC/driver): the reduced result
    is wrong on every rank (every chunk passed through it), and every node says so."""
    real = col._send

    def corrupt(sock, kind, body, deadline):
        if kind == col.DATA and threading.current_thread().name.startswith("rank-1"):
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        return real(sock, kind, body, deadline)

    monkeypatch.setattr(col, "_send", corrupt)
    v = _run(3)[0]
    assert isinstance(v, col.Verdict)
    assert all(f.slow and "result wrong" in f.why for f in v.nodes), v
    assert col.apply_thresholds(v, 0, 0).slow == ("n0", "n1", "n2")


def _throttle(monkeypatch, rank: int, delay: float):
    """Rank *rank* sends slowly: each ping/pong *delay* late, each payload stalls *delay*
    after its first byte (so the receiver's timer sees it)."""
    real = col._send

    def slow(sock, kind, body, deadline):
        if not threading.current_thread().name.startswith(f"rank-{rank}"):
            return real(sock, kind, body, deadline)
        if kind in (col.PING, col.PONG):
            time.sleep(delay)
            return real(sock, kind, body, deadline)
        if kind == col.DATA and len(body) > 1:
            sock.settimeout(col._left(deadline))
            sock.sendall(col.HEADER.pack(col.MAGIC, kind, len(body)) + body[:1])
            time.sleep(delay)
            sock.sendall(body[1:])
            return None
        return real(sock, kind, body, deadline)

    monkeypatch.setattr(col, "_send", slow)


def test_slow_participant_is_named_and_only_it(monkeypatch):
    _throttle(monkeypatch, rank=2, delay=0.15)
    v = _run(4, nbytes=1 << 18)[0]
    assert isinstance(v, col.Verdict), v
    fig = {f.node: f for f in v.nodes}
    assert fig["n2"].latency_ms >= 150
    # 2 x 64 KiB from n2 per link, each stalled 0.15 s: well under 2 MB/s
    assert fig["n2"].bandwidth_mbps < 2
    judged = col.apply_thresholds(v, min_mbps=5, max_latency_ms=100)
    assert judged.slow == ("n2",)
    why = next(f.why for f in judged.nodes if f.node == "n2")
    assert "bandwidth" in why and "latency" in why
    # either threshold alone names it too
    assert col.apply_thresholds(v, min_mbps=0, max_latency_ms=100).slow == ("n2",)
    assert col.apply_thresholds(v, min_mbps=5, max_latency_ms=0).slow == ("n2",)


def test_a_missing_participant_fails_within_the_deadline_naming_it():
    t0 = time.monotonic()
    out = _run(3, secs=1.5, ranks=[0, 1])
    assert time.monotonic() - t0 < 5
    assert isinstance(out[0], col.PreflightError) and "n2" in str(out[0])
    assert isinstance(out[1], col.PreflightError)
    # a rank that cannot reach a lower rank names it
    out = _run(2, secs=1.0, ranks=[1])
    assert isinstance(out[1], col.PreflightError) and "cannot reach rank 0 (n0" in str(out[1])


def test_connections_from_elsewhere_are_dropped():
    """An impostor claiming rank 1 from an address that is not rank 1's, and one speaking
    garbage, are dropped; the real rank 1 (from 127.0.0.2) still completes the check."""
    addrs = ("127.0.0.1", "127.0.0.2")
    ports = _ports(2)
    deadline = time.monotonic() + 10
    res: dict[int, object] = {}

    def rank(r):
        try:
            res[r] = col.participate(col.Plan(9, r, ("a", "b"), addrs, ports, 4096, deadline, 2))
        except col.PreflightError as exc:
            res[r] = exc

    t0 = threading.Thread(target=rank, args=(0,), name="rank-0")
    t0.start()
    for payload in (
        col.HEADER.pack(col.MAGIC, col.HELLO, 16) + col.HELLO_BODY.pack(9, 1, 2),  # wrong source
        b"GET / HTTP/1.0\r\n\r\n",
        col.HEADER.pack(col.MAGIC, col.HELLO, 1 << 40),  # oversized
    ):
        for _ in range(50):
            try:
                s = socket.create_connection(("127.0.0.1", ports[0]), timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        s.sendall(payload)
        s.close()
    t1 = threading.Thread(target=rank, args=(1,), name="rank-1")
    t1.start()
    t0.join(15)
    t1.join(15)
    assert isinstance(res[0], col.Verdict), res
    assert res[1] is None


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b'{"rank": 2, "ok": true, "rtt_ms": {}, "mbps_in": {}}',  # another rank's
        b'{"rank": 1, "ok": true, "rtt_ms": {"5": 1.0}, "mbps_in": {}}',  # no such peer
        b'{"rank": 1, "ok": true, "rtt_ms": {"0": NaN}, "mbps_in": {}}',
        b'{"rank": 1, "ok": true, "rtt_ms": {}, "mbps_in": {"0": -1}}',
        b'{"rank": 1, "ok": "yes", "rtt_ms": {}, "mbps_in": {}}',
    ],
)
def test_hostile_rank_reports_are_refused(raw):
    with pytest.raises(col.PreflightError):
        col.RankReport.from_json(raw, size=3, rank=1)


# ---- launcher / participant plumbing ------------------------------------------------------


def test_node_addresses_read_only_before_state():
    text = (
        "NodeName=gn1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.0.0.2 NodeHostName=gn1 "
        "State=IDLE Reason=x NodeAddr=6.6.6.6 \n"
        "NodeName=gn2 Arch=x86_64 NodeAddr=10.0.0.3 NodeHostName=gn2 State=ALLOCATED "
        "Comment=NodeAddr=6.6.6.6\n"
    )
    assert pf.node_addresses(text, ["gn1", "gn2"]) == {"gn1": "10.0.0.2", "gn2": "10.0.0.3"}
    with pytest.raises(pf.PreflightFailed, match="gn3"):
        pf.node_addresses(text, ["gn1", "gn3"])
    with pytest.raises(pf.PreflightFailed, match="no NodeAddr"):
        pf.node_addresses("NodeName=gn1 Arch=x State=IDLE NodeAddr=1.2.3.4\n", ["gn1"])


@pytest.mark.parametrize(
    "text", ["", "gn1", "gn1=10.0.0.1,gn1=10.0.0.2", "gn1=evil.example", "-x=1.2.3.4", "a=1,b"]
)
def test_peer_list_from_the_environment_is_checked(text):
    with pytest.raises(pf.PreflightFailed):
        pf.decode_peers(text)


def test_participant_must_be_the_node_its_rank_names():
    probe = gcfg.Probe(mode="collective", timeout=30)
    env = {
        pf.ENV_PEERS: "gn1=10.0.0.2,gn2=10.0.0.3",
        pf.ENV_DEADLINE: str(time.time() + 3600),
        pf.ENV_JOB: "12",
        "SLURM_NODEID": "1",
        "SLURMD_NODENAME": "gn2",
    }
    plan = pf.participant_plan(probe, env)
    assert (plan.rank, plan.hosts, plan.addrs) == (1, ("gn1", "gn2"), ("10.0.0.2", "10.0.0.3"))
    # a deadline further off than probe.timeout is cut to it
    assert plan.deadline - time.monotonic() <= 30
    for bad in (
        {"SLURMD_NODENAME": "gn1"},
        {"SLURM_NODEID": "2"},
        {pf.ENV_JOB: "12; rm"},
        {pf.ENV_DEADLINE: "nan"},
    ):
        with pytest.raises(pf.PreflightFailed):
            pf.participant_plan(probe, {**env, **bad})


def test_result_line_must_name_exactly_the_jobs_nodes():
    v = col.Verdict((col.NodeFigure("gn1", 0.1, 900, False), col.NodeFigure("gn2", 0.2, 1, True)))
    line = v.to_line()
    got = pf.read_result(f"noise\n{line}\nmore\n", ["gn1", "gn2"])
    assert got.slow == ("gn2",)
    with pytest.raises(pf.PreflightFailed):
        pf.read_result(line, ["gn1", "gn3"])
    with pytest.raises(pf.PreflightFailed):
        pf.read_result(f"{line}\n{line}\n", ["gn1", "gn2"])
    with pytest.raises(pf.PreflightFailed):
        pf.read_result("", ["gn1", "gn2"])


def test_nccl_bus_bandwidth_parsed_from_all_reduce_perf_output():
    # FIXTURE: the summary lines nccl-tests' all_reduce_perf prints (format of nccl-tests 2.x)
    out = "#  Out of bounds values : 0 OK\n# Avg bus bandwidth    : 187.32 \n#\n"
    assert pf.nccl_busbw(out) == pytest.approx(187320)
    assert pf.nccl_busbw("# Avg bus bandwidth    : lots\n") is None
    assert pf.nccl_busbw("") is None


# ---- config --------------------------------------------------------------------------------


def test_collective_config_parsed():
    c = gcfg.from_dict(
        {
            "probe": {
                "mode": "collective",
                "bytes": "512KiB",
                "port": 30000,
                "min_bandwidth_mb_s": 100,
                "max_latency_ms": 2.5,
                "transport": "tcp",
            }
        }
    )
    assert c.probe.bytes == 512 * 1024 and c.probe.port == 30000
    assert c.probe.min_bandwidth_mb_s == 100.0 and c.probe.max_latency_ms == 2.5


@pytest.mark.parametrize(
    "probe,key",
    [
        ({"bytes": 0}, "probe.bytes"),
        ({"bytes": "1GiB"}, "probe.bytes"),
        ({"bytes": "4 MB"}, "probe.bytes"),
        ({"bytes": True}, "probe.bytes"),
        ({"port": 80}, "probe.port"),
        ({"port": "29571"}, "probe.port"),
        ({"min_bandwidth_mb_s": -1}, "probe.min_bandwidth_mb_s"),
        ({"min_bandwidth_mb_s": float("inf")}, "probe.min_bandwidth_mb_s"),
        ({"max_latency_ms": float("nan")}, "probe.max_latency_ms"),
        ({"pings": 0}, "probe.pings"),
        ({"transport": "nccl"}, "probe.transport"),
        ({"mode": "collective", "timeout": 0}, "probe.timeout"),
    ],
)
def test_collective_config_refused_naming_key_and_file(probe, key):
    with pytest.raises(gcfg.ConfigError, match=rf"gang\.yaml: '{key}'"):
        gcfg.from_dict({"probe": probe}, "gang.yaml")


@settings(max_examples=200, deadline=None)
@given(hst.one_of(hst.integers(-(2**40), 2**40), hst.floats(allow_nan=True), hst.text(max_size=12)))
def test_probe_bytes_accepted_only_in_bounds(v):
    try:
        got = gcfg.from_dict({"probe": {"bytes": v}}, "g.yaml").probe.bytes
    except gcfg.ConfigError as exc:
        assert "'probe.bytes'" in str(exc)
        return
    assert isinstance(got, int) and 1 <= got <= gcfg.MAX_PROBE_BYTES


@settings(max_examples=200, deadline=None)
@given(hst.one_of(hst.floats(allow_nan=True, allow_infinity=True), hst.integers(), hst.text()))
def test_latency_threshold_finite_and_bounded(v):
    try:
        got = gcfg.from_dict({"probe": {"max_latency_ms": v}}, "g.yaml").probe.max_latency_ms
    except gcfg.ConfigError as exc:
        assert "'probe.max_latency_ms'" in str(exc)
        return
    assert math.isfinite(got) and 0 <= got <= 60000


# ---- the token and the governor ----------------------------------------------------------


def _job(comment="", restarts=0, nodes=("gn1", "gn2", "gn3")):
    return JobObs(
        job_id="5",
        state="RUNNING",
        reason="None",
        nodes=nodes,
        num_nodes=len(nodes),
        start_time=T0,
        submit_time=T0 - 10,
        restarts=restarts,
        partition="main",
        comment=comment,
    )


def test_slow_token_bound_to_the_run_and_to_the_allocation():
    assert readiness.slow_nodes(_job("nfg-slow=0:gn2")) == ("gn2",)
    assert readiness.slow_nodes(_job("nfg-slow=0:gn2", restarts=1)) == ()  # last run's
    assert readiness.slow_nodes(_job("nfg-slow=0:gn3,other9,gn1")) == ("gn1", "gn3")
    for forged in ("nfg-slow=0:", "nfg-slow=00:gn2", "nfg-slow=0:gn2,,gn3", "nfg-slow=x:gn2"):
        assert readiness.slow_nodes(_job(forged)) == (), forged


@settings(max_examples=300, deadline=None)
@given(
    hst.text(
        alphabet=hst.sampled_from(list("nfg-slow=0123:,gn ab.\t\n")),
        max_size=60,
    ),
    hst.integers(0, 3),
)
def test_slow_token_never_names_a_node_outside_the_job(comment, restarts):
    got = readiness.slow_nodes(_job(comment, restarts, nodes=("gn1", "gn2")))
    assert set(got) <= {"gn1", "gn2"}
    for n in got:  # and only when a well-formed token of this run names it
        assert any(
            w.startswith(f"nfg-slow={restarts}:") and n in w.split(":", 1)[1].split(",")
            for w in comment.split()
        )


def _cfg(**kw):
    base = {
        "timeout": 10,
        "node_strike_limit": 3,
        "probe": {"mode": "collective"},
        "requeuing": {"backoff_base_seconds": 5, "backoff_max_seconds": 40, "jitter": 0},
    }
    base.update(kw)
    return gcfg.from_dict(base, "t")


def _snap(job):
    return Snapshot(jobs=[job], nodes={n: OK for n in ("gn1", "gn2", "gn3", "victim")})


def test_governor_names_the_slow_node_at_once_and_strikes_it_at_the_timeout():
    c = _cfg()
    # a forged name of a node outside the job ("victim") in the same token
    j = _job("user-text nfg-slow=0:gn2,victim")
    st, acts = decide(c, GovState(), _snap(j), T0 + 1)
    assert st.jobs["5"].phase == "admitted"
    assert [(a.kind, a.reason) for a in acts] == [("note", "PreflightSlow")]
    assert "gn2" in acts[0].detail and "victim" not in acts[0].detail
    st, acts = decide(c, st, _snap(j), T0 + 5)
    assert acts == []  # said once
    st, acts = decide(c, st, _snap(j), T0 + 10)
    kinds = [(a.kind, a.node) for a in acts]
    assert ("strike", "gn2") in kinds and ("requeue", "") in kinds, kinds
    assert [a.node for a in acts if a.kind == "strike"] == ["gn2"]
    assert set(st.nodes) == {"gn2"} and len(st.nodes["gn2"].strikes) == 1


def test_collective_ready_needs_the_ready_mark_and_no_slow_node():
    c = _cfg()
    st, _acts = decide(c, GovState(), _snap(_job("nfg-ready=0")), T0 + 1)
    assert st.jobs["5"].phase == "ready"
    st, _ = decide(c, GovState(), _snap(_job()), T0 + 1)
    assert st.jobs["5"].phase == "admitted"
    assert "collective preflight not passed" in st.jobs["5"].why
    # a slow verdict wins over a (forged) ready mark of the same run
    st, _ = decide(c, GovState(), _snap(_job("nfg-ready=0 nfg-slow=0:gn1")), T0 + 1)
    assert st.jobs["5"].phase == "admitted"


def test_slow_nodes_not_struck_without_collective_mode():
    c = _cfg(probe={"mode": "command"})
    j = _job("nfg-slow=0:gn2")
    st, _ = decide(c, GovState(), _snap(j), T0 + 1)
    st, acts = decide(c, st, _snap(j), T0 + 10)
    assert not [a for a in acts if a.kind == "strike"]


def test_participants_as_processes_through_the_cli(tmp_path):
    """`nodeforge gang ready --local` with probe.mode collective, one process per rank (what
    srun starts), each on its own loopback address: rank 0 prints the one result line."""
    import os
    import subprocess
    import sys

    port = _ports(1)[0]
    cfgfile = tmp_path / "gang.yaml"
    cfgfile.write_text(
        f"probe:\n  mode: collective\n  port: {port}\n  bytes: 64KiB\n  timeout: 20\n"
        "  min_bandwidth_mb_s: 1\n  max_latency_ms: 500\n"
    )
    hosts = ["gn1", "gn2", "gn3"]
    peers = ",".join(f"{h}=127.0.0.{i + 1}" for i, h in enumerate(hosts))
    procs = []
    for r, h in enumerate(hosts):
        env = {
            **os.environ,
            pf.ENV_PEERS: peers,
            pf.ENV_DEADLINE: str(time.time() + 20),
            pf.ENV_JOB: "33",
            "SLURM_NODEID": str(r),
            "SLURMD_NODENAME": h,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "nodeforge.cli", "gang", "ready", "--local"]
                + ["--config", str(cfgfile)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [p.communicate(timeout=40)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    v = pf.read_result(outs[0], hosts)
    assert v.slow == () and v.transport == "tcp"
    assert all(col.RESULT_PREFIX not in o for o in outs[1:])
