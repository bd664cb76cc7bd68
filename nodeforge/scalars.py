"""Typed scalar fields read strictly: integers, seconds and Slurm times.

The strict YAML loader (nodeforge/strict_yaml.py) leaves every scalar that YAML 1.1 would
retype (`010` octal, `2:00:00` base 60, `0x1f`, `1_000`) as the string it reads as; these
parsers decide what a field accepts and say so when a value is not one of those forms. Each
raises ScalarError with a message that starts with what was expected and names the accepted
forms; the caller prefixes the file and the field.
"""

from __future__ import annotations

import re
from typing import Any

INT_FORMS = "a decimal integer such as 96 (no leading zero, quotes, '_', 0x/0o/0b or ':')"
SLURM_TIME_FORMS = (
    "minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, "
    "days-hours:minutes:seconds, INFINITE or UNLIMITED (e.g. 90, 1:30:00, 2-12:00:00)"
)

_DECIMAL = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")
_LEADING_ZERO = re.compile(r"[-+]?0[0-9_]+")
_PREFIXED = re.compile(r"[-+]?0[oOxXbB][0-9a-fA-F_]*")
_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-9]{1,2})+(?:\.[0-9_]*)?")
_UNDERSCORE = re.compile(r"[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?")

# Slurm's time forms (sbatch(1) --time); a part after the first is at most two digits.
_MIN = r"(?P<m>0|[1-9][0-9]{0,6})"
_SLURM_TIME = re.compile(
    rf"{_MIN}"
    r"|(?P<ms_m>[0-9]{1,7}):(?P<ms_s>[0-9]{1,2})"
    r"|(?P<hms_h>[0-9]{1,5}):(?P<hms_m>[0-9]{1,2}):(?P<hms_s>[0-9]{1,2})"
    r"|(?P<d>[0-9]{1,5})-(?P<dh>[0-9]{1,2})(?::(?P<dm>[0-9]{1,2})(?::(?P<ds>[0-9]{1,2}))?)?"
)
SLURM_TIME_MAX_DAYS = 99999  # far below INFINITE (2^32 - 1 minutes); a typo, not a wish


class ScalarError(ValueError):
    """A value is not of its field's type; the message names the accepted forms."""


def _tn(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def yaml11_note(s: str) -> str | None:
    """What YAML 1.1 would have made of the string *s* if it is one of the number forms the
    strict loader leaves as text (and so why it is refused), else None."""
    if _LEADING_ZERO.fullmatch(s):
        return "a leading zero is octal in YAML 1.1 (010 is 8); write the number without it"
    if _PREFIXED.fullmatch(s):
        return "0x/0o/0b forms are not accepted; write the decimal value"
    if _SEXAGESIMAL.fullmatch(s):
        return "a:b is base 60 in YAML 1.1 (1:30 is 90); write the decimal value"
    if "_" in s and _UNDERSCORE.fullmatch(s):
        return "'_' separators are not accepted; write the digits alone (1000)"
    return None


def why_not_int(s: str) -> str:
    """Why the string *s* is not a plain decimal integer."""
    note = yaml11_note(s)
    if note is not None:
        return note
    if _DECIMAL.fullmatch(s):
        return "it is quoted; write the number without quotes"
    if re.fullmatch(r"[0-9]{20,}", s):
        return "too many digits"
    return f"expected {INT_FORMS}"


def integer(v: Any, lo: int, hi: int) -> int:
    """An int in [lo, hi]; a bool, a float or a string is refused with its reason."""
    if isinstance(v, bool) or not isinstance(v, int):
        detail = ""
        if isinstance(v, str):
            detail = f" {v[:40]!r}: {why_not_int(v)}"
        elif isinstance(v, float):
            detail = f" {v!r}: a whole number has no decimal point"
        raise ScalarError(f"expected an integer, got {_tn(v)}{detail}")
    if v < lo or v > hi:
        raise ScalarError(f"{v} out of range [{lo}, {hi}]")
    return v


def integer_text(s: str, lo: int, hi: int) -> int:
    """An integer written as text (kernel command line): decimal digits, no leading zero."""
    if not re.fullmatch(r"0|[1-9][0-9]{0,18}", s):
        reason = why_not_int(s) if _DECIMAL.fullmatch(s) is None else f"expected {INT_FORMS}"
        raise ScalarError(f"expected an integer, got {s[:40]!r}: {reason}")
    return integer(int(s), lo, hi)


def why_not_seconds(v: Any) -> str:
    """The reason a non-number is not seconds (for a caller's 'expected a number' message)."""
    if isinstance(v, str):
        note = yaml11_note(v)
        return f" {v[:40]!r}" + (f": {note}" if note else "")
    return ""


def slurm_time(v: Any) -> str:
    """A Slurm time limit (MaxTime): an int is minutes; a string one of Slurm's own forms.
    Returns the text Slurm gets."""
    if isinstance(v, bool) or v is None or isinstance(v, float):
        raise ScalarError(
            f"expected a Slurm time, got {_tn(v)} {v!r}; accepted: {SLURM_TIME_FORMS}"
        )
    if isinstance(v, int):
        if not 0 <= v <= SLURM_TIME_MAX_DAYS * 1440:
            raise ScalarError(
                f"{v} minutes out of range [0, {SLURM_TIME_MAX_DAYS * 1440}]; accepted: "
                f"{SLURM_TIME_FORMS}"
            )
        return str(v)
    if not isinstance(v, str):
        raise ScalarError(f"expected a Slurm time, got {_tn(v)}; accepted: {SLURM_TIME_FORMS}")
    if v in ("INFINITE", "UNLIMITED"):
        return v
    m = _SLURM_TIME.fullmatch(v)
    if m is None:
        hint = ""
        if _LEADING_ZERO.fullmatch(v):
            hint = " (a leading zero on bare minutes is ambiguous: YAML 1.1 read 010 as 8)"
        raise ScalarError(f"{v[:40]!r} is not a Slurm time{hint}; accepted: {SLURM_TIME_FORMS}")
    g = {k: int(x) for k, x in m.groupdict().items() if x is not None}
    over = [
        name
        for name, key, top in (
            ("seconds", "ms_s", 59),
            ("minutes", "hms_m", 59),
            ("seconds", "hms_s", 59),
            ("hours", "dh", 23),
            ("minutes", "dm", 59),
            ("seconds", "ds", 59),
            ("days", "d", SLURM_TIME_MAX_DAYS),
        )
        if g.get(key, 0) > top
    ]
    if over:
        raise ScalarError(f"{v!r}: {over[0]} out of range; accepted: {SLURM_TIME_FORMS}")
    return v
