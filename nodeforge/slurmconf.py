"""Slurm `Key=Value` text: the one writer and reader (slurm.conf lines, `slurmd --conf`,
`scontrol create` words).

Slurm's parser (s_p_parse_line) takes `Key=Value` pairs separated by whitespace; a value is a
run of non-space characters, or a double-quoted string without `"` in it; `#` starts a comment
anywhere on the line (even inside quotes). So a value with a newline, `#`, `"` or a backslash
cannot be written safely and is refused; a value with spaces is double-quoted; an `=` in a
value is refused because the words of a line must split into exactly the intended keys.
Values reach here already validated by their grammar (params); this is defence in depth.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from .errors import NodeforgeError

KEY_RE = re.compile(r"[A-Za-z][A-Za-z0-9]{0,63}")
# Plain values: the characters Slurm values in nodeforge need (names, addresses, lists,
# host(addr), [v6], plugin/paths, times, gres counts) and nothing Slurm treats specially.
_PLAIN_RE = re.compile(r"[A-Za-z0-9_.,:/@+()\[\]*-]{1,4096}")
# What may sit inside double quotes: printable ASCII except `"`, `#`, `\` and `=`.
_QUOTABLE_RE = re.compile(r"[ !$%&'()*+,\-./0-9:;<>?@A-Z\[\]^_`a-z{|}~]{1,4096}")
_WORD_RE = re.compile(r'\s*([A-Za-z][A-Za-z0-9]*)=(?:"([^"]*)"|([^\s"]+))(?=\s|$)')


class SlurmConfError(NodeforgeError):
    """A value cannot be written as Slurm Key=Value text; the message names the key."""


def value(key: str, v: object) -> str:
    """*v* rendered for `key=`: plain, or double-quoted when it has spaces; else refused."""
    if not KEY_RE.fullmatch(key):
        raise SlurmConfError(f"slurm.conf: {key!r} is not a Slurm key")
    s = str(v)
    if _PLAIN_RE.fullmatch(s):
        return s
    if _QUOTABLE_RE.fullmatch(s) and s.strip() == s:
        return f'"{s}"'
    raise SlurmConfError(
        f"slurm.conf: {key}={s!r}: a Slurm value cannot hold a newline, control character, "
        "'#', '\"', '\\' or '=' (nor lead/trail spaces); fix the params value"
    )


def line(pairs: Mapping[str, object] | Iterable[tuple[str, object]]) -> str:
    """One line of `Key=Value` words."""
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return " ".join(f"{k}={value(k, v)}" for k, v in items)


def words(pairs: Mapping[str, object] | Iterable[tuple[str, object]]) -> list[str]:
    """`Key=Value` argv words (for `scontrol create ...`): each a single argument."""
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return [f"{k}={value(k, v)}" for k, v in items]


def parse_line(text: str) -> list[tuple[str, str]]:
    """The `(key, value)` pairs of one line, as Slurm's parser sees them (comments removed).
    Raises SlurmConfError for text that is not a sequence of Key=Value words."""
    text = text.split("#", 1)[0]
    out: list[tuple[str, str]] = []
    pos = 0
    while text[pos:].strip():
        m = _WORD_RE.match(text, pos)
        if m is None:
            raise SlurmConfError(f"not Key=Value at {text[pos : pos + 40]!r}")
        out.append((m.group(1), m.group(2) if m.group(2) is not None else m.group(3)))
        pos = m.end()
    return out


def parse_conf(text: str) -> list[list[tuple[str, str]]]:
    """Every non-empty, non-comment line of a slurm.conf, parsed with parse_line."""
    return [parse_line(ln) for ln in text.splitlines() if ln.split("#", 1)[0].strip()]
