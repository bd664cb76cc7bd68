"""Hostile params: each class of bad input gets an error naming the source and the field, and
nothing is written. Also: secrets only from root-only sources, strict YAML, kernel quoting,
HyperPod resolution, and the renderers' own escaping (defence in depth)."""

from __future__ import annotations

import base64
import json
import os

import pytest

from nodeforge import slurmconf, strict_yaml
from nodeforge.bootstrap import identity
from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.bootstrap.params_sources import (
    SourceConfig,
    hyperpod_params,
    kernel_args,
    load_params,
    parse_cmdline,
)
from nodeforge.bootstrap.paths import Paths
from nodeforge.bootstrap.private_read import exposure
from nodeforge.bootstrap.slurm_setup import _sd_quote, conf_server, node_conf
from nodeforge.bootstrap.state import State
from nodeforge.bootstrap.status import as_text
from nodeforge.errors import NodeforgeError
from tests.helpers import http_server, routes_handler
from tests.unit.support import MUNGE_KEY as KEY

pytestmark = pytest.mark.unit


def base(**kw):
    d = {"role": "compute", "cluster_name": "demo", "controller": "ctl(10.9.0.2)", "munge_key": KEY}
    d.update(kw)
    return d


def err(**patch) -> str:
    with pytest.raises(ParamsError) as ei:
        parse_params(base(**patch), "node.yaml")
    return str(ei.value)


# -- grammar: full match, no control characters ------------------------------------------------
@pytest.mark.parametrize(
    "patch, field",
    [
        ({"features": ["gpu\n"]}, "features[0]"),  # trailing newline: `$` would have let it in
        ({"features": ["gpu\nNodeName=evil"]}, "features[0]"),
        ({"features": "gpu,a=b"}, "features[1]"),
        ({"features": ['gpu"x']}, "features[0]"),
        ({"features": ["a b"]}, "features[0]"),
        ({"gres": ["gpu:1\n"]}, "gres[0]"),
        ({"gres": ["gpu:1 Feature=x"]}, "gres[0]"),
        ({"node_name": "c1\n"}, "node_name"),
        ({"node_name": "c_1"}, "node_name"),  # not a hostname label
        ({"node_name": "c1-"}, "node_name"),
        ({"node_name": "a" * 64}, "node_name"),
        ({"node_name": "0"}, "node_name"),  # getaddrinfo reads "0" as 0.0.0.0 (hypothesis found)
        ({"node_name": "123"}, "node_name"),
        ({"node_name": "0x7f"}, "node_name"),  # inet_aton hex: 0.0.0.127
        ({"cluster_name": "demo\n"}, "cluster_name"),
        ({"role": "compute\n"}, "role"),
        ({"partitions": [{"name": "main\nNodes=x"}]}, "partitions[0].name"),
        ({"partitions": [{"name": "p", "max_time": "1:00\n"}]}, "partitions[0].max_time"),
        ({"partitions": [{"name": "p", "max_time": "1 State=DOWN"}]}, "partitions[0].max_time"),
        ({"munge_key": KEY + "\n"}, "munge_key"),
        ({"munge_key": None, "munge_key_file": "/etc/x\n"}, "munge_key_file"),
        ({"munge_key": None, "munge_key_file": "relative/key"}, "munge_key_file"),
        ({"munge_key": None, "munge_key_file": "/etc/../root/key"}, "munge_key_file"),
        ({"hooks": [{"uri": "https://h/x\n.sh"}]}, "hooks[0].uri"),
        ({"hooks": [{"uri": "https://h/x y.sh"}]}, "hooks[0].uri"),
        ({"hooks": [{"uri": "https://h/x", "name": ".."}]}, "hooks[0].name"),
        ({"hooks": [{"uri": "https://h/x", "name": "a/b"}]}, "hooks[0].name"),
        ({"extra": {"users": ["a\x1b[31m"]}}, "extra.users[0]"),
        ({"extra": {"k\x00": 1}}, "extra.'k\\x00'"),
        ({"extra": {"s": "line\u2028break"}}, "extra.s"),
        ({"gres_types": ["gpu\t"]}, "gres_types[0]"),
    ],
)
def test_structure_characters_are_refused_by_field(patch, field):
    msg = err(**patch)
    assert msg.startswith(f"node.yaml: {field}: "), msg


