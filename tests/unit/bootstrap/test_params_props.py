"""Property tier (hypothesis, bounded): for ANY value that params validation accepts, what the
agent renders parses back to exactly the intended keys: slurm.conf lines (the real template),
the `slurmd --conf` string, the client slurm.conf, systemd drop-in ExecStart words and the
/etc/hosts block. The kernel command-line parser round-trips kernel-style quoted arguments.

Inputs mix grammar-shaped strings with hostile characters (newline, '=', '#', quotes, '%',
'$', NUL, U+2028, spaces) so that both the validator and the renderers are exercised.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nodeforge import slurmconf
from nodeforge.bootstrap import identity
from nodeforge.bootstrap.node_roles import RoleContext
from nodeforge.bootstrap.node_roles.compute import slurmd_exec
from nodeforge.bootstrap.node_roles.controller import _checked, slurm_conf_context
from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.bootstrap.params_sources import kernel_args
from nodeforge.bootstrap.paths import Paths
from nodeforge.bootstrap.slurm_setup import SlurmFeatures, _sd_quote, client_conf, dropin, node_conf
from nodeforge.errors import NodeforgeError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
# Bounded: ~200 examples per property, no example may take 2 s; no example database on disk.
PROPS = settings(
    max_examples=200,
    deadline=2000,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

HOSTILE = list("\n\r\t\x00\x1b\x7f\u2028 =#\"'\\%$(),:;.[]*@é")
name_ish = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,12}", fullmatch=True)
hostile = st.text(alphabet=st.sampled_from(list("abcXYZ019_-.:,/") + HOSTILE), max_size=14)
# A grammar-shaped string with hostile characters spliced in (or a trailing newline).
spliced = st.builds(
    lambda a, h, b: a + h + b, name_ish, st.sampled_from(HOSTILE), st.text("ab", max_size=2)
)
text = st.one_of(hostile, spliced, name_ish.map(lambda s: s + "\n"))
label = st.from_regex(r"[a-z](?:[a-z0-9-]{0,6}[a-z0-9])?", fullmatch=True)
dns = st.builds(lambda ls: ".".join(ls), st.lists(label, min_size=1, max_size=3)).filter(
    lambda s: not s.split(".")[-1].isdigit()
)
ip = st.ip_addresses().map(str)
VALID = {
    "cluster_name": st.from_regex(r"[a-z0-9][a-z0-9_-]{0,8}", fullmatch=True),
    "controller": st.one_of(
        dns,
        ip,
        st.builds(lambda h, a: f"{h}({a})", dns, ip),
        st.fixed_dictionaries({"host": dns, "address": ip}),
        st.fixed_dictionaries({"address": st.one_of(dns, ip)}),
    ),
    "node_name": label,
    "features": st.lists(st.from_regex(r"[A-Za-z0-9_.-]{1,10}", fullmatch=True), max_size=4),
    "gres": st.lists(
        st.from_regex(r"[a-z]{1,5}(:[a-z0-9]{1,4})?(:[0-9]{1,3})?", fullmatch=True), max_size=3
    ),
    "gres_types": st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), max_size=2),
    "partitions": st.lists(
        st.fixed_dictionaries(
            {"name": name_ish},
            optional={
                "default": st.booleans(),
                "max_time": st.sampled_from(["INFINITE", "60", "1-00:00:00", "2:30", "UNLIMITED"]),
            },
        ),
        min_size=1,
        max_size=3,
        unique_by=lambda x: x["name"],
    ),
    "cpus": st.integers(1, 65535),
}
HOSTILE_VALUE = {
    "cluster_name": text,
    "controller": st.one_of(
        text, st.builds(lambda h, a: f"{h}({a})", text, ip), st.just("fe80::1%eth0")
    ),
    "node_name": text,
    "features": st.one_of(st.lists(text, min_size=1, max_size=2), text),
    "gres": st.lists(text, min_size=1, max_size=2),
    "gres_types": st.lists(text, min_size=1, max_size=2),
    "partitions": st.lists(
        st.fixed_dictionaries({"name": text}, optional={"max_time": text}), min_size=1, max_size=2
    ),
    "cpus": st.one_of(st.integers(-5, 0), st.integers(65536, 10**20), st.booleans(), st.floats()),
}
REQUIRED = ("cluster_name", "controller")


@st.composite
def params_docs(draw, role=None):
    """Valid params with at most one field made hostile (half the examples have none)."""
    fields = list(VALID)
    bad = draw(st.integers(0, 2 * len(fields) - 1))
    d = {"role": role or draw(st.sampled_from(["compute", "login", "controller"]))}
    for i, k in enumerate(fields):
        if i == bad:
            d[k] = draw(HOSTILE_VALUE[k])
        elif k in REQUIRED or draw(st.booleans()):
            d[k] = draw(VALID[k])
    return d


def accepted(doc):
    try:
        p = parse_params(doc, "prop")
    except ParamsError:
        event("params refused")
        return None
    event("params accepted")  # --hypothesis-show-statistics: the share that reached a renderer
    return p


def node_or_none(p, hostname):
    """The agent's node name (params.node_name, else the checked hostname label)."""
    try:
        return identity.node_name(p, hostname)
    except NodeforgeError:
        first = hostname.split(".")[0]
        label = re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", first)
        as_ipv4 = re.fullmatch(r"[0-9]+|0[xX][0-9a-fA-F]*", first)  # what inet_aton would read
        assert not p.node_name and (not label or as_ipv4)
        return None


