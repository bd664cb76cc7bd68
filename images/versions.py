"""The versions file: every URL and version nodeforge downloads, pinned by sha256.

Loading validates the file; fetching verifies checksums and names the artifact and the
`--artifact-mirror` option when anything goes wrong. Unpinned entries (sha256: null) are
refused unless the caller explicitly allows them.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from nodeforge import download, strict_yaml
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import UnsafeName, confined, safe_name, write_atomic

from .targets import DEFAULT_VARIANT, VARIANTS

log = logging.getLogger("nodeforge.versions")

VERSIONS_FILE = Path(__file__).with_name("versions.yaml")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# 60 s without a byte is a dead connection; 3 tries with 2, 4 s between them.
DOWNLOAD_POLICY = download.Policy(timeout=60.0, deadline=6 * 3600.0, attempts=3, backoff=2.0)


@dataclass(frozen=True)
class Base:
    name: str
    suite: str
    mirror: str
    slurm: str
    keyring: str


@dataclass(frozen=True)
class Artifact:
    name: str  # key in versions.yaml, e.g. enroot_deb
    component: str
    version: str
    arch: str
    file: str
    url: str
    sha256: str | None
    variant: str | None = None  # only the image variant that needs it (None: every variant)

    @property
    def pinned(self) -> bool:
        return self.sha256 is not None


@dataclass
class Versions:
    path: Path
    bases: dict[str, Base]
    default_base: str
    artifacts: dict[str, dict[str, Artifact]]  # name -> arch -> Artifact

    def base(self, name: str | None) -> Base:
        key = name or self.default_base
        if key not in self.bases:
            raise NodeforgeError(
                f"unknown base '{key}'; choose one of {', '.join(sorted(self.bases))} "
                f"(defined under 'bases' in {self.path})"
            )
        return self.bases[key]

    def for_arch(self, arch: str, variant: str = "cpu") -> list[Artifact]:
        """The artifacts a build of *variant* for *arch* needs (arch entry, else 'all')."""
        out = []
        for name, by_arch in self.artifacts.items():
            if any(a.variant not in (None, variant) for a in by_arch.values()):
                continue  # another variant's artifact (e.g. the NVIDIA stack for gpu)
            art = by_arch.get(arch) or by_arch.get("all")
            if art is None:
                raise NodeforgeError(
                    f"{self.path}: artifacts.{name} has no entry for architecture '{arch}' "
                    f"(has: {', '.join(sorted(by_arch))}); add arch.{arch} with url, file and sha256"
                )
            out.append(art)
        return out

    def all_artifacts(self) -> list[Artifact]:
        return [a for by_arch in self.artifacts.values() for a in by_arch.values()]


def _req(d: dict, key: str, where: str, path: Path, typ: type = str):
    if not isinstance(d, dict) or key not in d:
        raise NodeforgeError(f"{path}: {where}.{key} is missing")
    val = d[key]
    if typ is str and isinstance(val, float):
        # YAML reads an unquoted 1.10 as the number 1.1: a version must say what it says.
        raise NodeforgeError(
            f"{path}: {where}.{key} must be a string, got the number {val!r}; quote it "
            f'(e.g. "1.10")'
        )
    if typ is str and isinstance(val, int) and not isinstance(val, bool):
        val = str(val)  # a decimal without a leading zero (strict_yaml) reads back the same
    if not isinstance(val, typ):
        raise NodeforgeError(f"{path}: {where}.{key} must be a {typ.__name__}, got {val!r}")
    return val


def load(path: Path | None = None) -> Versions:
    path = Path(path or VERSIONS_FILE)
    try:
        with path.open("rb") as fh:  # one byte past the cap is enough to refuse it
            raw = strict_yaml.load(fh.read(strict_yaml.MAX_BYTES + 1).decode())
    except OSError as exc:
        raise NodeforgeError(f"cannot read versions file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise NodeforgeError(
            f"versions file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    except strict_yaml.StrictYAMLError as exc:
        raise NodeforgeError(f"versions file {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise NodeforgeError(f"versions file {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise NodeforgeError(f"{path}: expected a mapping at the top level")
    if type(raw.get("schema")) is not int or raw["schema"] != 1:  # true and 1.0 equal 1 too
        raise NodeforgeError(f"{path}: schema must be 1, got {raw.get('schema')!r}")
    bases = {}
    for name, b in (_req(raw, "bases", "", path, dict)).items():
        w = f"bases.{name}"
        bases[name] = Base(
            name=name,
            suite=_req(b, "suite", w, path),
            mirror=_req(b, "mirror", w, path),
            slurm=_req(b, "slurm", w, path),
            keyring=_req(b, "keyring", w, path),
        )
    default_base = _req(raw, "default_base", "", path)
    if default_base not in bases:
        raise NodeforgeError(f"{path}: default_base '{default_base}' is not one of the bases")
    artifacts: dict[str, dict[str, Artifact]] = {}
    for name, a in (_req(raw, "artifacts", "", path, dict)).items():
        w = f"artifacts.{name}"
        variant = a.get("variant") if isinstance(a, dict) else None
        if variant is not None and variant not in VARIANTS:
            raise NodeforgeError(
                f"{path}: {w}.variant must be one of {', '.join(VARIANTS)} or absent, got {variant!r}"
            )
        by_arch = {}
        for arch, e in _req(a, "arch", w, path, dict).items():
            wa = f"{w}.arch.{arch}"
            sha = e.get("sha256") if isinstance(e, dict) else None
            if sha is not None and not (isinstance(sha, str) and _SHA256.match(sha)):
                raise NodeforgeError(
                    f"{path}: {wa}.sha256 must be 64 lowercase hex characters or null "
                    f"(unpinned), got {sha!r}"
                )
            file = _req(e, "file", wa, path)
            try:  # it names a file in the download and mirror directories: a bare name only
                safe_name(file, what=f"{path}: {wa}.file")
            except UnsafeName as exc:
                raise NodeforgeError(f"{exc}; give the artifact's bare file name") from None
            by_arch[arch] = Artifact(
                name=name,
                component=_req(a, "component", w, path),
                version=_req(a, "version", w, path),
                arch=arch,
                file=file,
                url=_req(e, "url", wa, path),
                sha256=sha,
                variant=variant,
            )
        artifacts[name] = by_arch
    return Versions(path, bases, default_base, artifacts)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _in(base: Path, art: Artifact) -> Path:
    """Where *art*'s file goes in (or comes from) *base*: checked again at every use, because an
    Artifact need not come from load()."""
    return confined(base, art.file, what=f"artifact {art.name} ({art.arch}) file")


def _source(art: Artifact, mirror: str | None) -> str:
    if not mirror:
        return art.url
    if re.match(r"^[a-z][a-z0-9+.-]*://", mirror):
        # the grammar alone: a bare name cannot leave the mirror's URL path (no / ? # %)
        safe_name(art.file, what=f"artifact {art.name} ({art.arch}) file")
        return mirror.rstrip("/") + "/" + art.file
    return str(_in(Path(mirror), art))


class ArtifactDownloadFailed(NodeforgeError):
    """An artifact could not be fetched (no route, a server error): a runtime failure, exit 1 as
    README's exit-status table says, not bad input (2)."""

    exit_code = 1


