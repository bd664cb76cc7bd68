"""The order of an image rollout: one canary compute, then batches of N computes, the controller
last. Pure: names in, steps out (lab/rollout.py runs them)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from nodeforge.errors import NodeforgeError

CANARY, BATCH, CONTROLLER = "canary", "batch", "controller"
MAX_BATCH = 1024
_NODE = re.compile(r"[a-z][a-z0-9-]{0,31}")  # what `cluster` names nodes (ctl, c001, login001)


@dataclass(frozen=True)
class Step:
    number: int  # 1-based, in the order the steps run
    kind: str  # canary | batch | controller
    nodes: tuple[str, ...]

    @property
    def label(self) -> str:
        """How progress lines and errors name the step: 'step 2/4 (batch: c002,c003)'."""
        return f"{self.kind}: {','.join(self.nodes)}"


def check_batch(batch: object) -> int:
    if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= MAX_BATCH:
        raise NodeforgeError(
            f"--batch {batch!r}: give a whole number of computes per batch, 1 to {MAX_BATCH}"
        )
    return batch


def plan(computes: Sequence[str], batch: int, controller: str | None) -> list[Step]:
    """Canary (the first compute by name), then the rest in batches of *batch*, in name order;
    the controller (if given) last, alone."""
    check_batch(batch)
    for n in [*computes, *([controller] if controller else [])]:
        if not isinstance(n, str) or not _NODE.fullmatch(n):
            raise NodeforgeError(f"node name {n!r} is not a cluster node name (e.g. c001)")
    if len(set(computes)) != len(computes):
        raise NodeforgeError(f"computes listed twice: {sorted(computes)}")
    if controller is not None and controller in computes:
        raise NodeforgeError(f"{controller} is listed as a compute and as the controller")
    order = sorted(computes)
    steps: list[Step] = []
    if order:
        steps.append(Step(1, CANARY, (order[0],)))
    rest = order[1:]
    for i in range(0, len(rest), batch):
        steps.append(Step(len(steps) + 1, BATCH, tuple(rest[i : i + batch])))
    if controller is not None:
        steps.append(Step(len(steps) + 1, CONTROLLER, (controller,)))
    return steps


def describe(steps: Sequence[Step], old: str, new: str) -> list[str]:
    """The plan as `--dry-run` prints it: one line per step, then what changes."""
    lines = [f"rollout plan: {len(steps)} step(s), image {old} -> {new}"]
    for s in steps:
        lines.append(f"  step {s.number}/{len(steps)} {s.kind:<10} {', '.join(s.nodes)}")
    return lines
