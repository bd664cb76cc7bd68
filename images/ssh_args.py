"""The one ssh command line for a machine this host made for a while (a build sandbox, a lab
VM or node): its throwaway host key is neither checked nor recorded in the operator's
known_hosts, no prompt can hang a run, and a dead peer fails within the connect timeout."""

from __future__ import annotations

import os
from collections.abc import Sequence

ROOT_AT_LOOPBACK = "root@127.0.0.1"  # every such machine is reached through a local port


def throwaway_ssh_argv(
    key: str | os.PathLike[str],
    *,
    connect_timeout: int,
    port: int | None = None,
    no_config: bool = False,
    options: Sequence[str] = (),
    command: Sequence[str] = (),
) -> list[str]:
    """`ssh` as root to 127.0.0.1 with *key*; *options* go before the destination,
    *command* after it. *no_config* ignores the operator's ~/.ssh/config (-F /dev/null)."""
    argv = ["ssh", *(["-F", "/dev/null"] if no_config else []), "-i", str(key)]
    if port is not None:
        argv += ["-p", str(port)]
    argv += [
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null",
        "-o", "LogLevel=ERROR",
        "-o", f"ConnectTimeout={connect_timeout}",
    ]  # fmt: skip
    return [*argv, *options, ROOT_AT_LOOPBACK, *command]
