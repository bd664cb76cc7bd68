"""Issue 23, items 6-8: HyperPod's files decide what HyperPod decides; one parser for the
kernel command line (the agent's bytes and `params check --cmdline` agree on any input);
addresses a node cannot use are refused wherever an address is accepted."""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.params import ParamsError, parse_params, unusable_address
from nodeforge.bootstrap.params_check import check_user_data
from nodeforge.bootstrap.params_sources import (
    SourceConfig,
    cmdline_bytes,
    cmdline_params,
    hyperpod_params,
    kernel_args,
    load_params,
)
from nodeforge.bootstrap.paths import Paths
from nodeforge.cli import main
from tests.unit.support import COMPUTE, make  # the agent harness (fake machine)

pytestmark = pytest.mark.unit

PROPS = settings(
    max_examples=300,
    deadline=None,  # bounded by max_examples; a per-example deadline flakes on a busy CI
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
PP = {
    "workload_manager": "slurm",
    "controller_group": "ctl",
    "worker_groups": [{"instance_group_name": "workers", "partition_name": "dev"}],
}


def rc(ctl_addr="10.0.0.1", worker_addr="10.0.0.2"):
    return {
        "InstanceGroups": [
            {"Name": "ctl", "Instances": [{"InstanceName": "a", "CustomerIpAddress": ctl_addr}]},
            {"Name": "workers",
             "Instances": [{"InstanceName": "b", "CustomerIpAddress": worker_addr}]},
        ]
    }  # fmt: skip


# -- 6. HyperPod ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "section, field",
    [
        ({"role": "controller"}, "role"),
        ({"controller": "10.0.0.99"}, "controller"),
        ({"controller": {"host": "evil", "address": "10.0.0.99"}}, "controller"),
        ({"cluster_name": "other"}, "cluster_name"),
        ({"extra": {"hyperpod": {"instance_group": "ctl"}}}, r"extra\.hyperpod"),
    ],
)
def test_hyperpod_section_cannot_override_what_hyperpod_decides(section, field):
    with pytest.raises(ParamsError, match=rf"^pp\.json: nodeforge\.{field}: refused"):
        hyperpod_params(rc(), {**PP, "nodeforge": section}, {"10.0.0.2"}, "", "rc.json", "pp.json")
    # Without the section the worker is a compute of the HyperPod controller.
    d = hyperpod_params(rc(), PP, {"10.0.0.2"}, "", "rc.json", "pp.json")
    assert d["role"] == "compute" and d["controller"] == {"address": "10.0.0.1"}


def test_hyperpod_section_still_adds_other_params():
    pp = {**PP, "cluster_name": "train", "nodeforge": {"hook_timeout": 30, "extra": {"k": 1}}}
    p = parse_params(hyperpod_params(rc(), pp, {"10.0.0.2"}, "", "rc", "pp"), "pp")
    assert (p.role, p.cluster_name, p.hook_timeout, p.extra["k"]) == ("compute", "train", 30.0, 1)


@pytest.mark.parametrize(
    "bad, why",
    [
        ("0.0.0.0", "unspecified"),
        ("255.255.255.255", "broadcast"),
        ("224.0.0.251", "multicast"),
        ("::", "unspecified"),
        ("localhost", "not an IP address"),
        ("ctl.example", "not an IP address"),
    ],
)
@pytest.mark.parametrize("which", ["ctl", "worker"])
def test_hyperpod_customer_ip_address_must_be_usable(bad, why, which):
    doc = rc(ctl_addr=bad) if which == "ctl" else rc(worker_addr=bad)
    i = 0 if which == "ctl" else 1
    with pytest.raises(
        ParamsError,
        match=rf"^rc\.json: InstanceGroups\[{i}\]\.Instances\[0\]\.CustomerIpAddress: .*{why}",
    ):
        hyperpod_params(doc, PP, {"10.0.0.2", bad}, "", "rc.json", "pp.json")


# -- 7. one kernel command-line parser ---------------------------------------------------------
def _agent(raw: bytes, tmp: Path) -> str:
    """What the agent makes of /proc/cmdline holding *raw*: the params or the error."""
    paths = Paths.under(tmp)
    paths.cmdline.parent.mkdir(parents=True, exist_ok=True)
    paths.cmdline.write_bytes(raw)
    try:
        got = load_params(SourceConfig(paths, imds_url=None))
    except ParamsError as exc:
        return "error: " + str(exc).replace("kernel command line: ", "", 1)
    except Exception as exc:  # noqa: BLE001 - "no params found" (NodeforgeError) and any crash
        return f"{type(exc).__name__}: {exc}".split(". Provide")[0]
    return json.dumps(got.params.public_dict(), sort_keys=True)


