"""Readiness gate: a node is never given a job before its hooks have succeeded.

Verified on Slurm 22.05.8 (see docs/agent.md, "Readiness gate"):

1. Before slurmd starts, the node is created in slurmctld:
   `scontrol create NodeName=X NodeAddr=… CPUs=… RealMemory=… Feature=… Gres=… State=FUTURE`,
   and, when hooks are to run (or for a 22.05 login node), drained:
   `scontrol update NodeName=X State=DRAIN Reason="nodeforge: initializing"`. A node without
   hooks is not drained: FUTURE is its final state until slurmd registers it (IDLE).
   The full hardware spec must be given at create time: when `slurmd -Z` registers a node that
   already exists, slurmctld keeps the existing definition and ignores slurmd's --conf.
   On a reboot the node already exists (never created again: see Gate.hold), and the drain is
   applied to it before slurmd starts again.
2. slurmd -Z registers: the node becomes IDLE+DRAIN (registration clears the Reason text, so
   the agent sets it again: "nodeforge: running hooks"). A job pending for it stays pending.
3. Hooks succeed: `State=RESUME`, only if the drain reason is still ours ("nodeforge:"), so an
   operator's own drain is never undone. A hook fails, hangs or crashes: Reason becomes
   "nodeforge: hook <name> failed (exit N)" / "timed out after Ns" / "killed by signal S" and
   the node stays drained, visible in `sinfo -R`.

Root with the cluster's munge key is a Slurm administrator, so the node can do this itself; the
client config is a minimal slurm.conf in /run/nodeforge (configless nodes have none yet).

"Ready" has ONE definition, here (`NodeState.ready`), used by the agent's gate, `cluster up/add`
(lab/localcluster.py) and both node benches: a job pinned to the node would start now, i.e. the
base state is IDLE or MIXED and no flag says otherwise (not NOT_RESPONDING `*`, POWERED_DOWN `~`,
POWERING_UP `#`, POWER_DOWN `!`, POWERING_DOWN `%`, DRAIN, ...). Measured on 24.11.5: RESUME (and
UNDRAIN) of a registered node sets NOT_RESPONDING until slurmctld's next ping of it answers
(0.3-0.7 s later), and `srun -w` is refused "Required node not available" meanwhile; so the gate
waits for that answer, and a node that needs no hooks is never drained (no RESUME at all).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nodeforge.errors import NodeforgeError
from nodeforge.slurm_facts import controller_up, has

from .host import Host

if TYPE_CHECKING:
    import subprocess

    from nodeforge.slurm_records import NodeRecord

log = logging.getLogger("nodeforge.readiness")

PREFIX = "nodeforge:"
INITIALIZING = "nodeforge: initializing"
RUNNING_HOOKS = "nodeforge: running hooks"
# What Gate.hold did (recorded in state.json as the role step's `slurm_node`).
HELD_EXISTING = "existing"
HELD_CREATED = "created"
HELD_CREATED_FINAL = "created (final state)"
HELD_REPLACED = "replaced another machine's registration"
REPLACED = "nodeforge: replaced by a new machine"

# sinfo's state suffixes (man sinfo, NODE STATE CODES) and the flag each one stands for.
SUFFIX_FLAGS = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "!": "POWER_DOWN",
    "%": "POWERING_DOWN",
    "$": "MAINTENANCE",
    "@": "REBOOT_REQUESTED",
    "^": "REBOOT_ISSUED",
    "-": "PLANNED",
}
# sinfo's compact (%t) and long (%T) base names for the states a ready node can be in.
_BASE_NAMES = {"idle": "IDLE", "mix": "MIXED", "mixed": "MIXED"}
READY_BASES = frozenset({"IDLE", "MIXED"})
# Flags that do not keep a job off the node; any other flag (or an unknown one) does.
HARMLESS_FLAGS = frozenset({"DYNAMIC_NORM", "DYNAMIC_FUTURE", "CLOUD"})


@dataclass(frozen=True)
class NodeState:
    """A node's Slurm state: base state and flags, from sinfo, scontrol or JSON."""

    base: str  # IDLE, MIXED, ALLOCATED, DOWN, FUTURE, ... ("" = not known to slurmctld)
    flags: frozenset[str] = frozenset()

    @property
    def ready(self) -> bool:
        """A job pinned to this node would start now (the one definition of "ready")."""
        return self.base in READY_BASES and self.flags <= HARMLESS_FLAGS

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.flags or self.base in ("DRAIN", "DRAINED", "DRAINING", "DRNG")

    def why_not(self) -> str:
        if not self.base:
            return "not registered"
        if self.base not in READY_BASES:
            return f"state {self.base}"
        return "flags " + "+".join(sorted(self.flags - HARMLESS_FLAGS))

    def __str__(self) -> str:
        return "+".join([self.base or "UNKNOWN", *sorted(self.flags)])

    def short(self) -> str:
        """sinfo-like: `idle`, `idle*`, `idle+drain` (harmless flags left out)."""
        marks = {v: k for k, v in SUFFIX_FLAGS.items()}
        rest = sorted(self.flags - HARMLESS_FLAGS - set(marks))
        suffix = "".join(marks[f] for f in sorted(self.flags & set(marks)))
        return (self.base or "unknown").lower() + "".join(f"+{f.lower()}" for f in rest) + suffix


