"""`nodeforge params check`: validate node params offline, before launching 100 nodes.

The same readers and rules as the agent (strict YAML, kernel quoting, secret sources, HyperPod
resolution); nothing is fetched from the network and nothing is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nodeforge import redact

from .params import Params, ParamsError, parse_params
from .params_sources import (
    _params_url,
    _read_params_file,
    _user_data_section,
    cmdline_params,
    load_hyperpod,
    load_node_yaml,
)


@dataclass(frozen=True)
class Checked:
    params: Params
    source: str

    def public(self) -> dict[str, Any]:
        # A display: also a secret pasted into a free-form field (extra) is hidden here.
        return redact.obj({"source": self.source, "params": self.params.public_dict()})


def check_node_yaml(path: Path) -> Checked:
    return Checked(load_node_yaml(path), f"file:{path}")


def check_user_data(path: Path, imds_guarded: bool) -> Checked:
    text, _ = _read_params_file(path, str(path))
    section = _user_data_section(text, str(path), imds_guarded)
    if section is None:
        raise ParamsError(
            f"{path}: no node params in this user-data; add a `nodeforge:` section (a mapping "
            "of node params) to the #cloud-config document, or give a plain YAML mapping with `role`"
        )
    return Checked(parse_params(section, f"{path} nodeforge"), "user-data")


def check_cmdline(raw: bytes | str, label: str) -> Checked:
    """*raw*: /proc/cmdline's bytes, or a string (made bytes the one way: cmdline_bytes)."""
    data = cmdline_params(raw, label, url_reader=_offline_url)
    if data is None:
        raise ParamsError(f"{label}: no nodeforge.* arguments (e.g. nodeforge.role=compute)")
    return Checked(parse_params(data, label), "cmdline")


def _offline_url(url: str, label: str) -> dict[str, Any]:
    if not url.startswith("file://"):
        raise ParamsError(
            f"{label}: not fetched (params check is offline); download the document and give "
            "nodeforge.params=file:///path/to/it"
        )
    return _params_url(url, label)


def check_hyperpod(directory: Path, addresses: list[str], hostname: str) -> Checked:
    rc = directory / "resource_config.json"
    pp = directory / "provisioning_parameters.json"
    for f in (rc, pp):
        if not f.exists():
            raise ParamsError(f"{f}: missing; --hyperpod DIR needs HyperPod's {f.name}")
    return Checked(load_hyperpod(rc, pp, set(addresses), hostname), "hyperpod")


def render(checked: Checked, as_json: bool) -> str:
    if as_json:
        return json.dumps(checked.public(), indent=2) + "\n"
    head = f"valid node params ({checked.source}); secrets redacted\n"
    return head + yaml.safe_dump(checked.public()["params"], sort_keys=False)