class _MetalHost:
    """Stand-in host for rendering only: answers the one probe the slurm.conf context makes
    (`systemd-detect-virt --container`) with "not a container", so cgroup settings render."""

    def ok(self, argv, timeout=None) -> bool:
        assert argv[0] == "systemd-detect-virt", argv
        return False


def ctx_for(p, tmp: Path, node="n1", address="10.0.0.5"):
    return RoleContext(
        _MetalHost(), Paths.under(tmp), p, SlurmFeatures("24.11.1", True, True), node, address
    )


# -- slurm.conf (the real template), slurmd --conf, client conf ------------------------------------
TEMPLATE = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(REPO / "roles/slurm/templates")),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
).get_template("slurm.conf.j2")


@PROPS
@given(params_docs(role="controller"), st.one_of(label, label, text))
def test_slurm_conf_parses_back_to_intended_keys(tmp_path_factory, doc, hostname):
    p = accepted(doc)
    if p is None:
        return
    node = node_or_none(p, hostname)
    if node is None:
        return
    ctx = ctx_for(p, tmp_path_factory.mktemp("c"), node=node)
    context = _checked(slurm_conf_context(ctx))  # the writer accepts everything params accepts
    lines = slurmconf.parse_conf(TEMPLATE.render(**context))
    parts = [ln for ln in lines if ln[0][0] == "PartitionName"]
    assert [dict(ln) for ln in parts] == [
        {"PartitionName": x.name, "Nodes": "ALL", "Default": "YES" if x.default else "NO",
         "MaxTime": x.max_time, "State": "UP"}
        for x in p.partitions
    ]  # fmt: skip
    assert all(len(ln) == 1 for ln in lines if ln[0][0] != "PartitionName")
    single = [ln[0] for ln in lines if ln[0][0] != "PartitionName"]
    keys = [k for k, _ in single]
    assert len(keys) == len(set(keys)), "a key appears twice"
    conf = dict(single)
    assert conf["ClusterName"] == p.cluster_name
    assert conf["SlurmctldHost"] == f"{node}(10.0.0.5)"
    assert conf.get("GresTypes", "") == ",".join(context["gres_types"])


