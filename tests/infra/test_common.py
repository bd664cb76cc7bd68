"""Checks every node must pass, whatever its role."""

from __future__ import annotations

import shlex

import pytest

from nodeforge.lab.verify import explain

# Units the image must never start on its own, whatever the role (enabled per role at first boot).
ROLE_UNITS = ("slurmctld", "slurmd", "slurmdbd", "sackd", "mariadb")


def test_agent_ready(node):
    st = node.state
    assert st, (
        "no /var/lib/nodeforge/state.json and `nodeforge node status --json` failed: the agent never ran"
    )
    failed = {
        k: v.get("error") for k, v in (st.get("steps") or {}).items() if v.get("status") == "failed"
    }
    assert st.get("status") == "ready" and not failed, (
        f"agent status {st.get('status')!r}, last error {st.get('last_error')!r}, failed steps {failed}"
    )


def test_init_unit_succeeded(node):
    out = node.sh(
        "systemctl show -p LoadState -p ActiveState -p Result -p ExecMainStatus nodeforge-init.service"
    )
    p = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    ok = (
        p.get("LoadState") == "loaded"
        and p.get("ActiveState") in ("active", "inactive")
        and p.get("Result") == "success"
        and p.get("ExecMainStatus", "0") == "0"
    )
    assert ok, f"nodeforge-init.service did not succeed: {p}"


def test_packages_match_manifest(node):
    want = node.image.get("packages") or {}
    assert want, "/etc/nodeforge/image.json has no `packages`"
    out = node.sh("dpkg-query -W -f '${Package} ${Version} ${db:Status-Abbrev}\\n'")
    have = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2].startswith("ii"):
            have[parts[0].split(":")[0]] = parts[1]
    bad = {p: (v, have.get(p)) for p, v in want.items() if have.get(p) != v}
    assert not bad, (
        "installed versions differ from the manifest (package: manifest, installed):\n"
        + "\n".join(f"  {p}: {a} != {b}" for p, (a, b) in sorted(bad.items())[:40])
    )


def test_machine_id_fresh(node, all_nodes):
    mid = node.sh("cat /etc/machine-id").strip()
    assert len(mid) == 32, f"/etc/machine-id is {mid!r}"
    others = {n.label: n.sh("cat /etc/machine-id").strip() for n in all_nodes if n is not node}
    same = [k for k, v in others.items() if v == mid]
    assert not same, f"machine-id {mid} is shared with {same} (sealing failed)"


def test_host_keys_generated_this_boot(node, all_nodes):
    btime = node.boot_time()
    out = node.sh("for f in /etc/ssh/ssh_host_*_key; do stat -c '%n %a %U %Y' \"$f\"; done")
    rows = [ln.split() for ln in out.splitlines() if ln.strip()]
    names = {r[0] for r in rows}
    assert "/etc/ssh/ssh_host_ed25519_key" in names, f"no ed25519 host key:\n{out}"
    for name, mode, owner, mtime in rows:
        assert (mode, owner) == ("600", "root"), (
            f"{name}: mode {mode} owner {owner} (want 600 root)"
        )
        # Keys made on this boot: not older than the kernel's boot time (the image has none).
        assert int(mtime) >= btime - 5, (
            f"{name}: mtime {mtime} is before this boot ({btime}): baked into the image?"
        )
    fp = node.sh("ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub").split()[1]
    for other in all_nodes:
        if other is node:
            continue
        ofp = other.sh("ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub").split()[1]
        assert ofp != fp, (
            f"host key {fp} is the same on {other.label}: keys were baked, not generated"
        )


def test_sshd_active(node):
    node.sh("systemctl is-active ssh.service")


def test_munge_key_and_service(node):
    out = node.sh("stat -c '%a %U %G %s' /etc/munge/munge.key")
    mode, owner, group, size = out.split()
    assert (mode, owner) == ("400", "munge"), (
        f"/etc/munge/munge.key: mode {mode} owner {owner}:{group} (want 0400 munge)"
    )
    assert int(size) >= 32, f"/etc/munge/munge.key is only {size} bytes"
    node.sh("systemctl is-active munge.service")
    node.sh("munge -n | unmunge", what="munge round trip failed")


