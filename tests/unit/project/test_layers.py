"""The layering contracts (pyproject's [tool.importlinter], docs/contracts.md) hold.

The checkout keeps nodeforge's packages in separate top-level folders that install under one
name (pyproject's package-dir), and import-linter reads a package from its own folder; so the
test copies the Python files into the installed layout and runs `lint-imports` over the copy.
A new upward or cross import fails here with the contract's name.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
# checkout folder -> subpackage of nodeforge (pyproject's [tool.setuptools.package-dir])
SUBPACKAGES = ("bootstrap", "gang", "images", "lab")


def _installed_layout(dest: Path) -> Path:
    root = dest / "nodeforge"
    root.mkdir(parents=True)
    for f in (REPO / "nodeforge").glob("*.py"):
        shutil.copy2(f, root / f.name)
    for sub in SUBPACKAGES:
        for f in (REPO / sub).rglob("*.py"):
            out = root / sub / f.relative_to(REPO / sub)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out)
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail("lint-imports is missing: pip install -e '.[dev]' (import-linter)")
    env = {**os.environ, "PYTHONPATH": str(tree), "NO_COLOR": "1"}
    return subprocess.run(
        [str(exe), "--no-cache", str(REPO / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layer_contracts_are_kept(tmp_path):
    cp = _lint(_installed_layout(tmp_path))
    assert cp.returncode == 0, (
        "an import breaks a layer contract (docs/contracts.md says which way imports go):\n"
        + cp.stdout[-4000:]
        + cp.stderr[-2000:]
    )
    assert "3 kept, 0 broken" in cp.stdout, cp.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        # the core importing the lab (upward)
        ("fsutil.py", "from nodeforge.lab import vm", "layers: lab above the build"),
        # the agent importing the governor (across node code)
        ("bootstrap/agent.py", "from nodeforge.gang import policy", "layers: lab above the build"),
        # the build reaching into the agent
        ("images/build.py", "from nodeforge.bootstrap import params", "does not use node code"),
        # product code importing the test helpers
        ("proc.py", "import tests.helpers", "product code does not import the tests"),
    ],
)
def test_a_planted_import_breaks_the_named_contract(tmp_path, module, line, contract):
    tree = _installed_layout(tmp_path)
    target = tree / "nodeforge" / module
    target.write_text(target.read_text() + f"\n{line}  # planted by the test\n")
    cp = _lint(tree)
    assert cp.returncode != 0, cp.stdout
    broken = [ln for ln in cp.stdout.splitlines() if " BROKEN" in ln]
    assert any(contract in ln for ln in broken), cp.stdout


def test_no_two_test_modules_share_a_basename():
    """The e2e run collects tests/e2e and tests/unit together (rootdir-relative imports by
    basename): two test files of one name abort the whole e2e tier at collection."""
    tests = Path(__file__).resolve().parents[2]
    seen: dict[str, Path] = {}
    for f in sorted(tests.rglob("test_*.py")):
        other = seen.setdefault(f.name, f)
        assert other == f, f"{f.relative_to(tests)} and {other.relative_to(tests)}: rename one"


def _import_problems(path: Path, source: str) -> list[str]:
    """What *path* (a file under tests/ or bench/) does that couples modules by accident: it
    imports a test module (test_*: pytest collects those; shared code goes in a support
    module or a conftest.py fixture), or it reads or edits sys.path (the project is installed,
    and pytest puts the checkout on the path: pyproject's pythonpath)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's own folder up
                pkg = (
                    path.parent.relative_to(REPO).parents[node.level - 2]
                    if node.level > 1
                    else path.parent.relative_to(REPO)
                )
                base = ".".join([*pkg.parts, *([base] if base else [])])
            mods = [base] + [
                f"{base}.{a.name}"
                for a in node.names
                if (REPO.joinpath(*base.split(".")) / f"{a.name}.py").is_file()
            ]
            if base == "sys" and any(a.name == "path" for a in node.names):
                found.append(f"line {node.lineno}: from sys import path")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            found.append(f"line {node.lineno}: sys.path")
            continue
        else:
            continue
        for mod in mods:
            if any(part.startswith("test_") for part in mod.split(".")):
                found.append(f"line {node.lineno}: imports the test module {mod}")
    return found


@pytest.mark.parametrize("top", ["tests", "bench"])
def test_no_module_imports_a_test_module_or_edits_sys_path(top):
    problems = [
        f"{f.relative_to(REPO)} {p}"
        for f in sorted((REPO / top).rglob("*.py"))
        for p in _import_problems(f, f.read_text())
    ]
    assert not problems, (
        "move what the test modules share into a support module (tests/e2e/gang_support.py,"
        " tests/unit/support.py) or a conftest.py fixture; import the project, not a path:\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize(
    "planted",
    [
        "from test_gang_slurm import wait_for",
        "import test_cli",
        "from tests.e2e.test_cluster_rollout import linked_copy",
        "from tests.e2e import test_cluster_rollout",
        "from . import test_cli",
        "import sys\nsys.path.insert(0, '/x')",
        "import sys\nif '/x' not in sys.path: pass",
        "from sys import path",
    ],
)
def test_a_planted_test_import_or_path_edit_is_found(planted):
    path = REPO / "tests" / "unit" / "core" / "test_planted.py"  # beside test_cli.py
    assert _import_problems(path, planted), planted


def test_support_and_project_imports_are_not_flagged():
    path = REPO / "tests" / "e2e" / "test_planted.py"
    source = (
        "from tests.e2e.gang_cases import test_prolog_hangs\n"  # a case function, not a module
        "from tests.e2e.gang_support import wait_for\n"
        "from bench import time_to_ready\n"
        "import nodeforge.proc\n"
    )
    assert _import_problems(path, source) == []


def test_unit_tests_sit_in_the_folder_of_their_part():
    """tests/unit holds one folder per part (bootstrap, images, gang, lab, core, project);
    conftest.py and support.py stay at its top, for every folder."""
    unit = REPO / "tests" / "unit"
    flat = sorted(f.name for f in unit.glob("test_*.py"))
    assert not flat, f"move {flat} into the folder of the part they test ({unit})"
    parts = sorted(d.name for d in unit.iterdir() if d.is_dir() and d.name[0] not in "._")
    assert parts == ["bootstrap", "core", "gang", "images", "lab", "project"], parts
