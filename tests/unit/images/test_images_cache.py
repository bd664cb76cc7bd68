"""The layered build cache: what keys a layer, integrity of entries, the lock, the size cap."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeforge.errors import NodeforgeError
from nodeforge.images import cache
from nodeforge.images import nspawn_build as local
from nodeforge.images.versions import sha256_file
from tests.unit.support import run_cli

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def repo(tmp_path) -> Path:
    """A copy of the roles and playbook, plus a stand-in agent package, to edit freely."""
    r = tmp_path / "repo"
    shutil.copytree(REPO / "roles", r / "roles")
    (r / "images").mkdir()
    shutil.copyfile(REPO / "images/site.yml", r / "images/site.yml")
    shutil.copyfile(REPO / "images/versions.yaml", r / "images/versions.yaml")
    (r / "bootstrap").mkdir()
    (r / "bootstrap/agent.py").write_text("STEP = 1\n")
    (r / "extensions/hooks").mkdir(parents=True)
    (r / "extensions/hooks/10-x.sh").write_text("#!/bin/sh\necho x\n")
    (r / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    return r


def _keys(r: Path, *, base_key="b1", arts=None, ansible_vars=None, user_vars=None):
    li = cache.layer_inputs(
        base_key=base_key,
        roles_dir=r / "roles",
        playbook=r / "images/site.yml",
        versions_file=r / "images/versions.yaml",
        artifacts=arts or {"pyxis_src": "a" * 64},
        ansible_vars=ansible_vars or {},
    )
    bk = cache.build_key(
        layer_key=li.key(),
        repo=r,
        playbook=r / "images/site.yml",
        user_vars=user_vars or {},
        options={"target": "local"},
    )
    return li.key(), bk


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


# -- keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        "role install tasks",
        "role defaults",
        "role handlers",
        "versions file",
        "artifact",
        "base",
        "install variable",
        "playbook",
    ],
)
def test_layer_key_changes_with_what_affects_installation(repo, change):
    layer0, build0 = _keys(repo)
    kw: dict = {}
    if change == "role install tasks":
        _append(repo / "roles/munge/tasks/install.yml", "\n# changed\n")
    elif change == "role defaults":
        _append(repo / "roles/slurm/defaults/main.yml", "\nslurm_extra: 1\n")
    elif change == "role handlers":
        handlers = next((repo / "roles").glob("*/handlers/main.yml"))
        _append(handlers, "\n# changed\n")
    elif change == "versions file":
        _append(repo / "images/versions.yaml", "\n# changed\n")
    elif change == "artifact":
        kw["arts"] = {"pyxis_src": "b" * 64}
    elif change == "base":
        kw["base_key"] = "b2"
    elif change == "install variable":
        kw["ansible_vars"] = {"docker_source": "upstream"}
    elif change == "playbook":
        _append(repo / "images/site.yml", "\n# changed\n")
    layer1, build1 = _keys(repo, **kw)
    assert layer1 != layer0
    assert build1 != build0


@pytest.mark.parametrize(
    "change",
    [
        "first-boot template",
        "config variable",
        "agent code",
        "extension hook",
        "pycache",
        "seal role",
    ],
)
def test_layer_key_ignores_configuration_but_build_key_sees_it(repo, change):
    layer0, build0 = _keys(repo)
    kw: dict = {}
    if change == "first-boot template":
        _append(repo / "roles/slurm/templates/slurm.conf.j2", "\n# changed\n")
    elif change == "config variable":
        kw["ansible_vars"] = {"logrotate_slurm_rotate": "9"}
        kw["user_vars"] = {"ansible_vars": {"logrotate_slurm_rotate": "9"}}
    elif change == "agent code":
        (repo / "bootstrap/agent.py").write_text("STEP = 2\n")
    elif change == "extension hook":
        _append(repo / "extensions/hooks/10-x.sh", "echo y\n")
    elif change == "seal role":  # the layer is the tree before sealing
        _append(repo / "roles/seal/tasks/install.yml", "\n# changed\n")
    elif change == "pycache":
        (repo / "bootstrap/__pycache__").mkdir()
        (repo / "bootstrap/__pycache__/agent.cpython-313.pyc").write_bytes(b"\0junk")
    layer1, build1 = _keys(repo, **kw)
    assert layer1 == layer0, f"a {change} change must reuse the cached layer"
    if change == "pycache":
        assert build1 == build0, "byte-code caches are not an input"
    else:
        assert build1 != build0, f"a {change} change must rebuild"


def test_same_inputs_same_keys(repo):
    assert _keys(repo) == _keys(repo)


def test_install_variables_are_the_ones_that_choose_packages():
    v = {
        "docker_source": "upstream",
        "slurm_packages": ["x"],
        "docker_upstream_url": "u",
        "pyxis_remove_build_packages": False,
        "logrotate_slurm_rotate": 9,
        "base_journald_system_max_use": "2G",
        "docker_sourcex": 1,
        "base_time_sync": "ntp",
    }
    assert list(cache.install_vars(v)) == [
        "base_time_sync",
        "docker_source",
        "docker_upstream_url",
        "pyxis_remove_build_packages",
        "slurm_packages",
    ]


# -- the store ------------------------------------------------------------------------------

KEY_A, KEY_B, KEY_C = "a" * 64, "b" * 64, "c" * 64
INPUTS = cache.PrefixInputs("g", "b", {}, {}, {}, {})


def _tree(root: Path, size: int = 100) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text("ID=debian\n")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/tool").write_bytes(b"\x7fELF" + b"x" * size)
    (root / "usr/bin/tool").chmod(0o755)
    (root / "usr/bin/alias").symlink_to("tool")
    return root


def test_store_then_lookup_returns_the_verified_layer(tmp_path):
    store = cache.LayerStore(tmp_path / "cache", clock=lambda: 1000.0)
    layer = store.store(KEY_A, _tree(tmp_path / "work/rootfs"), INPUTS)
    assert not (tmp_path / "work/rootfs").exists()  # moved, not copied
    assert (layer.tree / "usr/bin/tool").is_file()
    got = store.lookup(KEY_A)
    assert got is not None and got.tree == layer.tree
    assert store.lookup(KEY_B) is None
    assert [i.key for i in store.entries()] == [KEY_A]


def _damage(layer, damage: str) -> None:
    """Damage a stored layer the way *damage* says (the cases of the two drop tests)."""
    tool = layer.tree / "usr/bin/tool"
    if damage == "content":  # same size, one byte flipped
        data = bytearray(tool.read_bytes())
        data[-1] ^= 1
        tool.write_bytes(bytes(data))
    elif damage == "content, mtime put back":  # same size, same mtime: only ctime tells
        st = tool.stat()
        fd = os.open(tool, os.O_WRONLY)
        os.pwrite(fd, b"Y", 10)
        os.close(fd)
        os.utime(tool, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif damage == "truncated":
        os.truncate(tool, 10)
    elif damage == "removed":
        (layer.tree / "etc/os-release").unlink()
    elif damage == "added":
        (layer.tree / "etc/extra").write_text("x")
    elif damage == "mode":
        tool.chmod(0o4755)
    elif damage == "owner":
        os.chown(tool, os.getuid(), os.getgid())  # same owner: ctime still moves
        data = bytearray(tool.read_bytes())
        data[0] ^= 1  # and the content differs, so the full check fails
        fd = os.open(tool, os.O_WRONLY)
        os.pwrite(fd, bytes(data[:1]), 0)
        os.close(fd)
    elif damage == "symlink":
        (layer.tree / "usr/bin/alias").unlink()
        (layer.tree / "usr/bin/alias").symlink_to("/etc/shadow")
    elif damage == "replaced by a copy":  # same bytes and times, other inodes: re-read, fine
        shutil.copytree(layer.tree, layer.path / "copy", symlinks=True)
        shutil.rmtree(layer.tree)
        os.rename(layer.path / "copy", layer.tree)
        data = bytearray(tool.read_bytes())
        data[1] ^= 1
        fd = os.open(tool, os.O_WRONLY)
        os.pwrite(fd, bytes(data[1:2]), 1)
        os.close(fd)
    elif damage == "no meta":
        (layer.path / cache.LAYER_META).unlink()
    elif damage == "bad meta":
        (layer.path / cache.LAYER_META).write_text('{"schema": 2, "key": ')
    elif damage == "meta of another key":
        m = json.loads((layer.path / cache.LAYER_META).read_text())
        (layer.path / cache.LAYER_META).write_text(json.dumps({**m, "key": KEY_B}))
    elif damage == "no tree":
        shutil.rmtree(layer.tree)
    else:
        raise AssertionError(f"unknown damage {damage!r}")


@pytest.mark.parametrize(
    "damage",
    [
        "content",
        "truncated",
        "removed",
        "added",
        "mode",
        "symlink",
        "no meta",
        "bad meta",
        "meta of another key",
        "no tree",
    ],
)
def test_corrupt_or_partial_entry_is_dropped_never_used(tmp_path, damage):
    logged: list[str] = []
    store = cache.LayerStore(tmp_path / "cache", log=logged.append)
    layer = store.store(KEY_A, _tree(tmp_path / "rootfs"), INPUTS)
    _damage(layer, damage)
    assert store.lookup(KEY_A) is None
    assert not layer.path.exists(), "a damaged entry must be dropped"
    assert logged and "dropped, rebuilding" in logged[0]


def test_open_checks_the_record_and_verify_the_content(tmp_path):
    """The build mounts a layer once its record is sound and verifies the content beside
    the work it starts on it; a mismatch is reported, and drop() removes the entry."""
    logged: list[str] = []
    store = cache.LayerStore(tmp_path / "cache", log=logged.append)
    layer = store.store(KEY_A, _tree(tmp_path / "rootfs"), INPUTS)
    opened = store.open(KEY_A)
    assert opened is not None and opened.digest == layer.digest and store.verify(opened) == ""
    tool = layer.tree / "usr/bin/tool"
    data = bytearray(tool.read_bytes())
    data[0] ^= 1
    tool.write_bytes(bytes(data))
    opened = store.open(KEY_A)  # the record is still sound: content is verify()'s job
    assert opened is not None
    problem = store.verify(opened)
    assert "content digest does not match" in problem
    store.drop(opened, problem)
    assert not layer.path.exists() and "dropped, rebuilding" in logged[-1]
    assert store.open(KEY_A) is None


def test_verification_stops_when_the_build_does(tmp_path):
    tree = _tree(tmp_path / "rootfs")
    with pytest.raises(cache.Cancelled):
        cache.tree_digest(tree, cancelled=lambda: True)


def test_interrupted_store_leaves_no_entry(tmp_path, monkeypatch):
    store = cache.LayerStore(tmp_path / "cache")

    def interrupted(tree, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "tree_digests", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.store(KEY_A, _tree(tmp_path / "rootfs"), INPUTS)
    monkeypatch.undo()
    assert store.lookup(KEY_A) is None
    assert store.entries() == []
    assert [p.name for p in store.root.iterdir()] == [f".tmp-{KEY_A}-{os.getpid()}"]
    assert store.drop_unfinished() == [f".tmp-{KEY_A}-{os.getpid()}"]
    assert list(store.root.iterdir()) == []


# -- the verified mark: a full check once, then the entries' inode fields -------------------

BOOT = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def _settled_tree(root: Path) -> Path:
    """A tree whose entries last changed more than RACY_NS ago (a mark may stand for it)."""
    tree = _tree(root)
    time.sleep(cache.RACY_NS / 1e9 + 0.05)
    return tree


def _marked_store(tmp_path, *, boot: str = BOOT, clock=time.time, log=None):
    store = cache.LayerStore(
        tmp_path / "cache", clock=clock, boot_id=lambda: boot, log=log or (lambda m: None)
    )
    layer = store.store(KEY_A, _settled_tree(tmp_path / "rootfs"), INPUTS)
    return store, layer


def _count_reads(monkeypatch) -> list[str]:
    """File contents the digest reads from here on."""
    reads: list[str] = []
    real = cache._file_sha

    def counting(path):
        reads.append(str(path))
        return real(path)

    monkeypatch.setattr(cache, "_file_sha", counting)
    return reads


def test_a_matched_full_check_leaves_a_mark_and_the_next_check_reads_nothing(tmp_path, monkeypatch):
    store, layer = _marked_store(tmp_path)
    mark = cache.VerifiedMark.load(layer.path / cache.VERIFIED_MARK)
    assert mark is not None and mark.digest == layer.digest and mark.boot_id == BOOT
    reads = _count_reads(monkeypatch)
    logged: list[str] = []
    store.log = logged.append
    opened = store.open(KEY_A)
    assert opened is not None and store.verify(opened) == ""
    assert reads == []  # only lstat: the mark stood for the content check
    assert logged == [
        f"cache: layer {KEY_A[:16]} verified by its mark (no entry changed "
        "since its content digest matched in this boot)"
    ]
    assert store.lookup(KEY_A) is not None and reads == []


@pytest.mark.parametrize(
    "damage",
    [
        "content",
        "content, mtime put back",
        "truncated",
        "removed",
        "added",
        "mode",
        "owner",
        "symlink",
        "replaced by a copy",
        "no tree",
    ],
)
def test_a_marked_layer_damaged_later_is_still_detected_and_dropped(tmp_path, damage):
    """The mark never hides a change: each damage moves some entry's ctime (or inode, or
    the listing), so the check reads the content again and the digest catches it."""
    logged: list[str] = []
    store, layer = _marked_store(tmp_path, log=logged.append)
    assert (layer.path / cache.VERIFIED_MARK).is_file()
    _damage(layer, damage)
    assert store.lookup(KEY_A) is None
    assert not layer.path.exists(), "a damaged entry must be dropped, mark or not"
    assert logged and "dropped, rebuilding" in logged[-1]


def _write_mark(layer, **change) -> None:
    m = json.loads((layer.path / cache.VERIFIED_MARK).read_text())
    (layer.path / cache.VERIFIED_MARK).write_text(json.dumps({**m, **change}))


@pytest.mark.parametrize(
    "why",
    [
        "another boot",
        "no boot id",
        "too old",
        "from the future",
        "other digest",
        "bad json",
        "truncated",
        "nan time",
        "bool time",
        "huge time",
        "boot id with a newline",
        "other schema",
        "stat not a digest",
    ],
)
def test_a_mark_that_does_not_hold_means_a_full_check(tmp_path, monkeypatch, why):
    store, layer = _marked_store(tmp_path)
    path = layer.path / cache.VERIFIED_MARK
    assert path.is_file()
    if why == "another boot":
        store.boot_id = lambda: "ffffffff-4b5a-6978-8796-a5b4c3d2e1f0"
    elif why == "no boot id":
        store.boot_id = lambda: ""
    elif why == "too old":
        store.clock = lambda: time.time() + cache.MARK_MAX_AGE + 1
    elif why == "from the future":
        store.clock = lambda: time.time() - 60
    elif why == "other digest":
        _write_mark(layer, digest="e" * 64)
    elif why == "bad json":
        path.write_text('{"schema": 1, "digest": ')
    elif why == "truncated":
        path.write_text("")
    elif why == "nan time":
        path.write_text(path.read_text().replace('"at": ', '"at": NaN, "x": '))
    elif why == "bool time":
        _write_mark(layer, at=True)
    elif why == "huge time":
        path.write_text(path.read_text().replace('"at": ', '"at": 1' + "0" * 400 + ', "x": '))
    elif why == "boot id with a newline":
        _write_mark(layer, boot_id=BOOT + "\n")
        store.boot_id = lambda: BOOT + "\n"
    elif why == "other schema":
        _write_mark(layer, schema=2)
    elif why == "stat not a digest":
        _write_mark(layer, stat="x")
    reads = _count_reads(monkeypatch)
    opened = store.open(KEY_A)
    assert opened is not None and store.verify(opened) == ""
    assert len(reads) == 2  # both regular files read again (the symlink has no content)


def test_no_mark_for_a_tree_changed_within_the_racy_window(tmp_path, monkeypatch):
    """An entry changed just before the walk could change again in the same ctime tick
    unseen: such a check leaves no mark, and the next one reads everything again."""
    store = cache.LayerStore(tmp_path / "cache", boot_id=lambda: BOOT)
    layer = store.store(KEY_A, _tree(tmp_path / "rootfs"), INPUTS)  # just written
    assert not (layer.path / cache.VERIFIED_MARK).exists()
    (layer.tree / "etc/os-release").chmod(0o600)  # a change, but not of the content
    layer = store.open(KEY_A)
    assert layer is not None
    assert store.verify(layer) == "its content digest does not match (corrupt or altered tree)"


def test_a_stale_mark_is_removed_when_the_full_check_fails(tmp_path):
    store, layer = _marked_store(tmp_path)
    (layer.tree / "etc/os-release").write_text("ID=other\n")
    opened = store.open(KEY_A)
    assert opened is not None and "does not match" in store.verify(opened)
    assert not (layer.path / cache.VERIFIED_MARK).exists()


@pytest.mark.parametrize(
    "text, want",
    [
        (BOOT + "\n", BOOT),
        (BOOT, BOOT),
        ("", ""),
        (BOOT + "\nx", ""),
        (BOOT.upper(), ""),
        ("../../etc", ""),
    ],
)
def test_read_boot_id_takes_only_a_lowercase_uuid(tmp_path, text, want):
    f = tmp_path / "boot_id"
    f.write_text(text)
    assert cache.read_boot_id(f) == want
    assert cache.read_boot_id(tmp_path / "missing") == ""


def test_lookup_refuses_a_key_that_is_not_a_sha256(tmp_path):
    store = cache.LayerStore(tmp_path / "cache")
    for bad in ("../../etc", "a" * 63, "A" * 64, "a" * 64 + "\n", ""):
        with pytest.raises(NodeforgeError, match="bad layer key"):
            store.lookup(bad)


def test_prune_keeps_the_most_recently_used_within_the_cap(tmp_path):
    now = [0.0]
    store = cache.LayerStore(tmp_path / "cache", clock=lambda: now[0])
    for i, key in enumerate((KEY_A, KEY_B, KEY_C)):
        now[0] = 100.0 * (i + 1)
        store.store(key, _tree(tmp_path / f"t{i}", size=1000), INPUTS)
    now[0] = 400.0
    assert store.lookup(KEY_A) is not None  # A is now the most recently used
    one = max(i.bytes for i in store.entries())
    (store.root / f".tmp-{KEY_C}-1").mkdir()  # an interrupted write
    removed = store.prune(2 * one)
    assert removed == [f".tmp-{KEY_C}-1 (unfinished)", KEY_B]
    assert sorted(i.key for i in store.entries()) == [KEY_A, KEY_C]
    assert store.prune(0, keep=[KEY_C]) == [KEY_A]
    assert [i.key for i in store.entries()] == [KEY_C]


# -- the lock -------------------------------------------------------------------------------


def test_second_build_on_one_cache_is_refused_naming_the_holder(tmp_path):
    with cache.locked(tmp_path), pytest.raises(NodeforgeError) as e:  # noqa: SIM117
        with cache.locked(tmp_path):
            pass
    assert f"in use by another nodeforge build or prune (pid {os.getpid()})" in str(e.value)
    assert "--cache-dir" in str(e.value)
    with cache.locked(tmp_path):  # released: the next build goes ahead
        pass


def test_lock_held_by_another_process_is_seen(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys,time; from pathlib import Path; from nodeforge.images import cache\n"
                "with cache.locked(Path(sys.argv[1])):\n print('held', flush=True); time.sleep(60)"
            ),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(NodeforgeError, match=f"pid {holder.pid}"), cache.locked(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    with cache.locked(tmp_path):  # a killed holder's lock is gone with its process
        pass


# -- sizes and the no-change check ----------------------------------------------------------


@pytest.mark.parametrize(
    "text,want",
    [("20G", 20 << 30), ("512M", 512 << 20), ("7", 7), ("1TiB", 1 << 40), ("3k", 3 << 10)],
)
def test_parse_size(text, want):
    assert cache.parse_size(text) == want


@pytest.mark.parametrize(
    "text",
    [
        "1\n2G",
        "20G\n",
        "=",
        "NaN",
        "-1G",
        "1.5G",
        "",
        "G",
        "9" * 16,
        "1 G x",
        "inf",
        "1e9",
        "20G\x00",
        "1G=2",
        "'1G'",
        "１G",  # noqa: RUF001 - a hostile full-width digit
    ],
)
def test_parse_size_rejects_hostile_text(text):
    with pytest.raises(NodeforgeError, match="is not a size"):
        cache.parse_size(text)


def _published(out: Path, key: str) -> dict:
    out.mkdir()
    (out / "rootfs.tar.zst").write_bytes(b"rootfs")
    (out / "disk.qcow2").write_bytes(b"disk")
    m = {
        "name": "img",
        "cache": {"build_key": key},
        "artifacts": {
            n: {"sha256": sha256_file(out / n), "bytes": (out / n).stat().st_size}
            for n in ("rootfs.tar.zst", "disk.qcow2")
        },
    }
    (out / "manifest.json").write_text(json.dumps(m))
    return m


def test_unchanged_build_is_the_published_one_while_its_artifacts_are_intact(tmp_path):
    out = tmp_path / "out"
    m = _published(out, KEY_A)
    assert local.published_unchanged(out, KEY_A) == m
    assert local.published_unchanged(out, KEY_B) is None  # some input changed
    assert local.published_unchanged(tmp_path / "none", KEY_A) is None
    (out / "disk.qcow2").write_bytes(b"disc")  # same size, other content
    assert local.published_unchanged(out, KEY_A) is None
    (out / "disk.qcow2").unlink()
    assert local.published_unchanged(out, KEY_A) is None


NO_ARTIFACTS = json.dumps({"cache": {"build_key": KEY_A}, "artifacts": {}})


@pytest.mark.parametrize("body", ["", "{", "[]", '{"cache": null}', NO_ARTIFACTS])
def test_unreadable_or_incomplete_manifest_means_rebuild(tmp_path, body):
    (tmp_path / "manifest.json").write_text(body)
    assert local.published_unchanged(tmp_path, KEY_A) is None


def test_cli_cache_ls_and_prune(tmp_path):
    store = cache.LayerStore(tmp_path, clock=lambda: 1.0)
    store.store(KEY_A, _tree(tmp_path / "t"), INPUTS)

    cp = run_cli("cache", "ls", "--cache-dir", str(tmp_path), "--json")
    assert cp.returncode == 0, cp.stderr
    rows = json.loads(cp.stdout)
    assert [(r["kind"], r["key"]) for r in rows] == [("layer", KEY_A)] and rows[0]["bytes"] > 0
    cp = run_cli("cache", "prune", "--cache-dir", str(tmp_path), "--max-size", "huge")
    assert cp.returncode == 2 and "'huge' is not a size" in cp.stderr
    cp = run_cli("cache", "prune", "--cache-dir", str(tmp_path), "--all")
    assert cp.returncode == 0 and f"removed {KEY_A}" in cp.stdout
    assert store.entries() == []


# -- what a pass over a cached layer re-applies ---------------------------------------------

ROLES = ["base", "slurm", "logrotate", "node_agent"]


def _config(r: Path, **ansible_vars) -> dict:
    return cache.config_inputs(roles_dir=r / "roles", repo=r, ansible_vars=ansible_vars)


def test_only_roles_whose_configuration_changed_are_reapplied(repo):
    old = _config(repo, logrotate_slurm_rotate=14)
    assert cache.roles_to_reapply(old, _config(repo, logrotate_slurm_rotate=14), ROLES) == []
    assert cache.roles_to_reapply(old, _config(repo, logrotate_slurm_rotate=9), ROLES) == [
        "logrotate"
    ]
    assert cache.roles_to_reapply(old, _config(repo), ROLES) == ["logrotate"]  # var dropped
    _append(repo / "roles/slurm/templates/slurm.conf.j2", "\n# changed\n")
    assert cache.roles_to_reapply(old, _config(repo, logrotate_slurm_rotate=14), ROLES) == ["slurm"]
    (repo / "images").mkdir(exist_ok=True)
    (repo / "images/build_step.py").write_text("X = 1\n")  # build code: not in the wheel
    assert cache.roles_to_reapply(old, _config(repo, logrotate_slurm_rotate=14), ROLES) == ["slurm"]
    (repo / "bootstrap/agent.py").write_text("STEP = 2\n")
    assert cache.roles_to_reapply(old, _config(repo, logrotate_slurm_rotate=14), ROLES) == [
        "slurm",
        "node_agent",
    ]


def test_unknown_variable_or_old_record_reapplies_every_role(repo):
    old = _config(repo)
    assert cache.roles_to_reapply(old, _config(repo, mystery=1), ROLES) is None
    assert cache.roles_to_reapply({}, old, ROLES) is None  # a layer recorded without config


def test_install_variables_are_not_configuration(repo):
    assert _config(repo, docker_source="upstream")["vars"] == {}


def test_every_role_of_the_real_playbook_is_selectable_by_its_tag():
    roles = local.playbook_roles(REPO / "images/site.yml")
    assert roles is not None and roles[0] == "base" and "node_agent" in roles
    assert "seal" not in roles  # never re-applied: the post-stop sealer seals every build


def test_no_pass_runs_the_seal_role():
    """The post-stop sealer seals every local build (the whole sealed-items list)."""
    assert local.PASS_INSTALL == {"ANSIBLE_SKIP_TAGS": "seal"}
    assert local.pass_roles(None) == local.PASS_INSTALL  # every role but seal
    assert local.pass_roles(["logrotate", "node_agent"]) == {
        "ANSIBLE_RUN_TAGS": "logrotate,node_agent"
    }


def test_a_skipped_phase_is_recorded_as_zero_with_its_reason():
    from nodeforge.images.pipeline import Phases

    said: list[tuple[str, str]] = []
    ph = Phases(lambda name, msg: said.append((name, msg)))
    ph.skip("sandbox", "no role to re-apply over the layer")
    assert ph.durations == {"sandbox": 0.0}
    assert said == [("sandbox", "skipped: no role to re-apply over the layer")]


def test_playbook_with_an_untagged_role_reapplies_everything(tmp_path):
    pb = tmp_path / "site.yml"
    pb.write_text("- hosts: all\n  roles:\n    - role: base\n      tags: [base]\n    - role: gpu\n")
    assert local.playbook_roles(pb) is None
    pb.write_text("- hosts: all\n  roles: [base]\n")
    assert local.playbook_roles(pb) is None
    pb.write_text("{: not yaml")
    assert local.playbook_roles(pb) is None


def test_parallel_export_runs_both_and_reports_a_failure(tmp_path, monkeypatch):
    from nodeforge.images import export

    ran: list[str] = []

    def rootfs(tree, dest):
        ran.append("rootfs")
        raise NodeforgeError("tar failed: disk full")

    def disk(tree, dest, **kw):
        ran.append("disk")
        return export.DiskExport([], {})

    monkeypatch.setattr(export, "export_rootfs", rootfs)
    monkeypatch.setattr(export, "export_disk", disk)
    with pytest.raises(NodeforgeError, match="tar failed: disk full"):
        local.export_parallel(tmp_path, tmp_path)
    assert sorted(ran) == ["disk", "rootfs"]  # the other export is not abandoned midway


def test_parallel_export_sums_what_it_wrote(tmp_path, monkeypatch):
    import hashlib

    from nodeforge.images import export
    from nodeforge.images import manifest as manifest_mod

    def rootfs(tree, dest):
        dest.write_bytes(b"archive")

    def disk(tree, dest, **kw):
        (dest / "disk.qcow2").write_bytes(b"disk")
        return export.DiskExport([dest / "disk.qcow2"], {"table": "gpt"})

    monkeypatch.setattr(export, "export_rootfs", rootfs)
    monkeypatch.setattr(export, "export_disk", disk)
    sums, layout = local.export_parallel(tmp_path, tmp_path)
    assert layout == {"table": "gpt"}
    assert sums == {
        "rootfs.tar.zst": {"sha256": hashlib.sha256(b"archive").hexdigest(), "bytes": 7},
        "disk.qcow2": {"sha256": hashlib.sha256(b"disk").hexdigest(), "bytes": 4},
    }
    (tmp_path / "build.log").write_text("log")
    (tmp_path / "disk.qcow2").write_bytes(b"other disk")  # changed since: read again
    got = manifest_mod.artifact_sums(tmp_path, known=sums)
    assert got == manifest_mod.artifact_sums(tmp_path)
    assert got["disk.qcow2"]["sha256"] == hashlib.sha256(b"other disk").hexdigest()


def test_agent_wheel_is_built_once_per_source_digest(tmp_path, monkeypatch):
    built: list[Path] = []

    def fake_build(dest, logfile):  # stands in for `pip wheel` (tested by the e2e build)
        dest.mkdir(parents=True)
        w = dest / "nodeforge-0.1.0-py3-none-any.whl"
        w.write_bytes(b"PK")
        built.append(w)
        return w

    monkeypatch.setattr(local, "build_wheel", fake_build)
    log = open(os.devnull, "w")
    w1 = local.cached_wheel(tmp_path / "wheels", KEY_A, tmp_path / "w1", log)
    w2 = local.cached_wheel(tmp_path / "wheels", KEY_A, tmp_path / "w2", log)
    w3 = local.cached_wheel(tmp_path / "wheels", KEY_B, tmp_path / "w3", log)
    log.close()
    assert w1 == w2 == tmp_path / "wheels" / KEY_A / "nodeforge-0.1.0-py3-none-any.whl"
    assert w3.parent.name == KEY_B and len(built) == 2
    with pytest.raises(NodeforgeError, match="bad sources digest"):
        local.cached_wheel(tmp_path / "wheels", "../x", tmp_path / "w4", log)


def test_a_pass_over_a_layer_gathers_only_the_minimal_facts():
    """The playbook's first task gathers facts with the subset the build driver passes (all
    when it passes none, as Packer's install pass and the qemu target do); every pass runs it
    (tag always), and the re-apply pass asks for the minimal set."""
    import yaml

    plays = yaml.safe_load((REPO / "images/site.yml").read_text())
    assert all(p.get("gather_facts") is False for p in plays)
    first = plays[0]["tasks"][0]
    assert first["ansible.builtin.setup"] == {
        "gather_subset": "{{ nodeforge_gather_subset | default('all') }}"
    }
    assert first["tags"] == ["always"]
    assert local.REAPPLY_GATHER_SUBSET == "min"


# -- role groups: prefix layers -------------------------------------------------------------


def _group_keys(r: Path, **kw) -> list[str]:
    li = cache.layer_inputs(
        base_key=kw.get("base_key", "b1"),
        roles_dir=r / "roles",
        playbook=r / "images/site.yml",
        versions_file=r / "images/versions.yaml",
        artifacts=kw.get("arts") or {"pyxis_src": "a" * 64},
        ansible_vars=kw.get("ansible_vars") or {},
    )
    assert li.key() == li.keys()[-1]
    return li.keys()


def test_role_groups_are_the_playbooks_roles_in_order():
    roles = local.playbook_roles(REPO / "images/site.yml")
    assert roles is not None
    assert [r for g in cache.ROLE_GROUPS for r in g.roles] == roles
    assert local.build_groups(roles) == cache.ROLE_GROUPS
    assert [g.name for g in cache.ROLE_GROUPS] == ["slurm_stack", "runtime"]
    # a playbook whose roles are not the groups': one group, the whole install pass
    other = local.build_groups([*roles, "extra"])
    assert len(other) == 1 and other[0].roles == (*roles, "extra")


@pytest.mark.parametrize(
    "change,first_changes",
    [
        ("docker_source", False),  # the bench's install-affecting change
        ("docker role task", False),
        ("pyxis artifact", False),
        ("versions file", False),  # read with the artifacts, by the runtime group's roles
        ("slurm role task", True),
        ("munge default", True),
        ("slurm install variable", True),
        ("unowned install variable", True),  # nobody's: keys the first group, the safe side
        ("playbook", True),
        ("base", True),
    ],
)
def test_a_group_key_changes_with_its_groups_inputs_and_every_earlier_one(
    repo, change, first_changes
):
    k0 = _group_keys(repo)
    kw: dict = {}
    if change == "docker_source":
        kw["ansible_vars"] = {"docker_source": "debian"}
    elif change == "docker role task":
        _append(repo / "roles/docker/tasks/install.yml", "\n# changed\n")
    elif change == "pyxis artifact":
        kw["arts"] = {"pyxis_src": "b" * 64}
    elif change == "versions file":
        _append(repo / "images/versions.yaml", "\n# changed\n")
    elif change == "slurm role task":
        _append(repo / "roles/slurm/tasks/install.yml", "\n# changed\n")
    elif change == "munge default":
        _append(repo / "roles/munge/defaults/main.yml", "\nmunge_extra: 1\n")
    elif change == "slurm install variable":
        kw["ansible_vars"] = {"slurm_packages": ["slurmd"]}
    elif change == "unowned install variable":
        kw["ansible_vars"] = {"site_packages": ["x"]}
    elif change == "playbook":
        _append(repo / "images/site.yml", "\n# changed\n")
    elif change == "base":
        kw["base_key"] = "b2"
    k1 = _group_keys(repo, **kw)
    assert (k1[0] != k0[0]) is first_changes
    assert k1[1] != k0[1], "the last group's key covers every install input"


def test_configuration_changes_no_group_key(repo):
    k0 = _group_keys(repo)
    _append(repo / "roles/slurm/templates/slurm.conf.j2", "\n# changed\n")
    assert _group_keys(repo, ansible_vars={"logrotate_slurm_rotate": "9"}) == k0


def test_artifacts_key_the_first_group_whose_roles_read_them(repo):
    assert cache.artifacts_group(repo / "roles") == 1  # pyxis, gpu: the runtime group
    _append(repo / "roles/slurm/tasks/install.yml", "\n# {{ nodeforge_artifacts.x }}\n")
    assert cache.artifacts_group(repo / "roles") == 0
    k0 = _group_keys(repo)
    assert _group_keys(repo, arts={"pyxis_src": "c" * 64})[0] != k0[0]


def test_a_variable_belongs_to_the_longest_role_name_it_starts_with():
    roles = ["node", "node_agent", "slurm"]
    assert cache.var_owner("node_agent_user", roles) == "node_agent"
    assert cache.var_owner("node_x", roles) == "node"
    assert cache.var_owner("slurmx_y", roles) is None


def _over(store, key, parent, tmp, size=100):
    return store.store(key, _tree(tmp / key[:4], size=size), INPUTS, parent=parent)


def test_a_later_group_is_stored_over_its_parent_and_found_as_a_chain(tmp_path):
    store = cache.LayerStore(tmp_path / "cache")
    a = store.store(KEY_A, _tree(tmp_path / "a"), INPUTS)
    b = _over(store, KEY_B, KEY_A, tmp_path)
    assert a.parent is None and b.parent == KEY_A
    assert [layer.key for layer in store.open_chain([KEY_A, KEY_B])] == [KEY_A, KEY_B]
    assert [layer.key for layer in store.open_chain([KEY_A, KEY_C])] == [KEY_A]  # a prefix
    assert store.open_chain([KEY_C, KEY_B]) == []  # B was not made over C
    assert not b.path.exists(), "a layer whose parent is not the chain's is dropped"
    assert [i.parent for i in store.entries()] == [None]
    with pytest.raises(NodeforgeError, match="missing parent"):
        _over(store, KEY_B, KEY_C, tmp_path / "x")


def test_a_layer_whose_parent_is_gone_is_a_miss_not_a_crash(tmp_path):
    logged: list[str] = []
    store = cache.LayerStore(tmp_path / "cache", log=logged.append)
    store.store(KEY_A, _tree(tmp_path / "a"), INPUTS)
    _over(store, KEY_B, KEY_A, tmp_path)
    shutil.rmtree(store.root / KEY_A)  # removed behind the cache's back
    assert store.open_chain([KEY_A, KEY_B]) == []
    assert store.entries() == [] and "the layer it was made over is gone" in logged[-1]


def test_dropping_a_layer_drops_every_layer_made_over_it(tmp_path):
    store = cache.LayerStore(tmp_path / "cache")
    a = store.store(KEY_A, _tree(tmp_path / "a"), INPUTS)
    _over(store, KEY_B, KEY_A, tmp_path)
    _over(store, KEY_C, KEY_B, tmp_path)
    assert store.descendants(KEY_A) == [KEY_B, KEY_C]
    data = bytearray((a.tree / "usr/bin/tool").read_bytes())
    data[0] ^= 1
    (a.tree / "usr/bin/tool").write_bytes(bytes(data))
    chain = store.open_chain([KEY_A, KEY_B, KEY_C])
    assert len(chain) == 3  # records sound: content is verify()'s job
    problem = store.verify(chain[0])
    assert problem
    store.drop(chain[0], problem)
    assert store.entries() == []


@pytest.mark.parametrize("parent", ["x" * 64, "../" + "a" * 61, 7, "a" * 64 + "\n"])
def test_a_record_with_a_hostile_parent_is_dropped(tmp_path, parent):
    store = cache.LayerStore(tmp_path / "cache")
    layer = store.store(KEY_A, _tree(tmp_path / "a"), INPUTS)
    m = json.loads((layer.path / cache.LAYER_META).read_text())
    (layer.path / cache.LAYER_META).write_text(json.dumps({**m, "parent": parent}))
    assert store.open_chain([KEY_A]) == []
    assert not layer.path.exists()


def test_a_record_naming_itself_as_parent_does_not_loop(tmp_path):
    store = cache.LayerStore(tmp_path / "cache")
    layer = store.store(KEY_A, _tree(tmp_path / "a"), INPUTS)
    m = json.loads((layer.path / cache.LAYER_META).read_text())
    (layer.path / cache.LAYER_META).write_text(json.dumps({**m, "parent": KEY_A}))
    assert store.descendants(KEY_A) == []
    assert store.open_chain([KEY_A]) == []  # not the first group's record: dropped


def test_prune_never_leaves_a_layer_without_its_parent(tmp_path):
    now = [0.0]
    store = cache.LayerStore(tmp_path / "cache", clock=lambda: now[0])
    key_d = "d" * 64
    now[0] = 100.0
    store.store(KEY_A, _tree(tmp_path / "a", size=1000), INPUTS)
    now[0] = 200.0
    _over(store, KEY_B, KEY_A, tmp_path, size=1000)  # the most recently used chain: A, B
    now[0] = 150.0
    store.store(KEY_C, _tree(tmp_path / "c", size=1000), INPUTS)
    one = max(i.bytes for i in store.entries())
    # A is the oldest entry, but B over it is the newest: C goes first
    assert store.prune(2 * one) == [KEY_C]
    assert sorted(i.key for i in store.entries()) == [KEY_A, KEY_B]
    # keeping B keeps its parent too
    assert store.prune(0, keep=[KEY_B]) == []
    # of equal use, a child goes before its parent
    now[0] = 300.0
    _over(store, key_d, KEY_A, tmp_path, size=1000)
    assert store.prune(one + 10) == [KEY_B, key_d]
    assert [i.key for i in store.entries()] == [KEY_A]
    _over(store, key_d, KEY_A, tmp_path / "again", size=1000)
    assert store.prune(0) == [key_d, KEY_A]
    assert store.entries() == []


def test_prune_removes_a_layer_whose_parent_is_gone(tmp_path):
    store = cache.LayerStore(tmp_path / "cache")
    store.store(KEY_A, _tree(tmp_path / "a"), INPUTS)
    _over(store, KEY_B, KEY_A, tmp_path)
    shutil.rmtree(store.root / KEY_A)
    assert store.prune(1 << 40) == [f"{KEY_B} (its parent is gone)"]


def test_digest_covers_extended_attributes(tmp_path):
    """The opaque-dir mark of an overlayfs upper dir is an xattr (trusted.overlay.opaque,
    root only): a user.* xattr stands in for it here; tests/e2e/test_build_cache.py has a
    real upper dir with whiteouts and opaque dirs."""
    tree = _tree(tmp_path / "t")
    before = cache.tree_digest(tree)[0]
    try:
        os.setxattr(tree / "etc", "user.overlay.opaque", b"y")
    except OSError as e:  # the test's own precondition, not the code's
        pytest.fail(f"tmp_path {tmp_path} has no user xattrs ({e}); run on ext4/xfs/tmpfs")
    marked = cache.tree_digest(tree)[0]
    assert marked != before
    os.setxattr(tree / "etc", "user.overlay.opaque", b"n")
    assert cache.tree_digest(tree)[0] not in (before, marked)
    os.removexattr(tree / "etc", "user.overlay.opaque")
    assert cache.tree_digest(tree)[0] == before


def test_reapply_among_the_cached_groups_roles(repo):
    old = _config(repo, logrotate_slurm_rotate=14)
    _append(repo / "roles/slurm/templates/slurm.conf.j2", "\n# changed\n")
    new = _config(repo, logrotate_slurm_rotate=9)
    assert cache.roles_to_reapply(old, new, ROLES) == ["slurm", "logrotate"]
    # resuming after the first group: only its changed roles run again with the next group
    assert cache.roles_to_reapply(old, new, ROLES, among=["base", "slurm"]) == ["slurm"]


@pytest.mark.parametrize("bad", ["a,b", "a:b", "a\\b", "a\nb"])
def test_an_overlay_path_that_mount_options_cannot_hold_is_refused(tmp_path, bad):
    with pytest.raises(NodeforgeError, match="--cache-dir"):
        local.mount_overlay([tmp_path / bad / "tree"], tmp_path / "work")
    assert not (tmp_path / "work").exists(), "nothing made before the refusal"


def test_settled_is_judged_per_entry_at_its_own_lstat(tmp_path):
    """An entry written just before the walk started but reached RACY_NS later (the walk
    is alphabetical: a journal under var/ comes last) does not keep the mark away; one
    reached within RACY_NS of its change does."""
    tree = _settled_tree(tmp_path / "rootfs")
    (tree / "usr/bin/zz-last").write_text("written just now\n")  # the last entry walked
    start = time.time_ns()
    calls = [0]

    def slow_walk_clock() -> int:  # FIXTURE clock: the walk starts now, each lstat 1 s later
        calls[0] += 1
        return start + (calls[0] - 1) * 1_000_000_000

    assert cache.tree_digests(tree, now_ns=slow_walk_clock).settled
    assert not cache.tree_digests(tree, now_ns=lambda: start).settled
