"""The node image's agent wheel: the core modules the node runs, bootstrap and gang only.

Nodes run the first-boot agent and the gang governor; the build (images/) and the test bed
(lab/) and their data stay on the build host. The wheel is written here directly (zip +
RECORD), from the modules this nodeforge runs, so a build works from an installed wheel as
well as from a checkout, needs neither pip nor setuptools, and the same sources give the same
bytes (fixed timestamps, sorted entries), which keeps the build's cache keys stable.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import nodeforge
import nodeforge.bootstrap
import nodeforge.gang
from nodeforge import data
from nodeforge.fsutil import atomic_output

NAME = "nodeforge"
REQUIRES = ("PyYAML>=6", "Jinja2>=3.1")  # Debian's python3-yaml / python3-jinja2 on the node
_EPOCH = (1980, 1, 1, 0, 0, 0)
# The core files the node code runs with, by name: what bootstrap/, gang/ and the CLI import
# from the core (tests/unit/images/test_agent_wheel.py checks this list against their imports), and
# the Slurm thresholds that nodeforge/slurm_facts.py reads. A new core module is build-host only
# until it is named here.
NODE_CORE = (
    "__init__.py",
    "__main__.py",
    "cli.py",
    "data.py",
    "download.py",
    "errors.py",
    "fsutil.py",
    "gang_config.py",
    "proc.py",
    "redact.py",
    "scalars.py",
    "slurm_facts.py",
    "slurm_records.py",
    "slurm_versions.json",
    "slurmconf.py",
    "strict_json.py",
    "strict_yaml.py",
)
# The node packages, whole: the first-boot agent and the gang governor.
NODE_PACKAGES = (nodeforge.bootstrap, nodeforge.gang)


def _sources() -> list[tuple[str, Path]]:
    """(path in the wheel, source file): the core's node files, then the node packages."""
    core = Path(nodeforge.__file__).resolve().parent
    out = [(f"nodeforge/{name}", core / name) for name in NODE_CORE]
    for mod in NODE_PACKAGES:
        pkg = Path(mod.__file__).resolve().parent
        arc = mod.__name__.replace(".", "/")
        out += [
            (f"{arc}/{f.relative_to(pkg).as_posix()}", f)
            for f in pkg.rglob("*")
            if f.is_file()
            and all(_wanted(p) for p in f.relative_to(pkg).parents[:-1])
            and _wanted(f)
        ]
    return sorted(out)


def _wanted(p: Path) -> bool:
    return not p.name.startswith(".") and p.name != "__pycache__" and p.suffix != ".pyc"


def _license() -> bytes | None:
    root = data.checkout()
    if root is not None and (root / "LICENSE").is_file():
        return (root / "LICENSE").read_bytes()
    from importlib import metadata

    try:
        dist = metadata.distribution(NAME)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "LICENSE":
            return Path(dist.locate_file(f)).read_bytes()
    return None


def write(dest: Path) -> Path:
    """Write nodeforge-VERSION-py3-none-any.whl (the node agent) into *dest*; return its path."""
    version = nodeforge.__version__
    info = f"{NAME}-{version}.dist-info"
    files: list[tuple[str, bytes]] = [(arc, src.read_bytes()) for arc, src in _sources()]
    lic = _license()
    meta = [
        "Metadata-Version: 2.1",
        f"Name: {NAME}",
        f"Version: {version}",
        "Summary: nodeforge node agent (first-boot bootstrap and gang governor)",
        "License: Apache-2.0",
        "Requires-Python: >=3.11",
        *(f"Requires-Dist: {r}" for r in REQUIRES),
    ]
    files += [
        (f"{info}/METADATA", ("\n".join(meta) + "\n").encode()),
        (
            f"{info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: nodeforge.images.agent_wheel\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n",
        ),
        (f"{info}/entry_points.txt", b"[console_scripts]\nnodeforge = nodeforge.cli:main\n"),
        (f"{info}/top_level.txt", b"nodeforge\n"),
    ]
    if lic is not None:
        files.append((f"{info}/licenses/LICENSE", lic))
    record = "".join(f"{arc},sha256={_digest(body)},{len(body)}\n" for arc, body in files)
    files.append((f"{info}/RECORD", (record + f"{info}/RECORD,,\n").encode()))
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"{NAME}-{version}-py3-none-any.whl"
    with atomic_output(out) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for arc, body in files:  # a finished wheel or none
            zi = zipfile.ZipInfo(arc, date_time=_EPOCH)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, body)
    return out


def _digest(body: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
