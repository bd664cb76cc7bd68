"""The one sealed-items list (images/sealed.yaml): a fake image tree with EVERY item planted is
fully reported by the scanner, fully sealed by the post-stop sealer, and the Ansible seal role
loads the same file. Large files are read whole (in chunks), never skipped."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
import yaml

from nodeforge.errors import NodeforgeError
from nodeforge.images import scan, seal, sealed_items
from tests.helpers import dpkg_ship

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
# Key-shaped text is assembled at run time: no key material (or look-alike) in git.
BEGIN = "-----BEGIN "
PRIV = "PRIVATE KEY-----"

# What the issue requires the list to cover, and a path that must be one of its matches.
REQUIRED = {
    "aws-credentials": "home/bob/.aws",  # the directory: credentials and config
    "git-credentials": "root/.git-credentials",
    "netrc": "home/alice/.netrc",
    "pgpass": "root/.pgpass",
    "docker-auths": "root/.docker/config.json",
    "apt-auth": "etc/apt/auth.conf.d/private.conf",
    "pip-index-token": "etc/pip.conf",
    "pgp-private-keys": "root/.gnupg/private-keys-v1.d",
    "ssh-private-keys": "root/.ssh/id_ed25519",
    "node-params": "etc/nodeforge/node.yaml",
    "ansible-state": "root/.ansible",
    "random-seed": "var/lib/systemd/random-seed",
    "systemd-credential-secret": "var/lib/systemd/credential.secret",
    "config-backup": "etc/slurm/slurmdbd.conf.bak",
}
CONTENT = {  # items that are findings only with this content
    "docker-auths": '{"auths": {"registry.example": {"auth": "dXNlcjpwYXNz"}}}',
    "pip-index-token": "[global]\nindex-url = https://user:tok3n@pypi.example/simple\n",
}


def _concrete(glob: str) -> str:
    return glob.replace("**/", "deep/").replace("*", "x").replace("?", "q")


def _plant(tree: Path, rel: str, text: str = "secret\n") -> None:
    p = tree / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _base(tmp_path) -> Path:
    t = tmp_path / "tree"
    (t / "var/lib/dpkg/info").mkdir(parents=True)
    (t / "etc").mkdir(parents=True, exist_ok=True)
    (t / "etc/machine-id").write_text("")
    return t


def test_list_covers_what_a_sealed_image_must_not_carry():
    sl = sealed_items.load()
    ids = {i.id for i in sl.items}
    for iid, example in REQUIRED.items():
        assert iid in ids, f"sealed.yaml lacks {iid}"
        item = next(i for i in sl.items if i.id == iid)
        assert item.matches(example), f"{iid} does not match {example}"
        assert len(item.reason) > 15  # each item says why
    assert {r.id for r in sl.content_rules} >= {"private-key", "db-password"}


def test_every_item_planted_is_found_then_sealed(tmp_path):
    sl = sealed_items.load()
    t = _base(tmp_path)
    planted: dict[str, str] = {}
    for item in sl.items:
        rel = _concrete(item.paths[0])
        _plant(t, rel, CONTENT.get(item.id, "secret\n"))
        planted[item.id] = "/" + rel
    findings = scan.scan(t)
    found = {f.kind for f in findings}
    expected = {i.id for i in sl.items if i.find != "never"}
    assert found == expected, f"not reported: {expected - found}; extra: {found - expected}"
    for f in findings:  # each finding carries its reason
        assert f.detail == next(i.reason for i in sl.items if i.id == f.kind)
    log = io.StringIO()
    done = seal.finalize(t, log)
    assert set(planted.values()) <= set(done)
    assert scan.scan(t) == []
    text = log.getvalue()
    for item in sl.items:
        assert f"— {item.reason}" in text


def test_match_items_only_when_the_content_says_so(tmp_path):
    t = _base(tmp_path)
    _plant(t, "etc/pip.conf", "[global]\nindex-url = https://pypi.example/simple\n")
    _plant(t, "root/.docker/config.json", '{"auths": {}, "credsStore": "pass"}')
    assert scan.scan(t) == []
    seal.finalize(t, io.StringIO())
    assert (t / "etc/pip.conf").exists() and (t / "root/.docker/config.json").exists()
    _plant(t, "etc/pip.conf", "[global]\nextra-index-url = https://__token__:x@pypi.example/\n")
    assert [f.kind for f in scan.scan(t)] == ["pip-index-token"]


def test_private_keys_and_passwords_anywhere_not_owned(tmp_path):
    t = _base(tmp_path)
    _plant(t, "opt/site/tls.pem", f"{BEGIN}RSA {PRIV}\nMIIB\n")
    _plant(t, "srv/signing.asc", f"{BEGIN}PGP PRIVATE KEY BLOCK-----\nxyz\n")
    _plant(t, "etc/site/app.ini", "[db]\npassword = hunter2-value\n")
    _plant(t, "usr/share/doc/pkg/test.pem", f"{BEGIN}{PRIV}\n")  # shipped by a package: public
    dpkg_ship(t, "pkg", "usr/share/doc/pkg/test.pem")
    findings = {f.path: f for f in scan.scan(t)}
    assert set(findings) == {"/opt/site/tls.pem", "/srv/signing.asc", "/etc/site/app.ini"}
    assert findings["/opt/site/tls.pem"].kind == "private-key"
    assert findings["/etc/site/app.ini"].kind == "db-password"
    assert "hunter2" not in str(findings["/etc/site/app.ini"])  # the value never in the log


def test_large_files_are_scanned_in_full(tmp_path):
    t = _base(tmp_path)
    big = t / "var/lib/blob.bin"
    big.parent.mkdir(parents=True, exist_ok=True)
    key = f"{BEGIN}OPENSSH {PRIV}".encode()
    with open(big, "wb") as f:
        f.write(b"\0" * ((9 << 20) - 10))  # the key straddles the 1 MiB block boundary at 9 MiB
        f.write(key + b"\n")
    assert [(x.path, x.kind) for x in scan.scan(t)] == [("/var/lib/blob.bin", "private-key")]


def test_bytecode_of_a_packaged_module_is_public(tmp_path):
    t = _base(tmp_path)
    mod = "usr/lib/python3/dist-packages/lib/x.py"
    _plant(t, mod, f"DOC = '{BEGIN}{PRIV}'\n")
    _plant(
        t, "usr/lib/python3/dist-packages/lib/__pycache__/x.cpython-313.pyc", f"DOC {BEGIN}{PRIV}"
    )
    _plant(t, "opt/venv/lib/__pycache__/y.cpython-313.pyc", f"DOC {BEGIN}{PRIV}")
    dpkg_ship(t, "lib", mod)
    assert [f.path for f in scan.scan(t)] == ["/opt/venv/lib/__pycache__/y.cpython-313.pyc"]


def test_symlinks_are_not_followed_out_of_the_tree(tmp_path):
    outside = tmp_path / "host-secret"
    outside.write_text(f"{BEGIN}{PRIV}\n")
    t = _base(tmp_path)
    (t / "etc/link.pem").symlink_to(outside)
    (t / "var").mkdir(exist_ok=True)
    (t / "var/hostdir").symlink_to(tmp_path)
    assert scan.scan(t) == []
    seal.finalize(t, io.StringIO())
    assert outside.exists()


def test_glob_semantics():
    rx = re.compile(sealed_items.glob_regex("var/log/**/*.log"))
    assert rx.fullmatch("var/log/a.log") and rx.fullmatch("var/log/x/y/a.log")
    assert not rx.fullmatch("var/log/a.log.1") and not rx.fullmatch("var/logx/a.log")
    star = re.compile(sealed_items.glob_regex("home/*/.netrc"))
    assert star.fullmatch("home/a/.netrc") and not star.fullmatch("home/a/b/.netrc")


@pytest.mark.parametrize(
    "edit, msg",
    [
        (lambda d: d["items"][0].pop("reason"), r"machine-id\.reason: every item says why"),
        (lambda d: d["items"][0].update(action="shred"), r"machine-id\.action"),
        (lambda d: d["items"][1].update(id="machine-id"), r"items\[1\]\.id"),
        (lambda d: d["items"][0].update(paths=["/etc/machine-id"]), r"machine-id\.paths"),
        (lambda d: d["items"][0].update(extra=1), r"unknown keys \['extra'\]"),
        (lambda d: d["items"][0].update(type="dir"), r"machine-id\.type: one of any, file"),
    ],
)
def test_bad_list_names_the_item(tmp_path, edit, msg):
    data = yaml.safe_load(sealed_items.SEALED_FILE.read_text())
    edit(data)
    f = tmp_path / "sealed.yaml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(NodeforgeError, match=msg):
        sealed_items.load(f)


def test_seal_role_loads_the_same_list():
    tasks = yaml.safe_load((REPO / "roles/seal/tasks/install.yml").read_text())
    load = next(t for t in tasks if "ansible.builtin.include_vars" in t)
    path = load["ansible.builtin.include_vars"]["file"].replace(
        "{{ role_path }}", str(REPO / "roles/seal")
    )
    assert Path(os.path.normpath(path)) == sealed_items.SEALED_FILE
    live = [p for i in sealed_items.load().items if i.live for p in i.paths if "*" not in p]
    assert "root/.aws" in live and "var/lib/systemd/credential.secret" in live


# Everything the Ansible seal role removes or empties (roles/seal/tasks/install.yml and its
# defaults), as one concrete path each: the local target runs the post-stop sealer instead of
# the role, so the list must seal each of them too.
ROLE_REMOVES = [
    "etc/ssh/ssh_host_ed25519_key",
    "etc/ssh/ssh_host_rsa_key.pub",
    "var/lib/dbus/machine-id",
    "etc/munge/munge.key",
    "etc/slurm/slurmdbd.conf",
    "etc/mysql/debian.cnf",
    "root/.my.cnf",
    "root/.mysql_history",
    "var/lib/apt/lists/deb.debian.org_debian_dists_trixie_main_binary-amd64_Packages",
    "var/lib/apt/lists/deb.debian.org_debian_dists_trixie_main_i18n_Translation-en",
    "var/lib/apt/lists/deb.debian.org_debian_dists_trixie_Release.gpg",
    "var/lib/apt/lists/partial/deb.debian.org_debian_dists_trixie_InRelease.FAILED",
    "var/cache/apt/pkgcache.bin",
    "var/cache/apt/archives/slurmd_24.11_amd64.deb",
    "var/cache/apt/archives/partial/munge_0.5_amd64.deb",
    "var/log/apt/eipp.log.xz",
    "var/log/dpkg.log.1",
    "var/log/syslog.2.gz",
    "var/log/slurm/slurmd.log.12",
    "var/log/installer/cdebconf/questions.dat.zst",
    "root/.bash_history",
    "root/.python_history",
    "root/.lesshst",
    "root/.viminfo",
    "root/.wget-hsts",
    "tmp/build-scratch",
    "var/tmp/.hidden-scratch",
    "var/lib/cloud/instance/boot-finished",
    "usr/sbin/policy-rc.d",
    "etc/dpkg/dpkg.cfg.d/nodeforge-bake",  # live items (bake-only settings of roles/base)
    "etc/apt/apt.conf.d/00nodeforge-bake",
    "root/.ssh/authorized_keys",
]
ROLE_TRUNCATES = [
    "var/log/dpkg.log",
    "var/log/apt/history.log",
    "var/log/faillog",
    "var/log/alternatives",
]


def test_the_list_seals_everything_the_seal_role_does(tmp_path):
    t = _base(tmp_path)
    (t / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    for rel in ROLE_REMOVES + ROLE_TRUNCATES:
        _plant(t, rel, "from the build\n")
    (t / "var/lib/apt/lists/lock").write_text("")
    (t / "var/log/journal").mkdir(parents=True)
    os.symlink("../../usr/share/doc/systemd/README.logs", t / "var/log/README")
    seal.finalize(t, io.StringIO())
    left = [rel for rel in ROLE_REMOVES if (t / rel).exists() or (t / rel).is_symlink()]
    assert left == [], f"the seal role removes these, the sealed-items list does not: {left}"
    for rel in [*ROLE_TRUNCATES, "etc/machine-id"]:
        assert (t / rel).is_file() and (t / rel).stat().st_size == 0, rel
    # Directories, links and apt's lock are not files to empty: they stay as they were.
    assert (t / "var/log/journal").is_dir() and (t / "var/log/apt").is_dir()
    assert os.readlink(t / "var/log/README") == "../../usr/share/doc/systemd/README.logs"
    assert (t / "var/lib/apt/lists/lock").is_file()
    assert scan.scan(t) == []


def test_the_seal_role_still_names_each_kind_the_list_covers():
    """A tripwire: a new removal in the seal role (the seal of targets without the post-stop
    step) needs its path in ROLE_REMOVES above and an item in the list."""
    text = (REPO / "roles/seal/tasks/install.yml").read_text()
    removals = re.findall(r"^- name: (?:Remove|Truncate|Empty) (.+)$", text, re.M)
    assert len(removals) == 15, f"the seal role's removals changed: {removals}"


def test_file_items_leave_directories_and_links_alone(tmp_path):
    sl = sealed_items.load()
    item = next(i for i in sl.items if i.id == "other-logs")
    assert item.type == "file" and item.matches("var/log/journal")
    t = _base(tmp_path)
    (t / "var/log/journal").mkdir(parents=True)
    assert not item.applies_to(t / "var/log/journal", True)
    _plant(t, "var/log/x")
    assert item.applies_to(t / "var/log/x", False)


def test_glob_character_class():
    rx = re.compile(sealed_items.glob_regex("var/log/**/*.[0-9]"))
    assert rx.fullmatch("var/log/dpkg.log.1") and rx.fullmatch("var/log/a/b.7")
    assert not rx.fullmatch("var/log/dpkg.log.x") and not rx.fullmatch("var/log/dpkg.log.12")
    # Anything else in brackets stays literal.
    assert re.fullmatch(sealed_items.glob_regex("a[!b]"), "a[!b]")