def test_control_character_is_named():
    assert "contains a control character (U+000A); remove it" in err(features=["gpu\n"])
    assert "(U+001B)" in err(extra={"x": "\x1b"})


# -- controller host/address in every accepted form -------------------------------------------
@pytest.mark.parametrize(
    "raw, host, addr",
    [
        ("ctl", "ctl", ""),
        ("ctl.example.org", "ctl.example.org", ""),
        ("10.9.0.2", "", "10.9.0.2"),
        ("fd00::2", "", "fd00::2"),
        ("ctl(10.9.0.2)", "ctl", "10.9.0.2"),
        ("ctl(fd00::2)", "ctl", "fd00::2"),
        ({"host": "ctl", "address": "10.9.0.2"}, "ctl", "10.9.0.2"),
        ({"address": "ctl.example.org"}, "", "ctl.example.org"),
    ],
)
def test_controller_forms_accepted(raw, host, addr):
    c = parse_params(base(controller=raw), "x").controller
    assert (c.host, c.address) == (host, addr)


@pytest.mark.parametrize(
    "raw, field, why",
    [
        ("fe80::1%eth0", "controller", "IPv6 zone"),
        ("ctl(fe80::1%eth0)", "controller.address", "IPv6 zone"),
        ("ctl.", "controller", "trailing dot"),
        ({"host": "ctl.example.org.", "address": "10.0.0.1"}, "controller.host", "trailing dot"),
        ("ctl\n", "controller", "control character"),
        ("ctl(10.9.0.2)\nSlurmctldHost=evil", "controller", "control character"),
        ("ctl_1", "controller", "neither an IP address nor a DNS name"),
        ("10.0.0.256", "controller", "neither an IP address nor a DNS name"),
        ("-ctl", "controller", "neither"),
        ("ctl(10.9.0.2) x", "controller", "neither"),
        ("a" * 64 + ".org", "controller", "neither"),
        ({"host": "ctl", "address": "ctl2.example.org"}, "controller.address", "give an IP"),
        ({"host": "ctl%n"}, "controller.host", "not a hostname"),
        ({"host": "$(reboot)"}, "controller.host", "not a hostname"),
        ("1.0x7f", "controller", "neither"),  # inet_aton reads it as 1.0.0.127
        ({"host": "0x7f", "address": "10.0.0.1"}, "controller.host", "not a hostname"),
    ],
)
def test_controller_forms_refused(raw, field, why):
    msg = err(controller=raw)
    assert msg.startswith(f"node.yaml: {field}: ") and why in msg, msg


def test_node_address_ipv6_zone_refused():
    assert "IPv6 zone" in err(node_address="fe80::1%eth0")
    assert parse_params(base(node_address="fd00::7"), "x").node_address == "fd00::7"