def from_flags(words: Iterable[str]) -> NodeState:
    """`IDLE+DRAIN+NOT_RESPONDING` split on '+', or a JSON `state` list (Slurm >= 23.02)."""
    items = [w.strip().upper() for w in words if w and w.strip()]
    if not items:
        return NodeState("")
    base, flags = items[0], set(items[1:])
    while base and base[-1] in SUFFIX_FLAGS:  # scontrol never prints these; sinfo does
        flags.add(SUFFIX_FLAGS[base[-1]])
        base = base[:-1]
    return NodeState(base, frozenset(flags))


def from_scontrol(state: str) -> NodeState:
    """`State=` of `scontrol show node -o`: `IDLE+DRAIN+DYNAMIC_NORM+NOT_RESPONDING`."""
    return from_flags(state.split("+"))


def from_record(rec: NodeRecord) -> NodeState:
    """A node read by nodeforge.slurm_records (JSON, or 22.05's `scontrol -o` line)."""
    return NodeState(rec.base, rec.flags - {rec.base})


def from_sinfo(state: str) -> NodeState:
    """sinfo's %t or %T: `idle`, `idle*`, `mix-`, `drain`, `drained*`, `down~`, ...

    The base name of anything but idle/mixed is kept upper-cased (DRAIN, ALLOC, ...): all
    that matters is that it is not a ready base.
    """
    s = state.strip().lower()
    flags = set()
    while s and s[-1] in SUFFIX_FLAGS:
        flags.add(SUFFIX_FLAGS[s[-1]])
        s = s[:-1]
    if not s:
        return NodeState("")
    return NodeState(_BASE_NAMES.get(s, s.upper()), frozenset(flags))


def from_json(text: str) -> dict[str, NodeState]:
    """`scontrol show node --json` (Slurm >= 23.02; 22.05's `sinfo --json` shape too):
    {node: NodeState}, read by nodeforge.slurm_records (the governor's reader).

    Raises ValueError on a body that is not that shape (truncated, wrong types, duplicates).
    """
    from nodeforge import slurm_records  # lazy: `node --help` does not need it

    try:
        nodes = slurm_records.parse_nodes(text)
    except slurm_records.SlurmDataError as exc:
        raise ValueError(str(exc)) from exc
    return {name: from_record(rec) for name, rec in nodes.items()}


def from_sinfo_table(text: str) -> dict[str, NodeState]:
    """`sinfo -h -N -o %N|%t` lines (any Slurm, 22.05 included): {node: NodeState}."""
    out: dict[str, NodeState] = {}
    for line in text.splitlines():
        name, sep, state = line.partition("|")
        if sep and name.strip():
            out[name.strip()] = from_sinfo(state.split("|", 1)[0])
    return out


def reads_json(version: str | tuple[int, ...]) -> bool:
    """True when this Slurm version's scontrol prints a node as JSON (>= 23.02): the one
    answer to "which node command" for the gate and `node health` (see read_node)."""
    return has(version, "json_records")


