"""Params: validation (errors name the field) and every source, incl. IMDSv2 on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import socket
import time
from typing import ClassVar

import pytest

from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.bootstrap.params_sources import (
    SourceConfig,
    hyperpod_params,
    imds_user_data,
    load_params,
    params_from_user_data,
    parse_cmdline,
)
from nodeforge.bootstrap.paths import Paths
from nodeforge.errors import NodeforgeError
from tests.conftest import make_keypair
from tests.helpers import QuietHandler, http_server
from tests.unit.support import MUNGE_KEY as KEY

pytestmark = pytest.mark.unit

SHA = "a" * 64


def base(**kw):
    d = {"role": "compute", "cluster_name": "demo", "controller": "ctl(10.9.0.2)", "munge_key": KEY}
    d.update(kw)
    return d


# -- validation ------------------------------------------------------------------------------
def test_minimal_compute_and_defaults():
    p = parse_params(base(features="gpu,nvme", gres=["gpu:2"]), "node.yaml")
    assert p.role == "compute" and p.controller.host == "ctl" and p.controller.address == "10.9.0.2"
    assert p.features == ("gpu", "nvme") and p.gres == ("gpu:2",)
    assert p.partitions[0].name == "main" and p.partitions[0].default
    assert p.hook_timeout == 600 and p.accounting is True
    assert p.munge_key_bytes() == b"k" * 64


@pytest.mark.parametrize(
    "patch, msg",
    [
        (
            {"hooks": [{"uri": "file:///a"}, {"uri": "file:///b", "sha256": "abc"}]},
            "node.yaml: hooks[1].sha256: expected 64 hex chars",
        ),
        ({"role": "worker"}, "node.yaml: role: 'worker' is not one of controller, compute, login"),
        ({"colour": "blue"}, "node.yaml: colour: unknown key"),
        ({"cpus": "4"}, "node.yaml: cpus: expected an integer, got str"),
        ({"cpus": True}, "node.yaml: cpus: expected an integer, got bool"),
        ({"accounting": "yes"}, "node.yaml: accounting: expected true or false, got str"),
        ({"munge_key": "%%%"}, "node.yaml: munge_key: not valid base64"),
        (
            {"munge_key": base64.b64encode(b"short").decode()},
            "node.yaml: munge_key: decodes to 5 bytes",
        ),
        (
            {"hooks": [{"uri": "ftp://x/y"}]},
            "node.yaml: hooks[0].uri: 'ftp://x/y': scheme must be one of",
        ),
        (
            {"hooks": [{"uri": "file:///a", "timeout": -1}]},
            "node.yaml: hooks[0].timeout: -1 out of range (0, 86400] seconds",
        ),
        ({"hooks": [{"uri": "file:///a", "bogus": 1}]}, "node.yaml: hooks[0].bogus: unknown key"),
        (
            {"partitions": [{"name": "a"}, {"name": "a"}]},
            "node.yaml: partitions[1].name: duplicate",
        ),
        ({"controller": {"host": "ctl", "port": 1}}, "node.yaml: controller.port: unknown key"),
        ({"cluster_name": "Demo!"}, "node.yaml: cluster_name: 'Demo!' is not a cluster name"),
        (
            {"users_keypair": {"public": "ssh-ed25519 AAA"}},
            "node.yaml: users_keypair.private: missing",
        ),
        ({"extra": [1]}, "node.yaml: extra: expected a mapping, got list"),
        ({"node_address": "ctl"}, "node.yaml: node_address: 'ctl' is not an IP address"),
    ],
)
def test_errors_name_the_field(patch, msg):
    with pytest.raises(ParamsError) as ei:
        parse_params(base(**patch), "node.yaml")
    assert msg in str(ei.value)


def test_compute_needs_controller_controller_does_not():
    d = base()
    del d["controller"]
    with pytest.raises(ParamsError, match="controller: missing"):
        parse_params(d, "x")
    p = parse_params({**d, "role": "controller"}, "x")
    assert p.controller.host == "" and p.role == "controller"


def test_public_dict_has_no_secrets(tmp_path):
    public, private = make_keypair(tmp_path)
    kp = {"public": public, "private": private}
    p = parse_params(base(users_keypair=kp, extra={"users": ["a,1001,/home/a"]}), "x")
    text = json.dumps(p.public_dict())
    assert KEY not in text and "BEGIN OPENSSH" not in text
    assert public in text and "a,1001,/home/a" in text


def test_hook_sha_lowercased_and_name():
    p = parse_params(
        base(hooks=[{"uri": "https://h/x/20-users.sh", "sha256": SHA.upper(), "retries": 0}]), "x"
    )
    assert p.hooks[0].sha256 == SHA and p.hooks[0].retries == 0


# -- node.yaml + first found wins ------------------------------------------------------------
def _cfg(tmp_path, **kw):
    return SourceConfig(Paths.under(tmp_path), imds_url=kw.pop("imds_url", None), **kw)


def test_file_source_wins(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.paths.node_yaml.parent.mkdir(parents=True)
    cfg.paths.node_yaml.write_text(json.dumps(base()))
    cfg.paths.node_yaml.chmod(0o600)
    cfg.paths.cmdline.parent.mkdir(parents=True)
    cfg.paths.cmdline.write_text(
        "quiet nodeforge.role=login nodeforge.cluster=other nodeforge.controller=x"
    )
    got = load_params(cfg)
    assert got.source.startswith("file:") and got.params.role == "compute"


def test_invalid_file_is_an_error_not_a_fallthrough(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.paths.node_yaml.parent.mkdir(parents=True)
    cfg.paths.node_yaml.write_text(
        "role: compute\ncluster_name: demo\ncontroller: c\nhooks: [{uri: 'file:///a', sha256: xyz}]\n"
    )
    cfg.paths.cmdline.parent.mkdir(parents=True)
    cfg.paths.cmdline.write_text("nodeforge.role=login nodeforge.cluster=x nodeforge.controller=c")
    with pytest.raises(ParamsError) as ei:
        load_params(cfg)
    assert str(ei.value).startswith(
        f"{cfg.paths.node_yaml}: hooks[0].sha256: expected 64 hex chars"
    )


def test_bad_yaml(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.paths.node_yaml.parent.mkdir(parents=True)
    cfg.paths.node_yaml.write_text("role: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(cfg)


def test_nothing_found(tmp_path):
    with pytest.raises(NodeforgeError, match="no node params found"):
        load_params(_cfg(tmp_path))


# -- kernel command line ---------------------------------------------------------------------
def test_cmdline_source(tmp_path):
    cfg = _cfg(tmp_path)
    extra = tmp_path / "more.yaml"
    extra.write_text(f"munge_key: {KEY}\nhook_timeout: 30\nfeatures: [old]\n")
    extra.chmod(0o600)  # root-only: may carry the munge key
    cfg.paths.cmdline.parent.mkdir(parents=True)
    cfg.paths.cmdline.write_text(
        "BOOT_IMAGE=/vmlinuz root=/dev/vda1 ro nodeforge.role=compute nodeforge.cluster=demo "
        f"nodeforge.controller=ctl(10.9.0.2) nodeforge.features=gpu,ib nodeforge.cpus=8 "
        f"nodeforge.params=file://{extra}\n"
    )
    got = load_params(cfg)
    p = got.params
    assert got.source == "cmdline"
    assert (
        p.features == ("gpu", "ib") and p.cpus == 8 and p.hook_timeout == 30 and p.munge_key == KEY
    )


def test_cmdline_errors_name_the_key(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.paths.cmdline.parent.mkdir(parents=True)
    cfg.paths.cmdline.write_text(
        "nodeforge.role=compute nodeforge.cluster=demo nodeforge.controller=c nodeforge.cpus=many"
    )
    with pytest.raises(
        ParamsError, match=r"kernel command line: nodeforge.cpus: expected an integer"
    ):
        load_params(cfg)
    assert parse_cmdline("a=b nodeforge.node=n1 x") == {"node_name": "n1"}


# -- user-data / IMDSv2 ----------------------------------------------------------------------
class _Imds(QuietHandler):
    user_data: bytes | None = b""
    token = "tok-123"
    seen: ClassVar[list] = []

    def do_PUT(self):
        self.seen.append(
            ("PUT", self.path, self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"))
        )
        if self.path != "/latest/api/token" or not self.headers.get(
            "X-aws-ec2-metadata-token-ttl-seconds"
        ):
            return self.send(400)
        self.send(200, self.token.encode())

    def do_GET(self):
        self.seen.append(("GET", self.path, self.headers.get("X-aws-ec2-metadata-token")))
        if self.headers.get("X-aws-ec2-metadata-token") != self.token:
            return self.send(401)
        if self.user_data is None or self.path != "/latest/user-data":
            return self.send(404)
        self.send(200, self.user_data)


@pytest.fixture
def imds():
    handler = type("H", (_Imds,), {"seen": [], "user_data": b""})
    with http_server(handler) as url:
        yield handler, url


def test_imds_token_flow(tmp_path, imds):
    handler, url = imds
    handler.user_data = (
        "#cloud-config\npackages: []\nnodeforge:\n"
        + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in base(role="login").items())
    ).encode()
    got = load_params(_cfg(tmp_path, imds_url=url, imds_guarded=lambda: True))
    assert got.source == "imds" and got.params.role == "login"
    assert handler.seen[0] == ("PUT", "/latest/api/token", "21600")
    assert handler.seen[1] == ("GET", "/latest/user-data", "tok-123")


def test_imds_no_user_data_and_foreign_user_data(tmp_path, imds):
    handler, url = imds
    handler.user_data = None  # 404
    assert imds_user_data(url) is None
    handler.user_data = b"#!/bin/bash\necho hi\n"
    with pytest.raises(NodeforgeError, match="no node params found"):
        load_params(_cfg(tmp_path, imds_url=url))


def test_imds_invalid_params_name_the_field(tmp_path, imds):
    handler, url = imds
    handler.user_data = json.dumps({"nodeforge": base(max_node_count=0)}).encode()
    with pytest.raises(
        ParamsError, match=r"EC2 user-data \(IMDSv2\) nodeforge: max_node_count: 0 out of range"
    ):
        load_params(_cfg(tmp_path, imds_url=url, imds_guarded=lambda: True))


def test_absent_imds_times_out_fast():
    # A listener that never accepts/answers: the connection is queued but no reply ever comes.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    try:
        t = time.monotonic()
        assert imds_user_data(f"http://127.0.0.1:{s.getsockname()[1]}", timeout=0.3) is None
        assert time.monotonic() - t < 2.0
    finally:
        s.close()
    # And nothing listening at all: refused, immediately.
    s2 = socket.socket()
    s2.bind(("127.0.0.1", 0))
    port = s2.getsockname()[1]
    s2.close()
    t = time.monotonic()
    assert imds_user_data(f"http://127.0.0.1:{port}", timeout=1.0) is None
    assert time.monotonic() - t < 1.5


def test_cloud_init_copy_used_before_imds(tmp_path):
    cfg = _cfg(tmp_path, imds_url="http://127.0.0.1:9", imds_guarded=lambda: True)
    cfg.paths.cloud_init_user_data.parent.mkdir(parents=True)
    cfg.paths.cloud_init_user_data.write_text(json.dumps({"nodeforge": base()}))
    assert load_params(cfg).source == "cloud-init"


def test_user_data_shapes():
    assert params_from_user_data("role: compute\ncluster_name: x\n", "u") == {
        "role": "compute",
        "cluster_name": "x",
    }
    assert params_from_user_data("#cloud-config\nruncmd: [ls]\n", "u") is None
    assert params_from_user_data("", "u") is None
    with pytest.raises(ParamsError, match="u: nodeforge: expected a mapping"):
        params_from_user_data("nodeforge: 3\n", "u")


# -- HyperPod ----------------------------------------------------------------------------------
PP = {
    "version": "1.0.0",
    "workload_manager": "slurm",
    "controller_group": "controller-machine",
    "login_group": "my-login-group",
    "worker_groups": [
        {"instance_group_name": "compute-nodes", "partition_name": "dev"},
        {"instance_group_name": "gpu-nodes", "partition_name": "gpu"},
    ],
    "fsx_dns_name": "fs-1.fsx.example",
    "fsx_mountname": "abc",
    "nodeforge": {"munge_key_file": "/opt/ml/config/munge.key", "hook_timeout": 120},
}
RC = {
    "ClusterConfig": {"ClusterArn": "arn:aws:sagemaker:x", "ClusterName": "c"},
    "InstanceGroups": [
        {
            "Name": "controller-machine",
            "InstanceType": "ml.c5.xlarge",
            "Instances": [
                {
                    "InstanceName": "ip-10-1-0-10",
                    "CustomerIpAddress": "10.1.0.10",
                    "AgentIpAddress": "172.16.0.1",
                }
            ],
        },
        {
            "Name": "my-login-group",
            "Instances": [{"InstanceName": "ip-10-1-0-20", "CustomerIpAddress": "10.1.0.20"}],
        },
        {
            "Name": "compute-nodes",
            "Instances": [{"InstanceName": "ip-10-1-0-31", "CustomerIpAddress": "10.1.0.31"}],
        },
        {
            "Name": "gpu-nodes",
            "Instances": [{"InstanceName": "ip-10-1-0-41", "CustomerIpAddress": "10.1.0.41"}],
        },
    ],
}


@pytest.mark.parametrize(
    "addr, role, features",
    [
        ("10.1.0.10", "controller", ()),
        ("10.1.0.20", "login", ()),
        ("10.1.0.31", "compute", ("dev",)),
        ("10.1.0.41", "compute", ("gpu",)),
    ],
)
def test_hyperpod_mapping(addr, role, features):
    d = hyperpod_params(RC, PP, {addr}, "whatever", "rc", "pp")
    p = parse_params(d, "pp")
    assert p.role == role and p.features == features
    assert p.controller.address == "10.1.0.10"
    assert p.munge_key_file == "/opt/ml/config/munge.key" and p.hook_timeout == 120
    assert p.extra["hyperpod"]["fsx_dns_name"] == "fs-1.fsx.example"
    if role == "controller":
        assert [x.name for x in p.partitions] == ["dev", "gpu"] and p.partitions[0].default


def test_hyperpod_by_hostname_and_files(tmp_path):
    cfg = _cfg(tmp_path, own_addresses=lambda: ["192.0.2.1"], hostname=lambda: "ip-10-1-0-31")
    cfg.paths.hyperpod_resource_config.parent.mkdir(parents=True)
    cfg.paths.hyperpod_resource_config.write_text(json.dumps(RC))
    cfg.paths.hyperpod_provisioning_parameters.write_text(json.dumps(PP))
    got = load_params(cfg)
    assert got.source == "hyperpod" and got.params.role == "compute"


def test_hyperpod_errors():
    with pytest.raises(ParamsError, match="rc: this node .* is in no instance group"):
        hyperpod_params(RC, PP, {"10.9.9.9"}, "nope", "rc", "pp")
    with pytest.raises(ParamsError, match="pp: controller_group: missing"):
        hyperpod_params(RC, {**PP, "controller_group": None}, {"10.1.0.31"}, "", "rc", "pp")
    with pytest.raises(ParamsError, match=r"pp: worker_groups\[0\]"):
        hyperpod_params(
            RC, {**PP, "worker_groups": [{"partition_name": "x"}]}, {"10.1.0.31"}, "", "rc", "pp"
        )
    bad = {**PP, "nodeforge": {"hook_timeout": "soon"}}
    with pytest.raises(ParamsError, match="pp: hook_timeout: expected a number"):
        parse_params(hyperpod_params(RC, bad, {"10.1.0.31"}, "", "rc", "pp"), "pp")
