"""Fixtures the unit tests share (plain helpers and fixture values: support.py)."""

from __future__ import annotations

import pytest

from nodeforge.bootstrap.paths import Paths


@pytest.fixture
def paths(tmp_path) -> Paths:
    """Fixture: a node's agent paths under tmp_path/root: an empty on-init.d (0755, as the bake makes
    it) and an empty params.json, what the hook runner reads. Modules that need another
    layout define their own `paths`."""
    p = Paths.under(tmp_path / "root")
    p.on_init_d.mkdir(parents=True, mode=0o755)
    p.on_init_d.chmod(0o755)
    p.params_json.parent.mkdir(parents=True)
    p.params_json.write_text("{}")
    return p
