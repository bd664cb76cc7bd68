"""The built wheels, installed into fresh venvs outside the checkout (no root, no network).

- The full wheel carries what `nodeforge build` and `nodeforge verify` read (roles/,
  ansible.cfg, images/site.yml, the Packer box files, tests/infra) and finds it without a
  checkout: the installed playbook passes `ansible-playbook --syntax-check` with the installed
  ansible.cfg and roles, and `nodeforge render` works from another directory.
- The node image's agent wheel holds the core, bootstrap and gang only, and every module in it
  imports there.
Dependencies come from the test venv (a .pth file), so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from nodeforge.images import agent_wheel

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _venv(where: Path, wheel: Path) -> tuple[Path, Path]:
    """A fresh venv with *wheel* installed (--no-deps); returns (python, its site-packages)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
                   check=True, capture_output=True, text=True)  # fmt: skip
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    # Third-party dependencies from the test venv, AFTER the wheel's own packages.
    (site / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py, site


def _run(py: Path, *args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), *args], cwd=cwd, capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def full_install(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    have = version("setuptools")
    if int(have.split(".")[0]) < 77:
        pytest.fail(f"setuptools {have} in this venv cannot build nodeforge's wheel (PEP 639 "
                    "license needs >=77): run `.venv/bin/pip install -e '.[dev]'`")  # fmt: skip
    # Build from a copy: setuptools writes build/ and *.egg-info into the source tree.
    src = tmp / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for rel in ("nodeforge", "images", "bootstrap", "gang", "lab", "roles", "tests/infra"):
        shutil.copytree(REPO / rel, src / rel, ignore=skip)
    for rel in ("pyproject.toml", "README.md", "LICENSE", "ansible.cfg"):
        shutil.copy2(REPO / rel, src / rel)
    out = tmp / "dist"
    cp = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                         "--no-build-isolation", "-w", str(out), str(src)],
                        capture_output=True, text=True, cwd=tmp)  # fmt: skip
    assert cp.returncode == 0, cp.stderr[-3000:]
    (wheel,) = out.glob("nodeforge-*.whl")
    py, site = _venv(tmp / "venv", wheel)
    return tmp, wheel, py, site


def test_full_wheel_carries_the_build_and_verify_data(full_install):
    _, wheel, _, _ = full_install
    names = set(zipfile.ZipFile(wheel).namelist())
    for rel in (
        "nodeforge/_data/ansible.cfg",
        "nodeforge/_data/roles/slurm/tasks/install.yml",
        "nodeforge/_data/roles/slurm/templates/slurm.conf.j2",
        "nodeforge/_data/roles/slurm/files/slurm_versions.json",
        "nodeforge/_data/tests/infra/conftest.py",
        "nodeforge/_data/tests/infra/test_compute.py",
        "nodeforge/images/site.yml",
        "nodeforge/images/versions.yaml",
        "nodeforge/images/box/Vagrantfile",
        "nodeforge/slurm_versions.json",
    ):
        assert rel in names, f"{rel} missing from {wheel.name}"
    # every file of every role and suite, not only the ones named above
    for f in [*(REPO / "roles").rglob("*"), *(REPO / "tests/infra").glob("*.py")]:
        if f.is_file() and not f.name.startswith("."):
            assert f"nodeforge/_data/{f.relative_to(REPO).as_posix()}" in names, f
    for f in (REPO / "images/box").iterdir():
        assert f"nodeforge/images/box/{f.name}" in names, f
    meta = zipfile.ZipFile(wheel).read(f"nodeforge-{_version()}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta
    requires = [
        ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln
    ]
    assert not [
        r for r in requires if any(x in r.lower() for x in ("setuptools", "wheel", "pytest"))
    ]
    assert any("pytest-testinfra" in ln and 'extra == "verify"' in ln for ln in meta.splitlines())


def test_installed_wheel_finds_its_data_outside_a_checkout(full_install):
    tmp, _, py, site = full_install
    code = (
        "import json; from nodeforge import data; from nodeforge.images.build import repo_paths;"
        "from nodeforge.images import packer_build as remote;"
        "pb, cfg, roles = repo_paths();"
        "print(json.dumps({'checkout': str(data.checkout()), 'playbook': str(pb), 'cfg': str(cfg),"
        " 'roles': str(roles), 'infra': str(data.path('tests/infra')),"
        " 'box': str(remote.BOX_VAGRANTFILE), 'box_ok': remote.BOX_VAGRANTFILE.is_file()}))"
    )
    got = json.loads(_run(py, "-c", code, cwd=tmp).stdout)
    assert got["checkout"] == "None"
    for key in ("playbook", "cfg", "roles", "infra", "box"):
        assert got[key].startswith(str(site / "nodeforge")), (key, got[key])
    assert got["box_ok"] is True
    # The table the slurm role reads is a real file in the wheel, equal to the core's.
    table = site / "nodeforge/_data/roles/slurm/files/slurm_versions.json"
    assert not table.is_symlink()
    assert table.read_bytes() == (site / "nodeforge/slurm_versions.json").read_bytes()


def test_installed_playbook_resolves_its_roles(full_install):
    """What `nodeforge build` hands to Ansible, from the install alone."""
    tmp, _, _, site = full_install
    ansible = Path(sys.executable).with_name("ansible-playbook")
    if not ansible.exists():
        pytest.fail("ansible-playbook not found next to the test interpreter", pytrace=False)
    data = site / "nodeforge" / "_data"
    cp = subprocess.run(
        [str(ansible), "--syntax-check", "-i", "localhost,", str(site / "nodeforge/images/site.yml")],
        env={"PATH": "/usr/bin:/bin", "ANSIBLE_CONFIG": str(data / "ansible.cfg"),
             "HOME": str(tmp), "ANSIBLE_LOCAL_TEMP": str(tmp / "ans")},
        cwd=tmp, capture_output=True, text=True,
    )  # fmt: skip
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-3000:]


