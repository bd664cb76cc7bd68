"""s3:// hooks the way a cloud node fetches them: TLS with a private CA (s3_ca_bundle), the
instance role's credentials from the metadata service (lab/imds.py, reached by boto3's default
chain), refreshed when they expire; and each failure a clear hook error (unknown CA, expired
or unknown credentials, 403, 404). moto's S3 server behind lab/s3front.py, all on loopback."""

from __future__ import annotations

import os
import socket
import time

import pytest

boto3 = pytest.importorskip("boto3", reason="dev extra: pip install -e '.[dev]' (boto3, moto)")
pytest.importorskip("moto.server", reason="dev extra: moto[server]")

from nodeforge.bootstrap import hooks as hooks_mod
from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.bootstrap.paths import Paths
from nodeforge.lab import s3front
from nodeforge.lab.imds import IMDS, Instance
from tests.conftest import require_tools
from tests.unit.support import HOOK_PARAMS

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    require_tools("openssl")
    work = tmp_path_factory.mktemp("s3cloud")
    tls = s3front.make_ca(work, ["127.0.0.1"])
    other = s3front.make_ca(work, ["127.0.0.1"], tag="other")
    clock = Clock()
    imds = IMDS(Instance(role="nf-node", cred_ttl=60), clock=clock)
    isrv = imds.serve()
    moto = s3front.moto()
    front = s3front.S3Front(moto.get_host_and_port()[1], tls, imds=imds)
    # Seed the bucket straight at moto (the test's admin path, not the node's).
    admin = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{moto.get_host_and_port()[1]}",
        aws_access_key_id="admin",
        aws_secret_access_key="admin",
        region_name="eu-west-1",
    )
    admin.create_bucket(
        Bucket="lifecycle", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"}
    )
    admin.put_object(Bucket="lifecycle", Key="cfg/on_init.sh", Body=b"#!/bin/sh\n./helper.sh\n")
    admin.put_object(Bucket="lifecycle", Key="cfg/helper.sh", Body=b"#!/bin/sh\necho ran > ran\n")
    admin.put_object(Bucket="lifecycle", Key="secret/x.sh", Body=b"#!/bin/sh\n")
    yield {
        "tls": tls,
        "other": other,
        "imds": imds,
        "clock": clock,
        "front": front,
        "endpoint": f"https://127.0.0.1:{front.port}",
        "imds_port": isrv.port,
        "tls_files": tls,
        "moto_port": moto.get_host_and_port()[1],
        "admin": admin,
    }
    front.stop()
    moto.stop()
    isrv.stop()