# -- numbers: finite, bounded, no bool-as-int --------------------------------------------------
@pytest.mark.parametrize(
    "patch, field, why",
    [
        ({"hook_timeout": float("nan")}, "hook_timeout", "not a finite number"),
        ({"wait_timeout": float("inf")}, "wait_timeout", "not a finite number"),
        ({"hook_backoff": 10**400}, "hook_backoff", "out of range"),
        ({"hook_backoff_max": 86401}, "hook_backoff_max", "out of range"),
        ({"wait_timeout": 0}, "wait_timeout", "out of range"),
        ({"wait_timeout": True}, "wait_timeout", "got bool"),
        ({"cpus": 10**30}, "cpus", "out of range [1, 65535]"),
        ({"real_memory": 2**41}, "real_memory", "out of range"),
        ({"hook_retries": 21}, "hook_retries", "out of range [0, 20]"),
        ({"max_node_count": False}, "max_node_count", "got bool"),
        (
            {"hooks": [{"uri": "https://h/x", "timeout": float("nan")}]},
            "hooks[0].timeout",
            "finite",
        ),
        ({"munge_key": base64.b64encode(b"k" * 1500).decode()}, "munge_key", "at most 1024"),
        ({"extra": {"x": float("nan")}}, "extra.x", "not a finite number"),
        ({"features": ["f"] * 65}, "features", "at most 64"),
    ],
)
def test_numbers_finite_and_bounded(patch, field, why):
    msg = err(**patch)
    assert msg.startswith(f"node.yaml: {field}: ") and why in msg, msg


def test_yaml_nan_and_inf_refused(tmp_path):
    for text in ("hook_timeout: .nan\n", "wait_timeout: .inf\n", "wait_timeout: -.inf\n"):
        data = strict_yaml.load("role: compute\ncluster_name: d\ncontroller: c\n" + text)
        with pytest.raises(ParamsError, match="not a finite number"):
            parse_params(data, "y")


def test_extra_depth_bounded():
    deep: dict = {}
    cur = deep
    for _ in range(20):
        cur["a"] = {}
        cur = cur["a"]
    assert "nested deeper than 8" in err(extra=deep)


# -- strict YAML ---------------------------------------------------------------------------------
def _node_yaml(tmp_path, text, mode=0o600):
    cfg = SourceConfig(Paths.under(tmp_path), imds_url=None)
    cfg.paths.node_yaml.parent.mkdir(parents=True, exist_ok=True)
    cfg.paths.node_yaml.write_text(text)
    cfg.paths.node_yaml.chmod(mode)
    return cfg


def test_duplicate_key_names_key_and_line(tmp_path):
    cfg = _node_yaml(tmp_path, "role: compute\ncluster_name: a\ncontroller: c\nrole: controller\n")
    with pytest.raises(ParamsError) as ei:
        load_params(cfg)
    assert str(ei.value) == (
        f"{cfg.paths.node_yaml}: line 4: duplicate key 'role' (first on line 1); keep one"
    )


def test_nested_duplicate_key(tmp_path):
    cfg = _node_yaml(
        tmp_path, "role: compute\ncluster_name: a\ncontroller:\n  host: a\n  host: b\n"
    )
    with pytest.raises(ParamsError, match="line 5: duplicate key 'host'"):
        load_params(cfg)


@pytest.mark.parametrize(
    "text, what",
    [
        ("role: &r compute\ncluster_name: a\ncontroller: *r\n", "anchor &r"),
        ("x: &a [1]\n", "anchor &a"),
        ("role: compute\ncluster_name: a\ncontroller: c\nextra: {<<: {a: 1}}\n", "merge key"),
    ],
)
def test_anchors_aliases_merge_refused(tmp_path, text, what):
    with pytest.raises(ParamsError, match=what):
        load_params(_node_yaml(tmp_path, text))


def test_billion_laughs_refused_without_expansion():
    lol = "a: &a [x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    with pytest.raises(strict_yaml.StrictYAMLError, match="anchor &a"):
        strict_yaml.load(lol)


def test_oversized_document_refused():
    with pytest.raises(strict_yaml.StrictYAMLError, match="limited to"):
        strict_yaml.load("a: " + "x" * (strict_yaml.MAX_BYTES + 1))


def test_symlinked_params_file_refused(tmp_path):
    cfg = _node_yaml(tmp_path, json.dumps(base()))
    real = tmp_path / "real.yaml"
    cfg.paths.node_yaml.rename(real)
    cfg.paths.node_yaml.symlink_to(real)
    with pytest.raises(ParamsError, match="is a symlink; params are read only from a regular file"):
        load_params(cfg)
    # A dangling link is no "no node.yaml": it is refused too, not skipped.
    real.unlink()
    with pytest.raises(ParamsError, match="is a symlink"):
        load_params(cfg)


