"""Lint and types in the unit tier: `ruff check` (rules in pyproject.toml) over the tree and
`mypy` over the core, the agent (bootstrap) and the gang governor."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(path).exists():
        pytest.fail(f"{name} not found: pip install -e '.[dev]'", pytrace=False)
    return path


def test_ruff_check():
    cp = subprocess.run([_tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."],
                        cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_mypy_on_core_bootstrap_and_gang(tmp_path):
    cp = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
                        cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "bootstrap" in (REPO / "pyproject.toml").read_text().split("[tool.mypy]", 1)[1]
