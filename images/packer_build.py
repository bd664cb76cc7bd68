"""Builds through Packer's own builders: `qemu` (a VM from a base disk) and `amazon-ebs` (an AMI).

Same playbook, same versions file and artifacts as the local target. The qemu base disk is
made here from the same cached mmdebstrap base (with a throwaway build key and DHCP on the
VM's NIC), unless the var file names a cloud image. Sealing happens in the guest (the `seal`
role); for qemu the result is then checked on the host with the same secret scanner, on the
files debugfs reads out of the built disk, before anything is published.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nodeforge import proc
from nodeforge.errors import NodeforgeError

from . import base as base_mod
from . import export, packer, targets, template
from . import manifest as manifest_mod
from .pipeline import (
    BuildResult,
    Fetched,
    Inputs,
    Phases,
    Reporter,
    build_wheel,
    extra_vars,
    fetch_inputs,
    manifest_header,
    now_iso,
    output_session,
)
from .qemu_host import console_tail, probe_accel
from .sandbox import release_mounts, session_key

NETWORK_UNIT = """# nodeforge: DHCP on the VM's NIC (containers get their network from the host)
[Match]
Name=en* eth*
Virtualization=!container

[Network]
DHCP=yes
"""
# Packed into every libvirt box: the sealed disk boots from firmware with its own loader
# (made here or a cloud image's), so the box needs no kernel of its own.
BOX_VAGRANTFILE = Path(__file__).resolve().parent / "box" / "Vagrantfile"
# cloud-init NoCloud user-data for a cloud image: only the build's throwaway key for root
# (the seal role removes it, cloud-init's state and the host keys).
SEED_USER_DATA = """#cloud-config
disable_root: false
ssh_pwauth: false
ssh_authorized_keys:
  - {key}
