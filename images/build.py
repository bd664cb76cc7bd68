"""`nodeforge build`: base → sandbox → packer/ansible → seal → export → manifest.

Everything is built under `<output>.partial` and renamed into place only when complete, so a
failed or interrupted build never leaves an artifact under the final name. The work tree,
the sandbox and its mounts are always cleaned up (also on Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nodeforge import __version__, data, proc
from nodeforge.errors import NodeforgeError

from . import agent_wheel, export, packer, seal, varfile, versions
from . import base as base_mod
from . import manifest as manifest_mod
from .sandbox import Sandbox, extract, release_mounts
from .template import TARGETS

log = logging.getLogger("nodeforge.build")

LOCAL_TOOLS = ("packer", "mmdebstrap", "systemd-nspawn", "mkfs.ext4", "qemu-img", "ssh-keygen",
               "ssh", "tar", "zstd", "dpkg-query", "ansible-playbook")


@dataclass
class BuildOptions:
    target: str = "local"
    base: str | None = None
    var_files: list[Path] = field(default_factory=list)
    artifact_mirror: str | None = None
    allow_unpinned: bool = False
    output: Path | None = None
    cache_dir: Path = Path("/var/cache/nodeforge")
    name: str | None = None
    versions_file: Path | None = None
    keep_work: bool = False
    playbook: Path | None = None  # default images/site.yml; tests provision with smaller ones


@dataclass
class BuildResult:
    output: Path
    manifest: dict
    log_file: Path


class Phases:
    """Times each phase and reports it (to rich progress, or plain lines)."""

    def __init__(self, reporter: Callable[[str, str], None]):
        self.durations: dict[str, float] = {}
        self.report = reporter

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.report(name, "start")
        t0 = time.monotonic()
        try:
            yield
        except BaseException:
            self.durations[name] = round(time.monotonic() - t0, 2)
            self.report(name, "failed")
            raise
        self.durations[name] = round(time.monotonic() - t0, 2)
        self.report(name, f"done {self.durations[name]:.1f}s")


def repo_paths(need_playbook: bool = True) -> tuple[Path, Path, Path]:
    """site.yml, ansible.cfg and roles/: in the checkout, or the installed wheel's copies."""
    playbook = Path(__file__).resolve().with_name("site.yml")
    if need_playbook and not playbook.is_file():
        raise NodeforgeError(f"{playbook} not found; reinstall nodeforge")
    return playbook, data.path("ansible.cfg"), data.path("roles")


def _tool_versions() -> dict[str, str]:
    out = {"nodeforge": __version__, "packer": str(packer.version())}
    cp = proc.run([proc.require_tool("ansible-playbook"), "--version"], check=False)
    first = cp.stdout.splitlines()[0] if cp.stdout else ""
    out["ansible-core"] = first.split("core ")[-1].rstrip("]") if "core" in first else first
    mm = proc.run([proc.require_tool("mmdebstrap"), "--version"], check=False).stdout.strip()
    out["mmdebstrap"] = mm.split()[-1] if mm else "unknown"
    return out


def build_wheel(dest: Path, logfile) -> Path:
    """The agent installed into the image: this nodeforge's core, bootstrap and gang, as a
    wheel (no lab, no images, no build data), from a checkout or an installed wheel alike."""
    wheel = agent_wheel.write(dest)
    logfile.write(f"agent wheel {wheel.name}: {wheel.stat().st_size} bytes\n")
    return wheel


def preflight(opts: BuildOptions) -> None:
    if opts.target not in TARGETS:
        raise NodeforgeError(f"unknown target '{opts.target}'; choose one of: {', '.join(TARGETS)}")
    if opts.playbook is not None and not opts.playbook.is_file():
        raise NodeforgeError(f"--playbook {opts.playbook}: no such file")
    if opts.target == "qemu" and os.geteuid() != 0:
        raise NodeforgeError(
            "the qemu target needs root (the base disk is made with real ownership and the "
            "built disk is loop-mounted to seal it); run it with sudo")
    if opts.target != "local":
        return  # remote.run_packer_target checks its own tools and credentials
    for tool in LOCAL_TOOLS:
        proc.require_tool(tool)
    if os.geteuid() != 0:
        raise NodeforgeError(
            "the local target needs root (mmdebstrap, systemd-nspawn and mkfs.ext4 -d with "
            "real ownership); run it with sudo"
        )


