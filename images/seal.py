"""Post-stop sealing: what the sandbox's own boot and shutdown (re)create, removed from the tree.

The Ansible `seal` role seals everything it can from inside; these items only settle once
systemd in the sandbox has powered off, so they are handled here, on the stopped tree. Each
item carries its reason; the build log lists what was removed.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass(frozen=True)
class SealItem:
    pattern: str  # glob relative to the tree root
    action: str  # "remove" | "truncate" | "replace"
    reason: str
    content: str = ""  # for "replace"


ITEMS: tuple[SealItem, ...] = (
    SealItem("etc/machine-id", "truncate",
             "empty machine-id: systemd generates a unique one on each node's first boot"),
    SealItem("var/lib/dbus/machine-id", "remove", "D-Bus copy of the build sandbox's machine id"),
    SealItem("var/lib/systemd/random-seed", "remove",
             "every node would start from the same entropy seed"),
    SealItem("var/lib/systemd/credential.secret", "remove",
             "host key for systemd credentials; must be per node"),
    SealItem("etc/ssh/ssh_host_*", "remove", "SSH host keys are generated per node at first boot"),
    SealItem("root/.ssh/authorized_keys", "remove", "the build's throwaway access key"),
    SealItem("etc/ssh/sshd_config.d/00-nodeforge-build.conf", "remove", "build-only sshd port"),
    SealItem("etc/resolv.conf", "truncate",
             "the build host's DNS settings; each node gets its own from DHCP or nspawn"),
    SealItem("etc/hostname", "remove",
             "the build host's name; each node takes its name from params, DHCP or nspawn"),
    SealItem("etc/hosts", "replace", "the build host's entries; nodes write their own",
             "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"),
    SealItem("var/log/journal/*", "remove", "journal of the build sandbox's or VM's boots"),
    SealItem("var/log/**/*.log", "truncate", "logs of the build; files kept for their owners/modes"),
    SealItem("var/log/wtmp", "truncate", "login records of the build's SSH sessions"),
    SealItem("var/log/btmp", "truncate", "failed-login records of the build"),
    SealItem("var/log/lastlog", "truncate", "last-login records of the build"),
    SealItem("var/lib/wtmpdb/*", "remove", "login database (trixie's wtmpdb) of the build's sessions"),
    SealItem("var/cache/apt/archives/*.deb", "remove", "package cache (was a bind mount; belt and braces)"),
    SealItem("tmp/*", "remove", "temporary files of the build"),
    SealItem("var/tmp/*", "remove", "temporary files of the build"),
    SealItem("root/.ansible", "remove", "Ansible's remote temp dir from provisioning"),
    SealItem("root/.bash_history", "remove", "shell history may hold secrets"),
    SealItem("var/lib/systemd/timers/*", "remove", "timer stamps of the build sandbox or VM"),
)


def _apply(path: Path, action: str, content: str = "") -> bool:
    if not (path.exists() or path.is_symlink()):
        return False
    if action == "replace":
        if path.is_symlink():
            path.unlink()
        path.write_text(content)
    elif action == "truncate":
        if path.is_symlink() or not path.is_file():
            path.unlink()
            path.write_text("")
        else:
            with open(path, "w"):
                pass
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    return True


def finalize(tree: Path, logfile: IO[str]) -> list[str]:
    done = []
    for item in ITEMS:
        for p in sorted(tree.glob(item.pattern)):
            if _apply(p, item.action, item.content):
                rel = "/" + str(p.relative_to(tree))
                done.append(rel)
                logfile.write(f"seal: {item.action} {rel} — {item.reason}\n")
    return done


def seal_and_scan(tree: Path, logfile: IO[str]) -> list[str]:
    """finalize(), then the secret scanner: any finding stops the build before export."""
    from nodeforge.errors import NodeforgeError

    from . import scan

    done = finalize(tree, logfile)
    findings = scan.scan(tree)
    if findings:
        raise NodeforgeError(
            "the sealed image still holds secrets or per-node identity; refusing to publish:\n  "
            + "\n  ".join(str(f) for f in findings))
    return done
