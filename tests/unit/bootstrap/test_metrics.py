"""Every image serves its metrics: role `metrics` (node_exporter) and params `metrics_listen`."""

from __future__ import annotations

import os
from pathlib import Path

import jinja2
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.bootstrap import health, metrics
from nodeforge.bootstrap.host import Host
from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.bootstrap.paths import Paths
from tests.helpers import REPO
from tests.unit.support import FakeHost

pytestmark = pytest.mark.unit
ROLE = REPO / "roles/metrics"
BASE = {"role": "compute", "cluster_name": "c", "controller": "ctl(10.0.0.2)"}


def _render(name: str) -> list[str]:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["dirname"] = os.path.dirname  # an Ansible filter
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    text = env.from_string((ROLE / "templates" / name).read_text())
    return text.render(ansible_managed="test", **defaults).splitlines()


def test_role_wires_node_exporter_to_the_agents_file_and_the_reports():
    """/var/lib/nodeforge is 0700: node_exporter (user prometheus) got "permission denied" on
    the textfile directory, so no gang or health metric was served; and nothing may be served
    before the agent has read this node's params."""
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    assert Path(defaults["metrics_textfile_dir"]) == health.REPORT_DIR == Path(metrics.TEXTFILE_DIR)
    assert Path(defaults["metrics_env_file"]) == Paths().metrics_env
    lines = _render("node-exporter-nodeforge.conf.j2")
    assert "ConditionPathExists=/etc/nodeforge/metrics.env" in lines
    assert "After=nodeforge-init.service" in lines
    assert "EnvironmentFile=/etc/nodeforge/metrics.env" in lines
    assert "TemporaryFileSystem=/var/lib/nodeforge:ro" in lines
    assert "BindReadOnlyPaths=/var/lib/nodeforge/gang" in lines
    tasks = yaml.safe_load((ROLE / "tasks/install.yml").read_text())
    dests = [t.get("ansible.builtin.template", {}).get("dest") for t in tasks]
    assert "/etc/systemd/system/{{ metrics_unit }}.d/nodeforge.conf" in dests
    site = yaml.safe_load((REPO / "images/site.yml").read_text())
    roles = [r["role"] for r in site[1]["roles"]]
    assert "metrics" in roles and "when" not in site[1]["roles"][roles.index("metrics")]


@pytest.mark.parametrize(
    ("listen", "address", "want"),
    [
        ("node:9100", "10.0.0.5", "10.0.0.5:9100"),
        ("node:9100", "fd00::5", "[fd00::5]:9100"),
        ("*:9200", "10.0.0.5", ":9200"),
        ("127.0.0.1:9100", "10.0.0.5", "127.0.0.1:9100"),
        ("[fd00::7]:9100", "10.0.0.5", "[fd00::7]:9100"),
        ("off", "10.0.0.5", None),
    ],
)
def test_listen_address(listen, address, want):
    assert parse_params(BASE | {"metrics_listen": listen}, "t").metrics_listen == listen
    assert metrics.listen_address(listen, address) == want


def test_default_is_the_nodes_own_address():
    assert parse_params(BASE, "t").metrics_listen == "node:9100"


@pytest.mark.parametrize(
    "bad",
    [
        "9100", "node", "node:0", "node:65536", "node:09100", "0.0.0.0:9100", "[::]:9100",
        "224.0.0.1:9100", "255.255.255.255:9100", "localhost:9100", "node:9100\n", "10.0.0.1:9100 x",
        "[fe80::1%eth0]:9100", 9100, True, None, ["node:9100"], "*:9100:1", "10.0.0.256:9100",
    ],
)  # fmt: skip
def test_bad_listen_is_refused_naming_the_field(bad):
    with pytest.raises(ParamsError, match="metrics_listen"):
        parse_params(BASE | {"metrics_listen": bad}, "node.yaml")


@given(st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_any_listen_text_is_valid_or_a_field_error(text):
    try:
        p = parse_params(BASE | {"metrics_listen": text}, "node.yaml")
    except ParamsError as exc:
        assert "metrics_listen" in str(exc)
        return
    out = metrics.listen_address(p.metrics_listen, "10.0.0.5")
    assert out is None or ("\n" not in out and " " not in out)


def _unit(paths: Paths) -> None:
    (paths.systemd_lib[0]).mkdir(parents=True, exist_ok=True)
    (paths.systemd_lib[0] / metrics.UNIT).write_text("[Service]\n")


def test_apply_writes_the_arguments_and_restarts_only_on_a_change(tmp_path):
    paths, calls = Paths.under(tmp_path), FakeHost()
    _unit(paths)
    host = Host(run=calls.run)
    assert metrics.apply(host, paths, "node:9100", "10.0.0.5") == "10.0.0.5:9100"
    text = paths.metrics_env.read_text()
    assert "ARGS=--collector.textfile.directory=/var/lib/nodeforge/gang " in text
    assert "--web.listen-address=10.0.0.5:9100\n" in text
    assert calls.calls == [["systemctl", "try-restart", "--no-block", metrics.UNIT]]
    metrics.apply(host, paths, "node:9100", "10.0.0.5")  # every boot: unchanged, no call
    assert len(calls.calls) == 1
    assert metrics.apply(host, paths, "off", "10.0.0.5") == "off"
    assert not paths.metrics_env.exists()  # the unit's condition now keeps it off
    assert calls.calls[-1] == ["systemctl", "stop", "--no-block", metrics.UNIT]


def test_apply_without_the_exporter_installed_makes_no_call(tmp_path):
    paths, calls = Paths.under(tmp_path), FakeHost()
    metrics.apply(Host(run=calls.run), paths, "*:9100", "10.0.0.5")
    assert calls.calls == [] and "--web.listen-address=:9100" in paths.metrics_env.read_text()
