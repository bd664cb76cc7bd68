"""What the gang e2e modules share (imported as tests.e2e.gang_support): the governor in a
thread pointed at a lab (`Gov`; the `gov` and `clean` fixtures in tests/e2e/conftest.py build
it), the bounded wait that shows what Slurm and the governor saw, and the operator's
`gang status --json`. Works with either lab: lab/slurm_netns.py (22.05) or
lab/gang_cluster.py (the image's Slurm)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from nodeforge.gang import config as gcfg
from nodeforge.gang.events import decode_admin, read_events
from nodeforge.gang.governor import Governor
from nodeforge.gang.slurm_view import SlurmCli
from nodeforge.lab.slurm_netns import Lab, LabError

REPO = Path(__file__).resolve().parents[2]


class Gov:
    """The governor in a thread, pointed at the lab; restartable with the same files."""

    def __init__(self, lab: Lab, tmp: Path, **overrides):
        data = {
            "timeout": 4,
            "recovery_timeout": 0,
            "interval_seconds": 0.5,
            "command_timeout": 10,
            "requeuing": {"backoff_base_seconds": 2, "backoff_max_seconds": 8, "jitter": 0},
            "state_file": str(tmp / "state.json"),
            "event_log": str(tmp / "events.jsonl"),
            "metrics_file": str(tmp / "metrics.prom"),
        }
        for k, v in overrides.items():
            if isinstance(v, dict):
                data.setdefault(k, {}).update(v)
            else:
                data[k] = v
        self.cfg = gcfg.from_dict(data, "test")
        self.lab = lab
        self.gov: Governor | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> Gov:
        self.gov = Governor(
            self.cfg, SlurmCli(prefix=self.lab.prefix(), env=self.lab.env, timeout=10)
        )
        self.thread = threading.Thread(target=self.gov.run, kwargs={"duration": 600}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.gov and self.thread:
            self.gov.stop()
            self.thread.join(timeout=30)
            assert not self.thread.is_alive(), "governor thread did not stop"

    def events(self, job_id=None, action=None) -> list[dict]:
        ev = read_events(self.cfg.event_log, None if job_id is None else str(job_id))
        return [e for e in ev if action is None or e.get("action") == action]

    def rec(self, job_id):
        return self.gov.state.jobs.get(str(job_id))


def parse_time(value: str) -> float:
    """scontrol's local `YYYY-MM-DDTHH:MM:SS` (what an operator reads) -> epoch."""
    return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))


def wait_for(pred, timeout, what, show=None):
    """Lab.wait; on a timeout, *show()* (what Slurm and the governor say) joins the error."""
    try:
        return Lab.wait(pred, timeout, what, interval=0.2)
    except LabError as exc:
        if show is None:
            raise
        raise LabError(f"{exc}; seen: {show()!r:.3000}") from None


def gang_status_json(cfgfile, env=None):
    """`nodeforge gang status --json` as the operator runs it."""
    return proc_run_json(
        sys.executable,
        "-m",
        "nodeforge.cli",
        "gang",
        "status",
        "--json",
        "--config",
        str(cfgfile),
        env=env,
    )


def proc_run_json(*argv, env=None):
    import json

    from nodeforge import proc

    return json.loads(proc.run(list(argv), env=env, timeout=30).stdout)


def assert_requeued(lab, g, j, count=1):
    # A hung prolog keeps the old allocation COMPLETING until it ends: end it, then check.
    lab.release_prologs()
    wait_for(lambda: lab.job(j)["JobState"] == "PENDING", 20, "job PENDING after requeue")
    info = lab.job(j)
    assert info["JobState"] == "PENDING", info
    assert int(info["Restarts"]) >= 1
    adm = decode_admin(info.get("AdminComment", ""))
    assert adm and adm["n"] == str(count), info.get("AdminComment")
    reqs = g.events(j, "requeue")
    assert len(reqs) == count, reqs
    assert all(e["reason"] == "PodsReadyTimeout" and "error" not in e for e in reqs)
    return info
