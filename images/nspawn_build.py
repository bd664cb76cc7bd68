"""The `local` target: base → nspawn sandbox → packer/ansible → seal → export → manifest.

With the layered cache (images/cache.py): the install pass runs in role groups
(cache.ROLE_GROUPS), each group's result one cached layer over the previous group's.
- no input changed (same build key as the published output, its artifacts intact): the
  published build is reported as it is, in seconds (`--force` rebuilds);
- every group's layer cached: the layers are the read-only lower dirs of an overlay mount;
  the roles whose templates, configuration variables or agent changed since the last layer
  was made are applied again by one pass of the playbook (they install nothing), and with
  none changed the sandbox is not even booted; then seal and export;
- the first groups cached (an install input of a later group changed, e.g. docker_source):
  the build resumes over them: each later group's pass (with the cached groups' roles whose
  configuration changed) runs in the overlay, and its upper dir becomes that group's layer;
- nothing cached: the base is provisioned with the first group's roles, that tree moves
  into the cache (temp name, then rename), and the later groups follow as above.
A reused layer's content is verified meanwhile; nothing made over it is kept unless its
digest matched (else it is dropped with the layers over it and the build starts again).

Sealing is the post-stop sealer's (images/seal.py) over the stopped tree: it applies the
whole sealed-items list (images/sealed.yaml), which covers everything the Ansible seal role
removes, and the scanner then proves nothing on that list is left. The seal role is for the
targets without a post-stop step; here it would only add a boot and ~20 round trips.

Only what is specific to this target lives here; options, inputs, extra vars, the manifest
skeleton and the output session (partial output, logs, cleanup) are images/pipeline.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from nodeforge import __version__, data, proc
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import swap_dir
from nodeforge.images import build_proc

from . import ansible_strategy, cache, export, packer, seal, template, versions
from . import base as base_mod
from . import manifest as manifest_mod
from .pipeline import (
    REPO_ROOT,
    BuildResult,
    Fetched,
    Inputs,
    Phases,
    Reporter,
    build_wheel,
    extra_vars,
    manifest_header,
    now_iso,
    output_session,
    tool_versions,
)
from .sandbox import Sandbox, extract, release_mounts

# Ansible tag selections (passed through Packer's environment) for the cache's passes:
# every role in images/site.yml is tagged with its name. No pass runs the seal role: the
# post-stop sealer applies the whole sealed-items list to the stopped tree.
PASS_INSTALL = {"ANSIBLE_SKIP_TAGS": "seal"}


# Facts gathered by a pass over a cached layer (images/site.yml's first play): the minimal
# set holds what the roles read (distribution, architecture, service and package managers);
# the hardware and network facts were the slowest task of a config-only rebuild (~3 s).
REAPPLY_GATHER_SUBSET = "min"


class Unusable(Exception):
    """A reused layer failed its content check: it is dropped, the build starts again."""

    def __init__(self, layer: cache.Layer, problem: str):
        super().__init__(problem)
        self.layer, self.problem = layer, problem


def pass_roles(roles: list[str] | None) -> dict[str, str]:
    """The pass that applies *roles* again (None: every role) over a cached layer."""
    return PASS_INSTALL if roles is None else {"ANSIBLE_RUN_TAGS": ",".join(roles)}


def playbook_roles(playbook: Path) -> list[str] | None:
    """The roles of *playbook* in order, or None unless each one is tagged with its own
    name (a pass could not select it by tag)."""
    import yaml

    try:
        plays = yaml.safe_load(playbook.read_text())
        roles = [r for play in plays for r in play.get("roles", [])]
        if all(isinstance(r, dict) and r.get("tags") == [r.get("role")] for r in roles):
            return [r["role"] for r in roles if r["role"] != "seal"]
    except (OSError, yaml.YAMLError, AttributeError, TypeError):
        pass
    return None


def build_groups(roles: list[str] | None) -> tuple[cache.RoleGroup, ...]:
    """The install pass's groups (cache.ROLE_GROUPS) when they are the playbook's roles in
    its order; else one group of every role (a pass could not select a group by tag)."""
    if roles is not None and [r for g in cache.ROLE_GROUPS for r in g.roles] == roles:
        return cache.ROLE_GROUPS
    return (cache.RoleGroup("all", tuple(roles or ())),)


def build_keys(
    inp: Inputs,
    base_key: str,
    seen: dict[str, str],
    groups: tuple[cache.RoleGroup, ...] | None = None,
) -> tuple[cache.LayerInputs, str]:
    """(layer inputs, build key) of this build."""
    if groups is None:
        groups = build_groups(playbook_roles(inp.playbook))
    li = cache.layer_inputs(
        base_key=base_key,
        roles_dir=data.path("roles"),
        playbook=inp.playbook,
        versions_file=inp.vers.path,
        artifacts=seen,
        ansible_vars=inp.ansible_vars,
        groups=groups,
    )
    bk = cache.build_key(
        layer_key=li.key(),
        repo=REPO_ROOT,
        playbook=inp.playbook,
        user_vars=inp.user_vars,
        options={
            "target": inp.opts.target,
            "name": inp.name,
            "base": inp.base.name,
            "arch": inp.arch,
            "variant": inp.opts.variant,
        },
    )
    return li, bk


def published_unchanged(output: Path, build_key: str) -> dict | None:
    """The manifest of the build published at *output* when it has *build_key* and every
    artifact still has the sha256 the manifest records; else None."""
    try:
        m = json.loads((output / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or (m.get("cache") or {}).get("build_key") != build_key:
        return None
    arts = m.get("artifacts")
    if not isinstance(arts, dict) or not arts:
        return None
    for name, a in arts.items():
        f = output / name
        if (
            not f.is_file()
            or f.stat().st_size != a.get("bytes")
            or versions.sha256_file(f) != a.get("sha256")
        ):
            return None
    return m


# Fixed overlayfs features, whatever the host's defaults: an upper dir becomes a cached
# layer and later a lower dir of other mounts, so it must hold nothing that ties it to this
# mount (no inode index, no metadata-only copy-ups, no directory redirects: a renamed lower
# dir is copied up whole).
OVERLAY_OPTIONS = "index=off,metacopy=off,redirect_dir=off"
OVERLAY_PATH_BAD = re.compile(r"[,:\\\x00-\x1f]")


def mount_overlay(lowers: list[Path], work: Path) -> Path:
    """The layers as read-only lower dirs (topmost first: a later group's diff over the
    earlier ones), this build's changes in work/upper: the merged tree at work/rootfs
    (unmounted by the session's release-mounts step)."""
    upper, scratch, merged = work / "upper", work / "overlay-work", work / "rootfs"
    for d in (*lowers, upper, scratch):
        if OVERLAY_PATH_BAD.search(str(d)):
            raise NodeforgeError(
                f"the build cache path {d} has a ',', ':' or '\\' (overlayfs mount options "
                "cannot hold them); pass a --cache-dir without them"
            )
    for d in (upper, scratch, merged):
        d.mkdir(parents=True, exist_ok=True)
    proc.run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={':'.join(str(p) for p in lowers)},upperdir={upper},workdir={scratch},"
            + OVERLAY_OPTIONS,
            merged,
        ],
        hint="the layered build cache needs overlayfs (modprobe overlay); "
        "or build with another --cache-dir on a local filesystem",
    )
    return merged


