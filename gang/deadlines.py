"""Per-job readiness timeouts within the operator's bounds (Kueue's per-workload timeouts).

A user asks for a longer or shorter `timeout` for one job with a token `<key>=<time>` (e.g.
`nfg-timeout=20:00`) in the one job field the operator allows (`deadlines.field`: the job's
Comment, `sbatch --comment`, or 24.11's `--extra`). The governor reads that field from the
job's own structured JSON record, so no text in another job, a job name or a directory can
be taken for it, and only the job's owner or an operator can set it. The value is read at
each admission and kept for that run: an edit after admission does not move the deadline.

Pure functions: no I/O, no clock (gang.policy calls request() at an admission).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum

from .config import Deadlines
from .slurm_view import JobObs


class Verdict(str, Enum):  # noqa: UP042 - str-valued like ActionKind (events compare names)
    """What became of a request; the event's reason."""

    SET = "DeadlineSet"
    CLAMPED = "DeadlineClamped"
    REFUSED = "DeadlineRefused"

    def __str__(self) -> str:
        return self.value


class Why(str, Enum):  # noqa: UP042
    """Short codes for the AdminComment (what `scontrol show job` shows the user)."""

    OK = "ok"
    OFF = "off"  # the operator allows no field
    FIELD = "field_not_allowed"  # asked in a field other than the allowed one
    DUPLICATE = "duplicate"  # asked more than once in the allowed field
    MALFORMED = "malformed"  # not a Slurm time or N s (NaN, negative, huge, words, ...)
    BELOW_MIN = "below_min"
    ABOVE_MAX = "above_max"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    why: Why
    timeout: float | None  # the timeout of this run; None = the configured default
    detail: str  # for the event log: what was asked, where, and what applies


# The fields a user can write that the governor reads (JSON keys, as in JobObs)
FIELDS = ("comment", "extra", "name")
# Slurm's time formats (as `--time`: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) or N seconds
# (`Ns`); ASCII digits, at most 9 a field, so no number is huge before the bounds apply.
_N = r"[0-9]{1,9}"
_SEXA = r"[0-5]?[0-9]"
_TIME = re.compile(
    rf"(?P<secs>{_N})s"
    rf"|(?P<d>{_N})-(?P<dh>[01]?[0-9]|2[0-3])(?::(?P<dm>{_SEXA})(?::(?P<ds>{_SEXA}))?)?"
    rf"|(?P<h>{_N}):(?P<hm>{_SEXA}):(?P<hs>{_SEXA})"
    rf"|(?P<m>{_N})(?::(?P<ms>{_SEXA}))?"
)
_SHOWN = 40  # characters of a refused value shown back (it is the user's text)


def parse_time(value: str) -> float | None:
    """Seconds, or None when *value* is not in the grammar."""
    m = _TIME.fullmatch(value)
    if m is None:
        return None
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "secs" in g:
        return float(g["secs"])
    if "d" in g:
        return float(g["d"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0))
    if "h" in g:
        return float(g["h"] * 3600 + g["hm"] * 60 + g["hs"])
    return float(g["m"] * 60 + g.get("ms", 0))


def _tokens(text: str, key: str) -> list[str]:
    """The values of `<key>=` tokens (whitespace or comma separated, as comment_flag)."""
    prefix = key + "="
    return [t[len(prefix) :] for t in text.replace(",", " ").split() if t.startswith(prefix)]


def _show(value: str) -> str:
    return ascii(value[:_SHOWN]) + ("..." if len(value) > _SHOWN else "")


def request(d: Deadlines, default: float, job: JobObs) -> Decision | None:
    """The job's request, judged; None when it asks for nothing (anywhere)."""
    found = {f: _tokens(getattr(job, f), d.key) for f in FIELDS}
    asked = {f: v for f, v in found.items() if v}
    if not asked:
        return None
    keep = f"the default timeout {default:g}s applies"
    if d.field == "none":
        return _refused(Why.OFF, f"per-job deadlines are off on this cluster; {keep}")
    others = sorted(set(asked) - {d.field})
    if others:
        return _refused(
            Why.FIELD,
            f"{d.key}= in the job's {', '.join(others)}: only its {d.field} is read "
            f"(sbatch --{d.field}); {keep}",
        )
    (values,) = asked.values()
    if len(values) > 1:
        return _refused(Why.DUPLICATE, f"{d.key}= given {len(values)} times; {keep}")
    raw = values[0]
    secs = parse_time(raw)
    if secs is None or not math.isfinite(secs):
        return _refused(
            Why.MALFORMED,
            f"{d.key}={_show(raw)} is not a time (Slurm's M, M:S, H:M:S, D-H, D-H:M, "
            f"D-H:M:S, or Ns for seconds); {keep}",
        )
    lo, hi = d.min_seconds, d.max_seconds
    if lo <= secs <= hi:
        return Decision(Verdict.SET, Why.OK, secs, f"{d.key}={raw}: timeout {secs:g}s")
    why = Why.BELOW_MIN if secs < lo else Why.ABOVE_MAX
    bound = lo if secs < lo else hi
    if d.out_of_bounds == "clamp":
        return Decision(
            Verdict.CLAMPED,
            why,
            bound,
            f"{d.key}={raw} ({secs:g}s) is outside {lo:g}..{hi:g}s: clamped to {bound:g}s",
        )
    return _refused(why, f"{d.key}={raw} ({secs:g}s) is outside {lo:g}..{hi:g}s; {keep}")


def _refused(why: Why, detail: str) -> Decision:
    return Decision(Verdict.REFUSED, why, None, detail)


TAG = "nfg-deadline:"


def admin_token(dec: Decision, applied: float) -> str:
    """The AdminComment token the user sees in `scontrol show job`, e.g.
    `nfg-deadline:refused,t=300,why=malformed` (t: the timeout of this run, seconds)."""
    status = {Verdict.SET: "set", Verdict.CLAMPED: "clamped", Verdict.REFUSED: "refused"}
    return f"{TAG}{status[dec.verdict]},t={applied:.0f},why={dec.why}"


def with_token(existing: str, token: str) -> str:
    """*existing* AdminComment with our deadline token replaced (other text kept)."""
    keep = [t for t in existing.split() if not t.startswith(TAG)]
    return " ".join([*keep, token])
