"""Recording actions: the job's AdminComment (durable, visible in `scontrol show job`) and an
append-only JSON-lines event log."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

TAG = "nfg-gang:"


def encode_admin(
    existing: str,
    *,
    count: int,
    phase: str,
    next_eligible: float | None,
    restarts: int | None,
    why: str,
    first_admitted: float | None = None,
) -> str:
    """Our token replaces any previous one; foreign AdminComment text is kept."""
    fields = [f"n={count}", f"phase={phase}"]
    if next_eligible is not None:
        fields.append(f"next={int(next_eligible)}")
    if restarts is not None:
        fields.append(f"r={restarts}")
    if first_admitted is not None:
        fields.append(f"f={int(first_admitted)}")
    if why:
        fields.append("why=" + "".join(c if c.isalnum() or c in "-_." else "_" for c in why)[:60])
    keep = [t for t in existing.split() if not t.startswith(TAG)]
    return " ".join(keep + [TAG + ",".join(fields)])


# Our token, full match: an AdminComment is operator-written text; anything else is ignored
_TOKEN = re.compile(
    r"nfg-gang:n=[0-9]{1,6},phase=[a-z_]{1,20}(?:,next=[0-9]{1,12})?(?:,r=[0-9]{1,6})?"
    r"(?:,f=[0-9]{1,12})?"
    r"(?:,why=[A-Za-z0-9_.-]{0,60})?"
)


def decode_admin(text: str) -> dict[str, str] | None:
    for tok in text.split():
        if tok.startswith(TAG) and _TOKEN.fullmatch(tok):
            out = {}
            for kv in tok[len(TAG) :].split(","):
                if "=" in kv:
                    k, v = kv.split("=", 1)
                    out[k] = v
            return out
    return None


class EventLog:
    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: dict) -> dict:
        rec = {"time": round(time.time(), 3), **event}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")
        return rec


def read_events(path: str | os.PathLike, job_id: str | None = None) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if job_id is None or str(e.get("job_id")) == str(job_id):
            out.append(e)
    return out