def read_node(
    scontrol: Callable[..., subprocess.CompletedProcess], node: str, *, json: bool
) -> NodeRecord | None:
    """*node* as slurmctld shows it now (None: not known to it, or scontrol failed), read by
    the one Slurm reader (nodeforge.slurm_records): JSON on Slurm >= 23.02, so no Reason or
    Comment text can pose as a state; on 22.05 (no --json in its scontrol, and its sinfo
    --json hides the FUTURE nodes the gate must see) `-o` with slurm_records.node_from_line,
    whose reason is marked REASON_AMBIGUOUS when operator text makes it unclear.

    *scontrol* runs `scontrol ARGS...` without raising on the exit status (a timeout may
    raise CommandError); a body that is not Slurm's shape raises SlurmDataError."""
    from nodeforge import slurm_records  # lazy: `node --help` does not need it

    if json:
        argv: tuple[str, ...] = ("--future", "show", "node", "--json", node)
    else:
        argv = ("--future", "-o", "show", "node", node)
    cp = scontrol(*argv)
    out = cp.stdout or ""
    if cp.returncode != 0 or not out.strip() or (not json and "not found" in out):
        return None
    if json:
        try:
            return slurm_records.parse_nodes(out, "scontrol show node --json").get(node)
        except slurm_records.SlurmDataError:
            # an unknown node may come back as a JSON error (ESLURM_INVALID_NODE_NAME)
            # rather than an exit status: that is "not known", anything else is raised
            if "Invalid node name specified" in out:
                return None
            raise
    return slurm_records.node_from_line(out, node)


@dataclass
class NodeClient:
    """This node in slurmctld, through `scontrol` with the node's client config: the one
    node-state reader that the readiness gate and the health action share (read_node: JSON
    on >= 23.02, 22.05's `-o` line otherwise)."""

    host: Host
    node: str
    client_conf: Path
    json: bool = False  # Slurm >= 23.02: read the node as JSON (see read_node)
    timeout: float = 30.0  # per scontrol call

    def _env(self) -> dict[str, str] | None:
        return {"SLURM_CONF": str(self.client_conf)}

    def _scontrol(self, *args: str, check: bool = True):
        return self.host.run(
            ["scontrol", *args], check=check, timeout=self.timeout, env=self._env()
        )

    def record(self) -> NodeRecord | None:
        """The node as slurmctld shows it now (None: not known to it); see read_node."""
        return read_node(lambda *a: self._scontrol(*a, check=False), self.node, json=self.json)


