"""s3:// hooks against an S3-compatible server on loopback (moto's server mode, a real boto3
client): a single object, HyperPod's prefix + script shape (synced, run beside its siblings),
the endpoint from params, credentials only from boto3's default chain (never params)."""

from __future__ import annotations

import hashlib
import os
import socket
import time

import pytest

boto3 = pytest.importorskip("boto3", reason="dev extra: pip install -e '.[dev]' (boto3, moto)")
moto_server = pytest.importorskip("moto.server", reason="dev extra: moto[server]")

from nodeforge.bootstrap import hooks as hooks_mod
from nodeforge.bootstrap.hooks import HookEnv, Runner, discover
from nodeforge.bootstrap.params import ParamsError
from tests.helpers import QuietHandler, http_server, unanswered_port
from tests.unit.support import hook_params

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def s3_server():
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    yield f"http://{host}:{port}"
    srv.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    # The fixture's credentials reach boto3 the way a node's do: its default chain (here the
    # environment; on EC2 the instance role through IMDSv2). Never through params.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "fixture-not-a-real-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fixture-not-a-real-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    client = boto3.client("s3", endpoint_url=s3_server)
    bucket = f"hooks-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=bucket)
    return client, bucket, s3_server


def params(endpoint, **kw):
    return hook_params(**{"s3_endpoint_url": endpoint, **kw})


def runner(paths, sleeps=None):
    env = HookEnv("compute", "demo", "c1", "ctl", paths.params_json)
    return Runner(
        paths, env, sleep=(sleeps.append if sleeps is not None else (lambda s: None)), grace=0.5
    )


def test_single_object_hook_with_sha256(s3, paths, tmp_path):
    client, bucket, endpoint = s3
    marker = tmp_path / "ran"
    body = f'#!/bin/sh\necho "$NODEFORGE_HOOK" > {marker}\n'.encode()
    client.put_object(Bucket=bucket, Key="hooks/30-s3.sh", Body=body)
    p = params(
        endpoint,
        hooks=[
            {"uri": f"s3://{bucket}/hooks/30-s3.sh", "sha256": hashlib.sha256(body).hexdigest()}
        ],
    )
    assert runner(paths).run_all(discover(paths, p)).ok
    assert marker.read_text() == "30-s3.sh\n"
    assert (paths.hook_cache / "30-s3.sh").read_bytes() == body
    # A wrong sha256 is refused and nothing is replaced.
    bad = params(endpoint, hooks=[{"uri": f"s3://{bucket}/hooks/30-s3.sh", "sha256": "0" * 64}])
    marker.unlink()
    res = runner(paths).run_all(discover(paths, bad)).failure
    assert res.status == "refused" and res.reason == "hook 30-s3.sh sha256 mismatch (not run)"
    assert not marker.exists()


def test_prefix_and_script_runs_beside_its_siblings(s3, paths, tmp_path):
    """HyperPod's SourceS3Uri + OnCreate: the prefix is synced, the script runs in it."""
    client, bucket, endpoint = s3
    out = tmp_path / "out"
    client.put_object(
        Bucket=bucket,
        Key="lifecycle/on_create.sh",
        Body=(
            f"#!/bin/bash\nset -e\nbash ./utils/add_users.sh > {out}\ncat config.json >> {out}\n"
            f"pwd >> {out}\n"
        ).encode(),
    )
    client.put_object(Bucket=bucket, Key="lifecycle/utils/add_users.sh", Body=b"echo users-ok\n")
    client.put_object(Bucket=bucket, Key="lifecycle/config.json", Body=b'{"k": 1}\n')
    client.put_object(Bucket=bucket, Key="lifecycle/", Body=b"")  # console "folder" marker
    client.put_object(Bucket=bucket, Key="other/not-synced.sh", Body=b"exit 1\n")
    p = params(
        endpoint,
        hooks=[
            {"uri": f"s3://{bucket}/lifecycle/", "script": "on_create.sh", "name": "60-lifecycle"}
        ],
    )
    hooks = discover(paths, p)
    assert [h.name for h in hooks] == ["60-lifecycle"]
    assert runner(paths).run_all(hooks).ok, (paths.hooks_log_dir / "60-lifecycle.log").read_text()
    synced = paths.hook_cache / "60-lifecycle.d"
    assert out.read_text() == f'users-ok\n{{"k": 1}}\n{synced}\n'
    assert sorted(str(p.relative_to(synced)) for p in synced.rglob("*") if p.is_file()) == [
        "config.json",
        "on_create.sh",
        "utils/add_users.sh",
    ]
    # A re-sync replaces the copy whole: an object deleted upstream is gone locally.
    client.delete_object(Bucket=bucket, Key="lifecycle/config.json")
    client.put_object(Bucket=bucket, Key="lifecycle/on_create.sh", Body=b"#!/bin/sh\ntrue\n")
    assert runner(paths).run_all(discover(paths, p)).ok
    assert not (synced / "config.json").exists()
    assert [x.name for x in paths.hook_cache.iterdir() if x.name.startswith(".")] == []