"""


def aws_credentials_present(env: dict[str, str] | None = None) -> bool:
    env = dict(os.environ if env is None else env)
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return True
    if env.get("AWS_PROFILE") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return True
    home = Path(env.get("HOME", "/root"))
    return (home / ".aws/credentials").is_file() or (home / ".aws/config").is_file()


def check_qemu_vars(user_vars: dict[str, object]) -> int:
    """Refuse var-file combinations the qemu target cannot build, before anything starts.
    Returns disk_size in MiB."""
    if "base_disk" in user_vars:
        if str(user_vars.get("base_disk_checksum", "none")) == "none":
            raise NodeforgeError(
                "base_disk_checksum is required with a base_disk of your own: set it to "
                "sha256:<hex> (or sha512:<hex>) of the cloud image in the var file; the "
                "image's SHA512SUMS file publishes it"
            )
        if "kernel" in user_vars or "initrd" in user_vars:
            raise NodeforgeError(
                "kernel/initrd are set by nodeforge for its own base disk; with base_disk "
                "(a cloud image that boots with its own loader) remove them from the var file"
            )
    return disk_size_mib(str(user_vars.get("disk_size", "8G")))


def write_nocloud_seed(dest: Path, key_pub: str, name: str) -> Path:
    """The NoCloud seed Packer serves to a cloud image (see the template's -smbios)."""
    dest.mkdir(parents=True)
    (dest / "user-data").write_text(SEED_USER_DATA.format(key=key_pub.strip()))
    (dest / "meta-data").write_text(f"instance-id: {name}-build\nlocal-hostname: nodeforge-build\n")
    return dest


def disk_size_mib(value: str) -> int:
    """Packer's disk_size syntax: a number with an optional K/M/G/T suffix; bare means MiB."""
    v = str(value).strip()
    units = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
    num, unit = (v[:-1], v[-1].upper()) if v and v[-1].upper() in units else (v, "M")
    try:
        mib = int(float(num) * units[unit])
    except ValueError:
        raise NodeforgeError(
            f"disk_size {value!r} is not a size: use a number with K, M, G or T (e.g. 8G)"
        ) from None
    if mib < 1024:
        raise NodeforgeError(f"disk_size {value!r} is under 1 GiB: the image needs at least 4G")
    return mib


def make_base_disk(
    base_tar: Path, dest: Path, key_pub: str, size_mib: int, arch: str = "amd64"
) -> tuple[Path, Path, Path]:
    """A partitioned qcow2 (+ kernel, initrd) from the base tarball, reachable by the build
    key. The base has no boot loader yet (the playbook installs it; images/disk_seal.py puts
    it on the sealed disk): Packer boots its kernel directly.

    The disk is made at the full *size_mib*, root filling it (sparse: the qcow2 stays small)."""
    tree = dest / "tree"
    from .sandbox import extract

    extract(base_tar, tree)
    try:
        ssh = tree / "root/.ssh"
        ssh.mkdir(mode=0o700, parents=True, exist_ok=True)
        (ssh / "authorized_keys").write_text(key_pub)
        (ssh / "authorized_keys").chmod(0o600)
        proc.run(["ssh-keygen", "-A", "-f", tree])  # removed by the seal role in the guest
        net = tree / "etc/systemd/network/80-nodeforge-vm.network"
        net.parent.mkdir(parents=True, exist_ok=True)
        net.write_text(NETWORK_UNIT)
        proc.run(["systemctl", f"--root={tree}", "enable", "systemd-networkd.service"])
        (tree / "etc/hostname").write_text("nodeforge-build\n")
        export.write_fstab(tree)
        export.export_disk(tree, dest, size_mib=size_mib, arch=arch, loader=False)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return dest / export.DISK, dest / export.KERNEL, dest / export.INITRD


def check_target(target: str, user_vars: dict[str, object]) -> int:
    """Tools, credentials and var-file combinations, before anything starts. Returns the
    qemu disk size in MiB (0 for amazon-ebs)."""
    t = targets.get(target)
    for tool in ("packer", "ansible-playbook", "ssh-keygen", *t.tools):
        proc.require_tool(tool)
    if t.cloud and user_vars.get("encrypt_boot") is False:
        # the template's post-check that the AMI really is unencrypted (HyperPod) runs them
        proc.require_tool("jq")
        if shutil.which("aws") is None:
            from nodeforge.errors import MissingToolError

            raise MissingToolError("aws", "awscli")
    if t.cloud and not aws_credentials_present():
        raise NodeforgeError(
            "target amazon-ebs needs AWS credentials: set AWS_PROFILE (or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY) or configure ~/.aws; `nodeforge validate` checks the "
            "template without them"
        )
    return check_qemu_vars(user_vars) if t.disk else 0


def run_packer_target(inp: Inputs, reporter: Reporter, on_line) -> BuildResult:
    """Build `qemu` or `amazon-ebs` through Packer's own builder."""
    target = inp.opts.target
    size_mib = check_target(target, inp.user_vars)
    # Source AMI of --base for the artifacts' architecture: refused before anything starts.
    ami = (
        template.amazon_source(inp.user_vars, inp.base.name, inp.arch)
        if targets.get(target).cloud
        else {}
    )
    phases = Phases(reporter)
    with output_session(inp.output, reporter) as s:
        work = Path(tempfile.mkdtemp(prefix=f"nodeforge-{target}-", dir=inp.opts.cache_dir))
        run = _PackerRun(inp, phases, work, s.partial, s.logfile)
        s.on_cleanup("release mounts", run.release_mounts)  # an interrupted disk seal
        s.on_cleanup("remove work tree", run.remove_work)
        with phases.phase("preflight"):
            fetched = fetch_inputs(inp)
            wheel = build_wheel(work / "wheel", run.logfile)
        run.start_values()
        if targets.get(target).disk:
            with phases.phase("base"):
                _qemu_base(run, size_mib)
        else:
            _ami_values(run, ami, fetched)
        manifest = _render_inputs(run, fetched, wheel)
        with phases.phase("provision"):
            _provision(run, on_line)
        with phases.phase("export"):
            image = _collect_outputs(run, manifest)
            artifacts = manifest_mod.artifact_sums(run.partial)
        manifest["phases"] = dict(phases.durations)
        if image is not None:
            # Packer's run holds both: the VM's provisioning and the host-side seal.
            manifest["phases"].update(
                provision=image["phases"]["provision"], seal=image["phases"]["seal"]
            )
            manifest_mod.require_valid({**manifest, "artifacts": artifacts})
        manifest["artifacts"] = artifacts
        export.write_json_atomic(run.partial / "manifest.json", manifest)
    return BuildResult(inp.output, manifest, inp.output / "build.log")


@dataclasses.dataclass
class _PackerRun:
    """What the phases of one Packer build share: its inputs, work and output folders, log,
    and the values handed to Packer (filled in phase by phase)."""

    inp: Inputs
    phases: Phases
    work: Path
    partial: Path
    logfile: Any
    values: dict[str, object] = dataclasses.field(default_factory=dict)
    base_key: str = ""
    base_cached: bool = False

    def __post_init__(self) -> None:
        self.target = self.inp.opts.target
        self.base_key = str(self.inp.user_vars.get("base_disk", "source AMI"))

    def start_values(self) -> None:
        """The values every target hands Packer (after preflight: a missing
        ansible-playbook fails there, naming its package)."""
        self.values.update(
            playbook_file=self.inp.playbook,
            ansible_config=self.inp.ansible_cfg,
            image_name=self.inp.name,
            ansible_playbook=proc.require_tool("ansible-playbook"),
        )

    def release_mounts(self) -> None:
        release_mounts(self.work)

    def remove_work(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _qemu_base(run: _PackerRun, size_mib: int) -> None:
    """The qemu build's base disk (local: made from the cached base tree; or the user's
    cloud image with a NoCloud seed), its accelerator, and where Packer writes."""
    inp, work, values, user_vars = run.inp, run.work, run.values, run.inp.user_vars
    key = work / "build_ed25519"
    pub = session_key(key, "nodeforge-build")
    values["ssh_private_key_file"] = key
    if "base_disk" not in user_vars:
        spec = base_mod.spec_for(inp.base, inp.arch)
        tar, run.base_cached = base_mod.ensure_base(
            spec, inp.opts.cache_dir / "base", inp.base.keyring, run.logfile
        )
        run.base_key = spec.key()
        disk, kernel, initrd = make_base_disk(
            tar, work / "base", pub.read_text(), size_mib, inp.arch
        )
        values.update(base_disk=disk, kernel=kernel, initrd=initrd)
    else:
        values["seed_directory"] = write_nocloud_seed(
            work / "seed", Path(f"{key}.pub").read_text(), inp.name
        )
    if "accelerator" not in user_vars:
        kern = values.get("kernel")
        acc = probe_accel(Path(kern), Path(values["initrd"]), work) if kern else None
        values["accelerator"] = acc.accel if acc else "tcg"
        run.logfile.write(f"accelerator: {values['accelerator']}\n")
    values["output_directory"] = work / "packer-out"
    values["box_output"] = run.partial / "nodeforge-libvirt.box"
    values["console_log"] = work / "console.log"
    values["box_vagrantfile"] = BOX_VAGRANTFILE


def _ami_values(run: _PackerRun, ami: dict, fetched: Fetched) -> None:
    """The amazon-ebs build's source AMI and the tags that say what the AMI holds."""
    run.values.update(ami)  # source AMI of --base, the artifacts' architecture
    comps = {a.component: a.version for a in fetched.arts}
    # Tags carry the versions, so an AMI says what it holds.
    run.values["ami_tags"] = _hcl_map(
        {
            **{f"nodeforge:{k}": v for k, v in comps.items()},
            "nodeforge:slurm": run.inp.base.slurm,
            **dict(run.inp.user_vars.get("ami_tags", {}) or {}),
        }
    )


def _render_inputs(run: _PackerRun, fetched: Fetched, wheel: Path) -> dict:
    """Write the extra vars and the Packer template; return the manifest's header (for
    qemu also handed to the disk sealer, which Packer runs before packing the box)."""
    inp, work, values = run.inp, run.work, run.values
    ev = work / "extra-vars.json"
    ev.write_text(json.dumps(extra_vars(inp, fetched, wheel), indent=2))
    values["extra_vars_file"] = ev
    tpl = work / f"{run.target}.pkr.hcl"
    tpl.write_text(packer.render(run.target, variant=inp.opts.variant))
    manifest = manifest_header(
        inp, fetched, created=now_iso(), base_key=run.base_key, base_cached=run.base_cached
    )
    if targets.get(run.target).disk:
        stub = work / "manifest-stub.json"
        export.write_json_atomic(
            stub,
            {**manifest, "phases": {**run.phases.durations, "provision_started": time.time()}},
        )
        values["seal_command"] = shlex.join(
            [
                sys.executable,
                "-m",
                "nodeforge.images.disk_seal",
                "--disk",
                str(Path(values["output_directory"]) / "nodeforge.qcow2"),
                "--manifest-stub",
                str(stub),
                "--boot-out",
                str(run.partial),
                "--result",
                str(work / "image.json"),
            ]
        )
    return manifest


def _provision(run: _PackerRun, on_line) -> None:
    """Packer's build; a qemu build that fails says what the build VM's console showed."""
    t_packer = time.monotonic()
    try:
        packer.build(
            run.work / f"{run.target}.pkr.hcl",
            run.values,
            run.inp.opts.var_files,
            logfile=run.logfile,
            on_line=on_line,
            timeout=4 * 3600,
            cache_dir=run.inp.opts.cache_dir / "packer",
            cwd=run.work,
            kill_grace=targets.get(run.target).kill_grace,
        )
    except NodeforgeError as e:
        if not targets.get(run.target).disk:
            raise
        tail = console_tail(Path(run.values["console_log"]))
        run.logfile.write(f"--- build VM console (last lines) ---\n{tail}\n")
        waited = time.monotonic() - t_packer
        raise NodeforgeError(
            f"{e}\nbuild VM console (accelerator {run.values['accelerator']}, Packer "
            f"ran {waited:.0f}s; SSH wait limit 20m), last lines:\n{tail}"
        ) from e


def _collect_outputs(run: _PackerRun, manifest: dict) -> dict | None:
    """Move Packer's outputs into the partial output; for qemu return the sealed disk's
    image.json (and take its components, packages and disk layout into *manifest*)."""
    if not targets.get(run.target).disk:
        pm = run.work / "packer-manifest.json"
        if pm.is_file():
            shutil.move(str(pm), run.partial / "packer-manifest.json")
        return None
    # Sealed, scanned and given its image.json by images/disk_seal.py, which
    # Packer ran before packing the box.
    image = json.loads((run.work / "image.json").read_text())
    manifest.update(components=image["components"], packages=image["packages"])
    if "disk" in image:  # the layout images/disk_seal.py gave the sealed disk
        manifest["disk"] = image["disk"]
    shutil.move(
        str(Path(run.values["output_directory"]) / "nodeforge.qcow2"), run.partial / export.DISK
    )
    return image


def _hcl_map(d: dict[str, str]) -> str:
    """A -var value of type map(string)."""
    inner = ", ".join(f'"{k}" = "{v}"' for k, v in d.items())
    return "{" + inner + "}"