@PROPS
@given(params_docs(role="compute"))
def test_node_conf_and_client_conf_parse_back(tmp_path_factory, doc):
    p = accepted(doc)
    if p is None:
        return
    got = dict(slurmconf.parse_line(node_conf(p)))
    want = {}
    if p.features:
        want["Feature"] = ",".join(p.features)
    if p.gres:
        want["Gres"] = ",".join(p.gres)
    if p.cpus:
        want["CPUs"] = str(p.cpus)
    assert got == want
    assert all("," not in f and "=" not in f for f in p.features)
    paths = Paths.under(tmp_path_factory.mktemp("cc"))
    lines = slurmconf.parse_conf(client_conf(paths, p).read_text())
    c = p.controller
    ctl = f"{c.host}({c.address})" if c.host and c.address else (c.host or c.address)
    assert lines == [
        [("ClusterName", p.cluster_name)], [("SlurmctldHost", ctl)],
        [("SlurmUser", "slurm")], [("AuthType", "auth/munge")],
    ]  # fmt: skip


# -- systemd drop-in -------------------------------------------------------------------------------
def systemd_words(line: str) -> list[str]:
    """ExecStart= value as systemd reads it: %-specifiers on the line (only %% is ours),
    then C-style word splitting, then $$ -> $ per word ($NAME left as an expansion)."""
    assert re.fullmatch(r"(?:[^%]|%%)*", line), f"an unescaped % specifier in {line!r}"
    line = line.replace("%%", "%")
    words = shlex.split(line, posix=True)  # double quotes + backslash escapes, as we write them
    return [w if re.fullmatch(r"\$[A-Z_][A-Z0-9_]*", w) else w.replace("$$", "$") for w in words]


@PROPS
@given(
    st.lists(
        st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E)).filter(bool),
        max_size=6,
    )
)
def test_systemd_word_round_trip(args):
    args = [a for a in args if not re.fullmatch(r"\$[A-Z_][A-Z0-9_]{0,63}", a)]
    line = " ".join(_sd_quote(a) for a in args)
    assert "\n" not in line and systemd_words(line) == args


@PROPS
@given(params_docs(role="compute"), st.one_of(label, label, text))
def test_dropin_parses_back_to_the_argv(tmp_path_factory, doc, hostname):
    p = accepted(doc)
    if p is None:
        return
    node = node_or_none(p, hostname)
    if node is None:
        return
    ctx = ctx_for(p, tmp_path_factory.mktemp("d"), node=node)
    argv = slurmd_exec(ctx)
    dropin(ctx.paths, "slurmd.service", argv)
    text = (ctx.paths.systemd_etc / "slurmd.service.d/nodeforge.conf").read_text()
    body = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert body[:4] == ["[Unit]", "ConditionPathExists=", "[Service]", "ExecStart="]
    assert len(body) == 5 and body[4].startswith("ExecStart=")
    assert systemd_words(body[4][len("ExecStart=") :]) == argv


# -- /etc/hosts --------------------------------------------------------------------------------------
@PROPS
@given(
    params_docs(role="compute"), st.sampled_from(["", "127.0.0.1 localhost\n", "# x\n::1 ip6\n"])
)
def test_hosts_block_parses_back(doc, existing):
    p = accepted(doc)
    if p is None or not (p.controller.host and p.controller.address):
        return
    entries = {p.controller.host: p.controller.address}
    if p.node_name:
        entries[p.node_name] = "10.0.0.5"
    text = identity._hosts_text(existing, entries)
    assert text.startswith(existing)
    block = identity.parse_hosts_block(text)
    want: dict[str, list[str]] = {}
    for n, a in sorted(entries.items()):
        want.setdefault(a, []).append(n)
    assert block == want


# -- kernel command line -----------------------------------------------------------------------------
kkey = st.from_regex(r"[a-z][a-z0-9_.-]{0,10}", fullmatch=True)
# Anything the kernel can carry in a value except '"' (no escape exists for it) and NUL.
kval = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"')
)


def kquote(k: str, v: str | None) -> str:
    if v is None:
        return k
    return f'{k}="{v}"' if (" " in v or v == "") else f"{k}={v}"


@PROPS
@given(
    st.lists(st.tuples(kkey, st.one_of(st.none(), kval)), max_size=8),
    st.sampled_from([" ", "  ", "\t", " \n"]),
)
def test_kernel_args_round_trip(args, sep):
    args = [(k, v) for k, v in args if k != "--"]
    text = sep.join(kquote(k, v) for k, v in args) + "\n"
    assert kernel_args(text) == args


