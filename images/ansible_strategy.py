"""The Ansible strategy of the bake's playbook runs: Mitogen for Ansible's `mitogen_linear`.

Linear order as before, but each task runs over one Python interpreter per host that Mitogen
starts once over SSH, instead of a worker fork, an AnsiballZ payload and a new remote Python
per task (~0.2 s each over ~200 small tasks of a cold build; bench/README.md has figures).

One place: the driver passes `strategy_env()` to every ansible-playbook run of the local
target (Packer's provisioner and the re-apply passes). ansible.cfg stays plain `linear`, so
running the playbook by hand needs nothing else; `strategy_plugins` must be a directory,
which is where pip put the mitogen package, found here at run time.

No fallback to plain `linear`: mitogen is a declared dependency (pyproject.toml), and a
build that silently ran the slower strategy would hide a broken install behind its time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from nodeforge.errors import MissingPackageError

STRATEGY = "mitogen_linear"
PACKAGE = "mitogen"
# Keep in step with pyproject.toml's dependency (the range verified with ansible-core 2.19).
REQUIREMENT = "mitogen>=0.3.54,<0.4"


def strategy_dir() -> Path:
    """The directory of Mitogen's Ansible strategy plugins in this interpreter's packages."""
    spec = importlib.util.find_spec("ansible_mitogen")  # finds it without importing Ansible
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        d = Path(loc) / "plugins" / "strategy"
        if (d / f"{STRATEGY}.py").is_file():
            return d
    raise MissingPackageError(
        PACKAGE,
        f"the build's Ansible strategy {STRATEGY}",
        f"pip install '{REQUIREMENT}' (or reinstall nodeforge: pip install -e .)",
    )


def strategy_env() -> dict[str, str]:
    """Environment that makes ansible-playbook use `mitogen_linear` (raises
    MissingPackageError naming the package if it is not installed)."""
    return {"ANSIBLE_STRATEGY": STRATEGY, "ANSIBLE_STRATEGY_PLUGINS": str(strategy_dir())}


def tool_versions() -> dict[str, str]:
    """For the manifest's `tools`: the mitogen release that ran the playbook."""
    try:
        return {PACKAGE: importlib.metadata.version(PACKAGE)}
    except importlib.metadata.PackageNotFoundError:  # a copy on sys.path without metadata
        return {PACKAGE: "unknown"}
