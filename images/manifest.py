"""The build manifest: `manifest.json` beside the artifacts, `/etc/nodeforge/image.json` inside.

`check()` is the schema, used by the build before writing and by the tests on real builds.
"""

from __future__ import annotations

import re

_SHA = re.compile(r"^[0-9a-f]{64}$")

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
REQUIRED_PHASES_IMAGE = {"local": ("preflight", "base", "sandbox", "provision", "seal"),
                         "qemu": ("preflight", "base", "provision", "seal")}


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
