"""The build manifest: `manifest.json` beside the artifacts, `/etc/nodeforge/image.json` inside.

`check()` is the schema, used by the build before writing and by the tests on real builds.
"""

from __future__ import annotations

import re
from pathlib import Path

_SHA = re.compile(r"^[0-9a-f]{64}$")

# Components whose installed versions the manifest summarises (all packages are listed too).
COMPONENT_PACKAGES = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "slurm-client",
    "sackd",
    "munge",
    "mariadb-server",
    "docker.io",
    "docker-ce",
    "enroot",
    "enroot+caps",
    "openssh-server",
    "systemd",
    "logrotate",
    "python3",
)

# key -> type; nested dicts are checked by check().
TOP_LEVEL = {
    "schema": int,
    "name": str,
    "target": str,
    "created": str,
    "arch": str,
    "base": dict,
    "components": dict,
    "inputs": dict,
    "packages": dict,
    "tools": dict,
    "phases": dict,
}
REQUIRED_TOOLS = ("nodeforge", "packer", "ansible-core")
# The qemu target provisions a VM, not an nspawn sandbox.
REQUIRED_PHASES_IMAGE = {
    "local": ("preflight", "base", "sandbox", "provision", "seal"),
    "qemu": ("preflight", "base", "provision", "seal"),
}


def check(m: dict, *, outer: bool = True) -> list[str]:
    """Return a list of problems (empty = valid). *outer*: manifest.json (with artifacts)."""
    errs: list[str] = []
    for key, typ in TOP_LEVEL.items():
        if key not in m:
            errs.append(f"missing '{key}'")
        elif not isinstance(m[key], typ):
            errs.append(f"'{key}' must be {typ.__name__}")
    if errs:
        return errs
    if m["schema"] != 1:
        errs.append("'schema' must be 1")
    for k in ("name", "suite", "mirror", "key"):
        if not isinstance(m["base"].get(k), str):
            errs.append(f"'base.{k}' must be a string")
    for tool in REQUIRED_TOOLS:
        if not m["tools"].get(tool):
            errs.append(f"'tools.{tool}' is missing")
    for ph in REQUIRED_PHASES_IMAGE.get(m["target"], REQUIRED_PHASES_IMAGE["local"]):
        v = m["phases"].get(ph)
        if not isinstance(v, (int, float)) or v < 0:
            errs.append(f"'phases.{ph}' must be a non-negative number of seconds")
    for name, inp in m["inputs"].items():
        if not _SHA.match(str(inp.get("sha256", ""))):
            errs.append(f"'inputs.{name}.sha256' must be a sha256")
        if not isinstance(inp.get("pinned"), bool):
            errs.append(f"'inputs.{name}.pinned' must be true or false")
    if not m["packages"]:
        errs.append("'packages' is empty (dpkg versions were not read)")
    if "disk" in m:
        errs += _disk_problems(m["disk"])
    if outer:
        arts = m.get("artifacts")
        if not isinstance(arts, dict) or not arts:
            errs.append("missing 'artifacts'")
        else:
            for f, a in arts.items():
                if not _SHA.match(str(a.get("sha256", ""))):
                    errs.append(f"'artifacts.{f}.sha256' must be a sha256")
                if not isinstance(a.get("bytes"), int) or a["bytes"] <= 0:
                    errs.append(f"'artifacts.{f}.bytes' must be a positive integer")
        if "export" not in m["phases"]:
            errs.append("'phases.export' is missing")
    return errs


_GUID = re.compile(r"^[0-9A-F]{8}-(?:[0-9A-F]{4}-){3}[0-9A-F]{12}$")


def _disk_problems(disk: object) -> list[str]:
    """The disk's layout (images/bootdisk.py): a GPT with each partition's facts and sum."""
    if not isinstance(disk, dict) or disk.get("table") != "gpt":
        return ["'disk.table' must be 'gpt'"]
    parts = disk.get("partitions")
    if not isinstance(parts, list) or not parts:
        return ["'disk.partitions' must be a non-empty list"]
    errs = []
    for i, p in enumerate(parts):
        if not isinstance(p, dict):
            errs.append(f"'disk.partitions[{i}]' must be a mapping")
            continue
        for k in ("type", "partuuid"):
            if not _GUID.match(str(p.get(k, ""))):
                errs.append(f"'disk.partitions[{i}].{k}' must be an upper-case GUID")
        if not _SHA.match(str(p.get("sha256", ""))):
            errs.append(f"'disk.partitions[{i}].sha256' must be a sha256")
        if not isinstance(p.get("bytes"), int) or p["bytes"] <= 0:
            errs.append(f"'disk.partitions[{i}].bytes' must be a positive integer")
    return errs


def header(
    *,
    name: str,
    target: str,
    created: str,
    arch: str,
    base,
    base_key: str,
    base_cached: bool,
    arts,
    seen: dict[str, str],
    tools: dict,
) -> dict:
    """What every target's manifest starts with: the image, its base and its inputs."""
    return {
        "schema": 1,
        "name": name,
        "target": target,
        "created": created,
        "arch": arch,
        "base": {
            "name": base.name,
            "suite": base.suite,
            "mirror": base.mirror,
            "key": base_key,
            "cached": base_cached,
        },
        "inputs": {
            a.name: {
                "component": a.component,
                "version": a.version,
                "file": a.file,
                "sha256": seen[a.name],
                "pinned": a.pinned,
            }
            for a in arts
        },
        "tools": tools,
    }


def with_packages(m: dict, pkgs: dict[str, str]) -> dict:
    """*m* plus the dpkg versions of the image and the summary of its components."""
    return {
        **m,
        "components": {p: pkgs[p] for p in COMPONENT_PACKAGES if p in pkgs},
        "packages": pkgs,
    }


def file_sums(paths: list[Path]) -> dict[str, dict]:
    """{name: {sha256, bytes}} of *paths*."""
    from .versions import sha256_file

    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in paths}


def artifact_sums(directory: Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """sha256 and size of every artifact in a build's output directory (not its log).
    *known*: sums the exporter took as it wrote the files, used while the size still
    matches; every other file is read here."""
    out = {}
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.name == "build.log":
            continue
        k = (known or {}).get(p.name)
        out[p.name] = k if k and k["bytes"] == p.stat().st_size else file_sums([p])[p.name]
    return out


def require_valid(m: dict, *, outer: bool = True) -> None:
    """Raise when the build's own manifest is incomplete (a bug, not a user error)."""
    problems = check(m, outer=outer)
    if problems:
        from nodeforge.errors import NodeforgeError

        what = "manifest.json" if outer else "image manifest"
        raise NodeforgeError(f"internal: {what} is incomplete: " + "; ".join(problems))