def run_local(inp: Inputs, reporter: Reporter, on_line) -> BuildResult:
    """Build the `local` target: the published build when no input changed, else preflight,
    the install passes over the layered cache, seal and export (one method a phase)."""
    spec = base_mod.spec_for(inp.base, inp.arch, inp.opts.variant)
    if not inp.opts.force:
        reused = _published_build(inp, spec, reporter)
        if reused is not None:
            return reused
    started = now_iso()
    with output_session(inp.output, reporter) as s:
        build = _LocalBuild(inp, spec, reporter, on_line, s)
        build.preflight()
        build.install()
        build.seal()
        manifest = build.export(started)
        build.record(manifest)
    return BuildResult(inp.output, manifest, inp.output / "build.log")


def _fetch(inp: Inputs) -> dict[str, str]:
    return versions.fetch(
        inp.vers.for_arch(inp.arch, inp.opts.variant),
        inp.art_dir,
        mirror=inp.opts.artifact_mirror,
        allow_unpinned=inp.opts.allow_unpinned,
        versions_path=inp.vers.path,
    )


def _published_build(
    inp: Inputs, spec: base_mod.BaseSpec, reporter: Reporter
) -> BuildResult | None:
    """The build published at the output, when its build key is this build's (no input
    changed) and its artifacts are intact; else None."""
    try:
        seen = _fetch(inp)
    except NodeforgeError:
        return None  # fails again inside the session: its log is kept
    m = published_unchanged(inp.output, build_keys(inp, spec.key(), seen)[1])
    if m is None:
        return None
    reporter("cache", f"no input changed: {inp.output} is this build (--force rebuilds)")
    return BuildResult(inp.output, m, inp.output / "build.log", reused=True)


