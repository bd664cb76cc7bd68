"""The build pipeline shared by every target: one output session, no import cycle."""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import pytest

from nodeforge.errors import NodeforgeError
from nodeforge.images import pipeline

pytestmark = pytest.mark.unit

IMAGES = Path(pipeline.__file__).resolve().parent


def _relative_imports(path: Path) -> set[str]:
    """Modules of images/ that *path* imports, lazily or not (`from . import x`, `from .x`)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "nodeforge.images."
        ):
            out.add(node.module.split(".")[2])
    return out


def test_images_package_has_no_import_cycle():
    graph = {p.stem: _relative_imports(p) for p in IMAGES.glob("*.py")}
    state: dict[str, int] = {}

    def visit(mod: str, stack: list[str]) -> None:
        if state.get(mod) == 2:
            return
        assert state.get(mod) != 1, "import cycle: " + " -> ".join(stack + [mod])
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            visit(dep, stack + [mod])
        state[mod] = 2

    for mod in sorted(graph):
        visit(mod, [])
    # The targets share the pipeline; neither imports the dispatcher or the other target.
    assert "pipeline" in graph["nspawn_build"] and "pipeline" in graph["packer_build"]
    assert not graph["packer_build"] & {"build", "nspawn_build"}
    assert not graph["nspawn_build"] & {"build", "packer_build"}


def _report_log() -> tuple[list[tuple[str, str]], pipeline.Reporter]:
    seen: list[tuple[str, str]] = []
    return seen, lambda phase, what: seen.append((phase, what))


def test_session_publishes_whole_on_success(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("from the previous build")
    out.with_name("out.failed-build.log").write_text("old failure")
    seen, rep = _report_log()
    with pipeline.output_session(out, rep) as s:
        s.logfile.write("hello\n")
        (s.partial / "artifact").write_text("new")
        assert not (out / "artifact").exists()  # nothing under the final name before the end
    assert (out / "artifact").read_text() == "new"
    assert not (out / "stale").exists()
    assert (out / "build.log").read_text() == "hello\n"
    assert not out.with_name("out.partial").exists()
    assert not out.with_name("out.failed-build.log").exists()
    assert seen == []


def test_session_failure_keeps_log_removes_partial_runs_every_step(tmp_path):
    out = tmp_path / "out"
    ran: list[str] = []
    seen, rep = _report_log()
    with (
        pytest.raises(NodeforgeError, match="cleanup after the build was incomplete: broken: boom"),
        pipeline.output_session(out, rep) as s,
    ):
        s.on_cleanup("first", lambda: ran.append("first"))
        s.on_cleanup("broken", lambda: (_ for _ in ()).throw(OSError("boom")))
        s.on_cleanup("last", lambda: ran.append("last"))
        s.logfile.write("working\n")
        raise RuntimeError("provision failed")
    assert ran == ["first", "last"]
    assert not out.exists() and not out.with_name("out.partial").exists()
    failed = out.with_name("out.failed-build.log").read_text()
    assert "working" in failed and "build FAILED: RuntimeError: provision failed" in failed
    assert seen == [("build", f"failed; full log: {out.with_name('out.failed-build.log')}")]


def test_session_masks_sigint_during_cleanup_and_restores_handlers(tmp_path):
    during: list[object] = []
    before_int = signal.getsignal(signal.SIGINT)
    before_term = signal.getsignal(signal.SIGTERM)
    with (
        pytest.raises(KeyboardInterrupt),
        pipeline.output_session(tmp_path / "o", lambda p, w: None) as s,
    ):
        s.on_cleanup("look", lambda: during.append(signal.getsignal(signal.SIGINT)))
        # SIGTERM takes the Ctrl-C path inside the session.
        signal.raise_signal(signal.SIGTERM)
    assert during == [signal.SIG_IGN]
    assert signal.getsignal(signal.SIGINT) is before_int
    assert signal.getsignal(signal.SIGTERM) is before_term
    assert (tmp_path / "o.failed-build.log").is_file()


def test_leftover_partial_of_an_interrupted_build_is_replaced(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "half.qcow2").write_text("x")
    with pipeline.output_session(out, lambda p, w: None):
        pass
    assert not (out / "half.qcow2").exists()
