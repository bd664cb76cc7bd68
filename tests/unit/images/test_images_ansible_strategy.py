"""The bake's Ansible strategy (images/ansible_strategy.py): Mitogen's `mitogen_linear`, found
in the installed mitogen package at run time and passed to every ansible-playbook run."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import distribution, version
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from nodeforge.errors import MissingPackageError
from nodeforge.images import ansible_strategy, template

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
PLAYBOOK = """\
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo nodeforge-strategy-probe
      register: out
      changed_when: false
    - ansible.builtin.assert:
        that: out.stdout == 'nodeforge-strategy-probe'
"""


def test_env_names_the_strategy_and_a_plugin_dir_of_the_installed_mitogen():
    env = ansible_strategy.strategy_env()
    assert env["ANSIBLE_STRATEGY"] == "mitogen_linear"
    d = Path(env["ANSIBLE_STRATEGY_PLUGINS"])
    assert d.is_absolute() and (d / "mitogen_linear.py").is_file()
    # the directory is the one pip installed with the mitogen distribution, not a copy
    dist = distribution("mitogen")
    files = {Path(dist.locate_file(f)).resolve() for f in dist.files or []}
    assert (d / "mitogen_linear.py").resolve() in files


def test_the_pinned_range_is_the_one_in_pyproject_and_the_installed_release_is_in_it():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    mine = [Requirement(d) for d in deps if Requirement(d).name == "mitogen"]
    assert [str(r) for r in mine] == [str(Requirement(ansible_strategy.REQUIREMENT))]
    spec = mine[0].specifier
    assert spec.contains(version("mitogen"))
    assert not spec.contains("0.4.0"), "the range must be bounded above"
    assert ansible_strategy.tool_versions() == {"mitogen": version("mitogen")}


def _playbook(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    pb = tmp_path / "probe.yml"
    pb.write_text(PLAYBOOK)
    full = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
        "ANSIBLE_HOME": str(tmp_path / "home"),
        **template.ANSIBLE_ENV,
        **env,
    }
    # The interpreter is named: Mitogen's interpreter discovery over the local connection
    # fails here ("EOF on stream"); the bake connects over SSH, where discovery works.
    cmd = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        *("-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}"),
    ]
    return subprocess.run(
        [*cmd, str(pb)], env=full, capture_output=True, text=True, timeout=120, check=False
    )


def test_ansible_core_runs_a_play_with_the_strategy_from_that_env(tmp_path):
    """The installed ansible-core (2.19) loads mitogen_linear from the env the driver passes,
    with the repository's ansible.cfg, and a task runs through it."""
    r = _playbook(tmp_path, ansible_strategy.strategy_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"localhost\s+: ok=2 .*failed=0", r.stdout), r.stdout


def test_without_the_plugin_dir_ansible_refuses_the_strategy(tmp_path):
    """The check above can fail: the strategy name alone is not found by ansible-core."""
    r = _playbook(tmp_path, {"ANSIBLE_STRATEGY": ansible_strategy.STRATEGY})
    assert r.returncode != 0
    assert "mitogen_linear" in r.stdout + r.stderr


def test_no_play_overrides_the_strategy():
    """A play's own `strategy:` would silently win over the driver's environment."""
    plays = yaml.safe_load((REPO / "images/site.yml").read_text())
    assert plays and all("strategy" not in p for p in plays)
    cfg = (REPO / "ansible.cfg").read_text()
    assert not re.search(r"(?m)^\s*strategy", cfg), "ansible.cfg stays plain linear"


def test_missing_mitogen_names_the_package_and_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "ansible_mitogen" else real(name, *a),
    )
    with pytest.raises(MissingPackageError) as e:
        ansible_strategy.strategy_env()
    msg = str(e.value)
    assert "'mitogen'" in msg and "mitogen_linear" in msg
    assert f"pip install '{ansible_strategy.REQUIREMENT}'" in msg


def test_a_mitogen_without_the_strategy_plugin_is_refused(tmp_path, monkeypatch):
    """An ansible_mitogen package without plugins/strategy/mitogen_linear.py (another
    package of that name, a broken install) is no strategy dir."""
    pkg = tmp_path / "ansible_mitogen"
    (pkg / "plugins" / "strategy").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in [
        m for m in sys.modules if m == "ansible_mitogen" or m.startswith("ansible_mitogen.")
    ]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(MissingPackageError, match="mitogen"):
        ansible_strategy.strategy_dir()