class _LocalBuild:
    """One `local` build inside its output session: the state the phases share, and one
    method a phase or step. Cleanups are registered on the session as they are set up."""

    def __init__(
        self, inp: Inputs, spec: base_mod.BaseSpec, reporter: Reporter, on_line, s
    ) -> None:
        self.inp, self.reporter, self.on_line, self.s = inp, reporter, on_line, s
        self.opts, self.logfile = inp.opts, s.logfile
        self.spec = spec
        self.arts = inp.vers.for_arch(inp.arch, inp.opts.variant)
        self.work = self.opts.cache_dir / "work" / f"{inp.name}-{os.getpid()}"
        if self.work.exists():
            release_mounts(self.work)
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True)
        self.sandbox: list[Sandbox] = []  # the sandbox of the current pass, once it exists
        s.on_cleanup("stop sandbox", self._stop_sandbox)
        s.on_cleanup("release mounts", self._release_mounts)
        if not self.opts.keep_work:
            s.on_cleanup("remove work tree", self._remove_work)
        self.store = cache.LayerStore(self.opts.cache_dir, log=self._cache_log)
        # An interrupted layer write (only this build's, under the lock) is no entry: drop it.
        s.on_cleanup("drop an unfinished layer", self.store.drop_unfinished)
        # Tool versions (three programs started) and the Packer template (`packer fmt`) take
        # seconds on a loaded machine and nothing waits for them until provision or the
        # manifest: they run beside the layer's verification.
        for tool in ("packer", "ansible-playbook", "mmdebstrap"):
            proc.require_tool(tool)  # a missing tool fails now, naming its package
        # Every ansible-playbook run uses Mitogen's strategy (images/ansible_strategy.py); a
        # missing mitogen package fails now, naming it.
        self.strategy_env = ansible_strategy.strategy_env()
        # The third worker verifies a reused layer's content while it is already mounted,
        # booted and provisioned (see "verify" below).
        self.background = ThreadPoolExecutor(max_workers=3, thread_name_prefix="background")
        self.stopping = threading.Event()
        s.on_cleanup("finish background work", self._finish_background)
        self.phases = Phases(reporter)
        self.tools_job = self.background.submit(tool_versions)
        self.template_job = self.background.submit(packer.render, "local", None, self.opts.variant)
        self.tpl = self.work / "local.pkr.hcl"
        self.apt_cache = self.opts.cache_dir / "apt-archives"
        self.tree = self.work / "rootfs"
        self.base_cached = True
        self.chain: list[cache.Layer] = []  # the layers under the merged tree, first group first
        self.verify_jobs: dict[str, Future] = {}  # a reused layer's content check, by key
        self.reused = 0
        self.reapplied: list[str] | None = []
        self.logfile.write(
            f"nodeforge {__version__} build {inp.name} target={self.opts.target} "
            f"base={inp.base.name}\n"
        )

    # -- cleanups (registered on the session)
    def _stop_sandbox(self) -> None:
        if self.sandbox:
            self.sandbox[-1].stop()

    def _release_mounts(self) -> None:
        release_mounts(self.work)

    def _remove_work(self) -> None:
        if self.work.exists():
            shutil.rmtree(self.work)

    def _finish_background(self) -> None:
        self.stopping.set()
        self.background.shutdown(cancel_futures=True)

    def _cache_log(self, msg: str) -> None:
        self.logfile.write(msg + "\n")
        self.reporter("cache", msg)

    def _timed(self, name: str, fn, *args):
        with self.phases.step(name):
            return fn(*args)

    # -- preflight
    def preflight(self) -> None:
        inp = self.inp
        with self.phases.phase("preflight"):
            seen = _fetch(inp)
            self.roles = playbook_roles(inp.playbook)
            self.groups = build_groups(self.roles)
            self.all_roles = [r for g in self.groups for r in g.roles]
            self.layer_in, self.bkey = build_keys(inp, self.spec.key(), seen, self.groups)
            self.keys, self.lkey = self.layer_in.keys(), self.layer_in.key()
            self.config = cache.config_inputs(
                roles_dir=data.path("roles"), repo=REPO_ROOT, ansible_vars=inp.ansible_vars
            )
            self.logfile.write(f"cache keys: layers {' '.join(self.keys)} build {self.bkey}\n")
            self.fetched = Fetched({}, self.arts, seen)  # tools: from tools_job, for the manifest
            wheel = cached_wheel(
                self.opts.cache_dir / "wheels",
                cache.sources_digest(REPO_ROOT),
                self.work,
                self.logfile,
            )
            self.ev = self.work / "extra-vars.json"
            self.ev.write_text(json.dumps(extra_vars(inp, self.fetched, wheel), indent=2))
        (self.apt_cache / "partial").mkdir(parents=True, exist_ok=True)
        self.values: dict[str, object] = {
            "playbook_file": inp.playbook,
            "extra_vars_file": self.ev,
            "ansible_playbook": proc.require_tool("ansible-playbook"),
            "ansible_config": inp.ansible_cfg,
            "image_name": inp.name,
        }

    # -- the sandbox and the passes in it
    def boot(self) -> None:
        sb = Sandbox(
            self.tree,
            self.work,
            self.logfile,
            name=f"nfbuild-{os.getpid()}",
            binds=[(self.apt_cache, "/var/cache/apt/archives")],
        )
        self.sandbox.append(sb)
        with self.phases.step("sandbox.prepare"):
            access = sb.prepare()
        with self.phases.step("sandbox.boot"):
            sb.start()
        self.values.update(ssh_port=access.port, ssh_private_key_file=access.key_file)

    def provision(self, env: dict[str, str]) -> None:
        self.logfile.write(f"provision pass: {env or 'all tags'}\n")
        if not self.tpl.exists():
            self.tpl.write_text(self.template_job.result())
        packer.build(
            self.tpl,
            self.values,
            self.opts.var_files,
            logfile=self.logfile,
            on_line=self.on_line,
            ansible_env={**self.strategy_env, **env},
        )

    def reapply(self, env: dict[str, str], gather_subset: str = REAPPLY_GATHER_SUBSET) -> None:
        """A pass over the cached layer: ansible-playbook straight at the sandbox, which
        has already answered SSH, with what Packer's ansible provisioner passes
        (images/template.py: playbook, extra vars, config, environment, user root, the
        build's SSH key). Packer's start-up and SSH wait would add seconds, nothing else."""
        logfile, values = self.logfile, self.values
        logfile.write(f"re-apply pass: {env}\n")
        inventory = self.work / "inventory"
        inventory.write_text(
            f"default ansible_host=127.0.0.1 ansible_port={values['ssh_port']} ansible_user=root\n"
        )
        build_proc.stream(
            [
                proc.require_tool("ansible-playbook"),
                "-i",
                inventory,
                "--ssh-extra-args=-o IdentitiesOnly=yes",
                "-e",
                f"ansible_ssh_private_key_file={values['ssh_private_key_file']}",
                "--extra-vars",
                f"@{self.ev}",
                "--extra-vars",
                json.dumps({"nodeforge_gather_subset": gather_subset}),
                self.inp.playbook,
            ],
            logfile=logfile,
            on_line=self.on_line,
            env={
                "ANSIBLE_CONFIG": str(self.inp.ansible_cfg),
                **template.ANSIBLE_ENV,
                **self.strategy_env,
                **env,
            },
            timeout=3600,
            hint=f"the full Ansible output is in {getattr(logfile, 'name', 'the build log')}",
        )

    # -- the layered cache
    def mount_chain(self) -> None:
        mount_overlay([layer.tree for layer in reversed(self.chain)], self.work)

    def require_verified(self) -> None:
        """Wait for the content checks of the reused layers: nothing made over a layer
        is kept unless its digest matched (raises Unusable for the first that did not)."""
        for layer in self.chain:
            job = self.verify_jobs.get(layer.key)
            problem = job.result() if job is not None else ""
            if problem:
                raise Unusable(layer, problem)

    def group_pass(self, i: int, again: list[str] | None) -> dict[str, str]:
        """Ansible's tags for the pass of group *i*: its roles, plus *again* (roles of
        the cached groups whose configuration changed; None: all of them). Skip-tags,
        so that the untagged pre-task checks run in every install pass."""
        run = set(self.groups[i].roles)
        run.update(r for g in self.groups[:i] for r in g.roles if again is None or r in again)
        skip = ["seal", *(r for r in self.all_roles if r not in run)]
        return {"ANSIBLE_SKIP_TAGS": ",".join(skip)}

    def make_base(self) -> None:
        with self.phases.phase("base"):
            base_tar, self.base_cached = base_mod.ensure_base(
                self.spec, self.opts.cache_dir / "base", self.inp.base.keyring, self.logfile
            )
            extract(base_tar, self.tree)

    def make_layers(self, again: list[str] | None) -> None:
        """Run the install pass for each group past the cached ones, storing each
        group's result as a layer over the previous one (the first: the whole tree)."""
        if not self.chain:
            self.make_base()
        for i in range(len(self.chain), len(self.groups)):
            g = self.groups[i]
            with self.phases.phase("sandbox"):
                self.boot()
            with self.phases.phase("provision"), self.phases.step(f"provision.{g.name}"):
                env = self.group_pass(i, again if i == len(self.chain) else [])
                if i == 0:
                    self.provision(env)
                else:  # the sandbox answered SSH already: no Packer start-up again
                    self.reapply(env, gather_subset="all")
            with self.phases.phase("layer"):
                self.sandbox[-1].stop()
                with self.phases.step(f"layer.store_{g.name}"):
                    self.chain.append(self.store_layer(i))
                self.mount_chain()
        self.store.prune(self.opts.cache_max_bytes, keep=[layer.key for layer in self.chain])

    def store_layer(self, i: int) -> cache.Layer:
        """Group *i*'s result as a cached layer: the whole tree for the first group, the
        overlay's upper dir over the previous layer for the others."""
        if not self.chain:
            return self.store.store(self.keys[0], self.tree, self.layer_in.prefixes[0], self.config)
        self.require_verified()
        release_mounts(self.work)  # the overlay: its upper dir is the layer
        made = self.store.store(
            self.keys[i],
            self.work / "upper",
            self.layer_in.prefixes[i],
            self.config,
            parent=self.chain[-1].key,
        )
        shutil.rmtree(self.work / "overlay-work")
        return made

    def open_layers(self) -> None:
        """Open the cached layers of this build's keys, start their content checks and
        mount them."""
        with self.phases.phase("base"):
            self.store.drop_unfinished()
            with self.phases.step("base.open_layers"):
                self.chain = self.store.open_chain(self.keys)
            self.reused = reused = len(self.chain)
            if not self.chain:
                return
            self.reporter(
                "cache",
                f"reusing {self.groups[reused - 1].name} layer {self.keys[reused - 1][:16]} "
                f"({reused} of {len(self.groups)} groups; content verified meanwhile)",
            )
            for layer in self.chain:
                if layer.key not in self.verify_jobs:
                    self.verify_jobs[layer.key] = self.background.submit(
                        self._timed, "verify.digest", self.store.verify, layer, self.stopping.is_set
                    )
            with self.phases.step("base.mount_layers"):
                self.mount_chain()

    def reapply_over_layers(self) -> None:
        """Every group's layer is cached: re-apply the roles whose configuration changed."""
        self.reapplied = (
            None
            if self.roles is None
            else cache.roles_to_reapply(self.chain[-1].config, self.config, self.all_roles)
        )
        self.reporter(
            "cache",
            "re-applying "
            + ("every role" if self.reapplied is None else ", ".join(self.reapplied) or "no role")
            + " over the layer, then seal",
        )
        if self.reapplied == []:
            self.phases.skip("sandbox", "no role to re-apply over the layer")
            self.phases.skip("provision", "no role to re-apply over the layer")
            return
        with self.phases.phase("sandbox"):
            self.boot()
        with self.phases.phase("provision"):
            self.reapply(pass_roles(self.reapplied))

    def resume_layers(self) -> None:
        """Some groups' layers are cached (or none): build the rest over them."""
        # The cached groups' roles whose configuration changed run again in the first pass,
        # so the new layer holds this build's configuration.
        done = [r for g in self.groups[: self.reused] for r in g.roles]
        self.reapplied = (
            []
            if not self.chain
            else cache.roles_to_reapply(
                self.chain[-1].config, self.config, self.all_roles, among=done
            )
        )
        self.make_layers(self.reapplied)

    def drop_unusable(self, bad: Unusable) -> None:
        """A reused layer failed its content check: drop it with every layer over it and
        what was made over it, so the build starts again after the layers that remain."""
        if self.sandbox:
            self.sandbox[-1].stop()
        release_mounts(self.work)
        # Its check (and any of a layer over it) is stale once it is rebuilt.
        for key in [bad.layer.key, *self.store.descendants(bad.layer.key)]:
            self.verify_jobs.pop(key, None)
        self.store.drop(bad.layer, bad.problem)
        for d in ("upper", "overlay-work", "rootfs"):
            if (self.work / d).exists():
                shutil.rmtree(self.work / d)

    def install(self) -> None:
        """The install passes over the layered cache, until every layer used is verified
        (bounded: one more try than there are groups)."""
        for _attempt in range(len(self.groups) + 1):
            try:
                self.open_layers()
                if self.reused == len(self.groups):
                    self.reapply_over_layers()
                else:
                    self.resume_layers()
                # Nothing made from a reused layer is kept unless its content digest matched:
                # a corrupt or altered layer is dropped here (with every layer over it) and
                # this build starts again after the layers that remain, never sealing or
                # exporting what was made over it.
                with self.phases.phase("verify"):
                    self.require_verified()
                return
            except Unusable as bad:
                self.drop_unusable(bad)
        raise NodeforgeError("internal: the build cache kept failing verification")

    # -- seal and export
    def seal(self) -> None:
        with self.phases.phase("seal"):
            if self.sandbox:
                with self.phases.step("seal.stop_sandbox"):
                    self.sandbox[-1].stop()
            export.write_fstab(self.tree)
            with self.phases.step("seal.seal_and_scan"):
                seal.seal_and_scan(self.tree, self.logfile)

    def export(self, started: str) -> dict:
        inp, phases, tree = self.inp, self.phases, self.tree
        with phases.phase("export"):
            with phases.step("export.tool_versions"):
                self.fetched.tools = {
                    **self.tools_job.result(),
                    **ansible_strategy.tool_versions(),
                }
            with phases.step("export.packages"):
                pkgs = export.dpkg_versions(tree)
            manifest = manifest_mod.with_packages(
                manifest_header(
                    inp,
                    self.fetched,
                    created=started,
                    base_key=self.spec.key(),
                    base_cached=self.base_cached,
                ),
                pkgs,
            )
            if (
                inp.opts.variant == "gpu"
            ):  # driver, module and kernel versions the gpu role recorded
                manifest["gpu"] = json.loads((tree / "etc/nodeforge/gpu.json").read_text())
            manifest["phases"] = dict(phases.durations)
            export.write_image_json(tree, manifest)
            self.sums, manifest["disk"] = export_parallel(
                tree, self.s.partial, phases.step, arch=inp.arch, logfile=self.logfile
            )
        return manifest

    def record(self, manifest: dict) -> None:
        """The manifest's phases, steps, cache and artifacts, written into the output."""
        groups, reused, phases = self.groups, self.reused, self.phases
        manifest["phases"] = dict(phases.durations)
        manifest["steps"] = dict(phases.steps)
        manifest["cache"] = {
            "build_key": self.bkey,
            "layer_key": self.lkey,
            "layer_reused": reused == len(groups),
            # the last group whose cached layer this build resumed after (None: from the base)
            "prefix_reused": groups[reused - 1].name if reused else None,
            "layers": [
                {"group": g.name, "key": k, "reused": i < reused}
                for i, (g, k) in enumerate(zip(groups, self.keys, strict=True))
            ],
            "reapplied": "all" if self.reapplied is None else self.reapplied,
        }
        manifest["artifacts"] = manifest_mod.artifact_sums(self.s.partial, known=self.sums)
        manifest_mod.require_valid(manifest)
        export.write_json_atomic(self.s.partial / "manifest.json", manifest)
        self.logfile.write(f"build complete in {sum(phases.durations.values()):.1f}s\n")


