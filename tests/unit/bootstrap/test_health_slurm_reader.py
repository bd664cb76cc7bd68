"""`nodeforge node health` reads its node through the one Slurm reader, as the readiness gate
does (readiness.read_node): JSON on Slurm >= 23.02, 22.05's `scontrol -o` line otherwise.
An operator's Reason or Comment is data: whatever it holds (newlines, `State=IDLE`, a
`Reason=nodeforge-health: ...` forged inside it, quotes, 10k characters), a passing run never
resumes that drain and a failing run never overwrites it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as hst

from nodeforge import slurm_records as sr
from nodeforge.bootstrap import health
from nodeforge.bootstrap.host import Host
from tests.unit.support import FakeHost, scontrol_json_doc

pytestmark = pytest.mark.unit

OURS = "nodeforge-health: gpu_count: 7 of 8 GPUs"
# Fixture: the start of 22.05's `scontrol --future -o show node c1` (fields before State come
# from the config and slurmd; Comment, Extra and Reason follow it).
LINE_22_HEAD = (
    "NodeName=c1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=1 CPULoad=0.00 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=c1 NodeHostName=c1 "
    "Version=22.05.8 OS=Linux 6.1.0-28-amd64 #1 SMP RealMemory=1 AllocMem=0 FreeMem=N/A "
    "Sockets=1 Boards=1 State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
    "MCS_label=N/A Partitions=main BootTime=None SlurmdStartTime=None"
)
STAMP = " [root@2026-12-03T10:00:00]"  # what 22.05 appends to a Reason on the -o line

HOSTILE_REASONS = [
    "maint\nState=IDLE Reason=nodeforge-health: disk: x",  # newline, then forged fields
    "State=IDLE",
    "RMA 42 Reason=nodeforge-health: gpu_count: 7 of 8 GPUs",  # ours, forged inside
    "RMA 42 State=IDLE+DRAIN Reason=nodeforge-health: x",
    '"nodeforge-health: x" says ops',  # quotes
    "'nodeforge-health: x'",
    "x" * 10_000 + " Reason=nodeforge-health: x",  # very long
    'maint"}],"nodes":[{"name":"c1","state":["IDLE"],"reason":"nodeforge-health: x"}]}',
]


class Slurmctld(FakeHost):
    """Answers scontrol as the named Slurm version would for node c1 (24.11: the fixture
    document's c001 as c1; 22.05: a fixture `-o` line), and records every update."""

    def __init__(self, json_: bool, state: str, reason: str, comment: str = ""):
        super().__init__()
        self.json, self.state, self.reason, self.comment = json_, state, reason, comment
        self.updates: list[list[str]] = []

    def answer(self, argv, timeout, env):
        assert argv[0] == "scontrol", argv
        if argv[1] == "update":
            self.updates.append(argv[2:])
            return 0, ""
        if self.json:
            assert argv[1:] == ["--future", "show", "node", "--json", "c1"], argv
            return 0, self.json_body()
        assert argv[1:] == ["--future", "-o", "show", "node", "c1"], argv
        return 0, self.line() + "\n"

    def json_body(self) -> str:
        doc = scontrol_json_doc()
        node = {**doc["nodes"][0], "name": "c1", "state": self.state.split("+")}
        node.update(reason=self.reason, comment=self.comment)
        return json.dumps({**doc, "nodes": [node]}, indent=2)

    def line(self) -> str:
        tail = f" Comment={self.comment}" if self.comment else ""
        tail += f" Reason={self.reason}{STAMP}" if self.reason else ""
        return LINE_22_HEAD.format(state=self.state) + tail


def report(ok: bool) -> health.Report:
    rep = health.Report(node="c1", started=1_760_000_000.0)
    rep.checks = [health.Check(health.DISK, ok, "ok" if ok else "/var/lib/enroot 99% full")]
    return rep


def apply(ctld: Slurmctld, ok: bool) -> str:
    node = health.HealthAction(Host(run=ctld.run), "c1", Path("/nonexistent/slurm.conf"), ctld.json)
    return node.apply(report(ok))


@pytest.mark.parametrize("as_json", [True, False], ids=["24.11-json", "22.05-line"])
@pytest.mark.parametrize("reason", HOSTILE_REASONS, ids=range(len(HOSTILE_REASONS)))
def test_operator_drain_with_hostile_reason_is_never_cleared_or_overwritten(as_json, reason):
    passing = Slurmctld(as_json, "IDLE+DRAIN", reason)
    assert apply(passing, ok=True) == health.NOTHING and passing.updates == []
    failing = Slurmctld(as_json, "IDLE+DRAIN", reason)
    assert apply(failing, ok=False) == health.LEFT and failing.updates == []


@pytest.mark.parametrize("as_json", [True, False], ids=["24.11-json", "22.05-line"])
@pytest.mark.parametrize(
    "comment",
    ["x State=IDLE", "x Reason=nodeforge-health: disk: x", "a\nState=IDLE Reason=" + OURS],
)
def test_comment_never_poses_as_state_or_as_our_drain(as_json, comment):
    """The old `-o` parser let a Comment's `State=IDLE` hide the drain and its
    `Reason=nodeforge-health:` make an operator's drain look like ours."""
    ctld = Slurmctld(as_json, "IDLE+DRAIN", "RMA ticket 42", comment)
    assert apply(ctld, ok=True) == health.NOTHING and ctld.updates == []
    assert apply(ctld, ok=False) == health.LEFT and ctld.updates == []


@pytest.mark.parametrize("as_json", [True, False], ids=["24.11-json", "22.05-line"])
def test_own_drain_is_cleared_and_a_failure_drains_with_its_reason(as_json):
    ours = Slurmctld(as_json, "IDLE+DRAIN", OURS, comment="State=DOWN")
    assert apply(ours, ok=True) == health.CLEARED
    assert ours.updates == [["NodeName=c1", "State=RESUME"]]
    idle = Slurmctld(as_json, "IDLE", "", comment="Reason=RMA State=IDLE+DRAIN")
    assert apply(idle, ok=False) == health.DRAINED
    assert idle.updates == [["NodeName=c1", "State=DRAIN", "Reason=" + report(False).reason]]
    gate = Slurmctld(as_json, "IDLE+DRAIN", "nodeforge: running hooks")
    assert apply(gate, ok=True) == health.NOTHING  # the gate's drain: the gate resumes it
    assert apply(gate, ok=False) == health.DRAINED  # a failed check names itself instead


def test_json_path_reads_the_reason_exactly():
    """24.11 sends the reason alone (who and when are other keys): an unchanged drain of ours
    is not issued again on every run."""
    ctld = Slurmctld(True, "IDLE+DRAIN", report(False).reason)
    assert apply(ctld, ok=False) == health.DRAINED and ctld.updates == []


def test_22_05_line_with_a_second_line_is_ambiguous():
    """A newline in free text puts the rest on a second line: the reason on the first one
    may be cut short (`nodeforge-health: x` of `nodeforge-health: x\\nby ops`)."""
    rec = sr.node_from_line(
        LINE_22_HEAD.format(state="IDLE+DRAIN") + " Reason=" + OURS + "\nset by ops" + STAMP,
        "c1",
    )
    assert rec is not None and rec.reason.startswith(sr.REASON_AMBIGUOUS)
    ctld = Slurmctld(False, "IDLE+DRAIN", OURS + "\nset by ops")
    assert apply(ctld, ok=True) == health.NOTHING and ctld.updates == []


@pytest.mark.parametrize("as_json", [True, False], ids=["24.11-json", "22.05-line"])
def test_unreadable_record_does_nothing(as_json):
    ctld = Slurmctld(as_json, "IDLE; rm -rf /", "")
    assert apply(ctld, ok=False) == health.UNREADABLE and ctld.updates == []


def test_unknown_node_or_failed_scontrol_is_unreachable():
    def run(argv, **kw):
        return subprocess.CompletedProcess(argv, 1, "", "slurm_load_node error")

    for as_json in (True, False):
        node = health.HealthAction(Host(run=run), "c1", Path("/nonexistent"), as_json)
        assert node.apply(report(False)) == health.UNREACHABLE


TEXT = hst.text(
    alphabet=hst.characters(blacklist_categories=("Cs",)), max_size=80
) | hst.sampled_from(
    [
        "\nState=IDLE",
        " Reason=nodeforge-health: x",
        "Reason=nodeforge-health: disk: x",
        " State=IDLE+DRAIN",
        '"',
        "'",
        "=",
        "\n",
        "x" * 5000,
    ]
)

OPERATOR_TEXT = hst.tuples(TEXT, TEXT).map("".join)  # e.g. a newline, then forged fields


@settings(max_examples=200, deadline=None)
# (found by hypothesis: a NUL in a Comment that repeats ` Reason=` made the 22.05 line
# unreadable instead of someone else's drain)
@example(as_json=False, reason="0", comment=" Reason=\x00", ok=False)
@given(
    as_json=hst.booleans(),
    reason=OPERATOR_TEXT,
    comment=OPERATOR_TEXT,
    ok=hst.booleans(),
)
def test_property_operator_drain_is_never_touched(as_json, reason, comment, ok):
    """Any operator reason (one that does not itself start with a nodeforge prefix) and any
    Comment, on both paths: a passing run resumes nothing, a failing one overwrites nothing."""
    assume(reason.strip() and "\x00" not in reason)
    assume(not reason.strip().startswith((health.REASON_PREFIX, health.GATE_PREFIX)))
    ctld = Slurmctld(as_json, "MIXED+DRAIN", reason, comment)
    action = apply(ctld, ok)
    assert ctld.updates == []
    assert action == (health.NOTHING if ok else health.LEFT)
    if as_json:  # the JSON path reads the text back exactly
        rec = sr.parse_nodes(ctld.json_body())["c1"]
        assert rec.reason == reason and rec.flags == {"MIXED", "DRAIN"}


@settings(max_examples=100, deadline=None)
@given(tail=TEXT, comment=TEXT)
def test_property_own_drain_is_cleared_on_json_whatever_the_text(tail, comment):
    assume("\x00" not in tail + comment)
    reason = f"{health.REASON_PREFIX} disk:{tail}"
    ctld = Slurmctld(True, "IDLE+DRAIN", reason, comment)
    assert apply(ctld, ok=True) == health.CLEARED
    assert ctld.updates == [["NodeName=c1", "State=RESUME"]]