def test_params_file_not_regular(tmp_path):
    cfg = SourceConfig(Paths.under(tmp_path), imds_url=None)
    cfg.paths.node_yaml.mkdir(parents=True)
    with pytest.raises(ParamsError, match="is not a regular file"):
        load_params(cfg)


# -- secrets only from root-only sources ---------------------------------------------------------
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_secret_in_readable_node_yaml_refused(tmp_path, mode):
    cfg = _node_yaml(tmp_path, json.dumps(base()), mode)
    with pytest.raises(ParamsError) as ei:
        load_params(cfg)
    msg = str(ei.value)
    assert msg.startswith(f"{cfg.paths.node_yaml}: munge_key: refused, the file is mode 0")
    assert "munge_key_file" in msg and "S3 URI" in msg and "0600" in msg


def test_readable_node_yaml_without_secret_is_fine(tmp_path):
    d = base(munge_key=None, munge_key_file="/etc/nodeforge/secrets/munge.key")
    assert load_params(_node_yaml(tmp_path, json.dumps(d), 0o644)).params.role == "compute"
    assert load_params(_node_yaml(tmp_path, json.dumps(base()), 0o600)).params.munge_key == KEY


def test_exposure_of_owner_and_mode():
    def st(mode, uid):
        return os.stat_result((0o100000 | mode, 0, 0, 1, uid, 0, 10, 0, 0, 0))

    root_only = frozenset({0})
    assert exposure(st(0o600, 0), root_only) is None
    assert exposure(st(0o400, 0), root_only) is None
    assert exposure(st(0o600, 1000), root_only) == "owned by uid 1000, not root"
    assert "mode 0644" in exposure(st(0o644, 0), root_only)
    assert "mode 0602" in exposure(st(0o602, 0), root_only)  # others may rewrite it


def test_secret_on_kernel_cmdline_refused(tmp_path):
    cfg = SourceConfig(Paths.under(tmp_path), imds_url=None)
    cfg.paths.cmdline.parent.mkdir(parents=True)
    cfg.paths.cmdline.write_text(
        f"ro nodeforge.role=compute nodeforge.cluster=d nodeforge.controller=c nodeforge.munge_key={KEY}\n"
    )
    with pytest.raises(ParamsError) as ei:
        load_params(cfg)
    msg = str(ei.value)
    assert msg.startswith("kernel command line: munge_key: refused, the kernel command line is")
    assert "/proc/cmdline" in msg and "munge_key_file" in msg


def test_secret_in_readable_params_url_file_refused(tmp_path):
    doc = tmp_path / "p.yaml"
    doc.write_text(f"munge_key: {KEY}\n")
    doc.chmod(0o644)
    cfg = SourceConfig(Paths.under(tmp_path), imds_url=None)
    cfg.paths.cmdline.parent.mkdir(parents=True)
    cfg.paths.cmdline.write_text(
        f"nodeforge.role=compute nodeforge.cluster=d nodeforge.controller=c nodeforge.params=file://{doc}"
    )
    with pytest.raises(
        ParamsError, match=r"nodeforge.params=file://.*: munge_key: refused, the file is mode 0644"
    ):
        load_params(cfg)


def test_secret_from_http_params_url_refused(tmp_path):
    body = f"munge_key: {KEY}\n".encode()

    with http_server(routes_handler({"/p.yaml": body})) as root:
        url = f"{root}/p.yaml"
        cfg = SourceConfig(Paths.under(tmp_path), imds_url=None)
        cfg.paths.cmdline.parent.mkdir(parents=True)
        cfg.paths.cmdline.write_text(
            f"nodeforge.role=compute nodeforge.cluster=d nodeforge.controller=c nodeforge.params={url}"
        )
        with pytest.raises(ParamsError, match="munge_key: refused, a params URL can be fetched"):
            load_params(cfg)


