"""The node image's agent wheel holds exactly the node's code: the core modules that the agent,
the gang governor and the CLI import (followed through the core), the Slurm thresholds file,
and bootstrap/ and gang/ whole; no build or lab module.
(test_packaging.py installs the wheel and imports every module in it.)"""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest

from nodeforge.images import agent_wheel

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
# Core files that no import names: the Slurm version thresholds nodeforge/slurm_facts.py reads.
CORE_DATA = {"slurm_versions.json"}
NODE_PACKAGES = ("bootstrap", "gang")


def _package_files(folder: str) -> set[str]:
    root = REPO / folder
    return {
        f"nodeforge/{folder}/{f.relative_to(root).as_posix()}"
        for f in root.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"
    }


def test_the_wheel_holds_exactly_the_node_files(tmp_path):
    wheel = agent_wheel.write(tmp_path)
    names = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    expected = {f"nodeforge/{n}" for n in _node_core() | CORE_DATA}
    for pkg in NODE_PACKAGES:
        expected |= _package_files(pkg)
    assert sorted(names - expected) == [], "files in the agent wheel that no node runs"
    assert sorted(expected - names) == [], "node files missing from the agent wheel"
    # the build and the lab stay on the build host
    assert not [n for n in names if n.startswith(("nodeforge/images/", "nodeforge/lab/"))]


def _core_imports(path: Path, package: str) -> set[str]:
    """The core modules (nodeforge.X, X a top-level file) that *path* imports, by file name."""
    found: set[str] = set()
    core = {f.stem for f in (REPO / "nodeforge").glob("*.py")}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own package
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "nodeforge" and len(parts) > 1 and parts[1] in core:
                found.add(f"{parts[1]}.py")
    return found


def _node_core() -> set[str]:
    """The core files that bootstrap/, gang/ and the entry points import, followed through
    the core: what a node runs."""
    todo = [(f, f"nodeforge.{pkg}") for pkg in NODE_PACKAGES for f in (REPO / pkg).rglob("*.py")]
    # the entry points: `nodeforge` (console script) and `python -m nodeforge`
    needed = {"__init__.py", "__main__.py", "cli.py"}
    todo += [(REPO / "nodeforge" / n, "nodeforge") for n in needed]
    seen: set[Path] = set()
    while todo:
        path, package = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for mod in _core_imports(path, package):
            needed.add(mod)
            todo.append((REPO / "nodeforge" / mod, "nodeforge"))
    return needed


def test_the_wheels_core_list_is_what_node_code_imports():
    """No node import goes missing on a node, and no core module rides along that no node
    code needs (a new build-host core module stays off the nodes)."""
    assert set(agent_wheel.NODE_CORE) == _node_core() | CORE_DATA
