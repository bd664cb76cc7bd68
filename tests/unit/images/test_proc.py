"""nodeforge.images.build_proc: long commands stop with their caller, even a SIGKILLed one (no root)."""

import subprocess
import sys
import time

import pytest

from tests.helpers import process_running

pytestmark = pytest.mark.unit

CALLER = r"""
from nodeforge.images import build_proc
with open(LOG, "w", buffering=1) as f:
    build_proc.stream(["sh", "-c", "echo child $$; sleep 300 & echo grandchild $!; wait"], logfile=f,
                stamp=False, timeout=600)
"""


def test_streamed_command_and_its_group_die_with_a_sigkilled_caller(tmp_path):
    log = tmp_path / "out.log"
    script = CALLER.replace("LOG", repr(str(log)))
    caller = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 20
        pids: dict[str, int] = {}
        while time.monotonic() < deadline and len(pids) < 2:
            for line in log.read_text().splitlines() if log.exists() else []:
                word, _, num = line.partition(" ")
                if word in ("child", "grandchild") and num.isdigit():
                    pids[word] = int(num)
            time.sleep(0.1)
        assert len(pids) == 2 and all(map(process_running, pids.values())), log.read_text()
        caller.kill()  # no cleanup code runs in the caller
        caller.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(map(process_running, pids.values())):
            time.sleep(0.2)
        left = [n for n, p in pids.items() if process_running(p)]
        for n in left:
            subprocess.run(["kill", "-9", str(pids[n])], check=False)
        assert not left, f"outlived the SIGKILLed caller: {left}"
    finally:
        if caller.poll() is None:
            caller.kill()