def test_secret_in_user_data_refused_unless_imds_guarded(tmp_path):
    cfg = SourceConfig(Paths.under(tmp_path), imds_url=None)
    ud = cfg.paths.cloud_init_user_data
    ud.parent.mkdir(parents=True)
    ud.write_text("#cloud-config\nnodeforge: " + json.dumps(base()) + "\n")
    with pytest.raises(ParamsError) as ei:
        load_params(cfg)
    assert "munge_key: refused, EC2 user-data can be read by every local user" in str(ei.value)
    assert "node_agent_imds_root_only" in str(ei.value)
    # The baked guard (role node_agent, node_agent_imds_root_only: true) makes it root-only.
    guard = tmp_path / "etc/nodeforge/imds-root-only.nft"
    guard.parent.mkdir(parents=True, exist_ok=True)
    guard.write_text("table inet nodeforge_imds {}\n")
    assert load_params(cfg).params.munge_key == KEY


def test_keypair_on_cmdline_refused():
    with pytest.raises(ParamsError, match="users_keypair: refused"):
        from nodeforge.bootstrap.params_sources import cmdline_params

        cmdline_params("nodeforge.role=login nodeforge.users_keypair=x")


# -- kernel command line: the kernel's quoting --------------------------------------------------
@pytest.mark.parametrize(
    "text, args",
    [
        ("a b=c", [("a", None), ("b", "c")]),
        ('a="b c" d', [("a", "b c"), ("d", None)]),
        ('"a=b c" d', [("a", "b c"), ("d", None)]),
        ("a='b c'", [("a", "'b"), ("c'", None)]),  # single quotes do not group
        ('a=b"c d"', [("a", 'b"c d"')]),  # a quote inside a word toggles, is not removed
        ("a=b\\ c", [("a", "b\\"), ("c", None)]),  # no escape character
        ("x=1 -- nodeforge.role=login", [("x", "1")]),  # `--`: the rest is init's
        ("  a=  ", [("a", "")]),
        ("=a", [("=a", None)]),  # the kernel does not split at a leading '='
        ("a\tb\nc", [("a", None), ("b", None), ("c", None)]),
        ('a="unterminated', [("a", "unterminated")]),
    ],
)
def test_kernel_args_follow_next_arg(text, args):
    assert kernel_args(text) == args


def test_cmdline_quoted_value_and_duplicate():
    assert parse_cmdline('nodeforge.features="gpu,ib" x') == {"features": "gpu,ib"}
    with pytest.raises(ParamsError, match="nodeforge.role: given twice"):
        parse_cmdline("nodeforge.role=compute nodeforge.role=controller")


@pytest.mark.parametrize(
    "arg, why",
    [
        ("nodeforge.cpus=1_000", "expected an integer"),
        ("nodeforge.cpus=-4", "expected an integer"),
        ("nodeforge.hook_timeout=nan", "expected a number of seconds"),
        ("nodeforge.hook_timeout=inf", "expected a number of seconds"),
        ("nodeforge.hook_timeout=1e999", "expected a number of seconds"),
        ("nodeforge.docker=maybe", "expected true or false"),
    ],
)
def test_cmdline_numbers(arg, why):
    from nodeforge.bootstrap.params_sources import cmdline_params

    with pytest.raises(ParamsError, match=why):
        cmdline_params("nodeforge.role=compute nodeforge.cluster=d nodeforge.controller=c " + arg)


# -- HyperPod ------------------------------------------------------------------------------------
PP = {
    "workload_manager": "slurm",
    "controller_group": "ctl",
    "worker_groups": [{"instance_group_name": "workers", "partition_name": "dev"}],
}


