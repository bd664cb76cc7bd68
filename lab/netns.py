"""Network namespaces and the private bridge of a local cluster.

Layout: one "fabric" namespace per cluster holds a Linux bridge; each node gets its own
namespace with a veth whose peer is enslaved to that bridge. Nothing is added to the host's
own network namespace, and the only addresses are the ones assigned here.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from nodeforge import proc

NETNS_DIR = Path("/run/netns")


def _ip(*args: str, ns: str | None = None, check: bool = True):
    argv = [proc.require_tool("ip")]
    if ns:
        argv += ["-n", ns]
    return proc.run([*argv, *args], check=check, timeout=30)


def exists(ns: str) -> bool:
    return (NETNS_DIR / ns).exists()


@dataclass(frozen=True)
class Fabric:
    ns: str  # fabric namespace name
    subnet: ipaddress.IPv4Network
    bridge: str = "br0"

    def create(self) -> None:
        if not exists(self.ns):
            _ip("netns", "add", self.ns)
        _ip("link", "set", "lo", "up", ns=self.ns)
        if _ip("link", "show", self.bridge, ns=self.ns, check=False).returncode != 0:
            _ip("link", "add", self.bridge, "type", "bridge", ns=self.ns)
        _ip("link", "set", self.bridge, "up", ns=self.ns)

    def attach(self, node_ns: str, index: int, address: ipaddress.IPv4Address) -> None:
        """Create the node's namespace and wire it to the bridge as eth0 with *address*."""
        if not exists(node_ns):
            _ip("netns", "add", node_ns)
        _ip("link", "set", "lo", "up", ns=node_ns)
        if _ip("link", "show", "eth0", ns=node_ns, check=False).returncode == 0:
            return  # already wired (idempotent re-attach after a partial failure)
        peer = f"nfv{index}"
        # Created inside the fabric namespace so no interface ever appears on the host.
        _ip(
            "link",
            "add",
            peer,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            node_ns,
            ns=self.ns,
        )
        _ip("link", "set", peer, "master", self.bridge, ns=self.ns)
        _ip("link", "set", peer, "up", ns=self.ns)
        _ip("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0", ns=node_ns)
        _ip("link", "set", "eth0", "up", ns=node_ns)

    def detach(self, node_ns: str) -> None:
        if exists(node_ns):
            # Deleting the namespace destroys eth0 and with it the veth peer on the bridge.
            _ip("netns", "delete", node_ns, check=False)

    def destroy(self) -> None:
        if exists(self.ns):
            _ip("netns", "delete", self.ns, check=False)


def list_namespaces(prefix: str) -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))
