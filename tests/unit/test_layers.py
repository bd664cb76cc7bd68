"""The layering contracts (pyproject's [tool.importlinter], docs/contracts.md) hold.

The checkout keeps nodeforge's packages in separate top-level folders that install under one
name (pyproject's package-dir), and import-linter reads a package from its own folder; so the
test copies the Python files into the installed layout and runs `lint-imports` over the copy.
A new upward or cross import fails here with the contract's name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
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
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, Path] = {}
    for f in sorted(tests.rglob("test_*.py")):
        other = seen.setdefault(f.name, f)
        assert other == f, f"{f.relative_to(tests)} and {other.relative_to(tests)}: rename one"