def _cli(text: str) -> str:
    """What `nodeforge params check --cmdline TEXT --json` says."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["params", "check", f"--cmdline={text}", "--json"])
    if rc == 0:
        return json.dumps(json.loads(out.getvalue())["params"], sort_keys=True)
    msg = err.getvalue().strip().removeprefix("nodeforge: error: ")
    if "no nodeforge.* arguments" in msg:
        return "NodeforgeError: no node params found"
    return "error: " + msg.replace("kernel command line (--cmdline): ", "", 1)


WORDS = [b"nodeforge.role=compute", b"nodeforge.cluster=demo", b"nodeforge.controller=10.0.0.1",
         b"nodeforge.features=", b"nodeforge.node=", b"nodeforge.", b"nodeforge.cpus=", b"quiet",
         b'"', b"=", b" ", b"\t", b"\n", b"\xa0", b"\xc3", b"\xa9", b"\xc3\xa0", b"\xc3\xa9",
         b"\xe2\x80\xa8", b"\xff", b"\xed\xa0\x80", b"--", b"gpu", b","]  # fmt: skip
cmdlines = st.lists(st.one_of(st.sampled_from(WORDS), st.binary(max_size=4)), max_size=14).map(
    b"".join
)


@PROPS
@given(raw=cmdlines)
def test_agent_and_params_check_agree_on_any_bytes(raw, tmp_path_factory):
    # argv reaches Python as UTF-8 with surrogateescape: what a shell passes for these bytes.
    text = raw.decode("utf-8", "surrogateescape")
    assert _agent(raw, tmp_path_factory.mktemp("c")) == _cli(text)
    words = [w for w in kernel_args(raw.decode("latin-1")) if w[0].startswith("nodeforge.")]
    if any(not (p + (v or "")).isascii() for p, v in words):
        # Refused: for the non-ASCII word, or for a key given twice before it (word order).
        with pytest.raises(ParamsError, match="not ASCII|given twice"):
            cmdline_params(raw)


def test_cmdline_string_becomes_the_kernels_bytes():
    assert cmdline_bytes("a=é") == b"a=\xc3\xa9"
    assert cmdline_bytes(b"x=\xff".decode("utf-8", "surrogateescape")) == b"x=\xff"
    assert cmdline_bytes("x=\ud800") == b"x=\xed\xa0\x80"  # a lone surrogate stays non-ASCII


@pytest.mark.parametrize(
    "raw, name, byte",
    [
        # "à" is C3 A0, and the kernel splits words at A0: the two readers used to see
        # different words here.
        (b"nodeforge.role=compute nodeforge.cluster=d\xc3\xa0mo nodeforge.controller=c",
         "nodeforge.cluster", "0xC3"),
        (b"nodeforge.role=compute nodeforge.features=gpu\xe2\x80\xa8 nodeforge.controller=c",
         "nodeforge.features", "0xE2"),
        (b"nodeforge.r\xc3\xb4le=compute", r"nodeforge.r\\xc3\\xb4le", "0xC3"),
        (b"nodeforge.cluster=\xff", "nodeforge.cluster", "0xFF"),
    ],
)  # fmt: skip
def test_non_ascii_nodeforge_word_refused_the_same_way(raw, name, byte, tmp_path):
    expect = f"{name}: byte {byte} at offset"
    assert _agent(raw, tmp_path).startswith(f"error: {expect}".replace("\\\\", "\\"))
    assert _cli(raw.decode("utf-8", "surrogateescape")) == _agent(raw, tmp_path)


def test_non_ascii_outside_nodeforge_words_is_not_ours(tmp_path):
    raw = b"root=LABEL=r\xc3\xa9 quiet nodeforge.role=compute nodeforge.cluster=d nodeforge.controller=c"
    assert '"cluster_name": "d"' in _agent(raw, tmp_path)
    assert _cli(raw.decode("utf-8", "surrogateescape")) == _agent(raw, tmp_path)


# -- 8. addresses a node cannot use ----------------------------------------------------------------
UNUSABLE = ["0.0.0.0", "0.1.2.3", "::", "::ffff:0.0.0.0", "255.255.255.255",
            "::ffff:255.255.255.255", "224.0.0.1", "239.255.255.250", "ff02::1", "ff05::1:3",
            "localhost", "LOCALHOST", "Localhost.", "db.localhost"]  # fmt: skip


@pytest.mark.parametrize("bad", UNUSABLE)
@pytest.mark.parametrize(
    "shape, field",
    [
        (lambda a: {"controller": a}, "controller"),
        (lambda a: {"controller": {"host": "ctl", "address": a}}, "controller.address"),
        (lambda a: {"controller": {"address": a}}, "controller.address"),
        (lambda a: {"controller": f"ctl({a})"}, "controller.address"),
        (lambda a: {"controller": {"host": a}}, "controller.host"),
        (lambda a: {"node_address": a}, "node_address"),
        (lambda a: {"node_name": a}, "node_name"),
    ],
)
def test_unusable_address_refused_with_the_field(bad, shape, field):
    data = {**COMPUTE, **shape(bad)}
    try:
        parse_params(data, "node.yaml")
    except ParamsError as exc:
        msg = str(exc)
    else:
        raise AssertionError(f"{bad!r} accepted as {field}")
    assert msg.startswith(f"node.yaml: {field}: "), msg
    usable_elsewhere = field in ("controller.host", "node_name") and not bad.lower().startswith(
        ("localhost", "db.")
    )  # an IP is no hostname/node name anyway: refused by that field's own grammar
    if not usable_elsewhere:
        assert "localhost" in msg or "address" in msg, msg


@PROPS
@given(
    ip=st.one_of(
        st.ip_addresses(v=4, network="224.0.0.0/4"),
        st.ip_addresses(v=4, network="0.0.0.0/8"),
        st.ip_addresses(v=6, network="ff00::/8"),
        st.just(ipaddress.ip_address("255.255.255.255")),
        st.just(ipaddress.ip_address("::")),
    ),
    mapped=st.booleans(),
)
def test_any_unusable_ip_is_refused(ip, mapped):
    s = f"::ffff:{ip}" if mapped and ip.version == 4 else str(ip)
    with pytest.raises(ParamsError, match=r"^t: controller: '.*' is (the|a|in) "):
        parse_params({**COMPUTE, "controller": s}, "t")


@PROPS
@given(
    ip=st.ip_addresses(v=4, network="10.0.0.0/8") | st.ip_addresses(v=6, network="2001:db8::/32")
)
def test_unicast_addresses_stay_accepted(ip):
    p = parse_params({**COMPUTE, "controller": str(ip), "node_address": str(ip)}, "t")
    assert p.controller.address == str(ip)


def test_subnet_broadcast_where_the_prefix_is_known():
    nets = [ipaddress.ip_network("10.9.0.0/24"), ipaddress.ip_network("192.0.2.0/31")]
    assert "broadcast address of 10.9.0.0/24" in (unusable_address("10.9.0.255", nets) or "")
    assert unusable_address("10.9.0.254", nets) is None
    assert unusable_address("192.0.2.1", nets) is None  # a /31 has no broadcast (RFC 3021)


def test_agent_refuses_a_controller_at_its_subnets_broadcast(tmp_path):
    """The prefix is known on the node: the kernel will not route to the broadcast address as
    to one host, and the agent names the field instead of waiting for a controller."""
    agent, fm, _paths, _ = make(tmp_path, {**COMPUTE, "controller": {"host": "ctl",
                                                                    "address": "10.9.0.255"}})  # fmt: skip
    agent.host.source_address = lambda target: None  # connect() to a broadcast: EACCES
    fake = fm.run

    def run(argv, **kw):
        if list(argv[:2]) == ["ip", "-o"]:
            out = "1: lo    inet 127.0.0.1/8 scope host lo\n2: eth0    inet 10.9.0.5/24 brd 10.9.0.255 scope global eth0\n"
            return subprocess.CompletedProcess(argv, 0, out, "")
        return fake(argv, **kw)

    agent.host.run = run
    with pytest.raises(
        StepFailed,
        match=r"controller\.address: 10\.9\.0\.255 is the broadcast address of 10\.9\.0\.0/24",
    ):
        agent.init()


def test_cmdline_and_user_data_refuse_unusable_addresses(tmp_path):
    with pytest.raises(ParamsError, match=r"^kernel command line: controller: '0\.0\.0\.0'"):
        parse_params(
            cmdline_params(
                b"nodeforge.role=compute nodeforge.cluster=d nodeforge.controller=0.0.0.0"
            ),
            "kernel command line",
        )
    ud = tmp_path / "user-data"
    ud.write_text("#cloud-config\nnodeforge:\n  role: compute\n  cluster_name: d\n"
                  "  controller: {host: ctl, address: 239.1.2.3}\n")  # fmt: skip
    with pytest.raises(ParamsError, match=r"user-data nodeforge: controller\.address: .*multicast"):
        check_user_data(ud, imds_guarded=False)
