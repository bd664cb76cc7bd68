"""lab/imds.py against the IMDSv2 contract, over a real socket on loopback (no root)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.bootstrap import params_sources
from nodeforge.lab.imds import IMDS, TTL_HEADER, Instance

pytestmark = pytest.mark.unit

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2xExampleExampleExampleExampleExampleExamp admin@lab"


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def imds(clock):
    inst = Instance(
        user_data=b"nodeforge:\n  role: compute\n",
        public_keys=[("admin", KEY)],
        role="nf-node",
        cred_ttl=60,
    )
    svc = IMDS(inst, clock=clock)
    srv = svc.serve()
    svc.port = srv.port  # type: ignore[attr-defined]
    yield svc
    srv.stop()


def req(svc, method, path, headers=None, body=None):
    c = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=5)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read().decode(), dict(r.getheaders())
    finally:
        c.close()


def token(svc, ttl="60"):
    status, body, hdrs = req(svc, "PUT", "/latest/api/token", {TTL_HEADER: ttl})
    assert status == 200, body
    assert hdrs[TTL_HEADER] == ttl
    return body


def get(svc, path, tok):
    return req(svc, "GET", path, {"X-aws-ec2-metadata-token": tok})[:2]


def test_token_then_metadata(imds):
    tok = token(imds)
    assert get(imds, "/latest/meta-data/instance-id", tok) == (200, "i-0123456789abcdef0")
    assert get(imds, "/latest/meta-data/local-ipv4", tok) == (200, "169.254.169.15")
    assert get(imds, "/latest/meta-data/hostname", tok)[1].startswith("ip-169-254-169-15")
    assert get(imds, "/latest/meta-data/placement/availability-zone", tok) == (200, "eu-west-1a")
    assert get(imds, "/latest/meta-data/placement/region", tok) == (200, "eu-west-1")
    assert get(imds, "/latest/meta-data/public-keys/", tok) == (200, "0=admin")
    assert get(imds, "/latest/meta-data/public-keys/0/", tok) == (200, "openssh-key")
    assert get(imds, "/latest/meta-data/public-keys/0/openssh-key", tok) == (200, KEY + "\n")
    assert get(imds, "/latest/user-data", tok) == (200, "nodeforge:\n  role: compute\n")
    status, listing = get(imds, "/latest/meta-data/", tok)
    assert status == 200
    assert {"instance-id", "placement/", "public-keys/", "iam/"} <= set(listing.splitlines())


@pytest.mark.parametrize("ttl", [None, "0", "21601", "-1", "abc", "1.5", "6 0", "99999999"])
def test_token_ttl_out_of_range_is_400(imds, ttl):
    headers = {} if ttl is None else {TTL_HEADER: ttl}
    assert req(imds, "PUT", "/latest/api/token", headers)[0] == 400


@pytest.mark.parametrize("ttl", ["1", "21600"])
def test_token_ttl_bounds_accepted(imds, ttl):
    assert token(imds, ttl)


@pytest.mark.parametrize("hdr", ["X-Forwarded-For", "Forwarded", "Via"])
def test_hop_limit_token_through_a_proxy_is_refused(imds, hdr):
    status, _, _ = req(imds, "PUT", "/latest/api/token", {TTL_HEADER: "60", hdr: "10.0.0.9"})
    assert status == 403


def test_no_token_is_401_imdsv1_never_served(imds):
    assert req(imds, "GET", "/latest/meta-data/instance-id")[0] == 401
    assert req(imds, "GET", "/latest/user-data")[0] == 401
    assert get(imds, "/latest/user-data", "not-a-token")[0] == 401


def test_token_expires(imds, clock):
    tok = token(imds, "5")
    assert get(imds, "/latest/meta-data/instance-id", tok)[0] == 200
    clock.t += 5
    assert get(imds, "/latest/meta-data/instance-id", tok)[0] == 401


def test_methods_and_paths(imds):
    tok = token(imds)
    assert req(imds, "GET", "/latest/api/token")[0] == 405
    assert req(imds, "POST", "/latest/meta-data/", {"X-aws-ec2-metadata-token": tok})[0] == 405
    assert req(imds, "PUT", "/latest/meta-data/x", {TTL_HEADER: "60"})[0] == 403
    assert get(imds, "/latest/meta-data/nope", tok)[0] == 404
    assert get(imds, "/etc/passwd", tok)[0] == 404
    assert get(imds, "/latest/meta-data/../../etc/passwd", tok)[0] == 404
    assert req(imds, "PUT", "/latest/api/token", {TTL_HEADER: "60"}, body=b"x" * 2000)[0] == 413


def test_no_user_data_is_404(clock):
    svc = IMDS(Instance(), clock=clock)
    with svc.serve() as srv:
        svc.port = srv.port  # type: ignore[attr-defined]
        assert get(svc, "/latest/user-data", token(svc))[0] == 404
        assert get(svc, "/latest/meta-data/iam/security-credentials/", token(svc))[0] == 404


def _expiry(doc):
    return datetime.strptime(doc["Expiration"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def test_role_credentials_rotate_before_they_expire(imds, clock):
    tok = token(imds, "21600")
    assert get(imds, "/latest/meta-data/iam/security-credentials/", tok) == (200, "nf-node")
    s, body = get(imds, "/latest/meta-data/iam/security-credentials/nf-node", tok)
    assert s == 200
    a = json.loads(body)
    assert a["Code"] == "Success" and a["Type"] == "AWS-HMAC"
    assert a["AccessKeyId"].startswith("ASIA") and a["SecretAccessKey"] and a["Token"]
    assert _expiry(a).timestamp() == pytest.approx(clock.t + 60, abs=1)
    assert imds.credential_valid(a["AccessKeyId"], a["Token"]) is None
    clock.t += 30  # half its life: the same set
    b = json.loads(get(imds, "/latest/meta-data/iam/security-credentials/nf-node", tok)[1])
    assert b["AccessKeyId"] == a["AccessKeyId"]
    clock.t += 20  # under a fifth left: a new set, the old one still valid until it expires
    c = json.loads(get(imds, "/latest/meta-data/iam/security-credentials/nf-node", tok)[1])
    assert c["AccessKeyId"] != a["AccessKeyId"]
    assert imds.credential_valid(a["AccessKeyId"], a["Token"]) is None
    clock.t += 11
    assert imds.credential_valid(a["AccessKeyId"], a["Token"]) == "expired"
    assert imds.credential_valid(c["AccessKeyId"], c["Token"]) is None
    assert imds.credential_valid(c["AccessKeyId"], "forged") == "unknown"
    assert get(imds, "/latest/meta-data/iam/security-credentials/other", tok)[0] == 404


def test_down_answers_nothing(imds):
    imds.down = True
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        req(imds, "PUT", "/latest/api/token", {TTL_HEADER: "60"})


def test_stall_delays_every_answer_then_answers(imds):
    """The slow-service fixture: each answer comes, correct, after `stall` seconds."""
    imds.stall = 0.3
    t = time.monotonic()
    tok = token(imds)
    assert get(imds, "/latest/meta-data/instance-id", tok) == (200, "i-0123456789abcdef0")
    assert time.monotonic() - t >= 0.6
    imds.stall = 0.0
    t = time.monotonic()
    token(imds)
    assert time.monotonic() - t < 0.3


def test_slow_client_is_dropped_and_others_served(clock):
    svc = IMDS(Instance(), clock=clock)
    with svc.serve(max_threads=2, request_timeout=0.5) as srv:
        svc.port = srv.port  # type: ignore[attr-defined]
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(2)]
        try:
            assert token(svc)  # waits for a slot: the idle ones time out
        finally:
            for s in idle:
                s.close()


def test_concurrent_clients(imds):
    errors: list[BaseException] = []

    def one():
        try:
            assert get(imds, "/latest/meta-data/instance-id", token(imds))[0] == 200
        except BaseException as exc:  # noqa: BLE001 - collected for the assert below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors


def test_agent_reader_against_the_server(imds):
    """The agent's own IMDSv2 reader (bootstrap/params_sources.py) gets user-data from it."""
    got = params_sources.imds_user_data(f"http://127.0.0.1:{imds.port}", timeout=2)
    assert got == "nodeforge:\n  role: compute\n"
    assert [m for m, _, _ in imds.log][:2] == ["PUT", "GET"]