def run_build(opts: BuildOptions, reporter: Callable[[str, str], None],
              on_line: Callable[[str], None] | None = None) -> BuildResult:
    preflight(opts)
    vers = versions.load(opts.versions_file)
    base = vers.base(opts.base)
    arch = base_mod.host_arch()
    name = opts.name or f"nodeforge-{base.name}-{arch}"
    output = (opts.output or Path("output") / opts.target).resolve()
    user_vars: dict[str, object] = {}
    for vf in opts.var_files:
        user_vars.update(varfile.load(vf, opts.target))
    playbook, ansible_cfg, _ = repo_paths(need_playbook=opts.playbook is None)
    playbook = opts.playbook or playbook

    if opts.target != "local":
        from .remote import run_packer_target

        def _term(signum, frame):  # SIGTERM takes the Ctrl-C path: Packer stops its VM
            raise KeyboardInterrupt

        old_term = signal.signal(signal.SIGTERM, _term)
        try:
            m = run_packer_target(opts, vers, base, arch, name, output, reporter, on_line)
        finally:
            signal.signal(signal.SIGTERM, old_term)
        _publish(output.with_name(output.name + ".partial"), output)
        return BuildResult(output, m, output / "build.log")

    partial = output.with_name(output.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)  # a leftover of an earlier interrupted build
    partial.mkdir(parents=True)
    cache = opts.cache_dir
    work = cache / "work" / f"{name}-{os.getpid()}"
    if work.exists():
        release_mounts(work)
        shutil.rmtree(work)
    work.mkdir(parents=True)
    log_path = partial / "build.log"
    logfile = open(log_path, "w", buffering=1)
    phases = Phases(reporter)
    sandbox: Sandbox | None = None
    started = dt.datetime.now(dt.UTC)

    def _sigterm(signum, frame):  # turn SIGTERM into the same cleanup path as Ctrl-C
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, _sigterm)
    failure: BaseException | None = None
    try:
        logfile.write(f"nodeforge {__version__} build {name} target={opts.target} base={base.name}\n")
        with phases.phase("preflight"):
            tools = _tool_versions()
            arts = vers.for_arch(arch)
            art_dir = cache / "artifacts"
            seen = versions.fetch(arts, art_dir, mirror=opts.artifact_mirror,
                                  allow_unpinned=opts.allow_unpinned, versions_path=vers.path)
            wheel = build_wheel(work / "wheel", logfile)
        with phases.phase("base"):
            spec = base_mod.spec_for(base, arch)
            base_tar, base_cached = base_mod.ensure_base(spec, cache / "base", base.keyring, logfile)
            tree = work / "rootfs"
            extract(base_tar, tree)
        apt_cache = cache / "apt-archives"
        (apt_cache / "partial").mkdir(parents=True, exist_ok=True)
        sandbox = Sandbox(tree, work, logfile, name=f"nfbuild-{os.getpid()}",
                          binds=[(apt_cache, "/var/cache/apt/archives")])
        with phases.phase("sandbox"):
            access = sandbox.prepare()
            sandbox.start()
        with phases.phase("provision"):
            extra_vars = {
                "nodeforge_image_name": name,
                "nodeforge_artifacts_dir": str(art_dir),
                "nodeforge_artifacts": {a.name: a.file for a in arts},
                "nodeforge_wheel": str(wheel),
                "nodeforge_base": base.name,
                **dict(user_vars.get("ansible_vars", {}) or {}),
            }
            ev = work / "extra-vars.json"
            ev.write_text(json.dumps(extra_vars, indent=2))
            tpl = work / "local.pkr.hcl"
            tpl.write_text(packer.render("local"))
            values = {
                "ssh_port": access.port,
                "ssh_private_key_file": access.key_file,
                "playbook_file": playbook,
                "extra_vars_file": ev,
                "ansible_playbook": proc.require_tool("ansible-playbook"),
                "ansible_config": ansible_cfg,
                "image_name": name,
            }
            packer.build(tpl, values, opts.var_files, logfile=logfile, on_line=on_line)
        with phases.phase("seal"):
            sandbox.stop()
            export.write_fstab(tree)
            seal.seal_and_scan(tree, logfile)
        with phases.phase("export"):
            manifest = manifest_mod.with_packages(manifest_mod.header(
                name=name, target=opts.target, created=started.isoformat(timespec="seconds"),
                arch=arch, base=base, base_key=spec.key(), base_cached=base_cached, arts=arts,
                seen=seen, tools=tools), export.dpkg_versions(tree))
            manifest["phases"] = dict(phases.durations)
            export.write_image_json(tree, manifest)
            export.export_rootfs(tree, partial / export.ROOTFS)
            export.export_disk(tree, partial)
        manifest["phases"] = dict(phases.durations)
        manifest["artifacts"] = manifest_mod.artifact_sums(partial)
        manifest_mod.require_valid(manifest)
        export.write_json_atomic(partial / "manifest.json", manifest)
        logfile.write(f"build complete in {sum(phases.durations.values()):.1f}s\n")
        logfile.close()
        _publish(partial, output)
        return BuildResult(output, manifest, output / "build.log")
    except BaseException as exc:
        failure = exc
        raise
    finally:
        # Cleanup must finish even if the operator presses Ctrl-C again or stderr is gone.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _cleanup(sandbox, work, opts.keep_work, failure, logfile, log_path, output, partial,
                     reporter)
        finally:
            signal.signal(signal.SIGTERM, old_term)
            signal.signal(signal.SIGINT, old_int)


