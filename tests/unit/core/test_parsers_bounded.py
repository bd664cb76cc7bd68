"""Parsers are bounded (issue 23, item 2): nesting, value count and size are refused before
the parse builds anything, with an error naming the file and the field or line, for every
YAML and JSON document from outside: node.yaml, user-data (ours or not), nodeforge.params
documents, HyperPod's JSON, the versions file, gang.yaml and Slurm's JSON. Refusing the worst
input stays cheap (time and memory)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from nodeforge import slurm_records, strict_json, strict_yaml
from nodeforge.bootstrap.params import ParamsError
from nodeforge.bootstrap.params_check import check_cmdline, check_hyperpod, check_user_data
from nodeforge.bootstrap.params_sources import (
    SourceConfig,
    load_node_yaml,
    load_params,
    params_from_user_data,
)
from nodeforge.bootstrap.paths import Paths
from nodeforge.errors import NodeforgeError
from nodeforge.gang import config as gang_config
from nodeforge.images import versions

pytestmark = pytest.mark.unit

BASE = "role: compute\ncluster_name: demo\ncontroller: 10.0.0.1\n"
DEEP = 2000  # under 1 KB of brackets... and far past Python's recursion limit as YAML


def _file(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / name
    p.write_text(text)
    p.chmod(mode)
    return p


@pytest.mark.parametrize(
    "doc, where",
    [
        (BASE + "extra: " + "[" * DEEP + "]" * DEEP + "\n", "line 4, extra: "),
        (BASE + "extra: " + "[" * DEEP + "\n", "line 4, extra: "),  # unclosed too
        (BASE + "extra: " + "{a: " * DEEP + "1" + "}" * DEEP, "line 4, extra.a.a"),
        (
            BASE + "extra:" + "".join(f"\n{'  ' * (i + 1)}a:" for i in range(40)) + " 1\n",
            "extra.a.a",
        ),
        ("- " * 400 + "a\n", "line 1, [0][0]"),
    ],
)
def test_deep_node_yaml_is_a_params_error_naming_file_and_field(tmp_path, doc, where):
    p = _file(tmp_path, "node.yaml", doc)
    with pytest.raises(ParamsError) as ei:
        load_node_yaml(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: line ")
    assert where in msg
    assert f"nested deeper than {strict_yaml.MAX_DEPTH} levels" in msg


def test_deep_node_yaml_through_the_agent_and_params_check(tmp_path):
    """`node init` (load_params) and `params check` both refuse it: no RecursionError."""
    paths = Paths.under(tmp_path)
    paths.node_yaml.parent.mkdir(parents=True)
    paths.node_yaml.write_text(BASE + "extra: " + "[" * DEEP)
    paths.node_yaml.chmod(0o600)
    with pytest.raises(ParamsError, match=r"node\.yaml: line 4, extra: nested deeper"):
        load_params(SourceConfig(paths, imds_url=None))


def test_too_many_values_is_refused_naming_the_field(tmp_path):
    n = strict_yaml.MAX_NODES + 10
    p = _file(tmp_path, "node.yaml", BASE + "extra:\n  users: [" + "1," * n + "1]\n")
    with pytest.raises(
        ParamsError,
        match=rf"node\.yaml: line 5, extra\.users\[\d+\]: more than {strict_yaml.MAX_NODES} values",
    ):
        load_node_yaml(p)


def test_nodeforge_params_document_is_bounded(tmp_path):
    doc = _file(tmp_path, "p.yaml", "extra: " + "[" * DEEP)
    with pytest.raises(
        ParamsError, match=r"nodeforge\.params=file://.*: line 1, extra: nested deeper"
    ):
        check_cmdline(f"nodeforge.params=file://{doc} nodeforge.role=compute", "cmdline")


def test_kernel_command_line_is_bounded():
    with pytest.raises(
        ParamsError, match=r"^c: 65537 characters; a kernel command line is at most 65536"
    ):
        check_cmdline("nodeforge.role=compute " + "x" * (65537 - 23), "c")


def test_params_url_with_a_nul_is_a_params_error():
    with pytest.raises(ParamsError, match="not a file path"):
        check_cmdline("nodeforge.params=file:///etc/x\x00y nodeforge.role=compute", "cmdline")


def test_user_data_ours_deep_is_an_error_naming_the_file(tmp_path):
    p = _file(tmp_path, "ud", "#cloud-config\nnodeforge:\n  extra: " + "[" * DEEP + "\n")
    with pytest.raises(ParamsError, match=rf"{p}: line 3, nodeforge\.extra: nested deeper"):
        check_user_data(p, imds_guarded=True)


@pytest.mark.parametrize(
    "doc",
    [
        "#cloud-config\nruncmd: " + "[" * DEEP + "]" * DEEP + "\n",  # someone else's, deep
        "#cloud-config\nwrite_files: [" + "a," * (strict_yaml.MAX_NODES + 5) + "a]\n",
        "#cloud-config\npackages: " + "{a: " * DEEP,
        "x: &a [1, 2]\ny: *a\n" + "z: " + "[" * DEEP,  # anchors allowed when not ours
    ],
)
def test_user_data_not_ours_is_not_ours_however_hostile(tmp_path, doc):
    """Another tool's user-data never crashes the agent: it is simply not our params."""
    assert params_from_user_data(doc, "ud") is None
    p = _file(tmp_path, "ud", doc)
    with pytest.raises(ParamsError, match="no node params in this user-data"):
        check_user_data(p, imds_guarded=True)