@settings(max_examples=60, deadline=None)
@given(
    path=st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80
    )
)
def test_any_path_without_token_is_401_never_a_crash(path):
    svc = IMDS(Instance(role="r", user_data=b"x"))
    status, _, _ = svc.answer("GET", "/" + path, {})
    assert status == 401
    tok = svc.new_token(60)
    status, _, _body = svc.answer("GET", "/" + path, {"x-aws-ec2-metadata-token": tok})
    assert status in (200, 404)


def test_stale_service_serves_one_expired_set(imds, clock):
    """The "only a stale key" fixture: a service that stopped rotating hands out one set whose
    Expiration has passed, and the S3 front's check calls that set expired."""
    tok = token(imds, "21600")
    path = "/latest/meta-data/iam/security-credentials/nf-node"
    fresh = json.loads(get(imds, path, tok)[1])
    imds.stale = True
    a = json.loads(get(imds, path, tok)[1])
    clock.t += 5
    b = json.loads(get(imds, path, tok)[1])
    assert a["AccessKeyId"] == b["AccessKeyId"] != fresh["AccessKeyId"]
    assert _expiry(a).timestamp() < clock.t
    assert imds.credential_valid(a["AccessKeyId"], a["Token"]) == "expired"
    assert imds.expiry_of(a["AccessKeyId"]) == pytest.approx(_expiry(a).timestamp(), abs=1)
    assert imds.expiry_of("ASIANEVERISSUED0000") is None
    imds.stale = False  # rotation resumes: a valid set again
    c = json.loads(get(imds, path, tok)[1])
    assert imds.credential_valid(c["AccessKeyId"], c["Token"]) is None