def _cleanup(sandbox, work, keep_work, failure, logfile, log_path, output, partial,
             reporter) -> None:
    ok = failure is None
    steps: list[tuple[str, Callable[[], object]]] = []
    if sandbox is not None:
        steps.append(("stop sandbox", sandbox.stop))
    steps.append(("release mounts", lambda: release_mounts(work)))
    if not keep_work:
        steps.append(("remove work tree", lambda: work.exists() and shutil.rmtree(work)))
    failed_log = output.with_name(output.name + ".failed-build.log")
    if not ok:

        def keep_log():
            if not logfile.closed:
                logfile.write(f"build FAILED: {type(failure).__name__}: {failure}\n")
                logfile.close()
            if log_path.exists():
                shutil.move(log_path, failed_log)

        steps.append(("keep the build log", keep_log))
        steps.append(("remove partial output", lambda: shutil.rmtree(partial, ignore_errors=True)))
    problems = []
    for what, fn in steps:
        try:
            fn()
        except Exception as e:  # keep going: every other cleanup step must still run
            problems.append(f"{what}: {e}")
            log.error("cleanup step '%s' failed: %s", what, e)
    if not ok:
        try:
            reporter("build", f"failed; full log: {failed_log}")
        except OSError:
            pass  # stderr closed (e.g. the caller went away); the log file has it all
    if problems:
        raise NodeforgeError("cleanup after the build was incomplete: " + "; ".join(problems))


def _publish(partial: Path, output: Path) -> None:
    """Swap the finished build into place; an older build under that name is replaced whole."""
    old = output.with_name(output.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if output.exists():
        os.replace(output, old)
    os.replace(partial, output)
    if old.exists():
        shutil.rmtree(old)
    stale = output.with_name(output.name + ".failed-build.log")
    stale.unlink(missing_ok=True)