@pytest.fixture
def node_env(world, monkeypatch):
    """boto3's default chain as on an instance: nothing in the environment or files, the
    metadata service (here at its loopback address) gives the role's credentials."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv(
        "AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{world['imds_port']}/"
    )
    world["front"].refused.clear()
    return world


def _params(world, uri, ca, **kw):
    d = {
        **HOOK_PARAMS,
        "s3_endpoint_url": world["endpoint"],
        "hooks": [
            {"uri": uri, "script": "on_init.sh", "name": "lifecycle"}
            if uri.endswith("/")
            else {"uri": uri}
        ],
        **kw,
    }
    if ca is not None:
        d["s3_ca_bundle"] = ca
    return parse_params(d, "test")


def _fetch(tmp_path, p):
    paths = Paths.under(tmp_path)
    (hook,) = hooks_mod.discover(paths, p)
    return hooks_mod.fetch(hook, paths.hook_cache)


def test_prefix_over_tls_with_role_credentials_refreshed(tmp_path, node_env):
    w = node_env
    ca_pem = w["tls"].ca.read_text()
    before = w["imds"].credentials_issued
    got = _fetch(tmp_path / "a", _params(w, "s3://lifecycle/cfg/", ca_pem))
    assert got.name == "on_init.sh" and (got.parent / "helper.sh").is_file()
    assert w["imds"].credentials_issued >= max(before, 1)
    w["clock"].offset += 61  # every set issued so far has expired (IMDS's and S3's view)
    got = _fetch(tmp_path / "b", _params(w, "s3://lifecycle/cfg/", str(w["tls"].ca)))
    assert got.is_file()
    assert w["front"].refused == []  # the client never sent an expired or unknown key
    assert w["imds"].credentials_issued >= before + 2


def test_unknown_ca_is_a_clear_tls_error(tmp_path, node_env):
    w = node_env
    for ca in (None, w["other"].ca.read_text()):
        with pytest.raises(hooks_mod.HookError, match="TLS.*s3_ca_bundle"):
            _fetch(tmp_path / str(ca is None), _params(w, "s3://lifecycle/cfg/", ca))


def test_s3_403_and_404_name_the_object(tmp_path, node_env):
    w = node_env
    w["front"].forbidden[:] = ["/lifecycle/secret"]
    ca = w["tls"].ca.read_text()
    with pytest.raises(hooks_mod.HookError, match=r"s3://lifecycle/secret.*(403|AccessDenied)"):
        _fetch(tmp_path / "f", _params(w, "s3://lifecycle/secret/", ca))
    with pytest.raises(hooks_mod.HookError, match=r"s3://lifecycle/cfg/nope\.sh.*does not exist"):
        _fetch(tmp_path / "n", _params(w, "s3://lifecycle/cfg/nope.sh", ca))


def test_expired_credentials_that_are_not_refreshed_are_refused(node_env):
    """What a client that kept its first credentials would see: S3's ExpiredToken."""
    w = node_env
    creds = w["imds"].credentials()
    w["clock"].offset += 3600
    c = boto3.client(
        "s3",
        endpoint_url=w["endpoint"],
        verify=str(w["tls"].ca),
        aws_access_key_id=creds.access_key_id,
        aws_secret_access_key=creds.secret_access_key,
        aws_session_token=creds.token,
    )
    with pytest.raises(Exception, match="ExpiredToken"):
        c.list_objects_v2(Bucket="lifecycle")


def test_ca_bundle_param_grammar(world, tmp_path):
    pem = world["tls"].ca.read_text()
    assert _params(world, "s3://lifecycle/cfg/", pem).s3_ca_bundle == pem.strip("\n") + "\n"
    assert _params(world, "s3://lifecycle/cfg/", "/etc/ssl/lab-ca.pem").s3_ca_bundle
    for bad in (
        pem + "extra text\n",
        pem.replace("CERTIFICATE", "PRIVATE KEY"),
        "-----BEGIN CERTIFICATE-----\n@@@@\n-----END CERTIFICATE-----\n",
        "relative/ca.pem",
        "/etc/../ca.pem",
        "/etc/ca\n.pem",
        "-----BEGIN CERTIFICATE-----\n" + "A" * 200 + "\n-----END CERTIFICATE-----\n",
        12,
    ):
        with pytest.raises(ParamsError, match="s3_ca_bundle"):
            _params(world, "s3://lifecycle/cfg/", bad)


def test_ca_bundle_path_must_be_root_owned_and_not_writable(world, tmp_path, node_env):
    ca = tmp_path / "ca.pem"
    ca.write_text(world["tls"].ca.read_text())
    ca.chmod(0o666)
    with pytest.raises(hooks_mod.HookError, match="s3_ca_bundle.*not group/world-writable"):
        _fetch(tmp_path / "w", _params(world, "s3://lifecycle/cfg/", str(ca)))
    with pytest.raises(hooks_mod.HookError, match="s3_ca_bundle.*No such file"):
        _fetch(tmp_path / "m", _params(world, "s3://lifecycle/cfg/", str(tmp_path / "nope.pem")))
    link = tmp_path / "link.pem"
    link.symlink_to(ca)
    with pytest.raises(hooks_mod.HookError, match="s3_ca_bundle"):
        _fetch(tmp_path / "l", _params(world, "s3://lifecycle/cfg/", str(link)))


