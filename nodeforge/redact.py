"""The one redaction helper: what a secret looks like on its way to an error, a log line,
state.json, `node status` or an event, and what is shown instead.

- `url(u)`: a URL without its userinfo (``user:pass@``), with every query value hidden
  (presigned ``X-Amz-Signature``/``X-Amz-Credential``, ``Signature=``, ``sig=``, tokens) and
  no fragment.
- `text(s)`: free text with every URL in it shown as `url` shows it, and every PEM block, AWS
  access key id, ``password=...``-style value and long base64-like blob replaced.
- `value(s)`: how an error may show a value it refuses: `repr` of its redacted form, bounded.
- `obj(x)`: `text` applied to every string in a JSON-like structure (state.json, status).

Fields that ARE secrets (munge_key, users_keypair.private, DB passwords) are never formatted at
all; this module is the net for everything else, including a secret pasted into the wrong field.
Standard library only (it ships to nodes).
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from typing import Any

REDACTED = "<redacted>"
# A URL in free text: scheme://, then everything up to whitespace. Trailing punctuation that
# quotes or ends a sentence is given back after the URL is redacted.
_URL_IN_TEXT = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,15}://\S*")
_URL_TAIL = "'\")]},;:.!>"
_QUERY_KEY = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# host:port has a numeric port; "user:pass" split off by a '/' in the password does not.
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]*\]|[^:]*)(?::[0-9]*)?")
_PEM = re.compile(r"-----BEGIN[ A-Z0-9]{0,64}-----.*?(?:-----END[ A-Z0-9]{0,64}-----|\Z)", re.S)
# AWS access key ids (AKIA long-term, ASIA session, and the other documented prefixes).
_AWS_KEY_ID = re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}")
# name=value / name: value where the name says secret. The value ends at space, quote, & or ,
_NAMED = re.compile(
    r"(?i)((?<![A-Za-z0-9_-])(?:[A-Za-z0-9_-]{0,40}(?:password|passwd|secret|token|credential|"
    r"signature|api[_-]?key|access[_-]?key|private[_-]?key|storagepass)|sig|pwd|authorization)"
    r"[\"']?\s{0,3}[=:]\s{0,3}(?:bearer\s+|basic\s+)?[\"']?)([^\s\"'&,;]{3,})"
)
_NAMED_WORDS = ("pass", "pwd", "secret", "token", "credential", "sig", "key", "authorization")
# A run of base64 / base64url characters long enough to be a key (an AWS secret key is 40, a
# munge key's base64 at least 44).
_BLOB = re.compile(r"[A-Za-z0-9+/_-]{32,}={0,2}")
# The blob rule's scan: a URL is taken whole, so its path is judged segment by segment (a
# release path "com/NVIDIA/enroot/releases/download/v4" mixes upper, lower and digits across
# its segments but is no key); anything else is a blob candidate.
_URL_OR_BLOB = re.compile(f"(?P<url>{_URL_IN_TEXT.pattern})|{_BLOB.pattern}")


def url(u: str) -> str:
    """*u* without userinfo, query values or fragment (the scheme, host, port and path stay)."""
    try:
        parts = urllib.parse.urlsplit(u)
    except ValueError:
        return "<unparseable URL>"
    netloc, path = parts.netloc, parts.path
    if "@" in netloc:
        netloc = netloc.rsplit("@", 1)[1]
    elif "@" in path and not _HOST_PORT.fullmatch(netloc):
        # "https://user:pa/ss@host/x": an unencoded '/' in the password cut the authority;
        # everything up to the last '@' is credentials, not a host.
        rest = (netloc + path).rsplit("@", 1)[1]
        netloc, _, tail = rest.partition("/")
        path = "/" + tail if tail or rest.endswith("/") else ""
    query = "&".join(_query_item(q) for q in parts.query.split("&")) if parts.query else ""
    try:
        return urllib.parse.urlunsplit((parts.scheme, netloc, path, query, ""))
    except ValueError:
        return "<unparseable URL>"


def _query_item(item: str) -> str:
    key, eq, _ = item.partition("=")
    if eq and _QUERY_KEY.fullmatch(key) and not _looks_secret(key):
        return f"{key}=…"
    return "…"


def _url_match(m: re.Match[str]) -> str:
    s = m.group()
    cut = len(s.rstrip(_URL_TAIL))
    u = s[:cut]
    if not any(c in u for c in "@?#"):
        return s  # nothing to hide: leave it exactly as written ("SCHEME://HOST" in a hint)
    shown = url(u)
    if shown == "<unparseable URL>":
        # Not a URL urllib reads ("https://[x"): drop whatever could be userinfo or query.
        scheme, _, rest = u.partition("://")
        rest = rest.rsplit("@", 1)[-1]
        shown = f"{scheme}://{re.split(r'[?#]', rest, maxsplit=1)[0]}"
        shown += "?…" if any(c in rest for c in "?#") else ""
    return shown + s[cut:]


def _blob_match(m: re.Match[str]) -> str:
    return REDACTED if _looks_secret(m.group()) else m.group()


def _url_or_blob(m: re.Match[str]) -> str:
    if m.group("url") is None:
        return _blob_match(m)
    # a key in a URL's path is one segment (a '/' would end it): each segment is a candidate
    return "/".join(_BLOB.sub(_blob_match, seg) for seg in m.group().split("/"))


def _looks_secret(s: str) -> bool:
    """A run of base64-ish characters that mixes upper case, lower case and digits (a key).
    One that starts with '/' may be a path (/var/lib/...): it counts when it has base64's
    '+' or '=' padding, or a 16+ character segment that mixes all three."""
    core = s.rstrip("=")
    if len(core) < 32:
        return False
    if core.startswith("/") and "+" not in core and core == s:
        return any(len(seg) >= 16 and _mixed(seg) for seg in core.split("/"))
    return _mixed(core)


def _mixed(s: str) -> bool:
    return (
        any(c.isupper() for c in s) and any(c.islower() for c in s) and any(c.isdigit() for c in s)
    )


def text(s: str) -> str:
    """*s* with URLs, PEM blocks, AWS key ids, named secrets and key-like blobs redacted."""
    if len(s) < 7:  # "pwd=abc" is the shortest thing a rule hides
        return s
    # Cheap checks first: most strings (state.json's statuses, names) skip every regex, and an
    # error message pays ~10 us.
    if "-----BEGIN" in s:
        s = _PEM.sub("<redacted PEM block>", s)
    if "://" in s:
        s = _URL_IN_TEXT.sub(_url_match, s)
    if len(s) >= 20 and "A" in s:
        s = _AWS_KEY_ID.sub(REDACTED, s)
    if ("=" in s or ":" in s) and any(w in s.lower() for w in _NAMED_WORDS):
        s = _NAMED.sub(lambda m: m.group(1) + "***", s)
    if len(s) >= 32:
        s = _URL_OR_BLOB.sub(_url_or_blob, s) if "://" in s else _BLOB.sub(_blob_match, s)
    return s


def value(v: Any, limit: int = 80) -> str:
    """`repr` of a refused value for an error message, secrets hidden, at most *limit* chars.

    A value that is a URL is redacted as one URL first, so a password with spaces or quotes in
    it cannot slip past the free-text rules."""
    if not isinstance(v, str):
        v = str(v)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]{0,15}://", v):
        v = url(v)
    v = text(v)
    if len(v) > limit:
        v = v[:limit] + "…"
    return repr(v)


class Formatter(logging.Formatter):
    """A log formatter whose every line (message, arguments and traceback) goes through
    `text`: the net under every log call, including a crash's traceback."""

    def format(self, record: logging.LogRecord) -> str:
        return text(super().format(record))


def obj(x: Any) -> Any:
    """*x* (dicts, lists, strings, scalars) with `text` applied to every string."""
    if isinstance(x, str):
        return text(x)
    if isinstance(x, dict):
        return {k: obj(val) for k, val in x.items()}
    if isinstance(x, list | tuple):
        return [obj(val) for val in x]
    return x
