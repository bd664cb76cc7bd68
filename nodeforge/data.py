"""Where nodeforge's non-Python inputs are: the Ansible roles and ansible.cfg, the testinfra suites.

A source checkout reads them in place, so an edit takes effect without reinstalling. An
installed wheel carries them as package data under nodeforge/_data/, in the same layout as the
checkout (pyproject.toml maps them there). images/site.yml and the Packer box files are data
of the nodeforge.images package itself, found next to its modules in both cases.
"""

from __future__ import annotations

from pathlib import Path

from .errors import NodeforgeError

_PKG = Path(__file__).resolve().parent
WHEEL_DATA = _PKG / "_data"


def checkout() -> Path | None:
    """The source checkout this nodeforge runs from (editable install), or None."""
    root = _PKG.parent
    if (root / "pyproject.toml").is_file() and (root / "roles").is_dir():
        return root
    return None


def root() -> Path:
    if WHEEL_DATA.is_dir():
        return WHEEL_DATA
    found = checkout()
    if found is None:
        raise NodeforgeError(
            f"nodeforge's data files (roles/, ansible.cfg, tests/infra) are neither in "
            f"{WHEEL_DATA} nor in a source checkout at {_PKG.parent}; reinstall nodeforge from "
            "its wheel (pip install --force-reinstall nodeforge-*.whl) or from a checkout "
            "(pip install -e .)"
        )
    return found


def path(rel: str) -> Path:
    """*rel* (a checkout-relative path such as "roles" or "tests/infra"), which must exist."""
    p = root() / rel
    if not p.exists():
        raise NodeforgeError(
            f"{p}: missing from this nodeforge install; reinstall it (pip install "
            "--force-reinstall nodeforge-*.whl, or pip install -e . in a checkout)"
        )
    return p
