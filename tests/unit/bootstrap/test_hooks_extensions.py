"""The example extension hooks in extensions/: inputs, idempotence, exit codes (fake tools on PATH)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

EXT = Path(__file__).resolve().parents[3] / "extensions"


def run_hook(name, tmp_path, params, role="compute", extra_env=None, fakes=None):
    pf = tmp_path / "params.json"
    pf.write_text(json.dumps(params))
    env = {
        "PATH": os.environ["PATH"],
        "NODEFORGE_PARAMS": str(pf),
        "NODEFORGE_ROLE": role,
        "NODEFORGE_NODE": "c1",
        "NODEFORGE_CLUSTER": "demo",
        "NODEFORGE_CONTROLLER": "ctl",
    }
    if fakes:
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        for tool, body in fakes.items():
            (bindir / tool).write_text("#!/bin/bash\n" + body)
            (bindir / tool).chmod(0o755)
        env["PATH"] = f"{bindir}:{env['PATH']}"
    env.update(extra_env or {})
    return subprocess.run(
        [str(EXT / name)], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def test_extensions_are_executable_and_documented():
    readme = (EXT / "README.md").read_text()
    for name in ("10-cluster-users", "20-shared-fs", "50-enroot-warm"):
        assert os.access(EXT / name, os.X_OK)
        assert name in readme


def test_users_nothing_to_do_and_errors(tmp_path):
    r = run_hook("10-cluster-users", tmp_path, {"extra": {}})
    assert r.returncode == 0 and "nothing to do" in r.stdout
    r = run_hook(
        "10-cluster-users", tmp_path, {"extra": {"users": ["alice,notanumber,/home/alice"]}}
    )
    assert r.returncode == 2 and "extra.users line 1: expected user,uid,/home/dir" in r.stderr
    r = run_hook("10-cluster-users", tmp_path, {"extra": {"users": ["root,4242,/root"]}})
    assert r.returncode == 2 and "user root exists with uid 0, params say 4242" in r.stderr
    r = run_hook("10-cluster-users", tmp_path, {"extra": {"users": ["nfbnosuchuser,0,/home/x"]}})
    assert r.returncode == 2 and "uid 0 for nfbnosuchuser is already taken by root" in r.stderr


def test_shared_fs_fstab_is_managed_and_idempotent(tmp_path):
    fstab = tmp_path / "fstab"
    fstab.write_text("UUID=abc / ext4 defaults 0 1\n")
    mnt = tmp_path / "shared"
    log = tmp_path / "mount.log"
    fakes = {
        "mount": f'echo "mount $*" >> {log}; touch {tmp_path}/mounted\n',
        "mountpoint": f"[ -e {tmp_path}/mounted ]\n",
        "systemctl": "exit 0\n",
        "mount.nfs": "exit 0\n",  # the image's nfs-common
    }
    params = {
        "extra": {"shared_fs": {"source": "10.9.0.2:/export", "mountpoint": str(mnt), "timeout": 5}}
    }
    env = {"NODEFORGE_FSTAB": str(fstab)}
    r = run_hook("20-shared-fs", tmp_path, params, extra_env=env, fakes=fakes)
    assert r.returncode == 0, r.stderr
    line = f"10.9.0.2:/export {mnt} nfs defaults,_netdev 0 0 # nodeforge:shared_fs"
    assert fstab.read_text() == f"UUID=abc / ext4 defaults 0 1\n{line}\n"
    assert log.read_text() == f"mount {mnt}\n"
    r = run_hook("20-shared-fs", tmp_path, params, extra_env=env, fakes=fakes)
    assert r.returncode == 0 and "already mounted" in r.stdout
    assert (
        fstab.read_text().count("nodeforge:shared_fs") == 1 and log.read_text().count("mount") == 1
    )
    # params change: the managed line is replaced, not duplicated
    params["extra"]["shared_fs"]["options"] = "ro,_netdev"
    run_hook("20-shared-fs", tmp_path, params, extra_env=env, fakes=fakes)
    assert fstab.read_text().count("nodeforge:shared_fs") == 1 and "ro,_netdev" in fstab.read_text()


def test_shared_fs_mount_failure_and_bad_params(tmp_path):
    fakes = {
        "mount": "sleep 10\n",
        "mountpoint": "exit 1\n",
        "systemctl": "exit 0\n",
        "mount.nfs": "exit 0\n",
    }
    env = {"NODEFORGE_FSTAB": str(tmp_path / "fstab")}
    params = {
        "extra": {"shared_fs": {"source": "h:/x", "mountpoint": str(tmp_path / "m"), "timeout": 1}}
    }
    r = run_hook("20-shared-fs", tmp_path, params, extra_env=env, fakes=fakes)
    assert r.returncode == 3 and "took longer than 1s" in r.stderr
    r = run_hook(
        "20-shared-fs",
        tmp_path,
        {"extra": {"shared_fs": {"source": "h:/x", "mountpoint": "rel"}}},
        extra_env=env,
        fakes=fakes,
    )
    assert r.returncode == 2
    assert run_hook("20-shared-fs", tmp_path, {}, extra_env=env).returncode == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("source", "h:/x /etc/shadow ext4 defaults 0 0"),  # a second fstab entry
        ("source", "h:/x#"),
        ("mountpoint", "/shared /etc"),
        ("mountpoint", "/a/../etc"),
        ("type", "nfs defaults"),
        ("options", "rw 0 0\nUUID=x / ext4"),
        ("timeout", "1; rm -rf /"),
        ("timeout", True),
        ("source", ["h:/x"]),
    ],
)
def test_shared_fs_refuses_hostile_fields_before_touching_fstab(tmp_path, field, value):
    fstab = tmp_path / "fstab"
    fstab.write_text("UUID=abc / ext4 defaults 0 1\n")
    fs = {"source": "h:/x", "mountpoint": str(tmp_path / "m")} | {field: value}
    fakes = {"mount": "exit 0\n", "mountpoint": "exit 1\n", "mount.nfs": "exit 0\n"}
    r = run_hook(
        "20-shared-fs", tmp_path, {"extra": {"shared_fs": fs}},
        extra_env={"NODEFORGE_FSTAB": str(fstab)}, fakes=fakes,
    )  # fmt: skip
    assert r.returncode == 2 and f"extra.shared_fs.{field}: expected" in r.stderr, r.stderr
    assert fstab.read_text() == "UUID=abc / ext4 defaults 0 1\n"


def test_shared_fs_names_the_missing_client(tmp_path):
    fstab = tmp_path / "fstab"
    fs = {"source": "mgs@tcp:/fs", "mountpoint": str(tmp_path / "m"), "type": "lustre"}
    r = run_hook(
        "20-shared-fs", tmp_path, {"extra": {"shared_fs": fs}},
        extra_env={"NODEFORGE_FSTAB": str(fstab)}, fakes={"mount": "exit 0\n"},
    )  # fmt: skip
    assert r.returncode == 4 and "no mount.lustre on this node" in r.stderr, r.stderr
    assert not fstab.exists()


def test_enroot_warm_imports_once(tmp_path):
    log = tmp_path / "enroot.log"
    state = tmp_path / "containers"
    state.write_text("")
    fakes = {
        "enroot": f"""echo "enroot $*" >> {log}