# -- HyperPod: any JSON shape gives params or a ParamsError, never a Python exception ----------
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.sampled_from(["", "ctl", "w", "10.0.0.1", "dev"]),
)
json_any = st.recursive(
    json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.dictionaries(st.sampled_from(["Name", "Instances", "x"]), kids, max_size=3),
    ),
    max_leaves=10,
)
instance = st.fixed_dictionaries(
    {},
    optional={
        "InstanceName": st.one_of(st.sampled_from(["a", "b", "ctl"]), json_leaf),
        "CustomerIpAddress": st.one_of(st.sampled_from(["10.0.0.1", "10.0.0.2"]), json_any),
    },
)
group = st.fixed_dictionaries(
    {},
    optional={
        "Name": st.one_of(st.sampled_from(["ctl", "w", "login"]), json_leaf),
        "Instances": st.one_of(st.lists(st.one_of(instance, json_leaf), max_size=3), json_any),
    },
)
CTL_GROUP = {"Name": "ctl", "Instances": [{"InstanceName": "ctl", "CustomerIpAddress": "10.0.0.1"}]}
clean_group = st.fixed_dictionaries(
    {"Name": st.sampled_from(["w", "login", "x"]), "Instances": st.lists(instance, max_size=2)}
)
rc_clean = st.builds(
    lambda more: {"InstanceGroups": [CTL_GROUP, *more]},
    st.lists(clean_group, max_size=3, unique_by=lambda g: g["Name"]),
)
rc_doc = st.one_of(
    rc_clean,
    rc_clean,
    rc_clean,
    st.builds(
        lambda more: {"InstanceGroups": [CTL_GROUP, *more]},
        st.lists(st.one_of(group, json_leaf), max_size=3),
    ),
    st.fixed_dictionaries({"InstanceGroups": st.lists(st.one_of(group, json_leaf), max_size=4)}),
    json_any,
)
pp_fields = st.fixed_dictionaries(
    {},
    optional={
        "controller_group": st.one_of(st.just("ctl"), st.just("ctl"), st.just("w"), json_leaf),
        "login_group": st.one_of(st.just("login"), json_leaf),
        "worker_groups": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "instance_group_name": st.one_of(st.just("w"), json_leaf),
                        "partition_name": st.one_of(st.just("dev"), json_leaf),
                    },
                ),
                max_size=2,
            ),
            json_any,
        ),
        "nodeforge": st.one_of(
            st.fixed_dictionaries({}, optional={"features": json_any, "extra": json_any}),
            json_any,
        ),
    },
)
pp_clean = st.builds(
    lambda nf: {
        "controller_group": "ctl",
        "login_group": "login",
        "worker_groups": [{"instance_group_name": "w", "partition_name": "dev"}],
        **nf,
    },
    st.fixed_dictionaries(
        {},
        optional={
            "nodeforge": st.fixed_dictionaries(
                {},
                optional={
                    "features": st.one_of(st.just("ib, nvme"), st.just(["ib"]), json_any),
                    "hook_timeout": st.one_of(st.just(30), json_leaf),
                },
            )
        },
    ),
)
pp_doc = st.one_of(
    pp_clean,
    pp_clean,
    pp_clean,
    st.builds(lambda rest: {**rest, "controller_group": "ctl"}, pp_fields),
    st.builds(lambda rest: {**rest, "controller_group": "ctl"}, pp_fields),
    pp_fields,
    json_any,
)


@PROPS
@given(
    rc_doc,
    pp_doc,
    st.one_of(
        st.just({"10.0.0.1"}),
        st.sets(st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.9"]), max_size=2),
    ),
    st.sampled_from(["", "a", "b"]),
)
def test_hyperpod_never_raises_a_python_exception(rc, pp, addrs, hostname):
    from nodeforge.bootstrap.params_sources import hyperpod_params

    try:
        data = hyperpod_params(rc, pp, addrs, hostname, "rc", "pp")
        parse_params(data, "pp")
    except ParamsError:
        event("ParamsError")
        return
    event("resolved")
