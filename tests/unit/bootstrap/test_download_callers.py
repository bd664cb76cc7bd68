"""The params URL goes through nodeforge.download: a truncated or oversized body is a ParamsError
naming the source, never half a params document."""

from __future__ import annotations

import pytest

from nodeforge import download
from nodeforge.bootstrap import params_sources
from nodeforge.bootstrap.params import ParamsError
from nodeforge.bootstrap.params_sources import SourceConfig, load_params
from nodeforge.bootstrap.paths import Paths
from tests.helpers import QuietHandler, http_server

pytestmark = pytest.mark.unit

# No secret in it: a params URL is not a root-only source, so a munge_key there is refused
# (tests/unit/bootstrap/test_params_hostile.py).
DOC = b"role: compute\ncluster_name: demo\ncontroller: ctl\nmunge_key_file: /etc/munge/munge.key\n"


@pytest.fixture
def server():
    class H(QuietHandler):
        def do_GET(self):
            body = DOC if self.path != "/big" else b"x: y\n" * 300_000
            cut = 50 if self.path == "/cut" else 0  # promises 50 bytes more than it sends
            self.send(200, body, length=len(body) + cut, close=True)

    with http_server(H) as base:
        yield base


def _load(tmp_path, url):
    paths = Paths.under(tmp_path)
    paths.cmdline.parent.mkdir(parents=True, exist_ok=True)
    paths.cmdline.write_text(f"quiet nodeforge.params={url} nodeforge.node=c7\n")
    return load_params(SourceConfig(paths, imds_url=None))


def test_params_url_whole_body(server, tmp_path):
    got = _load(tmp_path, server + "/ok")
    assert got.params.role == "compute" and got.params.node_name == "c7"


def test_params_url_truncated_or_too_big(server, tmp_path, monkeypatch):
    monkeypatch.setattr(
        params_sources,
        "PARAMS_URL_POLICY",
        download.Policy(timeout=5, attempts=1, max_bytes=1 << 20),
    )
    with pytest.raises(
        ParamsError,
        match=r"kernel command line nodeforge.params=\S*: cannot download "
        r".*/cut: truncated body",
    ):
        _load(tmp_path, server + "/cut")
    with pytest.raises(ParamsError, match=r"over the limit of 1048576 bytes"):
        _load(tmp_path, server + "/big")
