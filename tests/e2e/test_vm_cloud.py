"""VM tier, first boot as a cloud does it: no node.yaml, no nodeforge.* kernel params, no SSH
key on the kernel command line.

Each VM gets its own metadata service (lab/imds.py, IMDSv2) on a loopback port, reached from the
guest only at 169.254.169.254 through qemu's restricted user network (guestfwd; lab/vm.py
CloudNet). Its user-data carries the node params (the image is built with the IMDS guard,
node_agent_imds_root_only, so the munge key may ride there), its public-keys the admin key,
its role the instance credentials. The computes fetch an s3:// extension in HyperPod's shape
(prefix + script) over TLS from moto's S3 server behind a private test CA
(lab/s3front.py), at 169.254.169.10:443 inside the same user network, signed with the role's
credentials, never with keys from params. The credentials live CRED_TTL seconds and the front
refuses a request signed with an expired or unknown set (lab/s3front.py).

* ctl: controller; c1: compute whose extension runs, then it is IDLE. Its extension outlives
  the credential set its fetch used, so the second extension's fetch must use a new set from
  the metadata service (refresh after expiry). Rebooted, it keeps its identity, does not run
  the extensions again, and is IDLE again; c2 (booted after c1 is stopped: ctl's qemu socket
  link takes one peer at a time): compute whose extension is refused by S3 (403), so it stays
  drained with the reason in `sinfo -R`; then its metadata service serves only a stale
  (expired) set, the agent is run again, and S3's ExpiredToken is the drain reason.

The image: $NODEFORGE_VM_CLOUD_IMAGE (a build output made with the guard), else built here from
the session's mirror with the guard var file (tests/e2e/conftest.py: built with layer cache).
Bounded: logins within $NODEFORGE_VM_BOOT_TIMEOUT (480 s), the agent within 420 s, reboot 420 s.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeforge.errors import CommandError
from nodeforge.lab import s3front
from nodeforge.lab.imds import IMDS, Instance
from nodeforge.lab.vm import VM, CloudNet, VMConfig, free_port
from tests.conftest import require_tools, wait_for
from tests.helpers import E2E_ROOT, build_image, drop_outputs

pytestmark = pytest.mark.e2e
BOOT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_BOOT_TIMEOUT", "480"))
INIT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_INIT_TIMEOUT", "420"))
# OVMF prints its hand-over line and the loader (shim, grub) writes within seconds under TCG.
IMAGE_ENV = os.environ.get("NODEFORGE_VM_CLOUD_IMAGE")
MUNGE_B64 = "bm9kZWZvcmdlLXZtLWNsb3VkLW11bmdlLWtleS0zMi1ieXRlcy1vaw=="  # test only
S3_ADDR = "169.254.169.10"
ROLE = "nf-node"
# Seconds each role credential set lives. botocore extends a set that expires within ~12 min
# locally (its static-stability window), so one client may sign with an expired key: the node
# makes a new client, hence a new set from the metadata service, for each hook's fetch.
CRED_TTL = 20
ON_INIT = f"""#!/bin/sh
# HyperPod's shape: the entry script runs beside its siblings (synced prefix).
set -eu
./stamp.sh
# Outlive the credential set this fetch was signed with: the next hook's fetch needs a new one.
sleep {CRED_TTL + 3}
""".encode()
STAMP = b"""#!/bin/sh
set -eu
echo "ran $(date +%s) $NODEFORGE_NODE" >> /var/lib/lifecycle-ran
"""
SECOND = b"""#!/bin/sh
set -eu
echo "ran $(date +%s) $NODEFORGE_NODE" >> /var/lib/second-ran
"""
SECOND_URI = "s3://lifecycle/second/after.sh"  # c1's second hook: runs after "lifecycle"


def _user_data(
    role: str, name: str, ip: str, *, hook_prefix: str | None, ca: str, second: bool = False
) -> bytes:
    section: dict = {
        "role": role,
        "cluster_name": "cloud",
        "node_name": name,
        "node_address": ip,
        "controller": {"host": "ctl", "address": "10.77.0.10"},
        "munge_key": MUNGE_B64,
        "wait_timeout": 360,
    }
    if hook_prefix:
        section |= {
            "s3_endpoint_url": f"https://{S3_ADDR}",
            "s3_ca_bundle": ca,
            "hook_retries": 0,
            "hooks": [{"uri": hook_prefix, "script": "on_init.sh", "name": "lifecycle"}],
        }
        if second:
            section["hooks"].append({"uri": SECOND_URI, "name": "second"})
    # A #cloud-config document with a nodeforge section, as on EC2.
    return ("#cloud-config\n" + json.dumps({"nodeforge": section}, indent=1) + "\n").encode()


@pytest.fixture(scope="module")
def cloud_image(request) -> Iterator[Path]:
    if IMAGE_ENV:
        yield Path(IMAGE_ENV)  # the developer's own image: never removed
        return
    mirror = request.getfixturevalue("fixture_mirror")
    versions = request.getfixturevalue("pinned_versions")
    var = E2E_ROOT / "imds-guard.pkrvars.hcl"
    var.write_text("ansible_vars = {\n  node_agent_imds_root_only = true\n}\n")
    out = E2E_ROOT / "image-imds"
    build_image(out, mirror, versions, "--var-file", str(var))
    yield out
    drop_outputs(out, var)  # 1.7 GiB no later module reads


@pytest.fixture(scope="module")
def cloud(tmp_path_factory, cloud_image):
    require_tools("qemu-system-x86_64", "qemu-img", "ssh", "ssh-keygen", "openssl")
    for f in ("disk.qcow2", "vmlinuz", "initrd.img"):
        if not (cloud_image / f).is_file():
            pytest.fail(f"VM image artifact missing: {cloud_image / f}", pytrace=False)
    work = tmp_path_factory.mktemp("vmcloud")
    tls = s3front.make_ca(work / "tls", [S3_ADDR])
    ca_pem = tls.ca.read_text()
    link = free_port()
    vms: dict[str, VM] = {}
    imds: dict[str, IMDS] = {}
    servers = []
    moto = s3front.moto()
    moto_port = moto.get_host_and_port()[1]
    prev = signal.signal(signal.SIGTERM, _interrupt)
    try:
        import boto3

        admin = boto3.client(
            "s3", endpoint_url=f"http://127.0.0.1:{moto_port}", region_name="eu-west-1",
            aws_access_key_id="admin", aws_secret_access_key="admin",
        )  # fmt: skip
        admin.create_bucket(
            Bucket="lifecycle", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"}
        )
        for prefix in ("config/", "denied/"):
            admin.put_object(Bucket="lifecycle", Key=prefix + "on_init.sh", Body=ON_INIT)
            admin.put_object(Bucket="lifecycle", Key=prefix + "stamp.sh", Body=STAMP)
        admin.put_object(Bucket="lifecycle", Key=SECOND_URI.split("/", 3)[3], Body=SECOND)
        # One S3 front; it accepts only credentials that the computes' metadata services
        # issued and that have not expired.
        nodes = [
            ("ctl", "controller", "10.77.0.10", "52:54:00:4e:46:20", None),
            ("c1", "compute", "10.77.0.11", "52:54:00:4e:46:21", "s3://lifecycle/config/"),
            ("c2", "compute", "10.77.0.12", "52:54:00:4e:46:22", "s3://lifecycle/denied/"),
        ]
        fronts: dict[str, s3front.S3Front] = {}
        for name, role, ip, mac, prefix in nodes:
            cfg = VMConfig(
                image_dir=cloud_image,
                workdir=work / name,
                name=name,
                memory_mb=1536,
                cpus=1 if role == "compute" else 2,
                boot_timeout=BOOT_TIMEOUT,
                keep=True,
                link_ip=f"{ip}/24",
                link_mac=mac,
                inject_key=False,
                boot="uefi",  # as EC2 and HyperPod boot it: firmware, no -kernel (issue 26)
                reset="exit",  # a guest reboot is a fresh start of this machine (lab/vm.py RESETS)
                **({"link_listen": link} if role == "controller" else {"link_connect": link}),
            )
            vm = VM(cfg)
            pub = vm.ensure_key()
            svc = IMDS(
                Instance(
                    instance_id=f"i-0{abs(hash(name)) % 10**16:016d}",
                    hostname=f"ip-10-77-0-{ip.rsplit('.', 1)[1]}.eu-west-1.compute.internal",
                    user_data=_user_data(
                        role, name, ip, hook_prefix=prefix, ca=ca_pem, second=name == "c1"
                    ),
                    public_keys=[("admin", pub)],
                    role=ROLE if prefix else None,
                    cred_ttl=CRED_TTL,
                )
            )
            srv = svc.serve()  # listening before qemu starts (guestfwd connects per guest SYN)
            servers.append(srv)
            forwards = {"169.254.169.254:80": srv.port}
            if prefix:
                front = s3front.S3Front(moto_port, tls, imds=svc)
                servers.append(front)
                fronts[name] = front
                forwards[f"{S3_ADDR}:443"] = front.port
            cfg.metadata = CloudNet(forwards)
            vms[name], imds[name] = vm, svc
        fronts["c2"].forbidden.append("/lifecycle/denied/")
        # ctl and c1 now; c2 later (test_failing_extension...): ctl's link socket takes one
        # peer at a time, so c2 joins once c1 is gone.
        states = boot(vms, ["ctl", "c1"])
        yield {"vms": vms, "imds": imds, "fronts": fronts, "states": states, "work": work}
    finally:
        for vm in vms.values():
            vm.stop()
        for srv in servers:
            srv.stop()
        moto.stop()
        signal.signal(signal.SIGTERM, prev)


def boot(vms: dict[str, VM], names: list[str]) -> dict[str, str]:
    for n in names:
        vms[n].start()
    for n in names:
        vms[n].wait_ssh()  # root's key came from IMDS public-keys: nothing else put it there
        print(f"\nVM {n}: SSH login after {vms[n].ready_after:.1f}s ({vms[n].accel.accel})")
    deadline = time.monotonic() + INIT_TIMEOUT
    states = {}
    for n in names:
        states[n] = vms[n].wait_unit(
            "nodeforge-init.service", timeout=max(10.0, deadline - time.monotonic())
        )
        print(f"VM {n}: nodeforge-init.service {states[n]} at {vms[n].elapsed():.1f}s")
    return states


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _state(vm: VM) -> dict:
    return json.loads(vm.ssh("cat /var/lib/nodeforge/state.json").stdout)


def _sinfo(ctl: VM, node: str) -> str:
    cp = ctl.ssh(f"sinfo -h -N -n {shlex.quote(node)} -o '%T|%E'", check=False, timeout=60)
    return cp.stdout.strip()


def _report(vm: VM, st: dict, label: str) -> None:
    steps = {k: v.get("duration") for k, v in st["steps"].items()}
    print(
        f"\n[{label}] {vm.cfg.name}: uptime_at_ready={st.get('uptime_at_ready')} s "
        f"time_to_ready={st.get('time_to_ready')} s steps={json.dumps(steps)}"
    )


def test_compute_configured_from_imds_runs_s3_extension_then_schedulable(cloud):
    ctl, c1 = cloud["vms"]["ctl"], cloud["vms"]["c1"]
    assert cloud["states"]["ctl"] == "active" and cloud["states"]["c1"] == "active"
    st = _state(c1)
    _report(c1, st, "first boot")
    assert st["source"] == "imds" and st["node"] == "c1" and st["status"] == "ready"
    # No lab shortcut in this VM: no node.yaml, no nodeforge.* on the command line, no key
    # credential; the admin key is IMDS's public-keys/0.
    out = c1.ssh(
        "test ! -e /etc/nodeforge/node.yaml && echo no-node-yaml; cat /proc/cmdline; "
        "cat /root/.ssh/authorized_keys"
    ).stdout
    assert "no-node-yaml" in out
    assert "nodeforge." not in out and "ssh.authorized_keys" not in out
    assert c1.key.with_suffix(".pub").read_text().strip() in out
    # IMDSv2 only: a token first, then user-data, keys and the role's credentials with it.
    log = list(cloud["imds"]["c1"].log)
    assert log[0][:2] == ("PUT", "/latest/api/token") and log[0][2] == 200
    paths = [p for _, p, s in log if s == 200]
    assert "/latest/user-data" in paths
    assert "/latest/meta-data/public-keys/0/openssh-key" in paths
    creds = [p for p in paths if p.endswith(f"/iam/security-credentials/{ROLE}")]
    assert len(creds) >= 2, "the role's credentials came from the metadata service once at most"
    assert not [e for e in log if e[2] == 401]
    # The extensions came over TLS from S3, signed with IMDS-issued unexpired credentials.
    front = cloud["fronts"]["c1"]
    assert front.refused == [] and any("config/on_init.sh" in p for _, p in front.requests)
    # Refresh after expiry: the first hook's fetch used set A; the second hook's fetch, made
    # after A expired (the first hook outlived it), used another set that the front accepted.
    svc, signed = cloud["imds"]["c1"], front.signed
    print(f"c1 S3 requests (when, key, method, path): {signed}")
    first_key = signed[0][1]
    late = [(t, k) for t, k, m, p in signed if p.startswith("/lifecycle/second/")]
    assert late, f"the second hook was never fetched: {signed}"
    expired_at = svc.expiry_of(first_key)
    assert expired_at is not None and expired_at <= late[0][0], (expired_at, late)
    assert all(k != first_key for _, k in late), f"an expired set was reused: {signed}"
    ran = c1.ssh("cat /var/lib/lifecycle-ran /var/lib/second-ran").stdout.splitlines()
    assert len(ran) == 2 and all(r.endswith(" c1") for r in ran), ran
    # Schedulable only after the extension ran: the hooks step ended before the ready step.
    assert st["steps"]["hooks"]["status"] == "done"
    assert st["steps"]["hooks"]["ended"] <= st["steps"]["ready"]["started"]
    assert int(ran[0].split()[1]) <= st["steps"]["ready"]["ended"] + 1
    wait_for("c1 IDLE in sinfo", lambda: _sinfo(ctl, "c1").startswith("idle|"), 120, every=3.0)
    # The guard: only root reaches the metadata service.
    cp = c1.ssh(
        'setpriv --reuid=nobody --regid=nogroup --clear-groups python3 -c "import urllib.request as u;'
        "u.urlopen(u.Request('http://169.254.169.254/latest/api/token',method='PUT',"
        "headers={'X-aws-ec2-metadata-token-ttl-seconds':'60'}),timeout=3)\"",
        check=False,
    )
    assert cp.returncode != 0 and "timed out" in cp.stdout + (cp.stderr or ""), cp.stdout


def test_reboot_keeps_identity_and_does_not_rerun_once_work(cloud):
    ctl, c1 = cloud["vms"]["ctl"], cloud["vms"]["c1"]
    ident = "cat /etc/machine-id; cat /etc/ssh/ssh_host_*_key.pub | sha256sum; hostname; " \
            "cat /proc/sys/kernel/random/boot_id; wc -l < /root/.ssh/authorized_keys"  # fmt: skip
    before = c1.ssh(ident).stdout.splitlines()
    t0 = time.monotonic()
    try:
        c1.ssh("systemctl reboot", check=False, timeout=30)
    except CommandError:
        pass  # the connection may hang while the guest goes down

    def rebooted():
        try:
            cp = c1.ssh(ident, check=False, timeout=30)
        except CommandError:
            return None
        lines = cp.stdout.splitlines() if cp.returncode == 0 else []
        return lines if len(lines) == 5 and lines[3] != before[3] else None

    # The guest's own reboot ends its qemu (reset="exit"); the same machine starts again with
    # its disk and firmware variables, as a cloud restarts an instance that rebooted itself.
    c1.restart_after_reset(timeout=300)
    after = wait_for("c1 back after its reboot", rebooted, INIT_TIMEOUT, every=5)
    assert after[:3] == before[:3]  # machine-id, host keys, NodeName
    assert after[4] == before[4]  # no second copy of the admin key
    assert c1.wait_unit("nodeforge-init.service", timeout=INIT_TIMEOUT) == "active"
    st = _state(c1)
    _report(c1, st, f"reboot, {time.monotonic() - t0:.0f}s wall")
    assert st["boots"] == 2 and st["status"] == "ready" and st["node"] == "c1"
    assert st["steps"]["identity"]["status"] == "skipped"
    assert st["steps"]["hooks"]["status"] == "skipped"
    assert len(c1.ssh("cat /var/lib/lifecycle-ran /var/lib/second-ran").stdout.splitlines()) == 2
    wait_for("c1 IDLE after reboot", lambda: _sinfo(ctl, "c1").startswith("idle|"), 180, every=3.0)


def test_failing_extension_leaves_node_drained_with_reason(cloud):
    ctl, c1, c2 = cloud["vms"]["ctl"], cloud["vms"]["c1"], cloud["vms"]["c2"]
    c1.stop()  # frees ctl's link for c2
    assert boot(cloud["vms"], ["c2"])["c2"] == "failed"
    assert cloud["fronts"]["c2"].refused, "S3 never refused c2's request"
    st = _state(c2)
    assert st["status"] == "failed" and st["steps"]["hooks"]["status"] == "failed"
    assert "AccessDenied" in st["steps"]["hooks"]["error"] or "403" in st["steps"]["hooks"]["error"]
    assert c2.ssh("test -e /var/lib/lifecycle-ran", check=False).returncode != 0
    reason = wait_for("c2 drained with a reason", lambda: _drained(ctl, "c2"), 120, every=3.0)
    assert "lifecycle" in reason, reason


def test_only_a_stale_role_key_leaves_node_drained_with_reason(cloud):
    """c2 again (after the 403 case): its metadata service now serves only an expired set, the
    prefix is allowed, and the agent runs again (a failed step is retried on the next run)."""
    ctl, c2 = cloud["vms"]["ctl"], cloud["vms"]["c2"]
    svc, front = cloud["imds"]["c2"], cloud["fronts"]["c2"]
    svc.stale = True
    front.forbidden.clear()
    front.refused.clear()
    front.signed.clear()
    c2.ssh("systemctl restart nodeforge-init.service", check=False, timeout=INIT_TIMEOUT)
    assert c2.wait_unit("nodeforge-init.service", timeout=INIT_TIMEOUT) == "failed"
    print(f"c2 S3 requests (when, key, method, path): {front.signed}; refused {front.refused}")
    assert front.refused and set(front.refused) == {"ExpiredToken"}, front.refused
    assert {k for _, k, _, _ in front.signed} == {svc.credentials().access_key_id}
    st = _state(c2)
    assert st["status"] == "failed" and st["steps"]["hooks"]["status"] == "failed"
    assert "ExpiredToken" in st["steps"]["hooks"]["error"], st["steps"]["hooks"]["error"]
    assert c2.ssh("test -e /var/lib/lifecycle-ran", check=False).returncode != 0

    def reason() -> str | None:
        r = _drained(ctl, "c2")
        return r if r and "ExpiredToken" in r else None

    print("c2 drain reason:", wait_for("c2 drained for ExpiredToken", reason, 120, every=3.0))


def _drained(ctl: VM, node: str) -> str | None:
    out = ctl.ssh(f"sinfo -h -R -n {shlex.quote(node)} -o '%E'", check=False).stdout.strip()
    state = _sinfo(ctl, node)
    return out if out and state.split("|")[0].startswith("drain") else None