def rc(*groups):
    return {
        "InstanceGroups": [
            {
                "Name": n,
                "Instances": [{"InstanceName": i, "CustomerIpAddress": a} for i, a in insts],
            }
            for n, insts in groups
        ]
    }


RC = rc(("ctl", [("ip-a", "10.0.0.1")]), ("workers", [("ip-b", "10.0.0.2"), ("ip-c", "10.0.0.3")]))


def test_hyperpod_address_wins_over_hostname():
    # Our hostname is a stale name of the controller; our address says we are worker ip-c.
    d = hyperpod_params(RC, PP, {"10.0.0.3"}, "ip-a", "rc", "pp")
    assert d["role"] == "compute" and d["extra"]["hyperpod"]["instance_name"] == "ip-c"
    d = hyperpod_params(RC, PP, {"192.0.2.9"}, "ip-a", "rc", "pp")  # no address: hostname
    assert d["role"] == "controller"


def test_hyperpod_address_in_two_groups():
    bad = rc(("ctl", [("ip-a", "10.0.0.1")]), ("workers", [("ip-b", "10.0.0.1")]))
    with pytest.raises(ParamsError) as ei:
        hyperpod_params(bad, PP, {"10.0.0.9"}, "", "rc", "pp")
    assert "10.0.0.1 is in two groups, 'ctl' and 'workers'" in str(ei.value)


def test_hyperpod_duplicate_group_name():
    bad = rc(("ctl", [("ip-a", "10.0.0.1")]), ("ctl", [("ip-b", "10.0.0.2")]))
    with pytest.raises(
        ParamsError, match=r"rc: InstanceGroups\[1\].Name: duplicate group name 'ctl'"
    ):
        hyperpod_params(bad, PP, {"10.0.0.2"}, "", "rc", "pp")


@pytest.mark.parametrize(
    "rc_doc, pp_doc, field",
    [
        (
            {"InstanceGroups": [{"Name": 3}]},
            PP,
            r"rc: InstanceGroups\[0\].Name: expected a non-empty string, got int",
        ),
        ({"InstanceGroups": ["x"]}, PP, r"rc: InstanceGroups\[0\]: expected an object, got str"),
        (
            {"InstanceGroups": [{"Name": "ctl", "Instances": {"a": 1}}]},
            PP,
            r"InstanceGroups\[0\].Instances: expected a list",
        ),
        (
            {"InstanceGroups": [{"Name": "ctl", "Instances": [5]}]},
            PP,
            r"Instances\[0\]: expected an object, got int",
        ),
        (
            {
                "InstanceGroups": [
                    {"Name": "ctl", "Instances": [{"CustomerIpAddress": ["10.0.0.1"]}]}
                ]
            },
            PP,
            r"Instances\[0\].CustomerIpAddress: expected a non-empty string, got list",
        ),
        (
            RC,
            {**PP, "controller_group": 7},
            "pp: controller_group: expected a non-empty string, got int",
        ),
        (RC, {**PP, "login_group": []}, "pp: login_group: expected a non-empty string, got list"),
        (RC, {**PP, "worker_groups": {"a": 1}}, "pp: worker_groups: expected a list, got dict"),
        (
            RC,
            {**PP, "worker_groups": [{"instance_group_name": ["w"], "partition_name": "p"}]},
            r"worker_groups\[0\].instance_group_name",
        ),
        (
            RC,
            {**PP, "nodeforge": {"features": 5}},
            "pp: nodeforge.features: expected a list or a comma-separated string, got int",
        ),
        (RC, {**PP, "nodeforge": {"extra": [1]}}, "pp: nodeforge.extra: expected a mapping"),
    ],
)
def test_hyperpod_type_errors_are_params_errors(rc_doc, pp_doc, field):
    with pytest.raises(ParamsError, match=field):
        hyperpod_params(rc_doc, pp_doc, {"10.0.0.2"}, "", "rc", "pp")


