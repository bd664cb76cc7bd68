"""The bootstrap-failure summary (issue 28 item 4): many nodes failing the same first-boot step
are said once, with the step, how many nodes, and the first error (redacted)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge.bootstrap import failures
from nodeforge.bootstrap.state import STEPS, State

pytestmark = pytest.mark.unit


def failed(step: str, error: str, ended: float | None) -> dict:
    """A state.json (as loaded) of an agent that failed in *step*."""
    s = State(status="failed", last_error=f"{step}: {error}")
    for name in STEPS[: STEPS.index(step)]:
        s.steps[name].status = "done"
    s.steps[step].status, s.steps[step].error, s.steps[step].ended = "failed", error, ended
    return s.to_dict()


def ready() -> dict:
    s = State(status="ready")
    for name in STEPS:
        s.steps[name].status = "done"
    return s.to_dict()


def test_many_nodes_failing_one_step_are_one_line_with_the_first_error():
    states = {
        f"c{i:03d}": failed("hooks", f"hook 10-mirror failed (exit {i})", 1000.0 + (i % 7))
        for i in range(1, 41)
    }
    states |= {"c041": ready(), "c042": failed("role", "slurmctld did not answer", 900.0)}
    states["c043"] = {**failed("hooks", "x", 1.0), "status": "running"}  # being retried now
    summary = failures.summarize(states)
    assert [(s.step, len(s.nodes)) for s in summary] == [("hooks", 40), ("role", 1)]
    hooks = summary[0]
    assert hooks.first_node == "c007"  # earliest failure (1000.0; c007, c014 … tie: by name)
    assert hooks.first_error == "hook 10-mirror failed (exit 7)"
    assert hooks.to_dict()["count"] == 40 and "c043" not in hooks.nodes
    lines = failures.lines(summary)
    assert len(lines) == 2
    assert lines[0].startswith("bootstrap: step hooks failed on 40 nodes (c001, c002,")
    assert "(+32)" in lines[0] and "first error (c007): hook 10-mirror failed (exit 7)" in lines[0]
    assert lines[1] == (
        "bootstrap: step role failed on 1 node (c042); first error (c042): slurmctld did not answer"
    )


def test_first_error_is_redacted_and_one_line():
    url = "https://h/x.sh?X-Amz-Signature=abcdef0123456789abcdef0123456789"
    states = {"c1": failed("hooks", f"hook 10-x could not be fetched: {url}\ntraceback…", 5.0)}
    (s,) = failures.summarize(states)
    assert "abcdef0123456789" not in s.first_error and "\n" not in s.first_error
    assert s.first_error.startswith("hook 10-x could not be fetched: https://h/x.sh")


def test_no_failure_no_summary_and_odd_records_do_not_break_it():
    assert failures.summarize({"c1": ready(), "c2": {}, "c3": {"status": "new"}}) == []
    odd = {"c1": {"status": "failed", "steps": "nonsense", "last_error": 7}}
    (s,) = failures.summarize(odd)
    assert (s.step, s.nodes, s.first_error) == ("unknown", ("c1",), "no error recorded")


def test_node_gauge_lists_every_step_with_the_failed_one_set():
    text = failures.prometheus(failed("munge", "munge -n did not answer", 3.0))
    rows = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert rows == [f'nodeforge_bootstrap_failed{{step="{s}"}} {int(s == "munge")}' for s in STEPS]
    assert "# TYPE nodeforge_bootstrap_failed gauge" in text
    assert all(r.endswith(" 0") for r in failures.prometheus(ready()).splitlines()[2:])


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"c[0-9]{1,4}", fullmatch=True),
        st.tuples(
            st.sampled_from((*STEPS, None)), st.text(max_size=40), st.none() | st.floats(0, 1e9)
        ),
        max_size=30,
    )
)
def test_summary_counts_every_failed_node_once(nodes):
    states = {n: (failed(s, e, t) if s else ready()) for n, (s, e, t) in nodes.items()}
    summary = failures.summarize(states)
    counted = [n for s in summary for n in s.nodes]
    assert sorted(counted) == sorted(n for n, (s, _, _) in nodes.items() if s)
    assert all("\n" not in s.first_error for s in summary)
    assert [len(s.nodes) for s in summary] == sorted((len(s.nodes) for s in summary), reverse=True)


def test_cluster_status_prints_the_summary_once_under_the_table(capsys):
    """`nodeforge cluster status` (lab/cluster_cli.py) over a status whose summary came from
    failures.summarize: one line per failing step, after the node rows."""
    from nodeforge.lab.cluster_cli import _print_status

    states = {f"c{i}": failed("hooks", "hook 10-x failed (exit 2)", float(i)) for i in (3, 1, 2)}
    row = {"role": "compute", "address": "10.0.0.9", "agent": "failed", "slurm_state": "idle+drain"}
    st = {
        "cluster": "demo",
        "image": "/img",
        "nodes": [{**row, "name": n, "time_to_ready_s": None, "reason": "r"} for n in states],
        "bootstrap_failures": [s.to_dict() for s in failures.summarize(states)],
    }
    _print_status(st, as_json=False)
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == (
        "bootstrap: step hooks failed on 3 nodes (c1, c2, c3); first error (c1): "
        "hook 10-x failed (exit 2)"
    )
    assert sum("bootstrap:" in ln for ln in out) == 1
