"""User var files (`--var-file F.pkrvars.hcl`), checked before Packer sees them."""

from __future__ import annotations

from pathlib import Path

import hcl2

from nodeforge.errors import NodeforgeError

from .template import variables_for

# Set by nodeforge itself for every build; a var file may not override them.
INTERNAL = {
    "playbook_file",
    "extra_vars_file",
    "ansible_playbook",
    "ansible_config",
    "ssh_port",
    "ssh_private_key_file",
}


# Keys python-hcl2 adds to what it parsed (block markers, the file's comments): not variables.
HCL2_META = {"__is_block__", "__comments__", "__inline_comments__"}


def _strip(v: object) -> object:
    """python-hcl2 keeps string quotes; return plain Python values."""
    if isinstance(v, str):
        if len(v) >= 2 and v[0] == '"' and v[-1] == '"':
            return v[1:-1]
        return v
    if isinstance(v, dict):
        return {_strip(k): _strip(x) for k, x in v.items() if k not in HCL2_META}
    if isinstance(v, list):
        return [_strip(x) for x in v]
    return v


def load(path: Path, target: str) -> dict[str, object]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise NodeforgeError(f"cannot read var file {path}: {exc.strerror}") from exc
    try:
        data = hcl2.loads(text)
    except Exception as exc:  # lark raises several types; all carry line/column
        line = getattr(exc, "line", "?")
        col = getattr(exc, "column", "?")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NodeforgeError(
            f"{path}:{line}:{col}: not valid HCL2 ({first}); a var file holds lines like "
            f'region = "eu-west-1"'
        ) from exc
    values = {_strip(k): _strip(v) for k, v in data.items() if k not in HCL2_META}
    known = {v.name: v for v in variables_for(target)}
    for name, value in values.items():
        if name in INTERNAL:
            raise NodeforgeError(
                f"{path}: variable '{name}' is set by nodeforge; remove it from the var file"
            )
        if name not in known:
            allowed = ", ".join(sorted(set(known) - INTERNAL))
            raise NodeforgeError(
                f"{path}: unknown variable '{name}' for target '{target}'; known variables: {allowed}"
            )
        typ = known[name].type
        ok = (
            (typ == "string" and isinstance(value, str))
            or (typ == "number" and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (typ == "bool" and isinstance(value, bool))
            or (typ.startswith("map(") and isinstance(value, dict))
            or (typ.startswith("list(") and isinstance(value, list))
        )
        if not ok:
            raise NodeforgeError(f"{path}: variable '{name}' must be of type {typ}, got {value!r}")
    return values
