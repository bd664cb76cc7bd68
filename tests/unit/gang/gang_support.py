"""Fixture builders for the gang tests: Slurm's JSON for jobs and nodes in the 22.05 and
>= 23.02 shapes, a recording SlurmCli, and a governor config. Shared by the gang test modules,
which import these, never each other."""

from __future__ import annotations

import json
import subprocess

from nodeforge.gang import config as gcfg
from nodeforge.gang.slurm_view import SlurmCli, Snapshot, parse_jobs


def job22(jid=1, **kw):
    """A job as 22.05's `squeue --json` (openapi v0.0.38) prints it: fixture shaped after a
    capture from the host's real 22.05.8 slurmctld (fewer keys)."""
    d = {
        "job_id": jid,
        "name": "train",
        "comment": "",
        "admin_comment": "",
        "current_working_directory": "/tmp",
        "standard_output": "/tmp/job-%j.out",
        "job_state": "RUNNING",
        "state_reason": "None",
        "state_description": "",
        "node_count": 2,
        "nodes": "gn[1-2]",
        "array_job_id": 0,
        "array_task_id": None,
        "het_job_id": 0,
        "het_job_offset": 0,
        "start_time": 1796290186,
        "submit_time": 1796290183,
        "eligible_time": 1796290183,
        "priority": 4294901759,
        "restart_cnt": 0,
        "requeue": True,
        "batch_flag": True,
        "partition": "main",
        "qos": "",
        "user_id": 0,
    }
    d.update(kw)
    return d


def n24(v):
    return {"set": v is not None, "infinite": False, "number": v or 0}


def job24(jid=1, **kw):
    """The same job in the >= 23.02 shape (data_parser v0.0.40+): fixture."""
    d = job22(jid)
    d.update(
        job_state=["RUNNING"],
        node_count=n24(2),
        array_job_id=n24(0),
        array_task_id=n24(None),
        het_job_id=n24(0),
        het_job_offset=n24(0),
        start_time=n24(1796290186),
        submit_time=n24(1796290183),
        eligible_time=n24(1796290183),
        priority=n24(4294901759),
    )
    d.update(kw)
    return d


def jobs_doc(*jobs):
    return json.dumps({"meta": {}, "errors": [], "jobs": list(jobs)})


def array_het_job(jid, *, shape="24.11", array=None, task=None, tasks="", het=None, off=None, **kw):
    """One job as Slurm's JSON prints it (job22/job24 above: 22.05 plain numbers,
    24.11 set/number objects), with its array and het identity."""
    ident = {
        "array_job_id": array or 0,
        "array_task_id": task,
        "array_task_string": tasks,
        "het_job_id": het or 0,
        "het_job_offset": off or 0,
    }
    ident.update(kw)  # (a case's own fields win, e.g. array_task_string)
    if shape == "22.05":
        return job22(jid, **ident)
    ident.update(
        array_job_id=n24(array or 0),
        array_task_id=n24(task),
        het_job_id=n24(het or 0),
        het_job_offset=n24(off if het else None),
    )
    ident.update(kw)
    return job24(jid, **ident)


class Recorder(SlurmCli):
    """A SlurmCli whose runner records argv and answers from *docs* (no Slurm): what the
    governor would have run, word for word."""

    def __init__(self, jobs_doc: str):
        super().__init__(clock=lambda: 1000.0)
        self.argv: list[list[str]] = []
        self.jobs_doc = jobs_doc
        self._commands = (["scontrol", "show", "job", "--json"], ["scontrol", "show", "node"])

    def _run(self, *argv, check=True, output_file=None):
        self.argv.append(list(argv))
        out = ""
        if argv[:3] == ("scontrol", "show", "job"):
            out = self.jobs_doc
        if output_file is not None:
            output_file.write(out.encode())
        return subprocess.CompletedProcess(list(argv), 0, out, "")

    def snapshot(self, need=None, settled=()):
        jobs = parse_jobs(self.jobs_doc)
        return Snapshot(jobs=jobs, nodes={f"gn{i}": frozenset({"ALLOCATED"}) for i in range(9)})


def gang_cfg(**kw):
    """Fixture: a governor config with short, jitter-free requeue backoff, *kw* over it."""
    base = {
        "timeout": 10,
        "requeuing": {"backoff_base_seconds": 5, "backoff_max_seconds": 40, "jitter": 0},
    }
    for k, v in kw.items():
        if isinstance(v, dict):
            base.setdefault(k, {}).update(v)
        else:
            base[k] = v
    return gcfg.from_dict(base, "t")


def cached_job(jid: int, shape: str, name: str = "j", restarts: int = 0, sched: int = 1796290190):
    """A job with the keys the reader reads plus last_sched_evaluation (fixture); 22.05 or
    >= 23.02 shape."""
    d = {
        "account": "a",
        "job_id": jid,
        "name": name,
        "comment": name,
        "current_working_directory": name,
        "job_state": "PENDING",
        "state_reason": "Priority",
        "node_count": 2,
        "nodes": "",
        "last_sched_evaluation": sched,
        "priority": 7,
        "restart_cnt": restarts,
        "submit_time": 1796290183,
        "job_resources": {"nodes": {"list": "gn[1-2]", "count": 2}},
    }
    if shape == "24":
        d.update(
            job_state=["PENDING"],
            node_count=n24(2),
            last_sched_evaluation=n24(sched),
            priority=n24(7),
            submit_time=n24(1796290183),
        )
    return d


def render_jobs(jobs: list, shape: str) -> str:
    if shape == "24":  # 24.11: jobs first, '/' escaped (as the capture)
        doc = {"jobs": jobs, "last_update": n24(5), "meta": {}, "errors": [], "warnings": []}
        return json.dumps(doc, indent=2).replace("/", "\\/")
    return json.dumps({"meta": {}, "errors": [], "jobs": jobs}, indent=2)  # 22.05: jobs last


def cached_node(
    name: str, shape: str, reason: str = "", drained: bool = False, load: int = 3
) -> dict:
    """A node with the keys the reader reads plus members that move with every slurmd ping
    (cpu_load, free_mem), nested as Slurm prints them; 22.05 `sinfo --json` or >= 23.02
    shape."""
    d = {
        "architecture": "x86_64",
        "name": name,
        "hostname": name,
        "cpu_load": load,
        "free_mem": n24(7000 + load) if shape == "24" else 7000 + load,
        "reason": reason,
        "energy": {"current_watts": n24(0), "last_collected": 0},
    }
    if shape == "24":
        d["state"] = ["IDLE", "DRAIN"] if drained else ["IDLE"]
    else:
        d["state"] = "idle"
        d["state_flags"] = ["DRAIN"] if drained else []
    return d


def render_nodes(nodes: list, shape: str) -> str:
    if shape == "24":
        doc = {"nodes": nodes, "last_update": n24(5), "meta": {}, "errors": [], "warnings": []}
        return json.dumps(doc, indent=2).replace("/", "\\/")
    return json.dumps({"meta": {}, "errors": [], "nodes": nodes}, indent=2)
