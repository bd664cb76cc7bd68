"""Builds through Packer's own builders: `qemu` (a VM from a base disk) and `amazon-ebs` (an AMI).

Same playbook, same versions file and artifacts as the local target. The qemu base disk is
made here from the same cached mmdebstrap base (with a throwaway build key and DHCP on the
VM's NIC), unless the var file names a cloud image. Sealing happens in the guest (the `seal`
role); for qemu the result is then checked on the host with the same secret scanner, on the
files debugfs reads out of the built disk, before anything is published.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from nodeforge import proc
from nodeforge.errors import NodeforgeError

from . import base as base_mod
from . import export, packer, scan, varfile, versions

NETWORK_UNIT = """# nodeforge: DHCP on the VM's NIC (containers get their network from the host)
[Match]
Name=en* eth*
Virtualization=!container

[Network]
DHCP=yes
"""
SCAN_DIRS = ("etc", "root", "home", "opt", "var/lib", "var/log", "tmp", "var/tmp")


def aws_credentials_present(env: dict[str, str] | None = None) -> bool:
    env = dict(os.environ if env is None else env)
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return True
    if env.get("AWS_PROFILE") or env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return True
    home = Path(env.get("HOME", "/root"))
    return (home / ".aws/credentials").is_file() or (home / ".aws/config").is_file()


def make_base_disk(base_tar: Path, dest: Path, key_pub: str) -> tuple[Path, Path, Path]:
    """A bootable qcow2 (+ kernel, initrd) from the base tarball, reachable by the build key."""
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
        export.export_disk(tree, dest)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    return dest / export.DISK, dest / export.KERNEL, dest / export.INITRD


def scan_disk(qcow2: Path, work: Path) -> list[scan.Finding]:
    """Read the security-relevant directories out of an ext4 disk (no mount) and scan them."""
    raw = work / "scan.raw"
    out = work / "scan-tree"
    out.mkdir(parents=True)
    proc.run([proc.require_tool("qemu-img"), "convert", "-O", "raw", qcow2, raw], timeout=1800)
    try:
        for d in SCAN_DIRS:
            parent = out / Path(d).parent
            parent.mkdir(parents=True, exist_ok=True)
            proc.run(["debugfs", "-R", f"rdump /{d} {parent}", raw], check=False, timeout=600)
        return scan.scan(out)
    finally:
        raw.unlink(missing_ok=True)
        shutil.rmtree(out, ignore_errors=True)


def run_packer_target(opts, vers, base, arch: str, name: str, output: Path,
                      reporter: Callable[[str, str], None], on_line) -> dict:
    """Build `qemu` or `amazon-ebs`; returns the manifest. Caller handles output publishing."""
    from .build import Phases, _tool_versions, build_wheel, repo_paths

    target = opts.target
    for tool in ("packer", "ansible-playbook", "ssh-keygen"):
        proc.require_tool(tool)
    if target == "qemu":
        for tool in ("qemu-system-x86_64", "qemu-img", "mkfs.ext4", "debugfs"):
            proc.require_tool(tool)
    if target == "amazon-ebs" and not aws_credentials_present():
        raise NodeforgeError(
            "target amazon-ebs needs AWS credentials: set AWS_PROFILE (or AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY) or configure ~/.aws; `nodeforge validate` checks the "
            "template without them")
    user_vars: dict[str, object] = {}
    for vf in opts.var_files:
        user_vars.update(varfile.load(vf, target))
    playbook, cfg, _ = repo_paths()
    phases = Phases(reporter)
    partial = output.with_name(output.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    work = Path(tempfile.mkdtemp(prefix=f"nodeforge-{target}-", dir=opts.cache_dir))
    log_path = partial / "build.log"
    ok = False
    with open(log_path, "w", buffering=1) as logfile:
        try:
            with phases.phase("preflight"):
                tools = _tool_versions()
                arts = vers.for_arch(arch)
                art_dir = opts.cache_dir / "artifacts"
                seen = versions.fetch(arts, art_dir, mirror=opts.artifact_mirror,
                                      allow_unpinned=opts.allow_unpinned, versions_path=vers.path)
                wheel = build_wheel(work / "wheel", logfile)
            values: dict[str, object] = {
                "playbook_file": playbook, "ansible_config": cfg, "image_name": name,
                "ansible_playbook": proc.require_tool("ansible-playbook"),
            }
            if target == "qemu":
                with phases.phase("base"):
                    key = work / "build_ed25519"
                    proc.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                              "nodeforge-build", "-f", key])
                    values["ssh_private_key_file"] = key
                    if "base_disk" not in user_vars:
                        spec = base_mod.spec_for(base, arch)
                        tar, _ = base_mod.ensure_base(spec, opts.cache_dir / "base", base.keyring,
                                                      logfile)
                        disk, kernel, initrd = make_base_disk(
                            tar, work / "base", Path(f"{key}.pub").read_text())
                        values.update(base_disk=disk, kernel=kernel, initrd=initrd)
                    if "accelerator" not in user_vars:
                        from nodeforge.vm import probe_accel

                        kern = values.get("kernel")
                        acc = probe_accel(Path(kern), Path(values["initrd"]), work) if kern \
                            else None
                        values["accelerator"] = acc.accel if acc else "tcg"
                        logfile.write(f"accelerator: {values['accelerator']}\n")
                    values["output_directory"] = work / "packer-out"
                    values["box_output"] = partial / "nodeforge-libvirt.box"
            else:
                comps = {a.component: a.version for a in arts}
                # Tags carry the versions, so an AMI says what it holds.
                values["ami_tags"] = _hcl_map({
                    **{f"nodeforge:{k}": v for k, v in comps.items()},
                    "nodeforge:slurm": base.slurm,
                    **dict(user_vars.get("ami_tags", {}) or {}),
                })
            extra = {
                "nodeforge_image_name": name,
                "nodeforge_artifacts_dir": str(opts.cache_dir / "artifacts"),
                "nodeforge_artifacts": {a.name: a.file for a in arts},
                "nodeforge_wheel": str(wheel),
                "nodeforge_base": base.name,
                **dict(user_vars.get("ansible_vars", {}) or {}),
            }
            ev = work / "extra-vars.json"
            ev.write_text(json.dumps(extra, indent=2))
            values["extra_vars_file"] = ev
            tpl = work / f"{target}.pkr.hcl"
            tpl.write_text(packer.render(target))
            with phases.phase("provision"):
                packer.build(tpl, values, opts.var_files, logfile=logfile, on_line=on_line,
                             timeout=4 * 3600)
            artifacts: dict[str, dict] = {}
            with phases.phase("export"):
                if target == "qemu":
                    built = Path(values["output_directory"]) / "nodeforge.qcow2"
                    findings = scan_disk(built, work)
                    if findings:
                        raise NodeforgeError(
                            "the built disk still holds secrets or per-node identity:\n  "
                            + "\n  ".join(map(str, findings)))
                    shutil.move(str(built), partial / "disk.qcow2")
                else:
                    pm = Path("packer-manifest.json")
                    if pm.is_file():
                        shutil.move(str(pm), partial / "packer-manifest.json")
                for p in sorted(partial.iterdir()):
                    if p.is_file() and p.name != "build.log":
                        artifacts[p.name] = {"sha256": versions.sha256_file(p),
                                             "bytes": p.stat().st_size}
            manifest = {
                "schema": 1, "name": name, "target": target,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                "arch": arch,
                "base": {"name": base.name, "suite": base.suite, "mirror": base.mirror,
                         "key": str(user_vars.get("base_disk", "mmdebstrap")), "cached": False},
                "inputs": {a.name: {"component": a.component, "version": a.version,
                                    "file": a.file, "sha256": seen[a.name], "pinned": a.pinned}
                           for a in arts},
                "tools": tools, "phases": dict(phases.durations), "artifacts": artifacts,
            }
            export.write_json_atomic(partial / "manifest.json", manifest)
            ok = True
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if not ok:
                logfile.flush()
                shutil.move(log_path, output.with_name(output.name + ".failed-build.log"))
                shutil.rmtree(partial, ignore_errors=True)
    return manifest


def _hcl_map(d: dict[str, str]) -> str:
    """A -var value of type map(string)."""
    inner = ", ".join(f'"{k}" = "{v}"' for k, v in d.items())
    return "{" + inner + "}"