def test_prefix_without_the_script_or_with_unsafe_keys(s3, paths):
    client, bucket, endpoint = s3
    client.put_object(Bucket=bucket, Key="lc/other.sh", Body=b"true\n")
    p = params(endpoint, hooks=[{"uri": f"s3://{bucket}/lc/", "script": "on_create.sh"}])
    res = runner(paths).run_all(discover(paths, p)).failure
    assert res.status == "fetch-failed"
    assert (
        res.reason == "hook on_create.sh could not be fetched: "
        f"s3://{bucket}/lc/ has no 'on_create.sh' (found 1 objects)"
    )
    client.put_object(Bucket=bucket, Key="lc2/on_create.sh", Body=b"#!/bin/sh\ntrue\n")
    client.put_object(Bucket=bucket, Key="lc2/a/../../escape.sh", Body=b"true\n")
    p = params(endpoint, hooks=[{"uri": f"s3://{bucket}/lc2/", "script": "on_create.sh"}])
    res = runner(paths).run_all(discover(paths, p)).failure
    assert (
        f"s3://{bucket}/lc2/a/../../escape.sh: key: 'a/../../escape.sh' is not a safe" in res.reason
    )
    assert res.reason.endswith("; refused")
    assert not (paths.hook_cache / "on_create.sh.d").exists()
    assert not (paths.hook_cache.parent / "escape.sh").exists()


@pytest.mark.parametrize("order", [("a", "a/b"), ("a/b", "a")])
def test_prefix_with_a_key_that_is_also_a_folder_is_a_clear_error(s3, paths, order):
    """`lc/a` and `lc/a/b` cannot both be files on the node: this crashed the runner with an
    OSError traceback half-way through the sync. Now refused from the listing, before any
    object is fetched, naming both keys; the previous copy stays as it was."""
    client, bucket, endpoint = s3
    client.put_object(Bucket=bucket, Key="lc/on_create.sh", Body=b"#!/bin/sh\ntrue\n")
    p = params(endpoint, hooks=[{"uri": f"s3://{bucket}/lc/", "script": "on_create.sh"}])
    assert runner(paths).run_all(discover(paths, p)).ok
    for key in order:
        client.put_object(Bucket=bucket, Key=f"lc/{key}", Body=b"x\n")
    res = runner(paths).run_all(discover(paths, p)).failure
    assert res is not None and res.status == "fetch-failed"
    assert res.reason == (
        f"hook on_create.sh could not be fetched: s3://{bucket}/lc/a is both an object and the "
        f"folder of s3://{bucket}/lc/a/b; a file and a directory cannot share a name on the "
        "node: rename or delete one of them"
    )
    synced = paths.hook_cache / "on_create.sh.d"
    assert sorted(x.name for x in synced.iterdir()) == ["on_create.sh"]  # the old copy, whole
    assert [x.name for x in paths.hook_cache.iterdir() if x.name.startswith(".")] == []