def cached_wheel(wheels: Path, sources: str, work: Path, logfile) -> Path:
    """The agent wheel of these sources: built once per digest of the checkout's sources (into the work dir,
    then renamed into the cache whole, so an interrupted build leaves no half wheel)."""
    if not cache.KEY_RE.fullmatch(sources):
        raise NodeforgeError(f"internal: bad sources digest {sources!r}")
    d = wheels / sources
    found = sorted(d.glob("nodeforge-*.whl")) if d.is_dir() else []
    if found:
        logfile.write(f"agent wheel: reusing {found[-1]}\n")
        return found[-1]
    built = build_wheel(work / "wheel", logfile)
    wheels.mkdir(parents=True, exist_ok=True)
    swap_dir(built.parent, d, old=wheels / f".{sources}.old")
    return d / built.name


def export_parallel(
    tree: Path,
    dest: Path,
    step: export.Step = export.no_step,
    *,
    arch: str = "amd64",
    logfile=None,
) -> tuple[dict[str, dict], dict]:
    """The rootfs archive (zstd on all cores) and the disk image are made at the same time:
    both only read the sealed tree. Each job then sums its own files while they are still
    in the page cache (and while the other job runs): the manifest's artifacts entries.
    Returns them and the disk's layout (the manifest's `disk`)."""

    def rootfs() -> dict[str, dict]:
        with step("export.rootfs"):
            export.export_rootfs(tree, dest / export.ROOTFS)
        with step("export.rootfs_sha256"):
            return manifest_mod.file_sums([dest / export.ROOTFS])

    layout: dict = {}

    def disk() -> dict[str, dict]:
        made = export.export_disk(tree, dest, step=step, arch=arch, logfile=logfile)
        layout.update(made.disk)
        with step("export.disk_sha256"):
            return manifest_mod.file_sums(made.files)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="export") as pool:
        jobs = [pool.submit(rootfs), pool.submit(disk)]
        errors = [j.exception() for j in jobs]
    for e in errors:
        if e is not None:
            raise e if isinstance(e, NodeforgeError) else NodeforgeError(f"export failed: {e}")
    return {name: s for j in jobs for name, s in j.result().items()}, layout
