"""images/ssh_args.py: the one ssh command line for the build sandbox, lab VMs and the bench's
nspawn nodes gives each caller the argv it had before (issue 25: three copies)."""

import pytest

from nodeforge.images.ssh_args import throwaway_ssh_argv

pytestmark = pytest.mark.unit

OPTS = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]  # fmt: skip


def test_the_sandbox_line():
    got = throwaway_ssh_argv("/k", port=2222, connect_timeout=5, command=["true"])
    assert got == ["ssh", "-i", "/k", "-p", "2222", *OPTS, "-o", "ConnectTimeout=5",
                   "root@127.0.0.1", "true"]  # fmt: skip


def test_the_vm_line_ignores_the_operators_ssh_config():
    got = throwaway_ssh_argv("/k", port=10022, connect_timeout=10, no_config=True,
                             command=["uname -r"])  # fmt: skip
    assert got == ["ssh", "-F", "/dev/null", "-i", "/k", "-p", "10022", *OPTS,
                   "-o", "ConnectTimeout=10", "root@127.0.0.1", "uname -r"]  # fmt: skip


def test_options_go_before_the_destination_and_no_port_means_ssh_default():
    got = throwaway_ssh_argv("/k", connect_timeout=2, options=["-O", "exit"])
    assert got == ["ssh", "-i", "/k", *OPTS, "-o", "ConnectTimeout=2", "-O", "exit",
                   "root@127.0.0.1"]  # fmt: skip
