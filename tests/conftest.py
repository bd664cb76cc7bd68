"""Shared pytest setup: tiers are selected by marker (-m unit / -m e2e)."""

import shutil

import pytest


def require_tools(*tools: str) -> None:
    """E2e prerequisite check: a missing tool FAILS the test with its name (never a skip)."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"required tools missing: {', '.join(missing)} (install them; see .ci/run)",
                    pytrace=False)
