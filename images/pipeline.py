"""The build pipeline every target shares: options, inputs, extra vars, manifest skeleton and
one output session (partial output, build log, failed-build log, cleanup with SIGINT masked).

Everything is built under `<output>.partial` and renamed into place only when complete, so a
failed or interrupted build never leaves an artifact under the final name. Cleanup steps
registered with the session always run (also on Ctrl-C and SIGTERM, and a second Ctrl-C
during cleanup is ignored). images/nspawn_build.py and images/packer_build.py hold only what is specific
to their targets; images/build.py dispatches.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from nodeforge import __version__, data, proc
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import swap_dir

from . import agent_wheel, packer, targets, template, varfile, versions
from . import base as base_mod
from . import manifest as manifest_mod

log = logging.getLogger("nodeforge.build")

REPO_ROOT = Path(__file__).resolve().parent.parent
Reporter = Callable[[str, str], None]


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
    force: bool = False  # rebuild even when an identical build is already published
    cache_max_bytes: int = 20 << 30  # layers beyond this are pruned, least recently used first
    variant: str = "cpu"  # "gpu": + roles/gpu, contrib/non-free base, NVIDIA artifacts


@dataclass
class BuildResult:
    output: Path
    manifest: dict
    log_file: Path
    reused: bool = False  # True: nothing changed, the published build was returned as is


class Phases:
    """Times each phase and reports it (to rich progress, or plain lines).

    `step()` times a part of a phase ("export.mkfs"): the manifest's `steps`, apart from
    `phases` so that the phases still add up to the build's time. Steps may run in
    parallel threads (the export's jobs), so they can add up to more than their phase."""

    def __init__(self, reporter: Reporter, clock: Callable[[], float] = time.monotonic):
        self.durations: dict[str, float] = {}
        self.steps: dict[str, float] = {}
        self.report = reporter
        self.clock = clock
        self._steps_lock = threading.Lock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.report(name, "start")
        t0 = self.clock()
        try:
            yield
        except BaseException:
            self._add(name, self.clock() - t0)
            self.report(name, "failed")
            raise
        took = self.clock() - t0
        self._add(name, took)
        self.report(name, f"done {took:.1f}s")

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time a part of a phase (thread-safe); a step run again adds to its total."""
        t0 = self.clock()
        try:
            yield
        finally:
            took = self.clock() - t0
            with self._steps_lock:
                self.steps[name] = round(self.steps.get(name, 0.0) + took, 2)

    def _add(self, name: str, seconds: float) -> None:
        # A phase run again (a dropped layer rebuilt from the base) adds to its total.
        self.durations[name] = round(self.durations.get(name, 0.0) + seconds, 2)

    def skip(self, name: str, why: str) -> None:
        """A phase this build does not need: recorded as 0 s, reported with its reason."""
        self.durations[name] = 0.0
        self.report(name, f"skipped: {why}")


def repo_paths(need_playbook: bool = True) -> tuple[Path, Path, Path]:
    """site.yml, ansible.cfg and roles/: in the checkout, or the installed wheel's copies."""
    playbook = Path(__file__).resolve().with_name("site.yml")
    if need_playbook and not playbook.is_file():
        raise NodeforgeError(f"{playbook} not found; reinstall nodeforge")
    return playbook, data.path("ansible.cfg"), data.path("roles")


def tool_versions() -> dict[str, str]:
    out = {"nodeforge": __version__, "packer": str(packer.version())}
    cp = proc.run([proc.require_tool("ansible-playbook"), "--version"], check=False)
    first = cp.stdout.splitlines()[0] if cp.stdout else ""
    out["ansible-core"] = first.split("core ")[-1].rstrip("]") if "core" in first else first
    mm = proc.run([proc.require_tool("mmdebstrap"), "--version"], check=False).stdout.strip()
    out["mmdebstrap"] = mm.split()[-1] if mm else "unknown"
    return out


def build_wheel(dest: Path, logfile: IO[str]) -> Path:
    """The agent installed into the image: this nodeforge's core, bootstrap and gang, as a
    wheel (no lab, no images, no build data), from a checkout or an installed wheel alike."""
    wheel = agent_wheel.write(dest)
    logfile.write(f"agent wheel {wheel.name}: {wheel.stat().st_size} bytes\n")
    return wheel


# -- inputs ---------------------------------------------------------------------------------


@dataclass
class Inputs:
    """What a build is made from, resolved once for every target."""

    opts: BuildOptions
    vers: versions.Versions
    base: versions.Base
    arch: str
    name: str
    output: Path
    user_vars: dict[str, object]
    playbook: Path
    ansible_cfg: Path

    @property
    def art_dir(self) -> Path:
        return self.opts.cache_dir / "artifacts"

    @property
    def ansible_vars(self) -> dict[str, object]:
        return dict(self.user_vars.get("ansible_vars", {}) or {})


def resolve_inputs(opts: BuildOptions) -> Inputs:
    vers = versions.load(opts.versions_file)
    base = vers.base(opts.base)
    arch = base_mod.host_arch()
    user_vars: dict[str, object] = {}
    for vf in opts.var_files:
        user_vars.update(varfile.load(vf, opts.target))
    template.check_variant(opts.target, opts.variant)  # the same refusal as render/validate
    if targets.get(opts.target).cloud:
        template.check_amazon_vars(user_vars)
    # The cpu image keeps its name; other variants are nodeforge-<base>-<variant>-<arch>.
    vtag = "" if opts.variant == targets.DEFAULT_VARIANT else f"-{opts.variant}"
    playbook, cfg, _ = repo_paths(need_playbook=opts.playbook is None)
    return Inputs(
        opts=opts,
        vers=vers,
        base=base,
        arch=arch,
        name=opts.name or f"nodeforge-{base.name}{vtag}-{arch}",
        output=(opts.output or Path("output") / opts.target).resolve(),
        user_vars=user_vars,
        playbook=opts.playbook or playbook,
        ansible_cfg=cfg,
    )


@dataclass
class Fetched:
    """The preflight phase's results: tool versions and the verified artifacts."""

    tools: dict[str, str]
    arts: list
    seen: dict[str, str]


def fetch_inputs(inp: Inputs) -> Fetched:
    tools = tool_versions()
    arts = inp.vers.for_arch(inp.arch, inp.opts.variant)
    seen = versions.fetch(
        arts,
        inp.art_dir,
        mirror=inp.opts.artifact_mirror,
        allow_unpinned=inp.opts.allow_unpinned,
        versions_path=inp.vers.path,
    )
    return Fetched(tools, arts, seen)


def extra_vars(inp: Inputs, fetched: Fetched, wheel: Path) -> dict[str, object]:
    """The extra vars the playbook asserts (images/site.yml), plus the var files' ansible_vars."""
    return {
        "nodeforge_image_name": inp.name,
        "nodeforge_artifacts_dir": str(inp.art_dir),
        "nodeforge_artifacts": {a.name: a.file for a in fetched.arts},
        "nodeforge_wheel": str(wheel),
        "nodeforge_base": inp.base.name,
        "nodeforge_variant": inp.opts.variant,
        **inp.ansible_vars,
    }


def manifest_header(
    inp: Inputs, fetched: Fetched, *, created: str, base_key: str, base_cached: bool
) -> dict:
    return {
        **manifest_mod.header(
            name=inp.name,
            target=inp.opts.target,
            created=created,
            arch=inp.arch,
            base=inp.base,
            base_key=base_key,
            base_cached=base_cached,
            arts=fetched.arts,
            seen=fetched.seen,
            tools=fetched.tools,
        ),
        "variant": inp.opts.variant,
    }


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# -- the output session ---------------------------------------------------------------------


@dataclass
class Session:
    """One build's partial output and log; cleanup steps run in the order they were added."""

    output: Path
    partial: Path
    log_path: Path
    logfile: IO[str]
    steps: list[tuple[str, Callable[[], object]]] = field(default_factory=list)

    @property
    def failed_log(self) -> Path:
        return self.output.with_name(self.output.name + ".failed-build.log")

    def on_cleanup(self, what: str, fn: Callable[[], object]) -> None:
        self.steps.append((what, fn))


def _interrupt(signum, frame):  # SIGTERM takes the Ctrl-C path: the same cleanup runs
    raise KeyboardInterrupt


@contextmanager
def output_session(output: Path, reporter: Reporter) -> Iterator[Session]:
    """Build under `<output>.partial`; publish it whole on success. On failure the log is
    kept as `<output>.failed-build.log` and the partial output removed. Cleanup runs with
    SIGINT ignored, so a second Ctrl-C cannot leave a sandbox, mount or work tree behind."""
    partial = output.with_name(output.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)  # a leftover of an earlier interrupted build
    partial.mkdir(parents=True)
    log_path = partial / "build.log"
    logfile = open(log_path, "w", buffering=1)
    s = Session(output, partial, log_path, logfile)
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    failure: BaseException | None = None
    try:
        yield s
        if not s.logfile.closed:
            s.logfile.close()
        publish(partial, output)
    except BaseException as exc:
        failure = exc
        raise
    finally:
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _cleanup(s, failure, reporter)
        finally:
            signal.signal(signal.SIGTERM, old_term)
            signal.signal(signal.SIGINT, old_int)


def _cleanup(s: Session, failure: BaseException | None, reporter: Reporter) -> None:
    steps = list(s.steps)
    if failure is not None:

        def keep_log():
            if not s.logfile.closed:
                s.logfile.write(f"build FAILED: {type(failure).__name__}: {failure}\n")
                s.logfile.close()
            if s.log_path.exists():
                shutil.move(s.log_path, s.failed_log)

        steps.append(("keep the build log", keep_log))
        steps.append(
            ("remove partial output", lambda: shutil.rmtree(s.partial, ignore_errors=True))
        )
    elif not s.logfile.closed:
        s.logfile.close()
    problems = []
    for what, fn in steps:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (every other cleanup step must still run)
            problems.append(f"{what}: {e}")
            log.error("cleanup step '%s' failed: %s", what, e)
    if failure is not None:
        try:
            reporter("build", f"failed; full log: {s.failed_log}")
        except OSError:
            pass  # stderr closed (e.g. the caller went away); the log file has it all
    if problems:
        raise NodeforgeError("cleanup after the build was incomplete: " + "; ".join(problems))


def publish(partial: Path, output: Path) -> None:
    """Swap the finished build into place; an older build under that name is replaced whole."""
    swap_dir(partial, output)
    stale = output.with_name(output.name + ".failed-build.log")
    stale.unlink(missing_ok=True)
