"""`nodeforge node status`: what the agent did on this node, from state.json."""

from __future__ import annotations

import datetime as dt
import json

from nodeforge import redact

from .state import STEPS, State


def as_json(state: State) -> str:
    # Redacted again here: a state.json written by an older agent may hold a secret.
    return json.dumps(redact.obj(state.to_dict()), indent=2)


def _ts(t: float | None) -> str:
    if t is None:
        return "-"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _dur(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}s"


def as_text(state: State) -> str:
    lines = [
        f"node      {state.node or '-'}   role {state.role or '-'}   cluster {state.cluster or '-'}",
        f"status    {state.status}   params from {state.source or '-'}   init runs {state.boots}",
        (
            f"ready     {_ts(state.ready_at)} UTC   time-to-ready {_dur(state.time_to_ready)}"
            f"   (since boot {_dur(state.uptime_at_ready)})"
        ),
        "",
        f"{'STEP':<10} {'STATUS':<9} {'STARTED (UTC)':<20} {'DURATION':>9} {'RUNS':>4}  ERROR",
    ]
    for name in STEPS:
        r = state.steps[name]
        err = (r.error or "").strip().splitlines()
        lines.append(
            f"{name:<10} {r.status:<9} {_ts(r.started):<20} {_dur(r.duration):>9} {r.runs:>4}  "
            f"{err[0] if err else ''}"
        )
    hooks = state.steps["hooks"].detail.get("results") or []
    if hooks:
        lines += ["", f"{'HOOK':<28} {'STATUS':<12} {'ATTEMPTS':>8} {'DURATION':>9}  LOG"]
        for h in hooks:
            lines.append(
                f"{h['name']:<28} {h['status']:<12} {h['attempts']:>8} {_dur(h['duration']):>9}  {h['log']}"
            )
    if state.last_error:
        lines += ["", f"last error: {state.last_error}"]
    if state.status == "failed" and state.retry:
        lines.append(
            "outside Slurm: nodeforge-rejoin.timer starts the agent again once slurmctld "
            "answers (`systemctl list-timers nodeforge-rejoin.timer`)"
        )
    return redact.text("\n".join(lines) + "\n")
