"""VM tier: boot the built disk in qemu and prove what nspawn cannot.

Two VMs, a controller and a compute, on a private qemu socket link (10.77.0.0/24), each
booted from a copy-on-write overlay of the artifact with TCG unless a probe boot shows KVM
really works (on 2 TCG cores the pair boots in parallel). Then:

* the testinfra suite (tests/infra) over SSH, through `nodeforge verify` code paths;
* `docker run` of an image imported locally (a busybox-static rootfs, `docker import`);
* enroot imports a local image and starts a command in it.

The image is the session's own `nodeforge build` (tests/e2e/conftest.py), or $NODEFORGE_VM_IMAGE (a build
output). A missing image or tool FAILS the test and names it. Bounded: the VM must log in
within $NODEFORGE_VM_BOOT_TIMEOUT (default 480 s) and the agent must finish within 300 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import tarfile
import time
from pathlib import Path

import pytest

from nodeforge import proc
from nodeforge.lab import verify
from nodeforge.lab.vm import VM, BootTimeout, VMConfig, free_port
from tests.conftest import require_tools

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
# The session's own build (tests/e2e/conftest.py: built_image) unless this points elsewhere.
IMAGE_ENV = os.environ.get("NODEFORGE_VM_IMAGE")
BOOT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_BOOT_TIMEOUT", "480"))
INIT_TIMEOUT = float(os.environ.get("NODEFORGE_VM_INIT_TIMEOUT", "420"))
BUSYBOX = "/bin/busybox"

MUNGE_B64 = "bm9kZWZvcmdlLXZtLXRpZXItbXVuZ2Uta2V5LTMyLWJ5dGVzLW9r"  # 38 bytes, test only


def node_yaml(role: str, name: str, ip: str) -> str:
    return (
        f"role: {role}\ncluster_name: vmtier\nnode_name: {name}\nnode_address: {ip}\n"
        "controller: {host: ctl, address: 10.77.0.10}\n"
        f"munge_key: {MUNGE_B64}\nwait_timeout: 360\n"
    )


def _cfg(image: Path, work: Path, name: str, role: str, ip: str, mac: str, **link) -> VMConfig:
    return VMConfig(
        image_dir=image,
        workdir=work / name,
        name=name,
        node_yaml=node_yaml(role, name, ip),
        boot_timeout=BOOT_TIMEOUT,
        keep=True,
        link_ip=f"{ip}/24",
        link_mac=mac,
        compat_net=os.environ.get("NODEFORGE_VM_COMPAT_NET") == "1",
        compat_keygen=os.environ.get("NODEFORGE_VM_COMPAT_KEYGEN") == "1",
        **link,
    )


@pytest.fixture(scope="module")
def vm_image(request) -> Path:
    return Path(IMAGE_ENV) if IMAGE_ENV else request.getfixturevalue("built_image")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, vm_image):
    require_tools("qemu-system-x86_64", "qemu-img", "ssh", "ssh-keygen", "scp")
    IMAGE = vm_image
    for f in ("disk.qcow2", "vmlinuz", "initrd.img", "manifest.json"):
        if not (IMAGE / f).is_file():
            pytest.fail(
                f"VM image artifact missing: {IMAGE / f} (build it with `nodeforge build`, "
                "or point NODEFORGE_VM_IMAGE at a build output)",
                pytrace=False,
            )
    work = tmp_path_factory.mktemp("vm")
    port = free_port()
    disk_sum = _sha(IMAGE / "disk.qcow2")
    ctl = VM(
        _cfg(IMAGE, work, "ctl", "controller", "10.77.0.10", "52:54:00:4e:46:10", link_listen=port)
    )
    c1 = VM(
        _cfg(IMAGE, work, "c1", "compute", "10.77.0.11", "52:54:00:4e:46:11", link_connect=port)
    )
    prev = signal.signal(signal.SIGTERM, _interrupt)  # so a killed run still stops qemu
    try:
        ctl.start()
        c1.start()
        for v in (ctl, c1):
            v.wait_ssh()
            print(
                f"\nVM {v.cfg.name}: SSH login after {v.ready_after:.1f}s ({v.accel.accel}: {v.accel.reason})"
            )
        # The agent's outcome is judged by the suite (test_suite_over_ssh); docker and enroot
        # are proven even when the agent failed, so one bug does not hide the others.
        deadline = time.monotonic() + INIT_TIMEOUT
        for v in (ctl, c1):
            try:
                state = v.wait_unit(
                    "nodeforge-init.service", timeout=max(10.0, deadline - time.monotonic())
                )
            except BootTimeout as exc:
                state = f"not finished: {str(exc).splitlines()[0]}"
                print(
                    v.ssh(
                        "systemctl list-jobs --no-pager; tail -n 5 /var/log/nodeforge/*.log",
                        check=False,
                    ).stdout
                )
            print(f"VM {v.cfg.name}: nodeforge-init.service {state} at {v.elapsed():.1f}s")
        yield {"ctl": ctl, "c1": c1}
    finally:
        c1.stop()
        ctl.stop()
        signal.signal(signal.SIGTERM, prev)
    assert _sha(IMAGE / "disk.qcow2") == disk_sum, "the VM modified the artifact disk.qcow2"


@pytest.fixture(scope="module")
def vm(cluster):
    """The compute VM: where docker and enroot run jobs' containers."""
    return cluster["c1"]


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _sha(p: Path) -> str:
    st = p.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _scp(v: VM, src: Path, dst: str) -> None:
    proc.run(
        [
            "scp",
            "-F",
            "/dev/null",
            "-i",
            str(v.key),
            "-P",
            str(v.port),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            str(src),
            f"root@127.0.0.1:{dst}",
        ],
        timeout=120,
    )


