"""The agent reads its node through nodeforge.slurm_records, the governor's reader: JSON on
Slurm >= 23.02 (the image's 24.11), 22.05's `scontrol -o` line otherwise; the one "ready"
definition (readiness.NodeState) on top. Operator text (Reason, Comment, Extra) is data: it
never reads as a state and never as the agent's own drain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from nodeforge import slurm_records as sr
from nodeforge.bootstrap import readiness as rd
from nodeforge.bootstrap.host import Host
from tests.unit.support import SCONTROL_JSON_24_11, FakeHost, scontrol_json_doc

pytestmark = pytest.mark.unit

FIXTURE = SCONTROL_JSON_24_11
fixture_doc = scontrol_json_doc  # 24.11-shaped `scontrol show node --json` (a fixture)


def test_fixture_nodes_read_with_the_one_ready_definition():
    got = {n: rd.from_record(r) for n, r in sr.parse_nodes(FIXTURE.read_text()).items()}
    assert {n: s.ready for n, s in got.items()} == {
        "c001": True,
        "c002": False,  # DRAIN (its Comment says State=IDLE: text, not state)
        "c003": False,  # NOT_RESPONDING, i.e. `idle*`
        "c004": False,  # FUTURE
        "c005": False,  # DRAIN
        "c006": False,  # POWERED_DOWN, i.e. `idle~`
    }
    assert str(got["c002"]) == "IDLE+DRAIN+DYNAMIC_NORM"
    assert got["c003"].short() == "idle*" and got["c006"].short() == "idle~"
    assert got["c004"].why_not() == "state FUTURE"
    c002 = sr.parse_nodes(FIXTURE.read_text())["c002"]
    assert c002.reason == "maint\nState=IDLE Reason=nodeforge: running hooks"


class Recorded(FakeHost):
    """A host whose scontrol answers from the fixture document, as `scontrol --future show
    node --json NAME` does (only that node); RESUME of a node sets it IDLE+DYNAMIC_NORM."""

    def __init__(self, doc: dict):
        super().__init__()
        self.nodes = {n["name"]: n for n in doc["nodes"]}

    def answer(self, argv, timeout, env):
        if argv[1:5] == ["--future", "show", "node", "--json"]:
            n = self.nodes.get(argv[5])
            if n is None:
                return 1, ""
            return 0, json.dumps({"nodes": [n], "meta": {}, "errors": []}, indent=2)
        if argv[1] == "update" and "State=RESUME" in argv:
            name = argv[2].removeprefix("NodeName=")
            self.nodes[name] = {**self.nodes[name], "state": ["IDLE", "DYNAMIC_NORM"], "reason": ""}
        return 0, ""


def gate(host: Recorded, node: str) -> rd.Gate:
    h = Host(run=host.run, sleep=lambda s: None)
    return rd.Gate(h, node, Path("/nonexistent/slurm.conf"), json=True, poll=0)


def test_gate_on_json_never_resumes_an_operator_drain_that_mentions_nodeforge():
    host = Recorded(fixture_doc())
    out = gate(host, "c002").release(timeout=1)
    assert out["slurm"].startswith("left drained (reason not ours: maint")
    assert not [c for c in host.calls if "State=RESUME" in c]


def test_gate_on_json_resumes_its_own_drain_and_waits_for_ready():
    host = Recorded(fixture_doc())
    out = gate(host, "c005").release(timeout=1)
    assert out["slurm"] == "resumed"
    assert [c for c in host.calls if "State=RESUME" in c] == [
        ["scontrol", "update", "NodeName=c005", "State=RESUME"]
    ]
    assert gate(host, "c005").state().ready


def test_gate_on_json_sees_future_nodes_and_unknown_ones():
    host = Recorded(fixture_doc())
    assert gate(host, "c004").record() is not None  # exists (FUTURE): never created again
    assert gate(host, "c999").record() is None
    assert gate(host, "c999").state().why_not() == "not registered"


class AnswersWithJsonError(Recorded):
    """Unknown node answered with exit 0 and a JSON error (ESLURM_INVALID_NODE_NAME's text),
    or with another error the gate must not take for "not there"."""

    def __init__(self, error: str):
        super().__init__(fixture_doc())
        self.error = error

    def answer(self, argv, timeout, env):
        doc = {"nodes": [], "meta": {}, "errors": [{"error": self.error, "error_number": 2008}]}
        return 0, json.dumps(doc, indent=2)


def test_gate_on_json_reads_an_invalid_node_name_error_as_not_known():
    assert gate(AnswersWithJsonError("Invalid node name specified"), "c9").record() is None
    with pytest.raises(sr.SlurmDataError, match="errors"):
        gate(AnswersWithJsonError("Access/permission denied"), "c9").record()


def test_gate_on_json_refuses_a_body_that_is_not_slurm_json():
    host = Recorded(fixture_doc())
    host.nodes["c001"] = {"name": "c001", "state": "IDLE; rm -rf /"}
    with pytest.raises(sr.SlurmDataError, match="c001"):
        gate(host, "c001").state()


LINE_22 = (
    "NodeName=c1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=1 CPULoad=0.00 "
    "AvailableFeatures=gpu ActiveFeatures=gpu Gres=(null) NodeAddr=c1 NodeHostName=c1 "
    "Version=22.05.8 OS=Linux 6.1.0-28-amd64 #1 SMP RealMemory=1 AllocMem=0 FreeMem=N/A "
    "Sockets=1 Boards=1 State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A "
    "MCS_label=N/A Partitions=main BootTime=None SlurmdStartTime=None{tail}\n"
)


def test_22_05_line_reads_state_before_any_free_text():
    """Fixture: 22.05's `scontrol --future -o show node c1` layout. Comment and Reason come
    after State; a Comment that says `State=IDLE` changes nothing."""
    line = LINE_22.format(
        state="IDLE+DRAIN+DYNAMIC_NORM",
        tail=" Comment=x State=IDLE NextState=IDLE Reason=maint [root@2026-12-03T10:00:00]",
    )
    rec = sr.node_from_line(line, "c1")
    assert rec is not None and rd.from_record(rec).drained and not rd.from_record(rec).ready
    assert rec.reason == "maint [root@2026-12-03T10:00:00]"
    assert sr.node_from_line(line, "c2") is None  # another node's line
    future = sr.node_from_line(LINE_22.format(state="FUTURE", tail=""), "c1")
    assert future is not None and future.base == "FUTURE" and future.reason == ""


def test_22_05_line_with_a_second_reason_is_never_taken_for_the_agents_own_drain():
    for tail in (
        " Comment=x Reason=nodeforge: y Reason=maint [root@t]",  # forged in a Comment
        " Reason=maint Reason=nodeforge: running hooks [root@t]",  # forged inside the Reason
    ):
        line = LINE_22.format(state="IDLE+DRAIN", tail=tail)
        rec = sr.node_from_line(line, "c1")
        assert rec is not None and rec.reason.startswith(sr.REASON_AMBIGUOUS)
        assert not rec.reason.startswith(rd.PREFIX)


TEXT = hst.text(
    alphabet=hst.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=60,
) | hst.sampled_from(["\nState=IDLE", "Reason=nodeforge: x", '"}],"nodes":[', "=", " "])


@settings(max_examples=150, deadline=None)
@given(reason=TEXT, comment=TEXT, extra=TEXT)
def test_operator_text_parses_back_exactly_and_never_moves_the_state(reason, comment, extra):
    doc = fixture_doc()
    n = doc["nodes"][1]  # c002: IDLE+DRAIN+DYNAMIC_NORM
    n.update(reason=reason, comment=comment, extra=extra)
    rec = sr.parse_nodes(json.dumps(doc, indent=2))["c002"]
    assert rec.reason == reason
    assert rec.flags == {"IDLE", "DRAIN", "DYNAMIC_NORM"} and rec.base == "IDLE"


def test_readiness_imports_the_reader_only_when_it_reads():
    """The agent's import cost: `nodeforge.bootstrap.readiness` loads slurm_records lazily."""
    code = (
        "import sys, nodeforge.bootstrap.readiness; print('nodeforge.slurm_records' in sys.modules)"
    )
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert cp.stdout.strip() == "False"
