"""`nodeforge validate`: `packer validate` of every target, offline, with stand-in inputs.

Required variables that only exist during a real build (the sandbox port, the throwaway key,
the extra-vars file) get harmless stand-ins made here, so validation checks the template and
the user's var files, not the presence of a build.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from nodeforge import proc

from . import packer, template, varfile
from . import targets as targets_mod
from .packer_build import BOX_VAGRANTFILE
from .pipeline import repo_paths
from .sandbox import session_key


def validate_targets(
    targets: list[str], var_files: list[Path], variant: str = "cpu"
) -> dict[str, str]:
    for target in targets:  # every refusal before the first `packer validate`
        template.check_variant(target, variant)
    playbook, cfg, _ = repo_paths()
    pv = packer.version()
    results = {}
    with tempfile.TemporaryDirectory(prefix="nodeforge-validate-") as tmp:
        t = Path(tmp)
        key = t / "stand-in-key"
        session_key(key, "validate")
        ev = t / "extra-vars.json"
        ev.write_text("{}")
        disk = t / "base.qcow2"
        disk.write_bytes(b"")
        common = {
            "playbook_file": playbook,
            "extra_vars_file": ev,
            "ansible_config": cfg,
            "ansible_playbook": proc.require_tool("ansible-playbook"),
        }
        per_target = {
            "local": {"ssh_port": 22, "ssh_private_key_file": key},
            "qemu": {
                "base_disk": disk,
                "ssh_private_key_file": key,
                "seal_command": "exit 1  # stand-in: validation never runs post-processors",
                "box_vagrantfile": BOX_VAGRANTFILE,
            },
            "amazon-ebs": {},
        }
        for target in targets:
            user_vars: dict[str, object] = {}
            for vf in var_files:
                user_vars.update(varfile.load(vf, target))
            if targets_mod.get(target).cloud:
                template.check_amazon_vars(user_vars)
            f = t / f"{target}.pkr.hcl"
            f.write_text(packer.render(target, pv, variant))
            results[target] = packer.validate(f, {**common, **per_target[target]}, var_files)
    return results