def test_enroot_paths(node):
    conf = node.sh("cat /etc/enroot/enroot.conf")
    paths = {}
    for line in conf.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith("_PATH") and not parts[0].startswith("#"):
            paths[parts[0]] = parts[1]
    for key in ("ENROOT_RUNTIME_PATH", "ENROOT_CACHE_PATH", "ENROOT_DATA_PATH", "ENROOT_TEMP_PATH"):
        assert key in paths, f"/etc/enroot/enroot.conf sets no {key}:\n{conf}"
    # The per-user part ($(id -u) …) is made by enroot; its parent must exist, world-writable+sticky.
    for key, val in paths.items():
        parent = val.split("/$")[0].split("/user-")[0].split("/group-")[0] if "$" in val else val
        out = node.run(f"stat -c '%a %U' {shlex.quote(parent)}")
        assert out.rc == 0, explain(
            f"stat {parent}", out, f"{key} ({val}): {parent} does not exist"
        )
        mode, owner = out.stdout.split()
        assert (mode, owner) == ("1777", "root"), (
            f"{key}: {parent} mode {mode} owner {owner} (want 1777 root)"
        )


def test_enroot_runs(node):
    v = node.sh("enroot version").strip()
    want = (node.image.get("components") or {}).get("enroot") or node.image.get("packages", {}).get(
        "enroot", ""
    )
    assert v and (not want or want.startswith(v)), f"enroot version {v!r}, manifest says {want!r}"


def test_plugstack_one_pyxis(node):
    files = node.sh(
        'for f in /etc/slurm/plugstack.conf /etc/slurm/plugstack.conf.d/*; do [ -f "$f" ] && echo "$f"; done'
    ).split()
    hits = []
    for f in files:
        for line in node.sh(f"cat {shlex.quote(f)}").splitlines():
            s = line.strip()
            if s and not s.startswith("#") and "spank_pyxis.so" in s:
                hits.append(f"{f}: {s}")
    assert len(hits) == 1, "plugstack must load pyxis exactly once, found:\n" + (
        "\n".join(hits) or "(none)"
    )
    so = hits[0].split()[1] if len(hits[0].split()) > 2 else ""
    if so.startswith("/"):
        node.sh(f"test -f {shlex.quote(so)}", what=f"pyxis plugin {so} missing")


def test_logrotate_config_valid(node):
    node.sh("logrotate -d /etc/logrotate.conf 2>&1", what="logrotate -d rejects the configuration")


def test_journald_logrotate_timer(node):
    node.sh("systemctl is-enabled logrotate.timer")


def test_no_build_leftovers(node):
    out = node.run(
        "ls /root/.ssh/authorized_keys.d /var/lib/cloud 2>/dev/null; ls /var/lib/apt/lists | grep -v -e lock -e partial -e auxfiles"
    )
    assert not out.stdout.strip(), f"sealed paths are not empty:\n{out.stdout}"


@pytest.mark.parametrize("unit", ROLE_UNITS)
def test_role_units_match_role(node, unit):
    want_active = {
        "controller": {"slurmctld", "slurmdbd", "mariadb"},
        "compute": {"slurmd"},
        "login": {"sackd"},
    }.get(node.role, set())
    if node.role == "controller" and unit in ("slurmdbd", "mariadb"):
        acct = node.run(
            "python3 -c \"import json;print(json.load(open('/var/lib/nodeforge/params.json')).get('accounting', True))\""
        )
        if acct.rc == 0 and acct.stdout.strip() == "False":
            want_active = want_active - {"slurmdbd", "mariadb"}
    r = node.run(f"systemctl is-active {unit}.service")
    state = r.stdout.strip()
    if unit in want_active:
        assert state == "active", explain(
            f"systemctl is-active {unit}", r, f"{unit} must run on a {node.role}"
        )
    else:
        assert state != "active", f"{unit} is active on a {node.role} (must not be)"