def test_hyperpod_features_string_split():
    pp = {**PP, "nodeforge": {"features": "ib, nvme"}}
    p = parse_params(hyperpod_params(RC, pp, {"10.0.0.2"}, "", "rc", "pp"), "pp")
    assert p.features == ("dev", "ib", "nvme")


def test_hyperpod_readable_file_with_secret_refused(tmp_path):
    cfg = SourceConfig(Paths.under(tmp_path), imds_url=None, own_addresses=lambda: ["10.0.0.2"],
                       hostname=lambda: "x")  # fmt: skip
    cfg.paths.hyperpod_resource_config.parent.mkdir(parents=True)
    cfg.paths.hyperpod_resource_config.write_text(json.dumps(RC))
    pp = cfg.paths.hyperpod_provisioning_parameters
    pp.write_text(json.dumps({**PP, "nodeforge": {"munge_key": KEY}}))
    pp.chmod(0o644)
    with pytest.raises(ParamsError, match="nodeforge: munge_key: refused, the file is mode 0644"):
        load_params(cfg)
    pp.chmod(0o600)
    assert load_params(cfg).params.munge_key == KEY


def test_hyperpod_json_nan_and_duplicate_refused(tmp_path):
    cfg = SourceConfig(Paths.under(tmp_path), imds_url=None, own_addresses=lambda: ["10.0.0.2"],
                       hostname=lambda: "x")  # fmt: skip
    cfg.paths.hyperpod_resource_config.parent.mkdir(parents=True)
    cfg.paths.hyperpod_resource_config.write_text(json.dumps(RC))
    pp = cfg.paths.hyperpod_provisioning_parameters
    pp.write_text('{"controller_group": "ctl", "nodeforge": {"hook_timeout": NaN}}')
    # The file and the field are named (the parser's hook knows neither).
    with pytest.raises(
        ParamsError,
        match=r"provisioning_parameters\.json: nodeforge\.hook_timeout: NaN is not a finite JSON",
    ):
        load_params(cfg)
    for doc, field in (
        (
            '{"controller_group": "ctl", "worker_groups": [{"x": -Infinity}]}',
            r"worker_groups\[0\]\.x",
        ),
        ('{"controller_group": "ctl", "nodeforge": {"cpus": 1e999}}', r"nodeforge\.cpus: 1e999"),
    ):
        pp.write_text(doc)
        with pytest.raises(ParamsError, match=rf"provisioning_parameters\.json: {field}"):
            load_params(cfg)
    pp.write_text('{"controller_group": "ctl", "controller_group": "workers"}')
    with pytest.raises(ParamsError, match="duplicate key 'controller_group'"):
        load_params(cfg)


# -- renderers escape too (defence in depth) -----------------------------------------------------
def test_systemd_words_escape_specifiers_and_variables():
    assert _sd_quote("/usr/sbin/slurmd") == "/usr/sbin/slurmd"
    assert _sd_quote("$SLURMD_OPTIONS") == "$SLURMD_OPTIONS"  # the one intended expansion
    assert _sd_quote("a%nb") == '"a%%nb"'
    assert _sd_quote("$HOME") == "$HOME"  # a whole-word variable name stays one (by design)
    assert _sd_quote("x$HOME") == '"x$$HOME"'
    assert _sd_quote('a"b') == '"a\\"b"'
    with pytest.raises(NodeforgeError, match="control character"):
        _sd_quote("a\nExecStartPre=/bin/evil")


def test_slurm_values_refused_or_quoted():
    assert (
        slurmconf.line({"Feature": "a,b", "Reason": "two words"})
        == 'Feature=a,b Reason="two words"'
    )
    for bad in ("a\nb", "a#b", 'a"b', "a=b", "a\\b", "a\x00"):
        with pytest.raises(slurmconf.SlurmConfError):
            slurmconf.value("Feature", bad)
    with pytest.raises(slurmconf.SlurmConfError):
        slurmconf.value("Bad Key", "x")


