"""How the governor takes slurmctld's answer each cycle (gang.slurm_view.OutputBuffer, through
nodeforge.proc.run's output_file): the client writes into a memory file kept between calls
and the reader reads it through a memory map, as bytes. Real child processes here (sh), no
Slurm: what is checked is that each call hands out exactly what the client wrote this time
(never a longer earlier output's tail), a failure names the command with its output, and the
snapshot reads bytes to the same jobs as text."""

from __future__ import annotations

import json

import pytest

from nodeforge import proc
from nodeforge.errors import CommandError
from nodeforge.gang.slurm_view import OutputBuffer, SlurmCli, parse_jobs

pytestmark = pytest.mark.unit


def _cli(tmp_path, jobs_file, nodes_file) -> SlurmCli:
    cli = SlurmCli(timeout=10)
    cli._commands = (["cat", str(jobs_file)], ["cat", str(nodes_file)])  # instead of scontrol
    return cli


def test_output_file_gets_stdout_and_stderr_and_no_pipe(tmp_path):
    with open(tmp_path / "out", "w+b") as f:
        cp = proc.run(["sh", "-c", "echo out; echo err >&2"], output_file=f, timeout=10)
        assert cp.stdout is None
        f.seek(0)
        assert sorted(f.read().split()) == [b"err", b"out"]


def test_each_read_is_exactly_this_calls_output_longer_or_shorter(tmp_path):
    out = OutputBuffer()
    cli = SlurmCli(timeout=10)
    seen = []
    for text in ["a" * 10000, "b" * 50, "", "c" * 70000, "d\n" * 3, "é" * 3000]:
        (tmp_path / "o").write_text(text, encoding="utf-8")
        got = out.run(cli, ["cat", str(tmp_path / "o")])
        seen.append(bytes(got))
        assert bytes(got) == text.encode() and len(got) == len(text.encode())
    # a view still held (a caller that kept it) never makes the next read wrong
    (tmp_path / "o").write_text("x" * 100)
    held = memoryview(out.run(cli, ["cat", str(tmp_path / "o")]))
    (tmp_path / "o").write_text("y" * 7)
    assert bytes(out.run(cli, ["cat", str(tmp_path / "o")])) == b"y" * 7
    held.release()


def test_failed_client_is_a_command_error_with_its_output(tmp_path):
    out = OutputBuffer()
    with pytest.raises(CommandError) as ei:
        out.run(
            SlurmCli(timeout=10), ["sh", "-c", "echo 'slurm_load_jobs error: down' >&2; exit 3"]
        )
    assert ei.value.returncode == 3 and "slurm_load_jobs error: down" in str(ei.value)
    assert "is slurmctld up" in str(ei.value)


def test_snapshot_reads_the_same_jobs_as_the_text_and_keeps_no_view(tmp_path):
    from tests.unit.gang.gang_support import cached_job as job
    from tests.unit.gang.gang_support import render_jobs as render

    jobs = [job(1, "24", 'n\n"x" é'), job(2, "24")]
    jf, nf = tmp_path / "jobs.json", tmp_path / "nodes.json"
    nodes = {"nodes": [{"name": "gn1", "state": ["IDLE"], "reason": "r"}], "errors": []}
    nf.write_text(json.dumps(nodes, indent=2))
    cli = _cli(tmp_path, jf, nf)
    for restarts in (0, 0, 1, 1):
        jobs[0]["restart_cnt"] = restarts
        text = render(jobs, "24")
        jf.write_text(text, encoding="utf-8")
        snap = cli.snapshot()
        assert snap.jobs == parse_jobs(text) and snap.bytes_read == len(text.encode()) + len(
            nf.read_bytes()
        )
        assert snap.nodes == {"gn1": frozenset({"IDLE"})} and snap.node_reasons == {"gn1": "r"}
    first = snap.nodes
    assert cli.snapshot().nodes is first  # unchanged node output: the same map
    # no view into the maps outlives the snapshot (else the next read could not resize)
    jf.write_text(render(jobs[:1], "24"))
    assert [j.job_id for j in cli.snapshot().jobs] == ["1"]


def test_snapshot_of_output_that_is_not_utf8_is_a_data_error(tmp_path):
    from nodeforge.slurm_records import SlurmDataError
    from tests.unit.gang.gang_support import cached_job as job
    from tests.unit.gang.gang_support import render_jobs as render

    jf, nf = tmp_path / "jobs.json", tmp_path / "nodes.json"
    nf.write_text('{"nodes": [], "errors": []}')
    cli = _cli(tmp_path, jf, nf)
    good = render([job(1, "24", "ab"), job(2, "24")], "24").encode()
    jf.write_bytes(good)
    cli.snapshot()
    jf.write_bytes(good.replace(b'"ab"', b'"a\xff"', 1))  # same length, a changed job
    with pytest.raises(SlurmDataError, match="not UTF-8"):
        cli.snapshot()


def test_empty_node_output_is_an_error_even_on_the_first_read(tmp_path):
    from nodeforge.slurm_records import SlurmDataError
    from tests.unit.gang.gang_support import cached_job as job
    from tests.unit.gang.gang_support import render_jobs as render

    jf, nf = tmp_path / "jobs.json", tmp_path / "nodes.json"
    jf.write_text(render([job(1, "24")], "24"))
    nf.write_text("")
    with pytest.raises(SlurmDataError, match="not JSON"):
        _cli(tmp_path, jf, nf).snapshot()


def test_snapshot_node_map_is_the_same_object_only_while_every_node_text_is(tmp_path):
    """The node map decide() reads: the same object while slurmctld prints every node as
    before; a ping (load, free memory) gives a new map with the same flags; a drain gives
    its flags and reason. Each read equals the full parse of that output."""
    from nodeforge.gang.slurm_view import parse_nodes
    from tests.unit.gang.gang_support import cached_job as job
    from tests.unit.gang.gang_support import cached_node as node
    from tests.unit.gang.gang_support import render_jobs as render
    from tests.unit.gang.gang_support import render_nodes

    jf, nf = tmp_path / "jobs.json", tmp_path / "nodes.json"
    jf.write_text(render([job(1, "24")], "24"))
    nodes = [node("c1", "24"), node("c2", "24")]
    nf.write_text(render_nodes(nodes, "24"))
    cli = _cli(tmp_path, jf, nf)
    first = cli.snapshot()
    assert cli.snapshot().nodes is first.nodes
    nodes[1] = node("c2", "24", load=9)  # slurmd's ping
    nf.write_text(render_nodes(nodes, "24"))
    pinged = cli.snapshot()
    assert pinged.nodes is not first.nodes and pinged.nodes == first.nodes
    nodes[0] = node("c1", "24", reason="ops: fan\nState=IDLE", drained=True)
    nf.write_text(render_nodes(nodes, "24"))
    drained = cli.snapshot()
    full = parse_nodes(nf.read_text())
    assert drained.nodes == {n: r.flags for n, r in full.items()}
    assert drained.nodes["c1"] == {"IDLE", "DRAIN"}
    assert drained.node_reasons == {"c1": "ops: fan\nState=IDLE"}
    nodes.pop(0)  # a dynamic node deleted
    nf.write_text(render_nodes(nodes, "24"))
    assert cli.snapshot().nodes == {"c2": frozenset({"IDLE"})}