def _label(art: Artifact) -> str:
    return f"artifact {art.name} ({art.component} {art.version})"


def _download(
    src: str,
    dest: Path,
    art: Artifact,
    mirror: str | None,
    *,
    sha256: str | None = None,
    progress: download.Progress | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Fetch *src* to *dest* through nodeforge.download (checked before the rename). Returns sha256."""
    hint = (
        "serve it from a local copy with --artifact-mirror DIR|URL (the mirror must hold "
        f"'{art.file}')"
    )
    try:
        if "://" not in src:
            if not Path(src).is_file():
                raise NodeforgeError(
                    f"{_label(art)}: '{art.file}' is not in the mirror directory {mirror}; copy "
                    "it there or fix --artifact-mirror"
                )
            return download.copy_file(
                Path(src), dest, label=_label(art), sha256=sha256, progress=progress
            ).sha256
        log.info("download %s", download.display_url(src))
        return download.fetch(
            src,
            dest,
            label=_label(art),
            policy=DOWNLOAD_POLICY,
            sha256=sha256,
            progress=progress,
            sleep=sleep,
        ).sha256
    except download.ChecksumMismatch as exc:
        raise NodeforgeError(
            f"checksum mismatch for artifact {art.name} ({art.file}) from "
            f"{download.display_url(src)}: expected {exc.expected}, got {exc.got}. The file is "
            "not the pinned release: fix the mirror (--artifact-mirror) or, if the release was "
            "re-published on purpose, re-pin it with 'nodeforge versions lock'."
        ) from exc
    except download.DownloadError as exc:
        raise ArtifactDownloadFailed(
            f"download of {_label(art)} from {download.display_url(src)} failed: {exc.reason}; "
            f"{hint}"
        ) from exc


def fetch(
    arts: list[Artifact],
    dest_dir: Path,
    *,
    mirror: str | None = None,
    allow_unpinned: bool = False,
    versions_path: Path = VERSIONS_FILE,
    progress: download.Progress | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """Download (or copy from the mirror) and verify each artifact into *dest_dir*.

    Returns {artifact name: sha256 actually seen}. Already present, verified files are reused.
    """
    unpinned = [a for a in arts if not a.pinned]
    if unpinned and not allow_unpinned:
        names = ", ".join(f"{a.name} ({a.file})" for a in unpinned)
        raise NodeforgeError(
            f"unpinned artifacts in {versions_path}: {names}. Pin what this build needs on a "
            f"machine that can reach the URLs with '{lock_command(arts)}' (add "
            "--artifact-mirror DIR|URL to read them from a mirror), which records each sha256; "
            "or pass --allow-unpinned to build with whatever the source serves."
        )
    dest_dir.mkdir(parents=True, exist_ok=True)
    seen: dict[str, str] = {}
    for art in arts:
        dest = _in(dest_dir, art)
        if dest.exists() and art.pinned and sha256_file(dest) == art.sha256:
            seen[art.name] = art.sha256
            continue
        try:
            # The sha256 is checked before the file is renamed into place.
            got = _download(
                _source(art, mirror),
                dest,
                art,
                mirror,
                sha256=art.sha256,
                progress=progress,
                sleep=sleep,
            )
        except NodeforgeError:
            dest.unlink(missing_ok=True)  # a stale file that failed the check above
            raise
        if not art.pinned:
            log.warning("artifact %s is unpinned; built with sha256 %s", art.name, got)
        seen[art.name] = got
    return seen


def build_of(arts: list[Artifact]) -> tuple[str, str | None]:
    """(variant, arch) of the build that needs *arts* (what for_arch returned)."""
    variant = next((a.variant for a in arts if a.variant), "cpu")
    arch = next((a.arch for a in arts if a.arch != "all"), None)
    return variant, arch


def lock_command(arts: list[Artifact]) -> str:
    """The `versions lock` that pins what a build of *arts* needs, and only that."""
    variant, arch = build_of(arts)
    return (
        "nodeforge versions lock"
        + (f" --variant {variant}" if variant != DEFAULT_VARIANT else "")
        + (f" --arch {arch}" if arch else "")
    )


def lock_targets(
    versions: Versions,
    *,
    arch: str | None = None,
    variant: str | None = None,
    only_missing: bool = False,
) -> list[Artifact]:
    """What `versions lock` downloads: what a build of *variant* (its own artifacts and the
    shared ones; None: every variant) for *arch* (its entry, else 'all'; None: every
    architecture) fetches. So a CPU-only mirror pins the cpu build's artifacts without the
    gpu variant's NVIDIA files, and a mirror of one architecture pins just that one."""
    if variant is not None and variant not in VARIANTS:
        raise NodeforgeError(f"variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    variants = VARIANTS if variant is None else (variant,)
    if arch is None:
        arts = [a for a in versions.all_artifacts() if a.variant in (None, *variants)]
    else:
        known = {a.arch for a in versions.all_artifacts()} - {"all"}
        if arch not in known:
            raise NodeforgeError(
                f"{versions.path}: no artifact has an entry for architecture {arch!r} "
                f"(known: {', '.join(sorted(known))})"
            )
        by_name = {a.name: a for v in variants for a in versions.for_arch(arch, v)}
        arts = list(by_name.values())
    return [a for a in arts if not (only_missing and a.pinned)]


def lock(
    versions: Versions,
    *,
    mirror: str | None = None,
    only_missing: bool = False,
    arch: str | None = None,
    variant: str | None = None,
    progress: Callable[[Artifact], download.Progress | None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """Download the artifacts and write each sha256 into the versions file in place.

    The edit is textual (the sha256 line following each url line) so comments survive. Every
    download finishes (whole, Content-Length honoured) before the file is touched, so a failed
    lock changes nothing. *progress* maps an artifact to a byte-progress callback (the CLI's).
    *variant* and *arch* narrow it to what one build needs (lock_targets). Returns {url: sha256}.
    """
    text = versions.path.read_text()
    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="nodeforge-lock-") as tmp:
        for art in lock_targets(versions, arch=arch, variant=variant, only_missing=only_missing):
            dest = _in(Path(tmp), art)
            results[art.url] = _download(
                _source(art, mirror),
                dest,
                art,
                mirror,
                progress=progress(art) if progress else None,
                sleep=sleep,
            )
            dest.unlink()
    for url, sha in results.items():
        pat = re.compile(
            r"(^\s*url:\s*" + re.escape(url) + r"\s*\n\s*sha256:\s*)(\S+)", re.MULTILINE
        )
        text, n = pat.subn(lambda m, sha=sha: m.group(1) + sha, text)
        if n != 1:
            raise NodeforgeError(
                f"{versions.path}: expected exactly one 'sha256:' line right after 'url: {url}', "
                f"found {n}; fix the file layout and run 'nodeforge versions lock' again"
            )
    write_atomic(versions.path, text, versions.path.stat().st_mode & 0o7777)
    load(versions.path)  # the edited file must still validate
    return results