def test_hosts_lines_refuse_non_ip_and_bad_names():
    assert identity.hosts_lines({"ctl": "10.0.0.1", "v6": "fd00::1"}) == [
        "10.0.0.1 ctl",
        "fd00::1 v6",
    ]
    with pytest.raises(NodeforgeError, match="is not an IP address"):
        identity.hosts_lines({"ctl": "10.0.0.1 evil"})
    with pytest.raises(NodeforgeError, match="is not a hostname"):
        identity.hosts_lines({"ctl\n1.2.3.4 evil": "10.0.0.1"})


def test_conf_server_brackets_ipv6():
    assert conf_server(parse_params(base(controller="fd00::2"), "x")) == "[fd00::2]:6817"
    assert conf_server(parse_params(base(), "x")) == "10.9.0.2:6817"


def test_node_conf_round_trips():
    p = parse_params(base(features=["gpu", "nvme"], gres=["gpu:a100:2"], cpus=8), "x")
    assert slurmconf.parse_line(node_conf(p)) == [
        ("Feature", "gpu,nvme"),
        ("Gres", "gpu:a100:2"),
        ("CPUs", "8"),
    ]


# -- the agent: bad params -> nothing written, node out of service, reason visible ----------------
def test_bad_params_write_nothing_and_show_the_reason(tmp_path):
    from tests.unit.support import COMPUTE, make

    agent, fm, paths, _ = make(tmp_path, {**COMPUTE, "features": ["gpu\nNodeName=evil"]})
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(StepFailed, match=r"features\[0\]: .* control character"):
        agent.init()
    after = sorted(str(p) for p in tmp_path.rglob("*"))
    # Only the agent's own record (state.json, under /var/lib/nodeforge) appeared.
    assert [p for p in after if p not in before] == [
        str(p)
        for p in (tmp_path / "var", tmp_path / "var/lib", paths.state_file.parent, paths.state_file)
    ]
    assert fm.calls == []  # no command ran: no daemon, no scontrol, no hostname change
    st = State.load(paths.state_file)
    text = as_text(st)
    assert st.status == "failed" and "params" in (st.last_error or "")
    assert "features[0]" in text and "control character" in text


def test_munge_key_file_must_be_root_only_and_not_a_link(tmp_path):
    from nodeforge.bootstrap import munge

    key = tmp_path / "munge.key"
    key.write_bytes(b"k!" * 32)  # raw bytes (not base64 text)
    key.chmod(0o644)
    p = parse_params(base(munge_key=None, munge_key_file=str(key)), "x")
    with pytest.raises(NodeforgeError, match="munge_key_file: .* is mode 0644 .* chmod 0400"):
        munge.key_bytes(p, "node.yaml")
    key.chmod(0o400)
    assert munge.key_bytes(p, "node.yaml") == b"k!" * 32
    link = tmp_path / "link.key"
    link.symlink_to(key)
    p = parse_params(base(munge_key=None, munge_key_file=str(link)), "x")
    with pytest.raises(NodeforgeError, match="is a symlink"):
        munge.key_bytes(p, "node.yaml")


def test_user_data_strictness_applies_to_our_documents_only():
    from nodeforge.bootstrap.params_sources import params_from_user_data

    foreign = "#cloud-config\nx: &a [1]\ny: *a\nruncmd: [ls]\n"  # another tool's anchors
    assert params_from_user_data(foreign, "u") is None
    ours = "#cloud-config\ndefaults: &d {role: compute}\nnodeforge: *d\n"
    with pytest.raises(ParamsError, match="u: line 2, defaults: anchor &d is not allowed"):
        params_from_user_data(ours, "u")
    dup = "#cloud-config\nnodeforge:\n  role: compute\n  role: login\n"
    with pytest.raises(ParamsError, match="u: line 4: duplicate key 'role'"):
        params_from_user_data(dup, "u")