def test_user_data_too_large_but_ours_is_an_error(tmp_path):
    doc = "nodeforge:\n  role: compute\n  extra: {a: '" + "x" * strict_yaml.MAX_BYTES + "'}\n"
    with pytest.raises(ParamsError, match=r"ud: \d+ bytes; documents are limited to 1048576"):
        params_from_user_data(doc, "ud")


def _hyperpod(tmp_path: Path, rc: str) -> Path:
    _file(tmp_path, "resource_config.json", rc)
    pp = {"controller_group": "ctl", "worker_groups": []}
    _file(tmp_path, "provisioning_parameters.json", json.dumps(pp))
    return tmp_path


@pytest.mark.parametrize(
    "rc, why",
    [
        ('{"InstanceGroups": ' + "[" * DEEP + "]" * DEEP + "}", "nested deeper than 32 levels"),
        ("[" * 100000, "nested deeper than 32 levels"),
        ('{"a": [' + "1," * (strict_json.MAX_VALUES + 1) + "1]}", "more than 200000 values"),
        ('{"InstanceGroups": [], "x": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
        (
            '{"InstanceGroups": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}',
            "InstanceGroups: expected a list",
        ),
    ],
)
def test_hyperpod_json_is_bounded(tmp_path, rc, why):
    d = _hyperpod(tmp_path, rc)
    with pytest.raises(ParamsError) as ei:
        check_hyperpod(d, ["10.0.0.1"], "")
    assert str(ei.value).startswith(f"{d / 'resource_config.json'}: ")
    assert why in str(ei.value)


def test_versions_file_is_bounded(tmp_path):
    p = _file(tmp_path, "versions.yaml", "schema: 1\nbases: " + "[" * DEEP, 0o644)
    with pytest.raises(NodeforgeError, match=rf"versions file {p}: line 2, bases: nested deeper"):
        versions.load(p)


def test_gang_config_is_bounded(tmp_path):
    p = _file(tmp_path, "gang.yaml", "gangs: {partitions: " + "[" * DEEP + "}", 0o644)
    with pytest.raises(
        gang_config.ConfigError, match=rf"{p}: line 1, gangs\.partitions: nested deeper"
    ):
        gang_config.load(p)
    p.write_text("timeout: &t 5\ncommand_timeout: *t\n")
    with pytest.raises(gang_config.ConfigError, match=rf"{p}: line 1, timeout: anchor &t"):
        gang_config.load(p)


@pytest.mark.parametrize("parse", [slurm_records.parse_jobs, slurm_records.parse_nodes])
def test_slurm_json_nested_past_the_recursion_limit(parse):
    text = '{"jobs": ' + "[" * 100000 + "]" * 100000 + ', "nodes": []}'
    with pytest.raises(slurm_records.SlurmDataError, match="nested too deep"):
        parse(text, "squeue --json")
    with pytest.raises(slurm_records.SlurmDataError, match="nested too deep"):
        parse(text.encode(), "squeue --json", slurm_records.BlockCache())


def test_explicit_tags_are_refused():
    for doc, tag in (("cpus: !!int 010\n", "!!int"), ("a: !!binary aGk=\n", "!!binary"),
                     ("a: !!python/object:os.system x\n", "!!python/object:os.system"),
                     ("a: !custom [1]\n", "!custom")):  # fmt: skip
        with pytest.raises(strict_yaml.StrictYAMLError, match="line 1, a|line 1, cpus"):
            strict_yaml.load(doc)
        with pytest.raises(strict_yaml.StrictYAMLError, match=f"tag {tag} is not allowed"):
            strict_yaml.load(doc)
    assert strict_yaml.load("a: ! 010\n") == {"a": "010"}  # '!' only says "a string"


def _cost(fn) -> tuple[float, int]:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    except NodeforgeError:
        pass
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return took, peak


@pytest.mark.parametrize(
    "name, doc",
    [
        ("flat list", "a: [" + "1," * 500_000 + "1]\n"),
        ("flat mapping", "".join(f"k{i}: {i}\n" for i in range(100_000))),
        ("deep", "a: " + "[" * 1_000_000),
        ("deep block", "- " * 500_000 + "a\n"),
        ("one scalar", "a: " + "x" * 1_000_000 + "\n"),
    ],
)
def test_refusing_a_hostile_megabyte_is_cheap(tmp_path, name, doc):
    """Before: 11 s and 234 MB for a flat 1 MB document. The peak memory (traced Python
    allocations) is the deterministic bound; the time bound is generous for a shared CI box."""
    doc = doc[: strict_yaml.MAX_BYTES - 1]  # under the byte cap: the other bounds refuse it
    p = _file(tmp_path, "node.yaml", BASE + doc)
    took, peak = _cost(lambda: load_node_yaml(p))
    assert peak < 12 * 1024 * 1024, f"{name}: {peak} bytes"
    assert took < 3.0, f"{name}: {took:.2f} s"


def test_pure_python_fallback_has_the_same_rules(monkeypatch):
    """Where PyYAML has no libyaml (a node without python3-yaml's C part) the loader falls
    back to PyYAML's Python parser, with the same bounds and typing."""
    monkeypatch.setattr(yaml, "__with_libyaml__", False)
    spec = importlib.util.spec_from_file_location("strict_yaml_py", strict_yaml.__file__)
    assert spec is not None and spec.loader is not None
    py = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "strict_yaml_py", py)  # dataclasses look it up
    spec.loader.exec_module(py)
    assert not hasattr(py, "CParser")
    doc = "a: 2:00:00\nb: 010\nc: 12\nd: 1.5\ne: 2024-01-01\n"
    assert py.load(doc) == strict_yaml.load(doc) == {
        "a": "2:00:00", "b": "010", "c": 12, "d": 1.5, "e": "2024-01-01"
    }  # fmt: skip
    for bad in ("a: " + "[" * 100, "a: &x 1\nb: *x\n", "a: 1\na: 2\n", "a: !!int 1\n"):
        with pytest.raises(strict_yaml.StrictYAMLError) as c_err:
            strict_yaml.load(bad)
        with pytest.raises(py.StrictYAMLError) as py_err:
            py.load(bad)
        assert str(py_err.value) == str(c_err.value)