def test_credentials_that_expire_within_a_sync_are_refreshed(tmp_path, node_env, monkeypatch):
    """botocore keeps a set past its expiry (it extends sets that expire soon, and it trusts the
    Expiration it was given): the set the listing was signed with expires before the objects
    are fetched. S3 refuses the next request (ExpiredToken) once; the runner asks the metadata
    service again and the rest of the sync goes through with the new set."""
    w = node_env
    w["front"].signed.clear()
    real = hooks_mod._s3_listing

    def listing_then_expiry(*a, **kw):
        out = real(*a, **kw)
        w["clock"].offset += 61  # between the listing and the first object
        return out

    monkeypatch.setattr(hooks_mod, "_s3_listing", listing_then_expiry)
    got = _fetch(tmp_path, _params(w, "s3://lifecycle/cfg/", w["tls"].ca.read_text()))
    assert got.is_file() and (got.parent / "helper.sh").is_file()
    keys = [k for _, k, _, _ in w["front"].signed]
    assert w["front"].refused == ["ExpiredToken"], w["front"].refused
    assert len(keys) == 4 and keys[0] == keys[1] != keys[2] == keys[3], keys


def test_only_a_stale_key_is_a_clear_error(tmp_path, node_env):
    """A metadata service that serves only an expired set: S3 refuses it, a fresh ask gets the
    same set, and the error names the expiry and where to look."""
    w = node_env
    w["imds"].stale = True
    try:
        with pytest.raises(hooks_mod.HookError) as err:
            _fetch(tmp_path, _params(w, "s3://lifecycle/cfg/", w["tls"].ca.read_text()))
    finally:
        w["imds"].stale = False
    assert str(err.value) == (
        "hook lifecycle: cannot fetch s3://lifecycle/cfg/: ExpiredToken: S3 refused the instance "
        "role's credentials as expired, a fresh set from the metadata service too; check the "
        "instance's clock and its IAM role credentials (iam/security-credentials)"
    )
    assert w["front"].refused == ["ExpiredToken", "ExpiredToken"]
    assert not (tmp_path / "var/lib/nodeforge/hooks/lifecycle.d").exists()


@pytest.mark.parametrize("how", ["down", "token-refused"])
def test_metadata_service_down_or_refusing_is_a_bounded_clear_error(tmp_path, node_env, how):
    """No role credentials (the service answers nothing, or refuses every token): botocore's
    chain ends, bounded (3 tries of 2 s, _s3_client), and nothing reaches S3."""
    w = node_env
    w["front"].requests.clear()
    svc = w["imds"]
    if how == "down":
        svc.down = True
    else:
        svc.token_valid = lambda tok: False  # type: ignore[method-assign]  # the test's refusal
    t = time.monotonic()
    try:
        with pytest.raises(hooks_mod.HookError) as err:
            _fetch(tmp_path, _params(w, "s3://lifecycle/cfg/", w["tls"].ca.read_text()))
    finally:
        svc.down = False
        vars(svc).pop("token_valid", None)
    took = time.monotonic() - t
    assert str(err.value).startswith(
        "hook lifecycle: cannot fetch s3://lifecycle/cfg/: NoCredentialsError: no credentials "
        "in boto3's default chain; on a cloud instance they are its IAM role's"
    )
    assert took < 3 * 2 * 2 + 2, took
    assert w["front"].requests == []


def test_a_slow_metadata_service_ends_at_the_fetch_deadline(tmp_path, node_env, monkeypatch):
    """Each metadata answer comes in 1 s, well inside botocore's own 2 s per try, but the role
    credentials need three (token, role name, the set): the 1.5 s fetch deadline ends the
    attempt at 1.5 s, says what it was waiting for, and nothing reaches S3."""
    w = node_env
    w["front"].requests.clear()
    monkeypatch.setattr(hooks_mod, "FETCH_DEADLINE", 1.5)
    w["imds"].stall = 1.0
    t = time.monotonic()
    try:
        with pytest.raises(hooks_mod.HookError) as err:
            _fetch(tmp_path, _params(w, "s3://lifecycle/cfg/", w["tls"].ca.read_text()))
        took = time.monotonic() - t
    finally:
        w["imds"].stall = 0.0
    assert 1.5 <= took < 2.5, took
    assert w["front"].requests == []
    assert str(err.value) == (
        "hook lifecycle: cannot fetch s3://lifecycle/cfg/: not finished within 1.5s (still "
        "getting credentials from boto3's default chain: on an instance, from its metadata service)"
    )


NAMED = "s3.nodeforge-test.invalid"


