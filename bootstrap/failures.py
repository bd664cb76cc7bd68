"""First-boot failures, said once: which step failed, on how many nodes, with the first error.

When many nodes fail the same step (a hook that cannot reach its mirror, a full data disk on
every node of a batch), the operator needs one line, not a drain per node to read one by one
(ParallelCluster's "protected mode" at scale). Two views over the agents' state.json records:

- `summarize`: the cluster's summary (`nodeforge cluster status`), a pure function over each
  node's state, grouped by failing step;
- `prometheus`: one node's gauge `nodeforge_bootstrap_failed{step="..."}` (1 for the step
  its agent failed in, 0 for the others), which the agent writes for node_exporter's textfile
  collector; the cluster-wide count is `sum by (step) (nodeforge_bootstrap_failed)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nodeforge import redact

from .state import STEPS

PROM_FILE = "nodeforge_bootstrap.prom"
ERROR_MAX = 500  # characters of the first error kept in the summary (one line)


@dataclass(frozen=True)
class Failure:
    node: str
    step: str
    error: str
    at: float | None  # when the step failed (epoch s)


@dataclass(frozen=True)
class StepSummary:
    step: str
    nodes: tuple[str, ...]  # sorted
    first_node: str
    first_error: str  # redacted, one line

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "count": len(self.nodes),
            "nodes": list(self.nodes),
            "first_node": self.first_node,
            "first_error": self.first_error,
        }


def failure_of(node: str, state: Mapping[str, Any]) -> Failure | None:
    """The failure recorded in one node's state.json (as loaded JSON), or None.

    Only an agent whose outcome is `failed` counts (a step marked failed in a run that was
    then resumed and succeeded is history, not a failure). Its failed step is the one with
    status `failed`; a record without one (an older or damaged file) counts under `unknown`,
    with `last_error`."""
    if not isinstance(state, Mapping) or state.get("status") != "failed":
        return None
    steps = state.get("steps")
    steps = steps if isinstance(steps, Mapping) else {}
    for name in STEPS:
        rec = steps.get(name)
        if isinstance(rec, Mapping) and rec.get("status") == "failed":
            at = rec.get("ended")
            return Failure(
                node,
                name,
                _line(rec.get("error")),
                float(at) if isinstance(at, (int, float)) else None,
            )
    return Failure(node, "unknown", _line(state.get("last_error")), None)


def _line(error: object) -> str:
    text = error if isinstance(error, str) else ""
    lines = text.strip().splitlines()
    first = lines[0] if lines else "no error recorded"
    return redact.text(first)[:ERROR_MAX]


def summarize(states: Mapping[str, Mapping[str, Any]]) -> list[StepSummary]:
    """{node: state.json} -> one summary per failing step, most nodes first (then step order).
    The first error is the earliest failure's (by the time its step failed; a failure without
    a time comes after those with one, then by node name)."""
    by_step: dict[str, list[Failure]] = {}
    for node, st in states.items():
        f = failure_of(node, st)
        if f is not None:
            by_step.setdefault(f.step, []).append(f)
    order = {s: i for i, s in enumerate((*STEPS, "unknown"))}
    out = []
    for step, fs in by_step.items():
        first = min(fs, key=lambda f: (f.at is None, f.at or 0.0, f.node))
        out.append(StepSummary(step, tuple(sorted(f.node for f in fs)), first.node, first.error))
    out.sort(key=lambda s: (-len(s.nodes), order[s.step]))
    return out


def lines(summary: Iterable[StepSummary], shown: int = 8) -> list[str]:
    """The summary for people: one line per failing step."""
    out = []
    for s in summary:
        names = ", ".join(s.nodes[:shown]) + (
            f", … (+{len(s.nodes) - shown})" if len(s.nodes) > shown else ""
        )
        n = len(s.nodes)
        out.append(
            f"bootstrap: step {s.step} failed on {n} node{'s' if n != 1 else ''} ({names}); "
            f"first error ({s.first_node}): {s.first_error}"
        )
    return out


def prometheus(state: Mapping[str, Any]) -> str:
    """One node's gauge, every step listed (0 or 1), for node_exporter's textfile collector."""
    f = failure_of("", state)
    failed = f.step if f is not None else None
    out = [
        "# HELP nodeforge_bootstrap_failed 1 if this node's first-boot agent failed in this step",
        "# TYPE nodeforge_bootstrap_failed gauge",
    ]
    for step in (*STEPS, "unknown"):
        if step == "unknown" and failed != "unknown":
            continue
        out.append(f'nodeforge_bootstrap_failed{{step="{step}"}} {1 if step == failed else 0}')
    return "\n".join(out) + "\n"
