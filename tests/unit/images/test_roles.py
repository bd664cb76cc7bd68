"""The Ansible roles and images/site.yml: shape, argument specs, rules, templates, fixtures."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import jinja2
import pytest
import yaml

from nodeforge import slurm_facts as slurm_facts

REPO = Path(__file__).resolve().parents[3]
SITE = REPO / "images" / "site.yml"
ROLE_ORDER = [
    "base",
    "ssh",
    "munge",
    "slurm",
    "accounting",
    "docker",
    "enroot",
    "pyxis",
    "gpu",
    "logrotate",
    "metrics",
    "node_agent",
    "seal",
]
# Extra vars the build driver passes; roles that read them must document them.
DRIVER_VARS = [
    "nodeforge_artifacts_dir",
    "nodeforge_artifacts",
    "nodeforge_wheel",
    "nodeforge_image_name",
]

from tests.fixtures.mirror import make_mirror
from tests.unit.support import ROLES_DIR, ansible_render


def _yaml(path: Path):
    return yaml.safe_load(path.read_text())


def _role_files(role: str) -> list[Path]:
    return [p for p in (ROLES_DIR / role).rglob("*") if p.is_file()]


def _all_ansible_files() -> list[Path]:
    files = [SITE, REPO / "ansible.cfg"]
    for role in ROLE_ORDER:
        files += _role_files(role)
    return files


def _spec_options(role: str) -> dict:
    spec = _yaml(ROLES_DIR / role / "meta" / "argument_specs.yml")
    return spec["argument_specs"]["main"].get("options") or {}


# -- shape --------------------------------------------------------------------------------


@pytest.mark.unit
def test_roles_directory_has_exactly_the_playbook_roles():
    assert sorted(p.name for p in ROLES_DIR.iterdir() if p.is_dir()) == sorted(ROLE_ORDER)


@pytest.mark.unit
@pytest.mark.parametrize("role", ROLE_ORDER)
def test_role_has_the_five_parts(role):
    r = ROLES_DIR / role
    for rel in (
        "defaults/main.yml",
        "tasks/main.yml",
        "tasks/install.yml",
        "handlers/main.yml",
        "meta/argument_specs.yml",
    ):
        assert (r / rel).is_file(), f"{role}: missing {rel}"
    assert (r / "templates").is_dir(), f"{role}: missing templates/"
    main = _yaml(r / "tasks/main.yml")
    assert any(t.get("ansible.builtin.import_tasks") == "install.yml" for t in main), (
        f"{role}: tasks/main.yml must import install.yml"
    )
    assert isinstance(_yaml(r / "handlers/main.yml"), list)


@pytest.mark.unit
@pytest.mark.parametrize("role", ROLE_ORDER)
def test_argument_specs_cover_every_default(role):
    defaults = _yaml(ROLES_DIR / role / "defaults/main.yml") or {}
    options = _spec_options(role)
    missing = sorted(set(defaults) - set(options))
    assert not missing, f"{role}: defaults not in meta/argument_specs.yml: {missing}"
    for name, opt in options.items():
        assert opt.get("description"), f"{role}: option {name} has no description"
        assert opt.get("type"), f"{role}: option {name} has no type"
        # Role variables carry the role's prefix; the driver's extra vars are the exception.
        assert name.startswith(f"{role}_") or name in DRIVER_VARS, f"{role}: {name} not prefixed"
        if name not in DRIVER_VARS:
            assert name in defaults, f"{role}: option {name} has no default"


@pytest.mark.unit
@pytest.mark.parametrize("role", ROLE_ORDER)
def test_driver_vars_used_by_a_role_are_documented_as_required(role):
    text = "\n".join(p.read_text() for p in (ROLES_DIR / role / "tasks").glob("*.yml"))
    options = _spec_options(role)
    for var in DRIVER_VARS:
        if re.search(rf"\b{var}\b", text):
            assert var in options and options[var].get("required") is True, (
                f"{role} reads {var} but meta/argument_specs.yml does not require it"
            )


@pytest.mark.unit
def test_site_playbook_asserts_first_then_runs_roles_in_order():
    plays = _yaml(SITE)
    assert len(plays) == 2
    pre = plays[0]
    modules = [next(k for k in t if k.startswith("ansible.builtin.")) for t in pre["tasks"]]
    assert "ansible.builtin.assert" in modules
    assert [r["role"] for r in plays[1]["roles"]] == ROLE_ORDER
    text = SITE.read_text()
    for word in ("Debian", "x86_64", "aarch64", "python3-apt", "is file"):
        assert word in text


@pytest.mark.unit
def test_ansible_cfg():
    text = (REPO / "ansible.cfg").read_text()
    for line in (
        "roles_path = roles",
        "pipelining = True",
        "nocows = True",
        "retry_files_enabled = False",
    ):
        assert line in text


# -- rules ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_no_ignore_errors_devnull_or_appends():
    for path in _all_ansible_files():
        text = path.read_text()
        assert "ignore_errors" not in text, f"ignore_errors in {path}"
        assert "/dev/null" not in text, f"/dev/null in {path}"
        assert not re.search(r"(?<![<>])>>(?!>)", text), f"'>>' append in {path}"


@pytest.mark.unit
def test_every_command_task_declares_changed_when():
    for role in ROLE_ORDER:
        for path in (ROLES_DIR / role / "tasks").glob("*.yml"):
            for task in _walk_tasks(_yaml(path) or []):
                mod = next(
                    (k for k in task if k in ("ansible.builtin.command", "ansible.builtin.shell")),
                    None,
                )
                if mod is None:
                    continue
                args = task[mod]
                has_creates = isinstance(args, dict) and "creates" in args
                assert "changed_when" in task or has_creates, f"{path}: {task['name']}"
                assert mod != "ansible.builtin.shell", f"{path}: use command, not shell"


def _walk_tasks(tasks):
    for t in tasks:
        yield t
        for key in ("block", "rescue", "always"):
            yield from _walk_tasks(t.get(key) or [])


@pytest.mark.unit
def test_seal_tasks_each_have_a_why_comment_and_authorized_keys_is_last():
    lines = (ROLES_DIR / "seal/tasks/install.yml").read_text().splitlines()
    names = [i for i, line in enumerate(lines) if line.startswith("- name: ")]
    acting = [i for i in names if not re.match(r"- name: (Find|Check) ", lines[i])]
    for i in acting:
        above = "\n".join(lines[max(0, i - 4) : i])
        assert "# why:" in above, f"seal task without a why comment: {lines[i]}"
    assert "authorized_keys" in lines[names[-1]]
    text = "\n".join(lines)
    for item in (
        "/etc/machine-id",
        "/var/lib/dbus/machine-id",
        "/etc/munge/munge.key",
        "/var/lib/apt/lists",
        "/var/cache/apt",
        "/var/lib/cloud",
        "/usr/sbin/policy-rc.d",
        "/root/.ssh/authorized_keys",
        "/var/tmp",
        "/var/log",
    ):
        assert item in text, f"seal does not handle {item}"
    defaults = (ROLES_DIR / "seal/defaults/main.yml").read_text()
    assert "/etc/slurm/slurmdbd.conf" in defaults and "/root/.bash_history" in defaults


@pytest.mark.unit
def test_units_disabled_at_bake_match_the_contract():
    disabled = set()
    for role in ("munge", "slurm", "accounting", "docker"):
        d = _yaml(ROLES_DIR / role / "defaults/main.yml")
        for key, value in d.items():
            if key.endswith("_units_disabled"):
                disabled |= {u.removesuffix(".service") for u in value}
    disabled.add("munge")  # the munge role disables munge.service directly
    assert "munge.service" in (ROLES_DIR / "munge/tasks/install.yml").read_text()
    assert "sackd.service" in (ROLES_DIR / "slurm/tasks/install.yml").read_text()
    for unit in ("slurmctld", "slurmd", "slurmdbd", "mariadb", "docker", "containerd"):
        assert unit in disabled


# -- templates ----------------------------------------------------------------------------


def _agent_env() -> jinja2.Environment:
    # The agent renders with plain Jinja2 (no Ansible filters), StrictUndefined.
    return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def _slurm_conf(version: str, **over) -> dict[str, str]:
    tpl = _agent_env().from_string((ROLES_DIR / "slurm/templates/slurm.conf.j2").read_text())
    params = {
        "cluster_name": "lab",
        "controller_host": "ctl",
        "controller_addr": "10.0.0.1",
        "max_node_count": 128,
        "slurm_version": version,
        "force_requeue_on_fail": slurm_facts.has(version, "prolog_force_requeue_on_fail"),
        "tree_width_65533": not slurm_facts.has(version, "dynamic_nodes_without_tree_width"),
        "partitions": [
            {"name": "batch", "default": True, "max_time": "2-00:00:00"},
            {"name": "debug", "default": False, "max_time": None},
        ],
        "gres_types": ["gpu"],
        "prolog_flags": ["Alloc", "ForceRequeueOnFail"],
        "accounting": True,
        "dbd_host": "ctl",
    }
    params.update(over)
    text = tpl.render(**params)
    conf: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and not line.startswith("PartitionName="):
            k, _, v = line.partition("=")
            assert k not in conf, f"duplicate key {k}"
            conf[k] = v
    conf["__text__"] = text
    return conf


@pytest.mark.unit
def test_slurm_conf_22_05_has_treewidth_and_no_force_requeue():
    c = _slurm_conf("22.05.8")
    assert c["TreeWidth"] == "65533"
    assert c["PrologFlags"] == "Alloc"


@pytest.mark.unit
@pytest.mark.parametrize("version", ["23.02.7", "24.11.5"])
def test_slurm_conf_new_versions_have_force_requeue_and_no_treewidth(version):
    c = _slurm_conf(version)
    assert "TreeWidth" not in c
    assert c["PrologFlags"] == "Alloc,ForceRequeueOnFail"


@pytest.mark.unit
@pytest.mark.parametrize("version", ["22.05.8", "24.11.5"])
def test_slurm_conf_contract_settings(version):
    c = _slurm_conf(version)
    assert c["SlurmUser"] == "slurm"
    assert c["SlurmctldParameters"] == "enable_configless"
    assert c["MailProg"] == "/bin/true"  # no "MailProg is invalid" at every start
    assert c["MaxNodeCount"] == "128"
    assert c["SlurmctldHost"] == "ctl(10.0.0.1)"
    assert c["JobAcctGatherType"] == "jobacct_gather/linux"
    assert c["AccountingStorageType"] == "accounting_storage/slurmdbd"
    assert c["AccountingStorageHost"] == "ctl"
    assert c["ProctrackType"] in ("proctrack/linuxproc", "proctrack/cgroup")
    assert c["SlurmctldLogFile"].startswith("/var/log/slurm/")
    assert c["SlurmdLogFile"].startswith("/var/log/slurm/")
    assert c["StateSaveLocation"] and c["SlurmdSpoolDir"]
    assert c["GresTypes"] == "gpu"
    text = c["__text__"]
    assert "PartitionName=batch Nodes=ALL Default=YES MaxTime=2-00:00:00 State=UP" in text
    assert "PartitionName=debug Nodes=ALL Default=NO MaxTime=INFINITE State=UP" in text


@pytest.mark.unit
def test_slurm_conf_without_accounting_or_gres():
    c = _slurm_conf("24.11.5", accounting=False, gres_types=[], prolog_flags=["Alloc"])
    assert "AccountingStorageType" not in c and "GresTypes" not in c
    assert c["PrologFlags"] == "Alloc"


@pytest.mark.unit
def test_slurmdbd_conf_template():
    tpl = _agent_env().from_string(
        (ROLES_DIR / "accounting/templates/slurmdbd.conf.j2").read_text()
    )
    text = tpl.render(
        dbd_host="ctl",
        storage_host="localhost",
        storage_user="slurm",
        storage_pass="s3cret",
        storage_loc="slurm_acct_db",
    )
    assert "StoragePass=s3cret" in text and "StorageLoc=slurm_acct_db" in text
    assert "DbdHost=ctl" in text and "SlurmUser=slurm" in text
    assert "0600" in (ROLES_DIR / "accounting/templates/slurmdbd.conf.j2").read_text()


@pytest.mark.unit
def test_bake_templates_render_with_defaults():
    facts = {"ansible_facts": {"architecture": "x86_64"}}
    out = {
        ("base", "journald-nodeforge.conf.j2"): None,
        ("ssh", "nodeforge-ssh-keygen.service.j2"): None,
        ("slurm", "cgroup.conf.j2"): None,
        ("docker", "daemon.json.j2"): None,
        ("enroot", "enroot.conf.j2"): None,
        ("enroot", "tmpfiles-enroot.conf.j2"): None,
        ("pyxis", "plugstack.conf.j2"): None,
        ("pyxis", "pyxis.conf.j2"): facts,
        ("logrotate", "nodeforge-slurm.j2"): None,
        ("logrotate", "nodeforge.j2"): None,
        ("node_agent", "nodeforge-init.service.j2"): None,
        ("node_agent", "nodeforge-rejoin.service.j2"): None,
        ("node_agent", "nodeforge-rejoin.timer.j2"): None,
    }
    rendered = {k: ansible_render(k[0], k[1], v) for k, v in out.items()}
    for text in rendered.values():
        assert "{{" not in text and "{%" not in text
    daemon = json.loads(rendered[("docker", "daemon.json.j2")])
    assert daemon["log-driver"] == "json-file"
    assert set(daemon["log-opts"]) == {"max-size", "max-file"} and daemon["data-root"]
    enroot = rendered[("enroot", "enroot.conf.j2")]
    for key in ("ENROOT_RUNTIME_PATH", "ENROOT_CACHE_PATH", "ENROOT_DATA_PATH"):
        assert re.search(rf"^{key}\s+/", enroot, re.MULTILINE)
    assert "ENROOT_CACHE_PATH          /var/lib/enroot/cache/group-$(id -g)" in enroot
    pyxis = rendered[("pyxis", "pyxis.conf.j2")]
    assert [
        ln for ln in pyxis.splitlines() if "spank_pyxis.so" in ln and not ln.startswith("#")
    ] == ["required /usr/lib/x86_64-linux-gnu/slurm-wlm/spank_pyxis.so"]
    plugstack = rendered[("pyxis", "plugstack.conf.j2")]
    assert "include /etc/slurm/plugstack.conf.d/pyxis.conf" in plugstack
    assert "*" not in plugstack.split("include", 1)[1]  # slurmctld cannot parse a glob include
    init = rendered[("node_agent", "nodeforge-init.service.j2")]
    assert "After=network-online.target" in init
    # Host keys are made in parallel (identity.keygen_unit_installed): Slurm does not wait on SSH.
    assert not re.search(r"^After=.*ssh-keygen", init, re.MULTILINE)
    # contracts.md: no Before= on the Slurm units (the agent starts them from inside the unit).
    assert not re.search(r"^Before=", init, re.MULTILINE) and "Wants=network-online.target" in init
    assert "ExecStart=/usr/local/bin/nodeforge node init" in init
    # A bound, never infinity: a FIFO hook once blocked a boot forever (issue 23).
    assert "Type=oneshot" in init and "TimeoutStartSec=3h" in init
    # A node that missed slurmctld looks again every 30 s, by itself (enabled timer).
    timer = rendered[("node_agent", "nodeforge-rejoin.timer.j2")]
    assert re.search(r"^OnUnitInactiveSec=30$", timer, re.MULTILINE)
    assert "WantedBy=timers.target" in timer
    rejoin = rendered[("node_agent", "nodeforge-rejoin.service.j2")]
    assert "ExecStart=/usr/local/bin/nodeforge node rejoin" in rejoin and "Type=oneshot" in rejoin
    # the agent's flag (Paths.rejoin_wanted): on every other node the timer starts nothing
    from nodeforge.bootstrap.paths import Paths

    assert f"ConditionPathExists={Paths().rejoin_wanted}" in rejoin
    gang_unit = (REPO / "gang/nodeforge-gang.service").read_text()
    assert "ExecStart=/usr/local/bin/nodeforge gang run" in gang_unit
    keygen = rendered[("ssh", "nodeforge-ssh-keygen.service.j2")]
    assert "ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key" in keygen
    assert "ssh-keygen -A" in keygen and "Before=ssh.service" in keygen
    # yields the CPU to the agent at first boot (bench/README.md, readyfast)
    assert re.search(r"^Nice=19$", keygen, re.MULTILINE)
    rot = rendered[("logrotate", "nodeforge-slurm.j2")]
    assert "--signal=USR2" in rot and "is-active" in rot
    if shutil.which("logrotate"):
        for key in (("logrotate", "nodeforge-slurm.j2"), ("logrotate", "nodeforge.j2")):
            cfg = Path(os.environ.get("TMPDIR", "/tmp")) / f"nodeforge-test-{key[1]}"
            cfg.write_text(rendered[key])
            try:
                res = subprocess.run(
                    ["logrotate", "-d", str(cfg)], capture_output=True, text=True, check=False
                )
            finally:
                cfg.unlink()
            assert res.returncode == 0 and "error" not in res.stderr.lower(), res.stderr


@pytest.mark.unit
def test_playbook_syntax_check():
    ansible = Path(sys.executable).with_name("ansible-playbook")
    if not ansible.exists():
        pytest.fail("ansible-playbook not found next to the test interpreter", pytrace=False)
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"))
    res = subprocess.run(
        [str(ansible), "-i", "localhost,", "--syntax-check", str(SITE)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.e2e
def test_ansible_lint_production_profile():
    # About 30 s, so it runs in the e2e tier.
    lint = Path(sys.executable).with_name("ansible-lint")
    if not lint.exists():
        pytest.fail("ansible-lint missing (pip install -e .[dev])", pytrace=False)
    start = time.monotonic()
    res = subprocess.run(
        [str(lint), "--profile", "production", "roles/", "images/site.yml"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert time.monotonic() - start < 300


# -- FIXTURE mirror -------------------------------------------------------------------------


@pytest.mark.unit
def test_fixture_mirror_builds_upstream_named_artifacts(tmp_path):
    if shutil.which("dpkg-deb") is None:
        pytest.fail("dpkg-deb missing (apt install dpkg)", pytrace=False)
    sums = make_mirror(tmp_path / "mirror", gpu=False)
    assert set(sums) == {
        "enroot_4.1.2-1_amd64.deb",
        "enroot+caps_4.1.2-1_amd64.deb",
        "pyxis-0.24.0.tar.gz",
    }
    for name, digest in sums.items():
        assert hashlib.sha256((tmp_path / "mirror" / name).read_bytes()).hexdigest() == digest

    def field(deb, f):
        return subprocess.run(
            ["dpkg-deb", "-f", str(tmp_path / "mirror" / deb), f],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    assert field("enroot_4.1.2-1_amd64.deb", "Package") == "enroot"
    assert field("enroot+caps_4.1.2-1_amd64.deb", "Package") == "enroot+caps"
    assert field("enroot_4.1.2-1_amd64.deb", "Version") == "4.1.2-1"
    assert "FIXTURE" in field("enroot_4.1.2-1_amd64.deb", "Description")
    assert "enroot (= 4.1.2-1)" in field("enroot+caps_4.1.2-1_amd64.deb", "Depends")
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(tmp_path / "mirror/enroot_4.1.2-1_amd64.deb")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "./usr/bin/enroot" in listing and "./etc/enroot/enroot.conf" in listing

    with tarfile.open(tmp_path / "mirror/pyxis-0.24.0.tar.gz") as tar:
        names = tar.getnames()
        src = tar.extractfile("pyxis-0.24.0/pyxis.c").read().decode()
        mk = tar.extractfile("pyxis-0.24.0/Makefile").read().decode()
    assert "pyxis-0.24.0/FIXTURE" in names
    assert "#include <slurm/spank.h>" in src and "spank_options" in src
    assert '"container-image"' in src and '"container-name"' in src
    assert "libdir" in mk and "prefix" in mk and "pyxis.conf" in mk
    # Reproducible: the same bytes twice.
    assert make_mirror(tmp_path / "again", gpu=False) == sums


@pytest.mark.unit
def test_fixture_enroot_script_smoke(tmp_path):
    """The FIXTURE enroot script answers version/import/create/start without root."""
    if shutil.which("dpkg-deb") is None:
        pytest.fail("dpkg-deb missing (apt install dpkg)", pytrace=False)
    make_mirror(tmp_path / "m")
    root = tmp_path / "x"
    subprocess.run(
        ["dpkg-deb", "-x", str(tmp_path / "m/enroot_4.1.2-1_amd64.deb"), str(root)], check=True
    )
    enroot = root / "usr/bin/enroot"
    env = dict(os.environ, HOME=str(tmp_path / "home"))

    def run(*a):
        return subprocess.run(
            [str(enroot), *a], capture_output=True, text=True, env=env, cwd=tmp_path, check=True
        ).stdout.strip()

    assert run("version") == "4.1.2"
    (tmp_path / "rootfs/etc").mkdir(parents=True)
    (tmp_path / "rootfs/etc/hello").write_text("hi\n")
    run("import", "-o", "img.sqsh", f"dir://{tmp_path / 'rootfs'}")
    run("create", "-n", "c1", "img.sqsh")
    assert run("start", "c1", "cat", "etc/hello") == "hi"


# -- bake-only package settings -------------------------------------------------------------

BAKE_SETTINGS = ROLES_DIR / "base/tasks/policy-rc-d.yml"


def _bake_files() -> dict[str, str]:
    """dest -> content of every file the bake-settings include writes."""
    return {
        t["ansible.builtin.copy"]["dest"]: t["ansible.builtin.copy"]["content"]
        for t in _walk_tasks(_yaml(BAKE_SETTINGS))
        if "ansible.builtin.copy" in t
    }


@pytest.mark.unit
def test_bake_settings_make_dpkg_skip_fsync_and_apt_skip_translations():
    files = _bake_files()
    dpkg = files["/etc/dpkg/dpkg.cfg.d/nodeforge-bake"]
    assert "force-unsafe-io" in [ln.strip() for ln in dpkg.splitlines()]
    apt = files["/etc/apt/apt.conf.d/00nodeforge-bake"]
    assert re.search(r'^Acquire::Languages "none";$', apt, re.M)
    # dpkg reads only dpkg.cfg.d names of [A-Za-z0-9_-]; apt.conf.d names of [A-Za-z0-9_.-]
    for dest in files:
        name = dest.rsplit("/", 1)[1]
        if dest.startswith("/etc/dpkg/dpkg.cfg.d/"):
            assert re.fullmatch(r"[A-Za-z0-9_-]+", name), dest
        if dest.startswith("/etc/apt/apt.conf.d/"):
            assert re.fullmatch(r"[A-Za-z0-9_.-]+", name), dest
    assert files["/usr/sbin/policy-rc.d"].rstrip().endswith("exit 101")


@pytest.mark.unit
def test_bake_settings_are_written_once_per_pass():
    (block,) = _yaml(BAKE_SETTINGS)
    assert block["when"] == "not (base_bake_settings_written | default(false))"
    last = block["block"][-1]["ansible.builtin.set_fact"]
    assert last == {"base_bake_settings_written": True}


@pytest.mark.unit
def test_every_package_install_comes_after_the_bake_settings():
    """The settings must be in place before any role's apt or dpkg runs (first task of a role
    that installs), so each role includes them before its first apt task."""
    for role in ROLE_ORDER:
        path = ROLES_DIR / role / "tasks/install.yml"
        tasks = list(_walk_tasks(_yaml(path) or []))
        apt = [i for i, t in enumerate(tasks) if "ansible.builtin.apt" in t]
        if not apt:
            continue
        inc = [
            i
            for i, t in enumerate(tasks)
            if (t.get("ansible.builtin.include_role") or {}).get("tasks_from") == "policy-rc-d.yml"
        ]
        assert inc and inc[0] < apt[0], f"{role}: apt runs before the bake settings"


@pytest.mark.unit
def test_bake_settings_are_removed_at_seal_by_both_sealers():
    from nodeforge.images import sealed_items

    items = sealed_items.load().items
    for dest in _bake_files():
        rel = dest.lstrip("/")
        item = next((i for i in items if i.matches(rel)), None)
        assert item is not None and item.action == "remove", f"{dest} is not sealed"
        assert item.find == "exists" and len(item.reason) > 15, item.id
        if dest != "/usr/sbin/policy-rc.d":  # the seal role has its own task for that one
            assert item.live and rel in item.paths, f"the seal role would leave {dest}"


@pytest.mark.unit
def test_pyxis_is_built_with_the_c_toolchain_only():
    """pyxis is C (its Makefile runs $(CC), strip, install): the build packages installed and
    purged again are gcc (with binutils), make and libc6-dev, not build-essential's g++,
    libstdc++-dev and dpkg-dev/perl. gcc only recommends libc6-dev, so it is named."""
    pkgs = _yaml(ROLES_DIR / "pyxis/defaults/main.yml")["pyxis_build_packages"]
    assert sorted(pkgs) == ["gcc", "libc6-dev", "make"]
    tasks = list(_walk_tasks(_yaml(ROLES_DIR / "pyxis/tasks/install.yml")))
    cmds = [(t.get("ansible.builtin.command") or {}) for t in tasks]
    assert any(isinstance(c, dict) and c.get("cmd", "").startswith("make") for c in cmds)