def test_an_endpoint_by_name_is_verified_and_named_by_that_name(tmp_path, node_env, monkeypatch):
    """The endpoint's name is looked up through the fetch deadline (here: answered 127.0.0.1),
    but TLS still sends that name (SNI) and checks the certificate against it: a front whose
    certificate names only the address is refused, one for the name is used."""
    w = node_env
    real = socket.getaddrinfo

    def lookup(host, *a, **kw):
        return real("127.0.0.1" if host == NAMED else host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    named_tls = s3front.make_ca(tmp_path / "ca", [], [NAMED], tag="named")
    named = s3front.S3Front(w["moto_port"], named_tls, imds=w["imds"])
    try:
        got = _fetch(
            tmp_path / "ok",
            _params(w, "s3://lifecycle/cfg/", named_tls.ca.read_text(),
                    s3_endpoint_url=f"https://{NAMED}:{named.port}"),
        )  # fmt: skip
    finally:
        named.stop()
    assert got.is_file() and named.server_names and set(named.server_names) == {NAMED}
    with pytest.raises(hooks_mod.HookError, match="TLS.*s3_ca_bundle"):
        _fetch(
            tmp_path / "ip",
            _params(w, "s3://lifecycle/cfg/", w["tls"].ca.read_text(),
                    s3_endpoint_url=f"https://{NAMED}:{w['front'].port}"),
        )  # fmt: skip
    assert w["front"].requests == []


def test_front_checks_the_signature_not_only_the_key_id(node_env):
    """The S3 front recomputes SigV4 with the issued set's secret: a client holding the key id
    and token of a live set but another secret is refused, the real secret is served."""
    w = node_env
    creds = w["imds"].credentials()

    def client(secret):
        return boto3.client(
            "s3",
            endpoint_url=w["endpoint"],
            verify=str(w["tls"].ca),
            region_name="eu-west-1",
            aws_access_key_id=creds.access_key_id,
            aws_secret_access_key=secret,
            aws_session_token=creds.token,
        )

    assert client(creds.secret_access_key).list_objects_v2(Bucket="lifecycle")["KeyCount"] >= 3
    with pytest.raises(Exception, match="SignatureDoesNotMatch"):
        client(creds.secret_access_key + "x").list_objects_v2(Bucket="lifecycle")
    assert w["front"].refused == ["SignatureDoesNotMatch"]


def test_a_hook_fetched_after_the_first_set_expired_uses_a_new_set(node_env, paths, monkeypatch):
    """The VM test's c1 case on loopback, in real time: the first hook (an S3 prefix) outlives
    the set its fetch was signed with; the second hook's fetch, by the runner as at boot, is
    signed with a new set that the front accepts."""
    w = node_env
    ttl = 4
    w["admin"].put_object(
        Bucket="lifecycle", Key="slow/on_init.sh", Body=f"#!/bin/sh\nsleep {ttl + 1}\n"
    )
    w["admin"].put_object(Bucket="lifecycle", Key="second/after.sh", Body=b"#!/bin/sh\n")
    svc = IMDS(Instance(role="nf-node", cred_ttl=ttl))  # the wall clock: nothing shifted
    with svc.serve() as isrv:
        front = s3front.S3Front(w["moto_port"], w["tls_files"], imds=svc)
        try:
            monkeypatch.setenv(
                "AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{isrv.port}/"
            )
            p = parse_params(
                {
                    **HOOK_PARAMS,
                    "s3_endpoint_url": f"https://127.0.0.1:{front.port}",
                    "s3_ca_bundle": w["tls"].ca.read_text(),
                    "hooks": [
                        {
                            "uri": "s3://lifecycle/slow/",
                            "script": "on_init.sh",
                            "name": "lifecycle",
                        },
                        {"uri": "s3://lifecycle/second/after.sh", "name": "second"},
                    ],
                },
                "test",
            )
            env = hooks_mod.HookEnv("compute", "demo", "c1", "ctl", paths.params_json)
            report = hooks_mod.Runner(paths, env, grace=0.5).run_all(hooks_mod.discover(paths, p))
        finally:
            front.stop()
    assert report.ok, report.failure
    assert front.refused == []
    first = front.signed[0][1]
    late = [(t, k) for t, k, _, path in front.signed if path.startswith("/lifecycle/second/")]
    assert late and all(k != first for _, k in late), front.signed
    assert svc.expiry_of(first) <= late[0][0]