@dataclass
class Gate(NodeClient):
    poll: float = 0.05  # between two looks at the node's state (each one scontrol call, ~10 ms)

    def controller_up(self) -> bool:
        return controller_up(lambda argv: self._scontrol(*argv[1:], check=False))

    def state(self) -> NodeState:
        rec = self.record()
        return from_record(rec) if rec is not None else NodeState("")

    def hold(
        self,
        spec: dict[str, str],
        reason: str = INITIALIZING,
        *,
        drain: bool = True,
        first_init: bool = False,
        wait: float = 300.0,
    ) -> str:
        """Make sure the node exists in slurmctld BEFORE slurmd starts, drained when *drain*.

        A new node is created as FUTURE (Slurm 24.11 refuses any other state at create: "Only
        State=FUTURE and State=CLOUD allowed"); slurmd's registration makes it IDLE. So a node
        with nothing to run before it may take jobs (*drain* False) is created in its final
        state with one call; otherwise it is drained before slurmd starts. An existing node (a
        reboot) is always drained. Never `create` a node that exists: on 24.11.5 the failed
        create DELETES the existing node (measured), hence the `show` first. On the *first_init*
        of a disk, an existing node is another machine's (see _forget_previous_machine).
        """
        if self.record() is not None:
            if not first_init:
                self.drain(reason)  # this machine's own registration (a reboot, a rerun)
                return HELD_EXISTING
            self._forget_previous_machine(wait)
            return self._create(spec, reason, drain=drain, replaced=True)
        return self._create(spec, reason, drain=drain)

    def _forget_previous_machine(self, wait: float) -> None:
        """The name is registered, but this disk never ran the agent: another machine held it
        (a replaced instance, as HyperPod's node replacement keeps the name). Its registration
        is replaced, never reused (it carries the old address and hardware): DOWN ends what
        still runs there (Slurm requeues or cancels each job, per its policy), then the record
        is deleted, retried while Slurm still completes those jobs, bounded by *wait*."""
        self._scontrol("update", f"NodeName={self.node}", "State=DOWN", f"Reason={REPLACED}")
        answers: list[str] = []

        def deleted() -> bool:
            cp = self._scontrol("delete", f"NodeName={self.node}", check=False)
            answers.append((cp.stdout or "").strip())
            return cp.returncode == 0 or self.record() is None

        try:
            self.host.wait_until(
                f"slurmctld to delete node {self.node}'s previous registration",
                deleted,
                timeout=wait,
                interval=1.0,
            )
        except NodeforgeError as exc:
            raise NodeforgeError(
                f"{exc} (last answer: {answers[-1] if answers else 'none'}); jobs may still be "
                f"completing there: see `squeue -w {self.node}`, then rerun `nodeforge node init`"
            ) from None

    def _create(
        self, spec: dict[str, str], reason: str, *, drain: bool, replaced: bool = False
    ) -> str:
        words = [
            f"NodeName={self.node}",
            *(f"{k}={v}" for k, v in spec.items() if v),
            "State=FUTURE",
        ]
        cp = self._scontrol("create", *words, check=False)
        if cp.returncode != 0:
            raise NodeforgeError(
                f"scontrol create {' '.join(words)} failed (exit {cp.returncode}): "
                f"{(cp.stdout or '').strip()}; check MaxNodeCount on the controller and that "
                "this node's munge key is the cluster's"
            )
        if drain:
            self.drain(reason)
            return HELD_REPLACED if replaced else HELD_CREATED
        return HELD_REPLACED if replaced else HELD_CREATED_FINAL

    def drain(self, reason: str) -> None:
        self._scontrol("update", f"NodeName={self.node}", "State=DRAIN", f"Reason={reason}")

    def release(self, timeout: float) -> dict:
        """Resume the node if the drain is ours, then wait (bounded) until it is ready.

        Returns what was done and the seconds waited for slurmctld to see the node ready.
        """
        rec = self.record()
        if rec is None:
            raise NodeforgeError(
                f"node {self.node} is not known to slurmctld; cannot mark it ready"
            )
        st = from_record(rec)
        reason = rec.reason
        if "DRAIN" not in st.flags:
            done = "not drained"
        elif reason and reason != "none" and not reason.startswith(PREFIX):
            log.warning(
                "node %s drained by someone else (%s); leaving it drained", self.node, reason
            )
            return {"slurm": f"left drained (reason not ours: {reason})"}
        else:
            self._scontrol("update", f"NodeName={self.node}", "State=RESUME")
            done, st = "resumed", NodeState("")
        return {"slurm": done, "ready_wait_s": round(self.wait_ready(timeout, st), 2)}

    def wait_ready(self, timeout: float, first: NodeState | None = None) -> float:
        """Wait until slurmctld shows the node ready (see NodeState.ready); bounded."""
        last = [first] if first is not None and first.base else []

        def ready() -> bool:
            if last and last[-1].ready:
                return True
            last.append(self.state())
            return last[-1].ready

        try:
            return self.host.wait_until(
                f"node {self.node} ready in slurmctld (IDLE or MIXED, no flag such as "
                "NOT_RESPONDING)",
                ready,
                timeout=timeout,
                interval=self.poll,
                hint="see `journalctl -u slurmd` here and slurmctld.log on the controller",
            )
        except NodeforgeError as exc:
            seen = last[-1] if last else "unknown"
            raise NodeforgeError(f"{exc} Last state seen: {seen}.") from exc

    def fail(self, reason: str) -> None:
        """Best effort: record *reason* as the drain reason (the node stays drained)."""
        if not reason.startswith(PREFIX):
            reason = f"{PREFIX} {reason}"
        try:
            self.drain(reason[:200])
        except NodeforgeError as exc:
            log.error("could not set drain reason on %s: %s", self.node, exc)
