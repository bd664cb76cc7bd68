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
    opts, name, output = inp.opts, inp.name, inp.output
    cache_dir = opts.cache_dir
    spec = base_mod.spec_for(inp.base, inp.arch, inp.opts.variant)
    arts = inp.vers.for_arch(inp.arch, inp.opts.variant)

    def fetch() -> dict[str, str]:
        return versions.fetch(
            arts,
            inp.art_dir,
            mirror=opts.artifact_mirror,
            allow_unpinned=opts.allow_unpinned,
            versions_path=inp.vers.path,
        )

    if not opts.force:
        try:
            seen: dict[str, str] | None = fetch()
        except NodeforgeError:
            seen = None  # fails again below, inside the session: its log is kept
        if seen is not None:
            m = published_unchanged(output, build_keys(inp, spec.key(), seen)[1])
            if m is not None:
                reporter("cache", f"no input changed: {output} is this build (--force rebuilds)")
                return BuildResult(output, m, output / "build.log", reused=True)
    started = now_iso()
    with output_session(output, reporter) as s:
        logfile = s.logfile
        work = cache_dir / "work" / f"{name}-{os.getpid()}"
        if work.exists():
            release_mounts(work)
            shutil.rmtree(work)
        work.mkdir(parents=True)
        sandbox: list[Sandbox] = []  # the sandbox of the current pass, once it exists
        s.on_cleanup("stop sandbox", lambda: sandbox and sandbox[-1].stop())
        s.on_cleanup("release mounts", lambda: release_mounts(work))
        if not opts.keep_work:
            s.on_cleanup("remove work tree", lambda: work.exists() and shutil.rmtree(work))
        store = cache.LayerStore(
            cache_dir, log=lambda msg: (logfile.write(msg + "\n"), reporter("cache", msg))
        )
        # An interrupted layer write (only this build's, under the lock) is no entry: drop it.
        s.on_cleanup("drop an unfinished layer", store.drop_unfinished)
        # Tool versions (three programs started) and the Packer template (`packer fmt`) take
        # seconds on a loaded machine and nothing waits for them until provision or the
        # manifest: they run beside the layer's verification.
        for tool in ("packer", "ansible-playbook", "mmdebstrap"):
            proc.require_tool(tool)  # a missing tool fails now, naming its package
        # Every ansible-playbook run uses Mitogen's strategy (images/ansible_strategy.py); a
        # missing mitogen package fails now, naming it.
        strategy_env = ansible_strategy.strategy_env()
        # The third worker verifies a reused layer's content while it is already mounted,
        # booted and provisioned (see "verify" below).
        background = ThreadPoolExecutor(max_workers=3, thread_name_prefix="background")
        stopping = threading.Event()

        def finish_background() -> None:
            stopping.set()
            background.shutdown(cancel_futures=True)

        s.on_cleanup("finish background work", finish_background)
        phases = Phases(reporter)

        def timed(name: str, fn, *args):
            with phases.step(name):
                return fn(*args)

        tools_job = background.submit(tool_versions)
        template_job = background.submit(packer.render, "local", None, inp.opts.variant)
        logfile.write(
            f"nodeforge {__version__} build {name} target={opts.target} base={inp.base.name}\n"
        )
        with phases.phase("preflight"):
            seen = fetch()
            roles = playbook_roles(inp.playbook)
            groups = build_groups(roles)
            all_roles = [r for g in groups for r in g.roles]
            layer_in, bkey = build_keys(inp, spec.key(), seen, groups)
            keys, lkey = layer_in.keys(), layer_in.key()
            config = cache.config_inputs(
                roles_dir=data.path("roles"), repo=REPO_ROOT, ansible_vars=inp.ansible_vars
            )
            logfile.write(f"cache keys: layers {' '.join(keys)} build {bkey}\n")
            fetched = Fetched({}, arts, seen)  # tools: from tools_job, for the manifest
            wheel = cached_wheel(
                cache_dir / "wheels", cache.sources_digest(REPO_ROOT), work, logfile
            )
            ev = work / "extra-vars.json"
            ev.write_text(json.dumps(extra_vars(inp, fetched, wheel), indent=2))
        tpl = work / "local.pkr.hcl"
        apt_cache = cache_dir / "apt-archives"
        (apt_cache / "partial").mkdir(parents=True, exist_ok=True)
        tree = work / "rootfs"

        def boot() -> None:
            sb = Sandbox(
                tree,
                work,
                logfile,
                name=f"nfbuild-{os.getpid()}",
                binds=[(apt_cache, "/var/cache/apt/archives")],
            )
            sandbox.append(sb)
            with phases.step("sandbox.prepare"):
                access = sb.prepare()
            with phases.step("sandbox.boot"):
                sb.start()
            values.update(ssh_port=access.port, ssh_private_key_file=access.key_file)

        def provision(env: dict[str, str]) -> None:
            logfile.write(f"provision pass: {env or 'all tags'}\n")
            if not tpl.exists():
                tpl.write_text(template_job.result())
            packer.build(
                tpl,
                values,
                opts.var_files,
                logfile=logfile,
                on_line=on_line,
                ansible_env={**strategy_env, **env},
            )

        def reapply(env: dict[str, str], gather_subset: str = REAPPLY_GATHER_SUBSET) -> None:
            """A pass over the cached layer: ansible-playbook straight at the sandbox, which
            has already answered SSH, with what Packer's ansible provisioner passes
            (images/template.py: playbook, extra vars, config, environment, user root, the
            build's SSH key). Packer's start-up and SSH wait would add seconds, nothing else."""
            logfile.write(f"re-apply pass: {env}\n")
            inventory = work / "inventory"
            inventory.write_text(
                f"default ansible_host=127.0.0.1 ansible_port={values['ssh_port']} "
                "ansible_user=root\n"
            )
            proc.stream(
                [
                    proc.require_tool("ansible-playbook"),
                    "-i",
                    inventory,
                    "--ssh-extra-args=-o IdentitiesOnly=yes",
                    "-e",
                    f"ansible_ssh_private_key_file={values['ssh_private_key_file']}",
                    "--extra-vars",
                    f"@{ev}",
                    "--extra-vars",
                    json.dumps({"nodeforge_gather_subset": gather_subset}),
                    inp.playbook,
                ],
                logfile=logfile,
                on_line=on_line,
                env={
                    "ANSIBLE_CONFIG": str(inp.ansible_cfg),
                    **template.ANSIBLE_ENV,
                    **strategy_env,
                    **env,
                },
                timeout=3600,
                hint=f"the full Ansible output is in {getattr(logfile, 'name', 'the build log')}",
            )

        values: dict[str, object] = {
            "playbook_file": inp.playbook,
            "extra_vars_file": ev,
            "ansible_playbook": proc.require_tool("ansible-playbook"),
            "ansible_config": inp.ansible_cfg,
            "image_name": name,
        }
        base_cached = True
        chain: list[cache.Layer] = []  # the layers under the merged tree, first group first
        verify_jobs: dict[str, Future] = {}  # a reused layer's content check, by key

        def mount_chain() -> None:
            mount_overlay([layer.tree for layer in reversed(chain)], work)

        def require_verified() -> None:
            """Wait for the content checks of the reused layers: nothing made over a layer
            is kept unless its digest matched (raises Unusable for the first that did not)."""
            for layer in chain:
                job = verify_jobs.get(layer.key)
                problem = job.result() if job is not None else ""
                if problem:
                    raise Unusable(layer, problem)

        def group_pass(i: int, again: list[str] | None) -> dict[str, str]:
            """Ansible's tags for the pass of group *i*: its roles, plus *again* (roles of
            the cached groups whose configuration changed; None: all of them). Skip-tags,
            so that the untagged pre-task checks run in every install pass."""
            run = set(groups[i].roles)
            run.update(r for g in groups[:i] for r in g.roles if again is None or r in again)
            skip = ["seal", *(r for r in all_roles if r not in run)]
            return {"ANSIBLE_SKIP_TAGS": ",".join(skip)}

        def make_layers(again: list[str] | None) -> None:
            """Run the install pass for each group past the cached ones, storing each
            group's result as a layer over the previous one (the first: the whole tree)."""
            nonlocal base_cached
            if not chain:
                with phases.phase("base"):
                    base_tar, base_cached = base_mod.ensure_base(
                        spec, cache_dir / "base", inp.base.keyring, logfile
                    )
                    extract(base_tar, tree)
            for i in range(len(chain), len(groups)):
                g = groups[i]
                with phases.phase("sandbox"):
                    boot()
                with phases.phase("provision"), phases.step(f"provision.{g.name}"):
                    env = group_pass(i, again if i == len(chain) else [])
                    if i == 0:
                        provision(env)
                    else:  # the sandbox answered SSH already: no Packer start-up again
                        reapply(env, gather_subset="all")
                with phases.phase("layer"):
                    sandbox[-1].stop()
                    with phases.step(f"layer.store_{g.name}"):
                        if not chain:
                            made = store.store(keys[0], tree, layer_in.prefixes[0], config)
                        else:
                            require_verified()
                            release_mounts(work)  # the overlay: its upper dir is the layer
                            made = store.store(
                                keys[i],
                                work / "upper",
                                layer_in.prefixes[i],
                                config,
                                parent=chain[-1].key,
                            )
                            shutil.rmtree(work / "overlay-work")
                    chain.append(made)
                    mount_chain()
            store.prune(opts.cache_max_bytes, keep=[layer.key for layer in chain])

        reused = 0
        reapplied: list[str] | None = []
        for _attempt in range(len(groups) + 1):
            try:
                with phases.phase("base"):
                    store.drop_unfinished()
                    with phases.step("base.open_layers"):
                        chain = store.open_chain(keys)
                    reused = len(chain)
                    if chain:
                        reporter(
                            "cache",
                            f"reusing {groups[reused - 1].name} layer {keys[reused - 1][:16]} "
                            f"({reused} of {len(groups)} groups; content verified meanwhile)",
                        )
                        for layer in chain:
                            if layer.key not in verify_jobs:
                                verify_jobs[layer.key] = background.submit(
                                    timed, "verify.digest", store.verify, layer, stopping.is_set
                                )
                        with phases.step("base.mount_layers"):
                            mount_chain()
                if reused == len(groups):
                    reapplied = (
                        None
                        if roles is None
                        else cache.roles_to_reapply(chain[-1].config, config, all_roles)
                    )
                    reporter(
                        "cache",
                        "re-applying "
                        + ("every role" if reapplied is None else ", ".join(reapplied) or "no role")
                        + " over the layer, then seal",
                    )
                    if reapplied == []:
                        phases.skip("sandbox", "no role to re-apply over the layer")
                        phases.skip("provision", "no role to re-apply over the layer")
                    else:
                        with phases.phase("sandbox"):
                            boot()
                        with phases.phase("provision"):
                            reapply(pass_roles(reapplied))
                else:
                    # The cached groups' roles whose configuration changed run again in
                    # the first pass, so the new layer holds this build's configuration.
                    done = [r for g in groups[:reused] for r in g.roles]
                    reapplied = (
                        []
                        if not chain
                        else cache.roles_to_reapply(chain[-1].config, config, all_roles, among=done)
                    )
                    make_layers(reapplied)
                # Nothing made from a reused layer is kept unless its content digest matched:
                # a corrupt or altered layer is dropped here (with every layer over it) and
                # this build starts again after the layers that remain, never sealing or
                # exporting what was made over it.
                with phases.phase("verify"):
                    require_verified()
                break
            except Unusable as bad:
                if sandbox:
                    sandbox[-1].stop()
                release_mounts(work)
                # Its check (and any of a layer over it) is stale once it is rebuilt.
                for key in [bad.layer.key, *store.descendants(bad.layer.key)]:
                    verify_jobs.pop(key, None)
                store.drop(bad.layer, bad.problem)
                for d in ("upper", "overlay-work", "rootfs"):
                    if (work / d).exists():
                        shutil.rmtree(work / d)
        else:
            raise NodeforgeError("internal: the build cache kept failing verification")
        with phases.phase("seal"):
            if sandbox:
                with phases.step("seal.stop_sandbox"):
                    sandbox[-1].stop()
            export.write_fstab(tree)
            with phases.step("seal.seal_and_scan"):
                seal.seal_and_scan(tree, logfile)
        with phases.phase("export"):
            with phases.step("export.tool_versions"):
                fetched.tools = {**tools_job.result(), **ansible_strategy.tool_versions()}
            with phases.step("export.packages"):
                pkgs = export.dpkg_versions(tree)
            manifest = manifest_mod.with_packages(
                manifest_header(
                    inp, fetched, created=started, base_key=spec.key(), base_cached=base_cached
                ),
                pkgs,
            )
            if (
                inp.opts.variant == "gpu"
            ):  # driver, module and kernel versions the gpu role recorded
                manifest["gpu"] = json.loads((tree / "etc/nodeforge/gpu.json").read_text())
            manifest["phases"] = dict(phases.durations)
            export.write_image_json(tree, manifest)
            sums, manifest["disk"] = export_parallel(
                tree, s.partial, phases.step, arch=inp.arch, logfile=logfile
            )
        manifest["phases"] = dict(phases.durations)
        manifest["steps"] = dict(phases.steps)
        manifest["cache"] = {
            "build_key": bkey,
            "layer_key": lkey,
            "layer_reused": reused == len(groups),
            # the last group whose cached layer this build resumed after (None: from the base)
            "prefix_reused": groups[reused - 1].name if reused else None,
            "layers": [
                {"group": g.name, "key": k, "reused": i < reused}
                for i, (g, k) in enumerate(zip(groups, keys, strict=True))
            ],
            "reapplied": "all" if reapplied is None else reapplied,
        }
        manifest["artifacts"] = manifest_mod.artifact_sums(s.partial, known=sums)
        manifest_mod.require_valid(manifest)
        export.write_json_atomic(s.partial / "manifest.json", manifest)
        logfile.write(f"build complete in {sum(phases.durations.values()):.1f}s\n")
    return BuildResult(output, manifest, output / "build.log")


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
    if d.exists():
        shutil.rmtree(d)
    os.rename(built.parent, d)
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