def test_installed_cli_renders_and_prints_its_version(full_install):
    tmp, _, py, _ = full_install
    nf = py.with_name("nodeforge")
    out = subprocess.run([str(nf), "render", "--target", "local"], cwd=tmp, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert 'source "null"' in out or "source " in out
    ver = subprocess.run([str(nf), "--version"], cwd=tmp, capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip
    assert ver == f"nodeforge {_version()}"  # not a checkout: no git revision
    # packer validate with the installed playbook and ansible.cfg (Packer is a unit-tier tool)
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"  # ansible
    cp = subprocess.run([str(nf), "validate", "--target", "local", "--target", "qemu", "--json"],
                        cwd=tmp, capture_output=True, text=True, env={**os.environ, "PATH": path})  # fmt: skip
    assert cp.returncode == 0, cp.stderr
    assert {t: r["valid"] for t, r in json.loads(cp.stdout).items()} == {
        "local": True,
        "qemu": True,
    }


def test_checkout_version_names_the_git_revision():
    out = subprocess.run([sys.executable, "-m", "nodeforge", "--version"], capture_output=True,
                         text=True, check=True, cwd=REPO).stdout.strip()  # fmt: skip
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.startswith(f"nodeforge {_version()} (checkout {REPO}, git ")
    if rev.returncode == 0:  # a copy without .git says "revision unknown"
        assert rev.stdout.strip() in out


def _version() -> str:
    import nodeforge

    return nodeforge.__version__


def test_version_has_one_source():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "nodeforge.__version__"}


# -- the node image's agent wheel ---------------------------------------------------------------
def test_agent_wheel_is_core_bootstrap_and_gang_and_imports_alone(tmp_path):
    wheel = agent_wheel.write(tmp_path / "w")
    assert wheel.name == f"nodeforge-{_version()}-py3-none-any.whl"
    z = zipfile.ZipFile(wheel)
    names = z.namelist()
    top = {n.split("/")[1] for n in names if n.startswith("nodeforge/") and n.count("/") > 1}
    assert top == {"bootstrap", "gang"}, top
    assert "nodeforge/bootstrap/node_roles/compute.py" in names
    assert "nodeforge/gang/nodeforge-gang.service" in names
    assert "nodeforge/slurm_versions.json" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert z.testzip() is None
    # RECORD lists every other file with its sha256
    info = f"nodeforge-{_version()}.dist-info"
    record = z.read(f"{info}/RECORD").decode().splitlines()
    assert sorted(r.split(",")[0] for r in record) == sorted(names)
    # same sources, same bytes (stable build cache keys)
    assert agent_wheel.write(tmp_path / "again").read_bytes() == wheel.read_bytes()

    py, _ = _venv(tmp_path / "venv", wheel)
    mods = sorted(
        n[:-3].replace("/", ".").removesuffix(".__init__")
        for n in names
        if n.endswith(".py") and not n.endswith("__main__.py")
    )
    code = f"import importlib; [importlib.import_module(m) for m in {mods!r}]; print('ok')"
    assert _run(py, "-c", code, cwd=tmp_path).stdout.strip() == "ok"
    helptext = _run(py.with_name("nodeforge"), "--help", cwd=tmp_path).stdout
    commands = re.findall(r"^ {4}(\w+) ", helptext, re.MULTILINE)  # under COMMAND
    assert sorted(commands) == ["gang", "node", "params"], helptext


def test_verify_without_its_extra_names_the_extra(monkeypatch):
    import importlib.util

    from nodeforge.errors import NodeforgeError
    from nodeforge.lab import verify_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "testinfra" else real(name, *a))  # fmt: skip
    with pytest.raises(NodeforgeError, match=r"needs testinfra.*pip install 'nodeforge\[verify\]'"):
        verify_cli._require_verify_extra(ssh=False)


def test_installed_wheel_builds_the_same_agent_wheel(full_install, tmp_path):
    """`nodeforge build` from a wheel install: the image's agent wheel has the same files as
    one built from the checkout (no images/, lab/ or _data/ from the install leak in)."""
    tmp, _, py, _ = full_install
    code = ("import sys; from pathlib import Path; from nodeforge.images import agent_wheel;"
            "print(agent_wheel.write(Path(sys.argv[1])))")  # fmt: skip
    installed = Path(_run(py, "-c", code, str(tmp_path / "from-wheel"), cwd=tmp).stdout.strip())
    checkout = agent_wheel.write(tmp_path / "from-checkout")
    a, b = zipfile.ZipFile(installed), zipfile.ZipFile(checkout)
    assert sorted(a.namelist()) == sorted(b.namelist())
    info = f"nodeforge-{_version()}.dist-info"
    assert f"{info}/licenses/LICENSE" in a.namelist()
    for name in a.namelist():
        if not name.endswith("RECORD"):
            assert a.read(name) == b.read(name), name