class _DripS3(QuietHandler):
    """An S3-compatible endpoint whose object body arrives one byte every 0.1 s: each read is
    well inside boto3's read_timeout, the whole is not."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "60")
        self.send_header("Content-Type", "binary/octet-stream")
        self.end_headers()
        try:
            for _ in range(60):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass


def test_a_dripping_s3_body_ends_at_the_fetch_deadline(s3, paths, monkeypatch):
    monkeypatch.setattr(hooks_mod, "FETCH_DEADLINE", 0.5)
    with http_server(_DripS3) as endpoint:
        p = params(endpoint, hooks=["s3://bucket/drip.sh"])
        t = time.monotonic()
        res = runner(paths).run_all(discover(paths, p)).failure
        took = time.monotonic() - t
    assert took < 3, took
    assert res is not None and res.reason == (
        "hook drip.sh could not be fetched: cannot fetch s3://bucket/drip.sh: "
        "not finished within 0.5s"
    )
    assert not (paths.hook_cache / "drip.sh").exists()


_LISTING = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>bucket</Name>'
    "<Prefix>lc/</Prefix><KeyCount>3</KeyCount><MaxKeys>1000</MaxKeys>"
    "<IsTruncated>false</IsTruncated>"
    + "".join(f"<Contents><Key>lc/{k}</Key><Size>8</Size></Contents>" for k in ("a", "b", "c.sh"))
    + "</ListBucketResult>"
).encode()


def _slow_s3(*, listing_delay: float = 0.0, header_delay: float = 0.0, object_delay: float = 0.0,
             http10: bool = False):  # fmt: skip
    """A hostile S3-compatible endpoint (test fixture): answers ListObjectsV2 for prefix lc/
    with objects a, b, c.sh; the listing's body, an object's status line and headers, or an
    object's body arrive one byte every *_delay seconds. Each read is well inside boto3's
    read_timeout (60 s); only a bound on the whole fetch ends it."""

    class Slow(QuietHandler):
        protocol_version = "HTTP/1.0" if http10 else "HTTP/1.1"

        def _drip(self, data: bytes, delay: float) -> None:
            end = time.monotonic() + 6  # then hang up: a client without the bound fails fast
            for i in range(len(data)):
                if time.monotonic() > end:
                    self.close_connection = True
                    return
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
                time.sleep(delay)

        def do_GET(self):
            try:
                if "list-type=2" in self.path:
                    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(_LISTING)}\r\n\r\n"
                    self.wfile.write(head.encode())
                    return self._drip(_LISTING, listing_delay)
                body = b"#!/bin/sh\n"
                head = (
                    "HTTP/1.1 200 OK\r\nContent-Type: binary/octet-stream\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode()
                self._drip(head, header_delay) if header_delay else self.wfile.write(head)
                self._drip(body, object_delay)
            except OSError:
                pass  # the client hung up at its deadline

    return Slow


@pytest.mark.parametrize(
    "server, hook, bound",
    [
        # the listing's body drips one byte per second (a server that closes after each answer:
        # http.client has let go of the connection's socket while the listing is read)
        (_slow_s3(listing_delay=1.0, http10=True), {"uri": "s3://bucket/lc/", "script": "c.sh"}, 2),
        # an object's status line and headers drip one byte per second (inside botocore's call)
        (_slow_s3(header_delay=1.0), "s3://bucket/lc/a", 2),
        # each object alone is inside the bound (0.6 s), all three are not: one deadline covers
        # the listing and every object of a prefix, not each request on its own
        (_slow_s3(object_delay=0.06), {"uri": "s3://bucket/lc/", "script": "c.sh"}, 1.5),
    ],
    ids=["listing-body", "object-headers", "prefix-sum"],
)
def test_every_s3_fetch_is_bounded_as_a_whole(s3, paths, monkeypatch, server, hook, bound):
    monkeypatch.setattr(hooks_mod, "FETCH_DEADLINE", bound)
    with http_server(server) as endpoint:
        p = params(endpoint, hooks=[hook])
        t = time.monotonic()
        res = runner(paths).run_all(discover(paths, p)).failure
        took = time.monotonic() - t
    uri = hook["uri"] if isinstance(hook, dict) else hook
    assert res is not None and res.status == "fetch-failed"
    name = res.name
    assert res.reason == (
        f"hook {name} could not be fetched: cannot fetch {uri}: not finished within {bound:g}s"
    )
    assert bound <= took < bound + 2, took
    assert [x.name for x in paths.hook_cache.iterdir() if x.name != "s3-ca-bundle.pem"] == []


SLOW_HOST = "s3.nodeforge-test.invalid"


def test_a_hanging_name_lookup_of_the_endpoint_ends_at_the_fetch_deadline(s3, paths, monkeypatch):
    """getaddrinfo has no timeout (the resolver's own bound can be long): a lookup of the S3
    endpoint's name that hangs 4 s ends at the 1 s deadline, with an error naming the host."""
    monkeypatch.setattr(hooks_mod, "FETCH_DEADLINE", 1)
    real = socket.getaddrinfo

    def hanging(host, *a, **kw):
        if host == SLOW_HOST:
            time.sleep(4)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    (hook,) = discover(paths, params(f"https://{SLOW_HOST}", hooks=["s3://bucket/x.sh"]))
    t = time.monotonic()
    with pytest.raises(hooks_mod.HookError) as err:
        hooks_mod.fetch(hook, paths.hook_cache)
    took = time.monotonic() - t
    assert 1 <= took < 1.8, took
    assert str(err.value) == (
        f"hook x.sh: cannot fetch s3://bucket/x.sh: not finished within 1s (still looking up "
        f"{SLOW_HOST})"
    )


def test_a_connect_timeout_is_not_called_the_deadline(s3, paths, monkeypatch):
    """An endpoint that drops SYNs: each connect ends at its own timeout, botocore retries as
    it does, and the error is its connect timeout; the fetch deadline (far off) is not named."""
    monkeypatch.setattr(hooks_mod, "FETCH_DEADLINE", 30)
    monkeypatch.setattr(hooks_mod, "S3_CONNECT_TIMEOUT", 0.3)
    with unanswered_port() as (host, port):
        endpoint = f"https://{host}:{port}"
        (hook,) = discover(paths, params(endpoint, hooks=["s3://bucket/x.sh"]))
        t = time.monotonic()
        with pytest.raises(hooks_mod.HookError) as err:
            hooks_mod.fetch(hook, paths.hook_cache)
        took = time.monotonic() - t
    assert str(err.value) == (
        "hook x.sh: cannot fetch s3://bucket/x.sh: ConnectTimeoutError: Connect timeout on "
        f'endpoint URL: "{endpoint}/bucket/x.sh"'
    )
    assert took < 10, took


def test_missing_object_is_a_retried_fetch_failure(s3, paths):
    _, bucket, endpoint = s3
    sleeps: list[float] = []
    p = params(endpoint, hooks=[{"uri": f"s3://{bucket}/nope.sh", "retries": 2}])
    res = runner(paths, sleeps).run_all(discover(paths, p)).failure
    assert res.status == "fetch-failed" and res.attempts == 3 and sleeps == [2.0, 4.0]
    assert "NoSuchKey" in res.reason and res.reason.endswith("after 3 attempts")


def test_credentials_never_from_params(s3, paths, monkeypatch):
    _, bucket, endpoint = s3
    with pytest.raises(ParamsError, match="aws_access_key_id: unknown key"):
        params(endpoint, aws_access_key_id="AKIA-not-real")
    # Without credentials in boto3's chain the fetch fails; params cannot fill the gap.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    p = params(endpoint, hooks=[f"s3://{bucket}/x.sh"])
    res = runner(paths).run_all(discover(paths, p)).failure
    assert res.status == "fetch-failed" and "NoCredentialsError" in res.reason


@pytest.mark.parametrize(
    "url, ok",
    [
        ("https://s3.eu-west-1.amazonaws.com", True),
        ("https://minio.internal:9000/", True),
        ("http://127.0.0.1:9000", True),
        ("http://[::1]:9000", True),
        ("http://s3.example.com", False),  # plain http off this machine
        ("https://s3.example.com/\n", False),
        ("https://s3.example.com/path", False),
        ("ftp://s3.example.com", False),
        ("https://user:pw@s3.example.com", False),
    ],
)
def test_endpoint_grammar(url, ok):
    if ok:
        assert params(url).s3_endpoint_url == url.rstrip("/")
    else:
        with pytest.raises(ParamsError, match="s3_endpoint_url"):
            params(url)


def test_script_only_with_a_prefix():
    with pytest.raises(ParamsError, match=r"hooks\[0\]\.script: only with an s3:// prefix"):
        params(None, hooks=[{"uri": "s3://b/x.sh", "script": "x.sh"}])
    with pytest.raises(ParamsError, match=r"hooks\[0\]\.script: 's3://b/lc/' is a prefix"):
        params(None, hooks=["s3://b/lc/"])
    with pytest.raises(ParamsError, match=r"hooks\[0\]\.script: '\.\.' is not a file name"):
        params(None, hooks=[{"uri": "s3://b/lc/", "script": ".."}])