case "$1" in
  import) [ "$2" = -o ] && echo sqsh > "$3" ;;
  create) echo "$3" >> {state} ;;
  list) cat {state} ;;
esac
"""
    }
    sq = tmp_path / "base.sqsh"
    sq.write_text("x")
    d = tmp_path / "cache"
    params = {
        "extra": {
            "enroot_dir": str(d),
            "enroot_images": [
                {"uri": "docker://nvcr.io#nvidia/pytorch:24.05-py3", "name": "pytorch"},
                {"uri": str(sq), "name": "base"},
            ],
        }
    }
    r = run_hook("50-enroot-warm", tmp_path, params, fakes=fakes)
    assert r.returncode == 0, r.stderr
    assert (d / "pytorch.sqsh").exists() and state.read_text() == "base\n"
    first = log.read_text()
    assert "enroot import -o" in first and f"enroot create -n base {sq}" in first
    r = run_hook("50-enroot-warm", tmp_path, params, fakes=fakes)
    assert r.returncode == 0 and "present; skip" in r.stdout
    assert (
        "import" not in log.read_text()[len(first) :]
        and "create" not in log.read_text()[len(first) :]
    )
    r = run_hook("50-enroot-warm", tmp_path, params, role="login", fakes=fakes)
    assert r.returncode == 0 and "skipping" in r.stdout
