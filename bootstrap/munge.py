"""Munge step: the cluster's shared key (0400 munge:munge), then munged started and answering."""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic

from .host import Host
from .params import Params
from .paths import Paths
from .private_read import UnsafeFileError, read_private


def key_bytes(params: Params, source_label: str) -> bytes | None:
    if params.munge_key is not None:
        return params.munge_key_bytes()
    if params.munge_key_file:
        p = Path(params.munge_key_file)
        try:
            got = read_private(p, f"{source_label}: munge_key_file", max_bytes=4096)
        except UnsafeFileError as exc:
            raise NodeforgeError(
                f"{exc}; put the cluster's munge key there (0400, owner root) "
                "or give munge_key (base64) in a root-only node.yaml instead"
            ) from None
        if got.exposure:
            raise NodeforgeError(
                f"{source_label}: munge_key_file: {p} is {got.exposure}; a munge key must be "
                "readable by root only (chown root:root, chmod 0400)"
            )
        raw = got.data
        # Accept either the raw key or its base64 text.
        try:
            dec = base64.b64decode(raw.strip(), validate=True)
            if len(dec) >= 32 and raw.strip().isascii():
                raw = dec
        except (binascii.Error, ValueError):
            pass
        if len(raw) < 32:
            raise NodeforgeError(
                f"{source_label}: munge_key_file: {p} holds {len(raw)} bytes; munge needs ≥ 32"
            )
        return raw
    return None


def run(host: Host, paths: Paths, params: Params, source_label: str) -> dict:
    key = key_bytes(params, source_label)
    detail: dict[str, object] = {}
    changed = False
    if key is None:
        if not paths.munge_key.exists():
            raise NodeforgeError(
                f"{source_label}: munge_key: missing and {paths.munge_key} does not exist; give the "
                "cluster's key as munge_key (base64 -w0 /etc/munge/munge.key) or munge_key_file"
            )
        detail["key"] = "kept existing"
    else:
        changed = write_atomic(paths.munge_key, key, 0o400)
        host.chown(paths.munge_key, "munge", "munge")
        detail["key"] = "written" if changed else "unchanged"
    # A new key: `restart` starts a stopped munged and makes a running one read the key, in one
    # systemctl call (not is-active, then restart or start: one spawn less on every first
    # boot's path to ready). Otherwise `start` (a no-op when it runs).
    host.start("munge.service", timeout=60, restart=changed)
    host.wait_until(
        "munge answering (munge -n)",
        lambda: host.ok(["munge", "-n"], timeout=10),
        timeout=min(params.wait_timeout, 60),
        interval=0.05,  # local and cheap; the default 1 s poll would be a second on the path
        hint="see `journalctl -u munge`",
    )
    return detail


def verify(host: Host, paths: Paths, params: Params, source_label: str) -> bool:
    key = key_bytes(params, source_label)
    try:
        if key is not None and paths.munge_key.read_bytes() != key:
            return False
    except OSError:
        return False
    return host.is_active("munge.service")