@pytest.fixture(scope="module")
def busybox_rootfs(tmp_path_factory) -> Path:
    require_tools("busybox")
    bb = Path(shutil.which("busybox") or BUSYBOX)
    out = (
        proc.run(["file", "-L", str(bb)], check=False).stdout if shutil.which("file") else "static"
    )
    if "dynamically linked" in out:
        pytest.fail(f"{bb} is dynamically linked; install busybox-static", pytrace=False)
    d = tmp_path_factory.mktemp("bbroot")
    tar = d / "busybox-rootfs.tar"
    with tarfile.open(tar, "w") as t:
        for sub in ("bin", "tmp"):
            ti = tarfile.TarInfo(sub)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            t.addfile(ti)
        t.add(bb, arcname="bin/busybox")
        for applet in ("sh", "echo", "cat", "uname", "hostname"):
            ti = tarfile.TarInfo(f"bin/{applet}")
            ti.type, ti.linkname = tarfile.SYMTYPE, "busybox"
            t.addfile(ti)
    return tar


def test_suite_over_ssh(cluster):
    specs = [verify.parse_host_spec(v.host_spec) for v in cluster.values()]
    t = time.monotonic()
    _rc, results = verify.run_suite(specs)
    took = time.monotonic() - t
    report = verify.format_report(results) + f"\nsuite runtime {took:.1f}s for {len(specs)} hosts"
    print("\n" + report)
    assert results, "the suite ran no checks"
    bad = [r for r in results if r.outcome in ("failed", "error")]
    assert not bad, report


DOCKER_API_RUN = r"""
set -e
api() { curl -sS --fail-with-body --unix-socket /run/docker.sock "$@"; }
api -X POST -H 'Content-Type: application/x-tar' --data-binary @/root/busybox-rootfs.tar \
    'http://docker/images/create?fromSrc=-&repo=nodeforge/busybox&tag=local' >/dev/null
api -X DELETE 'http://docker/containers/nf-api?force=1' >/dev/null 2>&1 || true
api -X POST -H 'Content-Type: application/json' 'http://docker/containers/create?name=nf-api' \
    -d '{"Image": "nodeforge/busybox:local", "Cmd": ["/bin/sh", "-c", "echo hello-from-docker; uname -r"],
         "HostConfig": {"NetworkMode": "none"}}' >/dev/null
api -X POST http://docker/containers/nf-api/start
echo "wait: $(api -X POST http://docker/containers/nf-api/wait)"
api 'http://docker/containers/nf-api/logs?stdout=1&stderr=1' | tr -c '[:print:]\n' ' '
echo "logconfig: $(api http://docker/containers/nf-api/json | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["HostConfig"]["LogConfig"]))')"
api -X DELETE 'http://docker/containers/nf-api?force=1'
"""


def test_docker_cli_present(vm):
    cp = vm.ssh("command -v docker || echo MISSING", check=False)
    assert "MISSING" not in cp.stdout, (
        "the image has dockerd (docker.io) but no `docker` command: on Debian 13 the CLI is the "
        "separate package docker-cli; the docker role must install it"
    )


