"""The Vagrantfile parses and validates offline (no provider, no box, no network)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nodeforge import proc
from tests.conftest import require_tools

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_vagrant_validate(tmp_path):
    require_tools("vagrant")
    # A copy, so validation never writes .vagrant/ into the checkout.
    shutil.copy(REPO / "Vagrantfile", tmp_path / "Vagrantfile")
    cp = proc.run(
        ["vagrant", "validate", "--ignore-provider"],
        cwd=tmp_path,
        timeout=180,
        env={"VAGRANT_CHECKPOINT_DISABLE": "1", "HOME": str(tmp_path)},
    )
    assert "validated successfully" in cp.stdout, cp.stdout
    for n in ("ctl", "c1", "c2"):
        assert f"{n}:" in cp.stdout, cp.stdout
