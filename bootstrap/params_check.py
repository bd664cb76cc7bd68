"""`nodeforge params check`: validate node params offline, before launching 100 nodes.

The same readers and rules as the agent (strict YAML, kernel quoting, secret sources, HyperPod
resolution, the extension hooks' trust rules); nothing is fetched from the network and
nothing is written.
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
    # nodeforge.params=http(s):// documents named but not fetched (params check is offline)
    unfetched: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # The hook trust rules that params alone decide are the agent's too (hooks.discover):
        # what passes here is not refused at boot for what the file says.
        from .hooks import HookError, extension_hooks

        try:
            extension_hooks(self.params)
        except HookError as exc:
            raise ParamsError(f"{self.source}: {exc}") from None

    def public(self) -> dict[str, Any]:
        # A display: also a secret pasted into a free-form field (extra) is hidden here.
        doc = {"source": self.source, "params": self.params.public_dict()}
        if self.unfetched:
            doc["not_fetched"] = list(self.unfetched)
        return redact.obj(doc)


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
    """*raw*: /proc/cmdline's bytes, or a string (made bytes the one way: cmdline_bytes).
    A nodeforge.params=http(s):// URL is checked as a URL and reported, not fetched: the keys
    of its document are the agent's to check at boot."""
    unfetched: list[str] = []

    def offline(url: str, where: str) -> dict[str, Any]:
        if url.startswith(("http://", "https://")):
            from nodeforge import download

            problem = download.url_problem(url)
            if problem:
                raise ParamsError(f"{where}: {problem}; give an http(s):// URL or file://")
            unfetched.append(download.display_url(url))
            return {}
        return _params_url(url, where)

    data = cmdline_params(raw, label, url_reader=offline)
    if data is None:
        raise ParamsError(f"{label}: no nodeforge.* arguments (e.g. nodeforge.role=compute)")
    return Checked(parse_params(data, label), "cmdline", tuple(unfetched))


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
    for url in checked.public().get("not_fetched", []):
        head += (
            f"not fetched (params check is offline): nodeforge.params={url}; the keys of that "
            "document are checked by the agent at boot (download it and give file:// to check "
            "them here)\n"
        )
    return head + yaml.safe_dump(checked.public()["params"], sort_keys=False)
