"""Params and the admin SSH key from a metadata service that behaves as EC2's IMDSv2
(lab/imds.py, a real server on loopback): the happy path, and each bad input a clear error or
the next source within a bounded time (wrong token, a proxy in the path, the service down)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from nodeforge.bootstrap import identity
from nodeforge.bootstrap.params import is_node_name
from nodeforge.bootstrap.params_sources import SourceConfig, load_params, node_name_from_hostname
from nodeforge.bootstrap.paths import Paths
from nodeforge.errors import NodeforgeError
from nodeforge.lab.imds import IMDS, Instance
from tests.unit.support import MUNGE_KEY as MUNGE

pytestmark = pytest.mark.unit

ADMIN = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKz0wGwRrZ6Oq2Zx9m1e8yq0kQ5rFJ1dJYqk7pL0aB1c admin@lab"
USER_DATA = json.dumps(
    {
        "nodeforge": {
            "role": "compute",
            "cluster_name": "cloud",
            "controller": "10.9.0.2",
            "munge_key": MUNGE,
        }
    }
).encode()


@pytest.fixture
def served():
    svc = IMDS(Instance(user_data=USER_DATA, public_keys=[("admin", ADMIN)], role="r"))
    srv = svc.serve()
    yield svc, f"http://127.0.0.1:{srv.port}"
    srv.stop()


def cfg(tmp_path, url, **kw):
    return SourceConfig(Paths.under(tmp_path), imds_url=url, imds_guarded=lambda: True, **kw)


def test_params_and_admin_key_from_imdsv2(tmp_path, served):
    svc, url = served
    got = load_params(cfg(tmp_path, url))
    assert got.source == "imds" and got.params.cluster_name == "cloud"
    assert got.ssh_keys == (ADMIN,)
    assert [(m, p) for m, p, _ in svc.log][:2] == [
        ("PUT", "/latest/api/token"),
        ("GET", "/latest/user-data"),
    ]
    paths = Paths.under(tmp_path)
    auth = paths.root_ssh / "authorized_keys"
    auth.parent.mkdir(parents=True)
    auth.write_text(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOtherOtherOtherOtherOtherOtherOtherOther x\n"
    )
    assert identity.install_admin_keys(paths, got.ssh_keys) == [ADMIN]
    assert identity.install_admin_keys(paths, got.ssh_keys) == []  # once: no duplicate
    lines = auth.read_text().splitlines()
    assert lines[1] == ADMIN and len(lines) == 2
    assert auth.stat().st_mode & 0o777 == 0o600
    assert paths.root_ssh.stat().st_mode & 0o777 == 0o700


def test_hostile_public_key_is_refused_and_written_nowhere(tmp_path, served):
    svc, url = served
    svc.instance.public_keys = [("admin", ADMIN + '\ncommand="sh" ssh-rsa AAAA')]
    with pytest.raises(NodeforgeError, match="public-keys/0/openssh-key: not one OpenSSH"):
        load_params(cfg(tmp_path, url))
    assert not (Paths.under(tmp_path).root_ssh / "authorized_keys").exists()


def test_authorized_keys_symlink_is_refused(tmp_path):
    paths = Paths.under(tmp_path)
    paths.root_ssh.mkdir(parents=True)
    (paths.root_ssh / "authorized_keys").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NodeforgeError, match="not a regular file"):
        identity.install_admin_keys(paths, (ADMIN,))
    assert not (tmp_path / "elsewhere").exists()


def test_wrong_token_is_a_clear_error(tmp_path, served):
    svc, url = served
    svc.token_valid = lambda tok: False  # type: ignore[method-assign]  # the service forgot it
    with pytest.raises(NodeforgeError, match=r"IMDS user-data .*HTTP 401.*token was refused"):
        load_params(cfg(tmp_path, url))


class _Proxy(BaseHTTPRequestHandler):
    """A forwarding proxy between the agent and IMDS, as a container bridge or an HTTP proxy
    would be: it adds X-Forwarded-For, so the token PUT is refused (the hop limit)."""

    upstream = 0

    def _fwd(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
        c = http.client.HTTPConnection("127.0.0.1", self.upstream, timeout=5)
        hdrs = dict(self.headers.items()) | {"X-Forwarded-For": self.client_address[0]}
        c.request(self.command, self.path, body=body or None, headers=hdrs)
        r = c.getresponse()
        data = r.read()
        self.send_response(r.status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = _fwd

    def log_message(self, *a):
        pass


def test_token_through_a_proxy_hop_limit_is_a_clear_error(tmp_path, served):
    _svc, url = served
    handler = type("P", (_Proxy,), {"upstream": int(url.rsplit(":", 1)[1])})
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=proxy.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(NodeforgeError, match="HTTP 403.*hop limit"):
            load_params(cfg(tmp_path, f"http://127.0.0.1:{proxy.server_address[1]}"))
    finally:
        proxy.shutdown()
        proxy.server_close()


@pytest.mark.parametrize("how", ["stopped", "silent"])
def test_service_down_is_bounded_then_the_next_source(tmp_path, how):
    svc = IMDS(Instance(user_data=USER_DATA))
    srv = svc.serve()
    url = f"http://127.0.0.1:{srv.port}"
    if how == "stopped":
        srv.stop()
    else:
        svc.down = True  # accepts, then closes without an answer
    try:
        t = time.monotonic()
        with pytest.raises(NodeforgeError, match="no node params found"):
            load_params(cfg(tmp_path, url, imds_timeout=0.5))
        assert time.monotonic() - t < 3
        # the next source, HyperPod's files, is used when they are there
        paths = Paths.under(tmp_path)
        paths.hyperpod_resource_config.parent.mkdir(parents=True)
        paths.hyperpod_resource_config.write_text(json.dumps({"InstanceGroups": [
            {"Name": "ctl", "Instances": [{"InstanceName": "c", "CustomerIpAddress": "10.9.0.2"}]},
            {"Name": "w", "Instances": [{"InstanceName": "n", "CustomerIpAddress": "10.9.0.5"}]},
        ]}))  # fmt: skip
        paths.hyperpod_provisioning_parameters.write_text(json.dumps(
            {"version": "1.0.0", "workload_manager": "slurm", "controller_group": "ctl",
             "worker_groups": [{"instance_group_name": "w", "partition_name": "dev"}],
             "nodeforge": {"munge_key_file": "/etc/nodeforge/secrets/munge.key"}}
        ))  # fmt: skip
        got = load_params(cfg(tmp_path, url, imds_timeout=0.5, own_addresses=lambda: ["10.9.0.5"]))
        assert got.source == "hyperpod" and got.params.features == ("dev",)
    finally:
        if how != "stopped":
            srv.stop()


def test_slow_first_answer_gets_a_second_bounded_try(tmp_path, served):
    svc, url = served
    real = svc.answer
    calls = []

    def slow_once(method, path, headers):
        calls.append(path)
        if len(calls) == 1:
            time.sleep(0.8)  # past the 0.5 s timeout: the agent's first try gives up
        return real(method, path, headers)

    svc.answer = slow_once  # type: ignore[method-assign]
    t = time.monotonic()
    got = load_params(cfg(tmp_path, url, imds_timeout=0.5))
    assert got.source == "imds"
    assert calls[:2] == ["/latest/api/token", "/latest/api/token"]
    assert time.monotonic() - t < 0.5 * 4 + 1


def test_node_name_from_imds_local_hostname_when_params_give_none(tmp_path, served):
    svc, url = served
    got = load_params(cfg(tmp_path, url))
    assert got.params.node_name == "ip-169-254-169-15"  # local-hostname's first label
    assert ("GET", "/latest/meta-data/local-hostname", 200) in svc.log
    # A node_name in user-data wins, and the hostname is not asked for.
    svc.instance.user_data = json.dumps(
        {"nodeforge": json.loads(USER_DATA)["nodeforge"] | {"node_name": "gpu7"}}
    ).encode()
    svc.log.clear()
    assert load_params(cfg(tmp_path, url)).params.node_name == "gpu7"
    assert not [p for _, p, _ in svc.log if p.endswith("hostname")]


@pytest.mark.parametrize(
    "hostname",
    [
        "",
        "-bad.eu-west-1.compute.internal",
        "ip_10_0_0_5.internal",
        "1234.internal",
        "0x1f.internal",
        "localhost",
        "ip-10-0-0-5.\nevil",
        "ip-10-0-0-5..internal",
        "a" * 64 + ".internal",
        "ip-10-0-0-5.internal\x00",
    ],
)
def test_hostile_imds_hostname_is_a_clear_error(tmp_path, served, hostname):
    svc, url = served
    svc.instance.hostname = hostname
    with pytest.raises(NodeforgeError, match=r"^IMDS local-hostname: .*set node_name in user-data"):
        load_params(cfg(tmp_path, url))


@settings(max_examples=300, deadline=None)
@given(hst.text(max_size=300))
def test_hostname_parser_never_crashes(text):
    """Fuzz: any text is a usable node name (a label of it) or an error naming the source."""
    try:
        name = node_name_from_hostname(text, "IMDS hostname")
    except NodeforgeError as exc:
        assert str(exc).startswith("IMDS hostname: ")
    else:
        assert is_node_name(name) and text.strip().startswith(name)
