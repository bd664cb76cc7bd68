"""The `local` target: base → nspawn sandbox → packer/ansible → seal → export → manifest.

Only what is specific to this target lives here; options, inputs, extra vars, the manifest
skeleton and the output session (partial output, logs, cleanup) are images/pipeline.py.
"""

from __future__ import annotations

import json
import os
import shutil

from nodeforge import __version__, proc

from . import base as base_mod
from . import export, packer, seal
from . import manifest as manifest_mod
from .pipeline import (
    BuildResult,
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
from .sandbox import Sandbox, extract, release_mounts


def run_local(inp: Inputs, reporter: Reporter, on_line) -> BuildResult:
    opts, name, output = inp.opts, inp.name, inp.output
    cache = opts.cache_dir
    started = now_iso()
    with output_session(output, reporter) as s:
        logfile = s.logfile
        work = cache / "work" / f"{name}-{os.getpid()}"
        if work.exists():
            release_mounts(work)
            shutil.rmtree(work)
        work.mkdir(parents=True)
        sandbox: list[Sandbox] = []  # set once the sandbox exists
        s.on_cleanup("stop sandbox", lambda: sandbox and sandbox[0].stop())
        s.on_cleanup("release mounts", lambda: release_mounts(work))
        if not opts.keep_work:
            s.on_cleanup("remove work tree", lambda: work.exists() and shutil.rmtree(work))
        phases = Phases(reporter)
        logfile.write(f"nodeforge {__version__} build {name} target={opts.target} "
                      f"base={inp.base.name}\n")
        with phases.phase("preflight"):
            fetched = fetch_inputs(inp)
            wheel = build_wheel(work / "wheel", logfile)
        with phases.phase("base"):
            spec = base_mod.spec_for(inp.base, inp.arch)
            base_tar, base_cached = base_mod.ensure_base(spec, cache / "base", inp.base.keyring,
                                                         logfile)
            tree = work / "rootfs"
            extract(base_tar, tree)
        apt_cache = cache / "apt-archives"
        (apt_cache / "partial").mkdir(parents=True, exist_ok=True)
        sandbox.append(Sandbox(tree, work, logfile, name=f"nfbuild-{os.getpid()}",
                               binds=[(apt_cache, "/var/cache/apt/archives")]))
        with phases.phase("sandbox"):
            access = sandbox[0].prepare()
            sandbox[0].start()
        with phases.phase("provision"):
            ev = work / "extra-vars.json"
            ev.write_text(json.dumps(extra_vars(inp, fetched, wheel), indent=2))
            tpl = work / "local.pkr.hcl"
            tpl.write_text(packer.render("local"))
            values = {
                "ssh_port": access.port,
                "ssh_private_key_file": access.key_file,
                "playbook_file": inp.playbook,
                "extra_vars_file": ev,
                "ansible_playbook": proc.require_tool("ansible-playbook"),
                "ansible_config": inp.ansible_cfg,
                "image_name": name,
            }
            packer.build(tpl, values, opts.var_files, logfile=logfile, on_line=on_line)
        with phases.phase("seal"):
            sandbox[0].stop()
            export.write_fstab(tree)
            seal.seal_and_scan(tree, logfile)
        with phases.phase("export"):
            manifest = manifest_mod.with_packages(
                manifest_header(inp, fetched, created=started, base_key=spec.key(),
                                base_cached=base_cached),
                export.dpkg_versions(tree))
            manifest["phases"] = dict(phases.durations)
            export.write_image_json(tree, manifest)
            export.export_rootfs(tree, s.partial / export.ROOTFS)
            export.export_disk(tree, s.partial)
        manifest["phases"] = dict(phases.durations)
        manifest["artifacts"] = manifest_mod.artifact_sums(s.partial)
        manifest_mod.require_valid(manifest)
        export.write_json_atomic(s.partial / "manifest.json", manifest)
        logfile.write(f"build complete in {sum(phases.durations.values()):.1f}s\n")
    return BuildResult(output, manifest, output / "build.log")