def test_docker_run_local_image(vm, busybox_rootfs):
    """dockerd runs a container from a locally imported image (what nspawn cannot do).

    Driven through the Engine API (curl on /run/docker.sock), so the proof does not depend on
    the docker CLI package; `docker run` itself is used when the CLI is there.
    """
    _scp(vm, busybox_rootfs, "/root/busybox-rootfs.tar")
    # docker must already run on a compute (the suite checks that too); start it if not, so
    # this test proves the engine itself.
    vm.ssh("systemctl is-active docker.service || systemctl start docker.service", timeout=180)
    cp = vm.ssh(DOCKER_API_RUN, timeout=300)
    assert '"StatusCode":0' in cp.stdout and "hello-from-docker" in cp.stdout, cp.stdout
    assert '"Type": "json-file"' in cp.stdout and "max-size" in cp.stdout, cp.stdout
    if "MISSING" not in vm.ssh("command -v docker || echo MISSING", check=False).stdout:
        out = vm.ssh(
            "docker run --rm --network none nodeforge/busybox:local /bin/echo hello-from-docker-cli",
            timeout=240,
        ).stdout
        assert "hello-from-docker-cli" in out, out


def test_enroot_local_image(vm, busybox_rootfs):
    """Only what the enroot in this image can honestly do.

    With the FIXTURE enroot (tests/fixtures/mirror.py) that is: import a dir:// rootfs, create
    a container from it and run a command with the rootfs as its working directory (no
    namespaces). Upstream enroot would also run it in its own user/mount namespaces with the
    rootfs as `/` (checked here when the image carries the real one).
    """
    _scp(vm, busybox_rootfs, "/root/busybox-rootfs.tar")
    fixture = vm.ssh("grep -c 'FIXTURE' /usr/bin/enroot || true").stdout.strip() not in ("", "0")
    vm.ssh(
        "rm -rf /root/bbroot /root/bb.sqsh && mkdir -p /root/bbroot && tar -C /root/bbroot -xf /root/busybox-rootfs.tar"
    )
    vm.ssh(
        "cd /root && enroot import -o /root/bb.sqsh dir:///root/bbroot && enroot create -n nfbb /root/bb.sqsh",
        timeout=240,
    )
    assert "nfbb" in vm.ssh("enroot list").stdout
    if fixture:
        cp = vm.ssh("enroot start nfbb ./bin/busybox echo hello-from-enroot")
        assert "hello-from-enroot" in cp.stdout
    else:
        cp = vm.ssh(
            "enroot start nfbb /bin/sh -c 'echo hello-from-enroot; test -x /bin/busybox && echo rootfs-is-slash'",
            timeout=240,
        )
        assert "hello-from-enroot" in cp.stdout and "rootfs-is-slash" in cp.stdout, cp.stdout
    vm.ssh("enroot remove -f nfbb")


def test_link_between_vms(cluster):
    cp = cluster["c1"].ssh(
        "timeout 10 bash -c '</dev/tcp/10.77.0.10/22' && echo link-ok || ip -br a", check=False
    )
    assert "link-ok" in cp.stdout, cp.stdout


def test_overlay_is_copy_on_write(vm, vm_image):
    info = proc.run(["qemu-img", "info", "-U", str(vm.overlay)]).stdout
    assert "backing file:" in info and str(vm_image.resolve() / "disk.qcow2") in info, info
    assert vm.describe()["ssh"].startswith("ssh://root@127.0.0.1:")


def test_cluster_booted_from_uefi_with_params_by_smbios(cluster):
    """The VMs boot as a cloud boots them: OVMF, the disk's own loader, no -kernel; the
    params and key came as SMBIOS credentials, not on the kernel command line."""
    for v in cluster.values():
        assert v.describe()["boot"] == "uefi"
        out = v.ssh("cat /proc/cmdline; test -d /sys/firmware/efi && echo firmware=efi").stdout
        assert "firmware=efi" in out and "root=UUID=" in out, out
        assert "set_credential" not in out and "nodeforge." not in out, out
        creds = v.ssh("systemd-creds --system list --no-legend").stdout
        assert "tmpfiles.extra" in creds and "ssh.authorized_keys.root" in creds, creds
