"""Slurm's jobs and nodes as typed records, read from Slurm's JSON output: the one reader
for the gang governor (controller) and the node agent.

Why JSON and not `scontrol show -o` / `squeue -o`: those print user-written text (job name,
Comment, WorkDir, StdOut paths) unescaped inside the record, so a job named
`train NumNodes=1` or a WorkDir holding a newline and `JobId=999 JobState=RUNNING` shifts or
adds fields. Slurm's JSON serializer escapes every string, so nothing a user writes can
leave its own value. Commands (both checked on a real slurmctld, see tests/e2e):

- jobs: `scontrol show job --json` on Slurm >= 23.02; `squeue --json` on 22.05 (openapi
  v0.0.38; 22.05's scontrol has no --json),
- nodes: `scontrol show node --json` on >= 23.02; `sinfo --json` on 22.05.

The two schema generations differ in shape, not meaning (22.05: `job_state: "RUNNING"`,
`priority: 7`; 24.11: `job_state: ["RUNNING"]`, `priority: {"set": true, "number": 7}`);
`_num`/`_states` read both. Every fixed-grammar field is checked with a full-match grammar and
numbers are bounded: a record that does not fit is an error naming the job and the field,
never a guess. Times are epoch seconds as Slurm sends them (no local-time parsing, so the
repeated DST hour cannot shift a deadline). A job id (or node name) listed twice is an error.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar, cast

from nodeforge.errors import NodeforgeError
from nodeforge.slurm_facts import has

_INT_MAX = 2**63 - 1
_U32_NO_VAL = 0xFFFFFFFE  # Slurm's NO_VAL (and INFINITE above it) in a uint32 field
# an array's pending task ids as Slurm prints them (bit_fmt, then "%N" for a run limit)
_TASK_RANGE = r"[0-9]{1,10}(?:-[0-9]{1,10}(?::[0-9]{1,10})?)?"  # ([0-9]: no Unicode digits)
_ARRAY_TASKS = re.compile(rf"{_TASK_RANGE}(?:,{_TASK_RANGE})*")
_DIGITS = re.compile(r"[0-9]{1,10}")
_STATE_WORD = re.compile(r"[A-Z][A-Z_]*")
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HOSTLIST = re.compile(r"[A-Za-z0-9._\-\[\],]*")
_PARTITION = re.compile(r"[A-Za-z0-9._-]+(?:,[A-Za-z0-9._-]+)*|")
_QOS = re.compile(r"[A-Za-z0-9._-]*")
_REASON = re.compile(r"[A-Za-z0-9_.:/() ,+-]*")  # Slurm's enum names; scontrol-set texts
MAX_HOSTLIST_NODES = 100_000  # a range like n[1-999999999] is refused, not expanded

# Base job states (scontrol's JobState); a 24.11 record lists them with flags.
JOB_BASE_STATES = frozenset(
    {
        "PENDING",
        "RUNNING",
        "SUSPENDED",
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)
FINISHED = frozenset(JOB_BASE_STATES - {"PENDING", "RUNNING", "SUSPENDED"}) | {
    "SPECIAL_EXIT",
    "REVOKED",
}
# Flags that scontrol shows *instead of* the base state (job_state_string's order).
_SHOWN_FLAGS = ("COMPLETING", "CONFIGURING", "RESIZING", "REQUEUED", "STAGE_OUT", "SIGNALING")


class SlurmDataError(NodeforgeError):
    """Slurm's output does not have the shape this reader checks for."""


# Slurm's output as bytes (UTF-8), e.g. a memory map of what the client wrote: find() and
# the buffer API are all the readers use.
Buffer = bytes | bytearray | mmap.mmap


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: int  # Slurm's own id of this job (an array task has one too)
    state: str  # what scontrol shows as JobState: a base state or COMPLETING/CONFIGURING/...
    base_state: str  # PENDING, RUNNING, COMPLETED, ...
    state_flags: frozenset[str]
    reason: str  # state_reason (Slurm's enum name, e.g. JobHeldAdmin, BeginTime)
    num_nodes: int
    nodes: tuple[str, ...]
    partition: str = ""
    qos: str = ""
    start_time: int | None = None  # epoch seconds; None = not set
    submit_time: int | None = None
    eligible_time: int | None = None
    priority: int | None = None
    restarts: int = 0
    requeue: bool = True
    batch: bool = True  # any BatchFlag >= 1
    array_job_id: int | None = None
    array_task_id: int | None = None
    het_job_id: int | None = None
    het_job_offset: int | None = None
    # an array's record of tasks not started yet (array_task_id unset): their ids, e.g.
    # "2-9" or "1,3,5-7:2" (Slurm's "%N" run limit taken off); "" otherwise
    array_tasks: str = ""
    user_id: int | None = None
    # Free text: written by users (name, comment) or admins (admin_comment). Kept as data,
    # never used to find another field.
    name: str = ""
    comment: str = ""
    admin_comment: str = ""
    state_description: str = ""
    extra: str = ""  # sbatch --extra (>= 23.02; 22.05 has no such field)

    @property
    def key(self) -> str:
        """Identity as operators write it: `ArrayJobId_TaskId` for array tasks, else JobId."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return str(self.job_id)


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    flags: frozenset[str]  # base state and flags, upper case: {"IDLE", "DRAIN", "CLOUD"}
    reason: str = ""
    base: str = ""  # the base state alone (IDLE, MIXED, FUTURE, ...); "" if none is listed


@dataclass(frozen=True, slots=True)
class JobState:
    """One job of a state listing (`squeue --json --only-job-state`, Slurm >= 24.05): its
    name and state, nothing a user writes. The listing names a job as squeue does: `N` (a
    job), `A_T` (array task T of array A: one entry per task, also for the tasks still in
    the array's one record of pending tasks), `N+O` (het component N, offset O)."""

    key: str
    base_state: str
    state_flags: frozenset[str]
    job: int  # N, or A for an array task: what squeue's --jobs filter takes
    task: int | None = None  # T of `A_T`
    het_offset: int | None = None  # O of `N+O`

    @property
    def pending(self) -> bool:
        """PENDING with no flag (a requeued job's old allocation still COMPLETING is not)."""
        return self.base_state == "PENDING" and not self.state_flags

    def shows(self, r: JobRecord) -> bool:
        """Does the full record *r* show this state?"""
        return r.base_state == self.base_state and r.state_flags == self.state_flags


# Node base states (node_state_base_string); anything else in a state list is a flag.
NODE_BASE_STATES = frozenset({"UNKNOWN", "DOWN", "IDLE", "ALLOCATED", "ERROR", "MIXED", "FUTURE"})


def _fail(what: str, field: str, value: object) -> SlurmDataError:
    return SlurmDataError(
        f"Slurm JSON: {what}: field {field!r} has an unexpected value {value!r:.120} "
        "(is this a Slurm version the reader knows? 22.05 and >= 23.02 are)"
    )


def _num(v: object, what: str, field: str, *, zero_is_unset: bool = False) -> int | None:
    """22.05 sends a plain number; >= 23.02 `{"set": bool, "infinite": bool, "number": n}`."""
    if isinstance(v, dict):
        if not v.get("set", True) or v.get("infinite", False):
            return None
        v = v.get("number")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(what, field, v)
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise _fail(what, field, v)
        v = int(v)
    if not 0 <= v <= _INT_MAX:
        raise _fail(what, field, v)
    if zero_is_unset and v == 0:
        return None
    return v


def _str(v: object, what: str, field: str, grammar: re.Pattern | None = None) -> str:
    if v is None:
        return ""
    if not isinstance(v, str):
        raise _fail(what, field, v)
    if grammar is not None and not grammar.fullmatch(v):
        raise _fail(what, field, v)
    return v


def _free_text(v: object, what: str, field: str) -> str:
    """User/admin text: any string (it is data); NUL and other odd types are refused."""
    if v is None:
        return ""
    if not isinstance(v, str) or "\x00" in v:
        raise _fail(what, field, v)
    return v


def _bool(v: object, what: str, field: str, default: bool) -> bool:
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255:
        return v >= 1  # BatchFlag=2 after Slurm's own launch-failure requeue is still batch
    raise _fail(what, field, v)


def _states(v: object, what: str, field: str) -> tuple[str, frozenset[str]]:
    """-> (base state or '', flags). 22.05: one word; >= 23.02: a list of words."""
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not words:
        raise _fail(what, field, v)
    out = []
    for w in words:
        if w == "?":
            continue  # a flag bit Slurm's own table lacks
        if not isinstance(w, str) or not _STATE_WORD.fullmatch(w.upper()):
            raise _fail(what, field, v)
        out.append(w.upper())
    if not out:
        raise _fail(what, field, v)
    base = next((w for w in out if w in JOB_BASE_STATES), "")
    return base, frozenset(w for w in out if w != base)


@functools.lru_cache(maxsize=16384)
def expand_hostlist(expr: str) -> tuple[str, ...]:
    """Expand a Slurm hostlist (`gn[1-3,5],gc1`) without calling scontrol; checked."""
    if not expr or expr in ("(null)", "None"):
        return ()
    if not _HOSTLIST.fullmatch(expr):
        raise SlurmDataError(f"Slurm hostlist {expr!r:.120}: unexpected characters")
    parts, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        if depth not in (0, 1):
            raise SlurmDataError(f"Slurm hostlist {expr!r:.120}: unbalanced brackets")
        cur += ch
    parts.append(cur)
    names: list[str] = []
    for p in parts:
        m = re.fullmatch(r"([^\[\]]*)\[([0-9,\-]+)\]([^\[\]]*)", p)
        if not m:
            if not _NODE_NAME.fullmatch(p):
                raise SlurmDataError(f"Slurm hostlist {expr!r:.120}: bad name {p!r}")
            names.append(p)
            continue
        pre, body, post = m.groups()
        for rng in body.split(","):
            a, _, b = rng.partition("-")
            if not a.isdigit() or (b and not b.isdigit()):
                raise SlurmDataError(f"Slurm hostlist {expr!r:.120}: bad range {rng!r}")
            lo, hi = int(a), int(b) if b else int(a)
            if hi < lo or hi - lo + len(names) >= MAX_HOSTLIST_NODES:
                raise SlurmDataError(f"Slurm hostlist {expr!r:.120}: range {rng!r} too large")
            names.extend(f"{pre}{i:0{len(a)}d}{post}" for i in range(lo, hi + 1))
    return tuple(names)


def job_from_json(d: object) -> JobRecord:
    if not isinstance(d, dict):
        raise SlurmDataError(f"Slurm JSON: a job entry is not an object: {d!r:.80}")
    jid = _num(d.get("job_id"), "job", "job_id")
    if jid is None or jid == 0:
        raise _fail("job", "job_id", d.get("job_id"))
    what = f"job {jid}"
    base, flags = _states(d.get("job_state"), what, "job_state")
    # scontrol shows a flag (COMPLETING, CONFIGURING, REQUEUE_HOLD, ...) instead of the base
    # state; 22.05's JSON sends only that one word, >= 23.02 the base state and all flags.
    # Any well-formed state word is accepted: a transition state this reader does not know
    # (REQUEUE_HOLD right after requeuehold, RESV_DEL_HOLD, ...) must not blind the
    # governor to every other job; it decides nothing on a state it does not know.
    shown = next((f for f in _SHOWN_FLAGS if f in flags), base) or min(flags)
    if not base and shown == "CONFIGURING":
        base = "RUNNING"
    nodelist = _str(d.get("nodes"), what, "nodes", _HOSTLIST)
    array_job = _num(d.get("array_job_id"), what, "array_job_id", zero_is_unset=True)
    array_task = _num(d.get("array_task_id"), what, "array_task_id")
    if array_task is not None and array_task >= _U32_NO_VAL:
        array_task = None  # Slurm's NO_VAL/INFINITE: the array's record of pending tasks
    tasks = ""
    if array_job is not None and array_task is None:
        # (a string this grammar does not know leaves the record without a task list: the
        # governor then cannot name it and issues no command to it, rather than guessing)
        raw = d.get("array_task_string")
        spec, pct, limit = raw.partition("%") if isinstance(raw, str) else ("", "", "")
        ok = _ARRAY_TASKS.fullmatch(spec) and (not pct or _DIGITS.fullmatch(limit))
        tasks = spec if ok else ""
    het_job = _num(d.get("het_job_id"), what, "het_job_id", zero_is_unset=True)
    return JobRecord(
        job_id=jid,
        state=shown,
        base_state=base,
        state_flags=flags,
        reason=_str(d.get("state_reason"), what, "state_reason", _REASON) or "None",
        num_nodes=_num(d.get("node_count"), what, "node_count") or 0,
        nodes=expand_hostlist(nodelist),
        partition=_str(d.get("partition"), what, "partition", _PARTITION),
        qos=_str(d.get("qos"), what, "qos", _QOS),
        start_time=_num(d.get("start_time"), what, "start_time", zero_is_unset=True),
        submit_time=_num(d.get("submit_time"), what, "submit_time", zero_is_unset=True),
        eligible_time=_num(d.get("eligible_time"), what, "eligible_time", zero_is_unset=True),
        priority=_num(d.get("priority"), what, "priority"),
        restarts=_num(d.get("restart_cnt"), what, "restart_cnt") or 0,
        requeue=_bool(d.get("requeue"), what, "requeue", True),
        batch=_bool(d.get("batch_flag"), what, "batch_flag", True),
        array_job_id=array_job,
        array_task_id=array_task if array_job is not None else None,
        het_job_id=het_job,
        het_job_offset=_num(d.get("het_job_offset"), what, "het_job_offset")
        if het_job is not None
        else None,
        array_tasks=tasks,
        user_id=_num(d.get("user_id"), what, "user_id"),
        name=_free_text(d.get("name"), what, "name"),
        comment=_free_text(d.get("comment"), what, "comment"),
        admin_comment=_free_text(d.get("admin_comment"), what, "admin_comment"),
        state_description=_free_text(d.get("state_description"), what, "state_description"),
        extra=_free_text(d.get("extra"), what, "extra"),
    )


def _load(text: str | Buffer, key: str, source: str) -> list:
    if not isinstance(text, str):  # Slurm writes UTF-8; anything else is refused, not guessed
        try:
            text = str(text, "utf-8")
        except UnicodeDecodeError as exc:
            raise SlurmDataError(f"{source}: not UTF-8 ({exc})") from exc
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise SlurmDataError(f"{source}: not JSON ({exc}); truncated output?") from exc
    except RecursionError:  # json.loads recurses per level; Slurm's own output nests ~6
        raise SlurmDataError(f"{source}: JSON nested too deep to be Slurm's output") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise SlurmDataError(f"{source}: no {key!r} list in the JSON document")
    errs = doc.get("errors") or []
    if errs:
        raise SlurmDataError(f"{source}: slurmctld reported errors: {errs!r:.300}")
    return doc[key]


class BlockCache:
    """What parse_jobs or parse_nodes keeps between calls (one per reader and list, e.g. the
    governor's jobs and its nodes): the text of each item of the last document (UTF-8 bytes),
    in its order, and the record parsed from it. See `_walk` for how it is used and why that
    is exact. *kind* is the list the entries came from: a cache handed the other list starts
    empty (a job's text is never looked up among nodes). *blob*/*offs*: the entries' texts
    end to end and where each starts, when no entry has a volatile number (the listing, the
    nodes): a run of unchanged items is then one comparison (_run). *out*: what the last
    call returned for these entries, handed out again when every item is unchanged.

    *ids*: the entries by their item's id (made when a walk first needs it, then kept in
    step with what each walk added and dropped): an item not in it is new, with no search
    for where it stood. *delta*: (the output before, the output now, the records added, the
    records dropped) of the last walk that kept every remaining item in its order, else
    None: a reader of the list (read_plan) updates what it derived from the output before by
    these alone. *walked*: the delta a walk found, until keep() takes it."""

    __slots__ = ("blob", "delta", "entries", "ids", "kind", "offs", "out", "walked")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.kind = ""
        self.blob: bytes | None = None
        self.offs: list[int] = []
        self.out: object = None
        self.ids: dict[object, Entry] | None = None
        self.delta: tuple[object, object, list[Record], list[Record]] | None = None
        self.walked: tuple[list[Entry], list[Entry]] | None = None

    def keep(self, walked: list[Entry] | None, lst: _List, out: object) -> None:
        """Hold this call's items of list *lst* (None: the full parse decided, nothing is
        kept)."""
        kind = lst.cache_kind
        step, self.walked = self.walked, None
        if walked is not None and walked is self.entries and self.kind == kind:
            return  # (every item unchanged: the same blob and output)
        before = self.out if self.kind == kind else None
        self.entries, self.kind = walked if walked is not None else [], kind
        self.out = out if walked is not None else None
        self.blob, self.offs = None, []
        if walked and not any(map(_VOL_LEN, walked)):
            self.blob = b"".join(map(_PRE, walked))
            self.offs = list(accumulate(map(len, map(_PRE, walked)), initial=0))
        ids = self.ids
        if walked is None or step is None or before is None:
            self.ids = self.delta = None
            return
        added, dropped = step
        record_id = lst.record_id
        if ids is not None:
            for ent in dropped:
                rid = record_id(ent[3])
                if ids.get(rid) is ent:
                    del ids[rid]
            for ent in added:
                ids[record_id(ent[3])] = ent
        self.delta = (before, out, list(map(_RECORD, added)), list(map(_RECORD, dropped)))


# One item's text (UTF-8) followed by the next item's start (_SEP), cut around the digits of
# its volatile number: (text before them, their count, text after them + _SEP, record).
# Without a volatile number: (whole text + _SEP, 0, b"", record). With _SEP in the pieces, an
# unchanged item in mid-list costs one comparison per piece (two with a volatile number).
Record = JobRecord | NodeRecord | JobState
Entry = tuple[bytes, int, bytes, Record]


@dataclass(frozen=True, slots=True)
class _List:
    """How one list of Slurm's JSON is walked: its member name, the member of an item that
    names it (a hint to find an item that moved: its text is still compared in full), and
    the parser of one item."""

    key: str
    id_member: bytes  # `\n      "job_id": `: the member at item level (indent 6)
    id_value: re.Pattern[bytes]  # its value; group 1 when the value is quoted
    record_id: Callable[[Record], object]
    parse: Callable[[object], Record]
    kind: str = ""  # what a BlockCache holds after this list (default: key)

    @property
    def cache_kind(self) -> str:
        return self.kind or self.key

    @property
    def open(self) -> bytes:  # the list's first item (pretty-printed, indent 2)
        return b'\n  "' + self.key.encode() + b'": [\n    {\n'

    def id_of(self, m: re.Match[bytes]) -> object:
        return int(m.group()) if m.lastindex is None else m.group(1).decode()


def parse_jobs(
    text: str | Buffer, source: str = "squeue --json", cache: BlockCache | None = None
) -> list[JobRecord]:
    """Jobs of one JSON document: text, or the bytes Slurm wrote (UTF-8; anything else is an
    error). A job id listed twice is an error (never a guess).

    With *cache* (kept by the caller between calls), a job whose text did not change since
    the last call costs a byte comparison with last call's text instead of a JSON parse;
    the records are exactly those of the full parse (`_walk` says why). Give it the bytes:
    only the changed jobs are then decoded (a str is encoded first)."""
    return _parse_job_list(text, source, cache, _JOBS, job_from_json, _JOB_ID)


_R = TypeVar("_R", "JobRecord", "JobState")


def _parse_job_list(
    text: str | Buffer,
    source: str,
    cache: BlockCache | None,
    lst: _List,
    from_json: Callable[[object], _R],
    key_of: Callable[[_R], object],
) -> list[_R]:
    """The one body of parse_jobs and parse_job_states: the cached walk (or a plain JSON
    parse), a job listed twice refused, the cache left holding this call's items."""
    walked = _walk_cached(text, cache, lst)
    if cache is not None and walked is not None and walked is cache.entries:
        return cast(list[_R], cache.out)  # every item unchanged: last call's list
    if walked is None:
        out = [from_json(d) for d in _load(text, "jobs", source)]
    else:
        out = list(map(_RECORD, walked))
    if len(set(map(key_of, out))) != len(out):
        seen: set[object] = set()
        for j in out:
            if key_of(j) in seen:
                raise SlurmDataError(f"{source}: job {key_of(j)} is listed twice")
            seen.add(key_of(j))
    if cache is not None:
        cache.keep(walked, lst, out)
    return out


_JOB_ID = operator.attrgetter("job_id")
_PRE, _VOL_LEN, _RECORD = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(3)
# Layout of Slurm's pretty-printed JSON (22.05's squeue, 24.11's scontrol/squeue: indent 2):
# the jobs list is a top-level member, its items sit at indent 4, their members at indent 6.
_ITEM_END = b"\n    }"
_NEXT_ITEM = b",\n    {\n"
_LIST_END = b"\n  ]"
_HEAD_MARK = "nodeforge: the list"
# A member that slurmctld's scheduler rewrites on every pass for every pending job and that
# job_from_json does not read: 22.05 prints it as a number, >= 23.02 as Slurm's number
# object. Only the digits of that number may differ from the cached text.
_VOL_KEY = b'\n      "last_sched_evaluation": '
_VOL_NUMBER = re.compile(
    rb'(?:\{\n {8}"set": (?:true|false),\n {8}"infinite": (?:true|false),\n {8}"number": )?'
    rb"(0|[1-9][0-9]{0,18})(?=[,\n])"
)
_VOL_DIGITS = re.compile(rb"0|[1-9][0-9]*")  # as many digits as cached (bytes: ASCII only)
_SEP = _ITEM_END + _NEXT_ITEM


def _entry(chunk: bytes, rec: Record) -> Entry:
    v = chunk.find(_VOL_KEY)
    m = _VOL_NUMBER.match(chunk, v + len(_VOL_KEY)) if v >= 0 else None
    if m is None:
        return chunk + _SEP, 0, b"", rec
    return chunk[: m.start(1)], m.end(1) - m.start(1), chunk[m.end(1) :] + _SEP, rec


def _at(mv: memoryview, pos: int, sub: bytes) -> bool:
    """Does *sub* stand at *pos* in *mv*? (`bytes.startswith` of an equally long view: memcmp,
    no copy; the length test first, since a view cut short by the end would match a prefix.)"""
    end = pos + len(sub)
    return pos >= 0 and end <= len(mv) and sub.startswith(mv[pos:end])


def _match(mv: memoryview, pos: int, entry: Entry) -> int:
    """End of the job text at *pos* if it is *entry*'s text (the digits of its volatile
    number aside: as many, ASCII, no leading zero), else -1."""
    pre, n, post, _ = entry
    if n:
        post = post[: -len(_SEP)]
    else:
        pre = pre[: -len(_SEP)]
    if not _at(mv, pos, pre):
        return -1
    e = pos + len(pre)
    if n:
        if e + n > len(mv) or not _VOL_DIGITS.fullmatch(mv, e, e + n):
            return -1
        e += n
        if not _at(mv, e, post):
            return -1
        e += len(post)
    return e if _at(mv, e, _ITEM_END) else -1


def _walk_cached(text: str | Buffer, cache: BlockCache | None, lst: _List) -> list[Entry] | None:
    """The items of *lst* through *cache* (the bytes: a str is encoded first); None without
    a cache, or when the full parse must decide."""
    if cache is None:
        return None
    try:
        data = text.encode() if isinstance(text, str) else text
    except UnicodeEncodeError:  # (a lone surrogate: the full parse decides)
        return None
    return _walk(data, cache, lst)


def _walk(text: Buffer, cache: BlockCache, lst: _List) -> list[Entry] | None:
    """The items of list *lst* (jobs or nodes), item by item, through *cache*; None when the
    document is not laid out as Slurm prints it or anything in it fails (the caller then
    parses the whole document, which gives the true records or the true error).

    Why this is exactly the full parse: Slurm's serializer escapes every newline inside a
    string, so a raw newline is layout. A line that starts with exactly four spaces and `}`
    therefore closes an item of the list (the items' own members and nested values are
    indented deeper), whatever a user wrote into a name, comment or path. Each item's text
    (between its `{` and that line) was parsed as one JSON object: now, or in an earlier
    call that cached it; an item whose text equals a cached one, byte for byte, has the
    cached record. The one exception is the number in `last_sched_evaluation`, which neither
    job_from_json nor node_from_json reads (nodes have no such member): its digits may
    differ (as many, so the item stays the same valid JSON but for them). After the list's
    `]`, the rest of the document is parsed with the list taken out (a marker in its place:
    a second member of that name would replace the marker, and the full parse is used). The
    document is UTF-8 (decoded strictly wherever it is parsed, as the full parse decodes
    it): cut only at ASCII layout bytes, equal bytes are equal text. The comparison runs at
    C speed (memcmp through a memoryview: the document is not copied, and may be a memory
    map of the client's output) and nothing is copied for an unchanged item; only a changed
    or new item is cut out and parsed. Items are compared in last call's order; an item that
    moved is found by its `job_id` or node `name` (only a hint: its text is still compared
    in full)."""
    with memoryview(text) as mv:
        return _walk_view(text, mv, cache, lst)


# long: one loop over every item, its fast path inline (50k items a cycle: no call per item)
def _walk_view(text: Buffer, mv: memoryview, cache: BlockCache, lst: _List) -> list[Entry] | None:
    cache.walked = None
    size = len(mv)
    opening = lst.open
    i = text.find(opening, 0, size)
    if i < 0:
        return None
    pos = i + len(opening)
    old = cache.entries if cache.kind == lst.cache_kind else []
    n_old = len(old)
    w = _Walk(text, mv, old, lst, cache)  # (for an item not in its expected place)
    added: list[Entry] = []  # items parsed now
    dropped: list[Entry] = []  # old items passed over (in order: no item is found behind)
    ordered = True
    entries: list[Entry] = []
    add = entries.append
    k = 0  # the cached job expected next
    vol = _VOL_DIGITS.fullmatch
    blob = cache.blob if old is cache.entries else None
    seq = True  # every item so far is the cached one expected next
    try:
        while True:
            if blob is not None and k < n_old:  # a run of unchanged items, at once
                j = _run(mv, pos, blob, cache.offs, k, n_old)
                if j > k:
                    entries += old[k:j]
                    pos += cache.offs[j] - cache.offs[k]
                    k = j
            if k < n_old:  # the fast path: _match and the next item's start, in one test
                ent = old[k]
                pre, n, post, _ = ent
                a = pos + len(pre)
                if n:
                    e = a + n
                    end = e + len(post)
                    if (
                        end <= size  # (so no view below is cut short)
                        and pre.startswith(mv[pos:a])
                        and vol(mv, a, e)
                        and post.startswith(mv[e:end])
                    ):
                        add(ent)
                        k += 1
                        pos = end
                        continue
                elif a <= size and pre.startswith(mv[pos:a]):
                    add(ent)
                    k += 1
                    pos = a
                    continue
            e = _match(mv, pos, old[k]) if k < n_old else -1  # (the last job, or a changed one)
            if e >= 0:
                add(old[k])
                k += 1
            else:
                e = text.find(_ITEM_END, pos, size)
                if e < 0:
                    return None
                ent, h, same = _changed_item(w, pos, e, k)
                seq = False
                add(ent)
                if not same:
                    added.append(ent)
                if h is not None:
                    if h < k:
                        ordered = False  # (an item found behind: it was passed over)
                    else:
                        dropped += old[k : h if same else h + 1]
                    k = h + 1
            e += len(_ITEM_END)
            if _at(mv, e, _NEXT_ITEM):
                pos = e + len(_NEXT_ITEM)
            elif _at(mv, e, _LIST_END):
                break
            else:
                return None
        if not _rest_is_slurms(mv, i, e + len(_LIST_END), lst):
            return None
    except (ValueError, SlurmDataError, RecursionError):
        return None  # the full parse says what is wrong
    if seq and k == n_old == len(entries):
        return old
    if ordered:
        cache.walked = (added, dropped + old[k:])
    return entries


def _rest_is_slurms(mv: memoryview, i: int, end: int, lst: _List) -> bool:
    """The document around the list (before *i*, after *end*), parsed with a marker in the
    list's place: a second member of that name would replace the marker (the full parse is
    used then), and Slurm's errors member must be empty."""
    rest = str(mv[end:], "utf-8")
    head = json.loads(f'{str(mv[:i], "utf-8")}\n  "{lst.key}": "{_HEAD_MARK}"{rest}')
    return isinstance(head, dict) and head.get(lst.key) == _HEAD_MARK and not head.get("errors")


@dataclass(slots=True)
class _Walk:
    """What a walk's search for an item that moved reads: the document (and its view), the
    cached items of the last call (*old*), the list walked, the index of old's items by id
    (made when first needed) and the cache (its *ids*)."""

    text: Buffer
    mv: memoryview
    old: list[Entry]
    lst: _List
    cache: BlockCache
    index: dict[object, int] | None = None


def _changed_item(w: _Walk, pos: int, e: int, k: int) -> tuple[Entry, int | None, bool]:
    """The item at [pos, e) where the cached one expected next (*k*) is not: (its entry,
    where it stood in old or None, whether it is that old item unchanged); else parsed now
    (its text decoded strictly: Slurm writes UTF-8)."""
    h = _last_place(w, pos, e, k)
    if h is not None and _match(w.mv, pos, w.old[h]) == e:
        return w.old[h], h, True
    chunk = bytes(w.mv[pos:e])
    return _entry(chunk, w.lst.parse(json.loads("{" + chunk.decode() + "}"))), h, False


LOOKAHEAD = 8  # items past the expected one tried by id before the index (a few dropped)


def _last_place(w: _Walk, pos: int, e: int, k: int) -> int | None:
    """Where the item at [pos, e) stood in old (the cache's entries), found by its id (only
    a hint: its text is still compared in full): the expected place *k*, a few places on
    (items dropped before it), else by the index of old's items by id, unless the cache's
    *ids* says it is no old item (a new job)."""
    old, lst, cache = w.old, w.lst, w.cache
    if not old:
        return None
    q = w.text.find(lst.id_member, pos - 1, e)
    m = lst.id_value.match(w.mv, q + len(lst.id_member), e) if q >= 0 else None
    if m is None:
        return None
    jid = lst.id_of(m)
    rid = lst.record_id
    for h in range(k, min(k + 1 + LOOKAHEAD, len(old))):
        if rid(old[h][3]) == jid:
            return h  # the expected item changed, or the next ones dropped (no index)
    ids = cache.ids
    if ids is None:  # (kept between calls from now on, in step with each walk)
        ids = cache.ids = {rid(ent[3]): ent for ent in old}
    if jid not in ids:
        return None
    if w.index is None:
        w.index = {rid(r): x for x, (_, _, _, r) in enumerate(old)}
    return w.index.get(jid)


def _run(mv: memoryview, pos: int, blob: bytes, offs: list[int], k: int, n: int) -> int:
    """How far the cached items from *k* on stand at *pos* unchanged, each with the next
    item's start (the fast path's test, for many items in one comparison): the end index.
    The span tried doubles, then is halved back; each comparison covers only bytes not yet
    compared (memcmp, no copy), so a document costs about two passes over its bytes."""
    base, size = offs[k], len(mv)
    good, bad, step = k, n + 1, 1

    def same(a: int, b: int) -> bool:  # are items [a, b) at their place? (a matched)
        lo, hi = pos + offs[a] - base, pos + offs[b] - base
        return hi <= size and blob.startswith(mv[lo:hi], offs[a])

    while good < n:  # gallop
        j = min(good + step, n)
        if not same(good, j):
            bad = j
            break
        good, step = j, step * 2
    while bad - good > 1:  # the first changed item is in [good, bad)
        mid = (good + bad) // 2
        if same(good, mid):
            good = mid
        else:
            bad = mid
    return good


def node_from_json(d: object) -> NodeRecord:
    if not isinstance(d, dict):
        raise SlurmDataError(f"Slurm JSON: a node entry is not an object: {d!r:.80}")
    name = _str(d.get("name"), "node", "name", _NODE_NAME)
    if not name:
        raise _fail("node", "name", d.get("name"))
    what = f"node {name}"
    state = d.get("state")
    words = [state] if isinstance(state, str) else state
    extra = d.get("state_flags") or []  # 22.05 only
    if not isinstance(words, list) or not isinstance(extra, list):
        raise _fail(what, "state", state)
    flags = set()
    for w in [*words, *extra]:
        if w == "?":
            continue  # Slurm's word for a flag bit its own table lacks (node_state_flag_string)
        if not isinstance(w, str) or not _STATE_WORD.fullmatch(w.upper()):
            raise _fail(what, "state", w)
        flags.add(w.upper())
    reason = _free_text(d.get("reason"), what, "reason")
    base = next(
        (w.upper() for w in words if isinstance(w, str) and w.upper() in NODE_BASE_STATES), ""
    )
    return NodeRecord(name=name, flags=frozenset(flags), reason=reason, base=base)


_JOBS = _List(
    "jobs", b'\n      "job_id": ', re.compile(rb"[1-9][0-9]{0,18}"), _JOB_ID, job_from_json
)
_NODES = _List(
    "nodes",
    b'\n      "name": ',
    re.compile(rb'"([A-Za-z0-9][A-Za-z0-9._-]{0,127})"'),
    operator.attrgetter("name"),
    node_from_json,
)


def parse_nodes(
    text: str | Buffer, source: str = "scontrol show node --json", cache: BlockCache | None = None
) -> dict[str, NodeRecord]:
    """Nodes of one JSON document by name (a name listed twice is an error). With *cache*,
    as parse_jobs: only the nodes whose text changed since the last call are parsed (a node's
    text moves with its load and free memory, so some do every few seconds)."""
    walked = _walk_cached(text, cache, _NODES)
    if cache is not None and walked is not None and walked is cache.entries:
        return cast(dict[str, NodeRecord], cache.out)  # every node unchanged: last call's
    records = (
        map(node_from_json, _load(text, "nodes", source))
        if walked is None
        else map(_RECORD, walked)
    )
    out: dict[str, NodeRecord] = {}
    for n in records:
        if n.name in out:
            raise SlurmDataError(f"{source}: node {n.name} is listed twice")
        out[n.name] = n
    if cache is not None:
        cache.keep(walked, _NODES, out)
    return out


_LINE_STATE = re.compile(r" State=([A-Z_]+(?:\+[A-Z_]+)*)(?= |$)")
REASON_AMBIGUOUS = "?ambiguous: "  # never starts like anyone's own reason prefix


def node_from_line(text: str, name: str) -> NodeRecord | None:
    """One node from Slurm 22.05's `scontrol --future -o show node NAME` (22.05's scontrol
    has no --json, and its `sinfo --json` does not list FUTURE nodes, which the agent's
    readiness gate must see). None if the line is not about *name*.

    Not a general Key=Value split: State is the first ` State=` word, because every field
    printed before it (name, arch, features, gres, address, OS, memory) comes from the
    config or slurmd, while the free texts (Comment, Extra, Reason) come after it. Reason
    is everything after ` Reason=`; a line where that appears twice (an admin's Comment or
    Reason holding ` Reason=`) cannot say whose drain it is: the reason is returned marked
    REASON_AMBIGUOUS, so that no caller takes it for its own. So is the reason of a body of
    more than one line: `-o` prints one node on one line, so a second line is free text
    (Comment, Extra or Reason) that held a newline, and the Reason read from the first line
    may be cut short or belong to someone else."""
    line, _, more = text.strip().partition("\n")
    if not line.startswith(f"NodeName={name} "):
        return None
    m = _LINE_STATE.search(line)
    if m is None:
        raise SlurmDataError(f"scontrol show node {name}: no State= in {line!r:.200}")
    words = m.group(1).split("+")
    parts = line.split(" Reason=")
    reason = "" if len(parts) == 1 else parts[1].strip() if len(parts) == 2 else ""
    if len(parts) > 2 or more.strip():
        # (a NUL here may sit in someone's Comment, not in the Reason: shown escaped, since
        # the text only says whose drain it is not)
        reason = REASON_AMBIGUOUS + " Reason=".join(parts[1:]).strip().replace("\x00", "\\0")
    elif "\x00" in reason:
        raise SlurmDataError(f"scontrol show node {name}: NUL in Reason")
    base = words[0] if words[0] in NODE_BASE_STATES else ""
    return NodeRecord(name=name, flags=frozenset(words), reason=reason, base=base)


def parse_version(text: str) -> tuple[int, int]:
    """`slurm 22.05.8` / `slurm-wlm 24.11.1` (scontrol --version) -> (major, minor)."""
    m = re.fullmatch(r"\s*slurm(?:-wlm)?\s+(\d{2})\.(\d{2})(?:\.\d+)?(?:-\S+)?\s*", text)
    if not m:
        raise SlurmDataError(f"scontrol --version: unexpected output {text!r:.80}")
    return int(m.group(1)), int(m.group(2))


_STATE_KEY = re.compile(r"([1-9][0-9]{0,18})(?:_([0-9]{1,10})|\+([0-9]{1,10}))?")


def job_state_from_json(d: object) -> JobState:
    if not isinstance(d, dict):
        raise SlurmDataError(f"Slurm JSON: a job entry is not an object: {d!r:.80}")
    key = d.get("job_id")
    if not isinstance(key, str) or (m := _STATE_KEY.fullmatch(key)) is None:
        raise _fail("job", "job_id", key)
    base, flags = _states(d.get("state"), f"job {key}", "state")
    job, task, off = m.groups()
    return JobState(
        key=key,
        base_state=base,
        state_flags=flags,
        job=int(job),
        task=None if task is None else int(task),
        het_offset=None if off is None else int(off),
    )


_STATES = _List(
    "jobs",
    b'\n      "job_id": ',
    re.compile(rb'"([0-9_+]{1,40})"'),
    operator.attrgetter("key"),
    job_state_from_json,
    kind="job states",
)


_STATE_KEY_OF = operator.attrgetter("key")


def parse_job_states(
    text: str | Buffer, source: str, cache: BlockCache | None = None
) -> list[JobState]:
    """Every job of a state listing, in slurmctld's order; a job id listed twice, a field
    out of its grammar or a truncated document is an error (SlurmDataError), never a guess.
    With *cache*, as parse_jobs: an item whose text is unchanged is the same JobState."""
    return _parse_job_list(text, source, cache, _STATES, job_state_from_json, _STATE_KEY_OF)


MAX_ARRAY_TASKS = 4_000_000  # (Slurm's MaxArraySize is at most 4000001)


def array_task_ids(spec: str) -> frozenset[int]:
    """The task ids of an array's pending-task string as JobRecord.array_tasks keeps it
    (`2-9`, `1,3,5-7:2`); SlurmDataError for anything else or more than MAX_ARRAY_TASKS."""
    if not _ARRAY_TASKS.fullmatch(spec):
        raise SlurmDataError(f"array task ids {spec!r:.80}: unexpected form")
    out: set[int] = set()
    for part in spec.split(","):
        rng, _, step = part.partition(":")
        a, _, b = rng.partition("-")
        lo, hi = int(a), int(b) if b else int(a)
        n = (hi - lo) // max(int(step or 1), 1) + 1 if hi >= lo else 0
        if len(out) + n > MAX_ARRAY_TASKS:
            raise SlurmDataError(f"array task ids {spec!r:.80}: more than {MAX_ARRAY_TASKS}")
        out.update(range(lo, hi + 1, max(int(step or 1), 1)))
    return frozenset(out)


def state_command(version: tuple[int, int]) -> list[str] | None:
    """The jobs' state listing (identity and state of every job, no user text) on Slurm
    versions that have one (squeue's --only-job-state: REQUEST_JOB_STATE, >= 24.05)."""
    if has(version, "job_state_listing"):
        return ["squeue", "--json", "--only-job-state", "--states=all"]
    return None


def json_commands(version: tuple[int, int]) -> tuple[list[str], list[str]]:
    """(jobs argv, nodes argv) that print JSON on this Slurm version."""
    if has(version, "json_records"):  # scontrol show job|node --json
        return ["scontrol", "show", "job", "--json"], ["scontrol", "show", "node", "--json"]
    return ["squeue", "--json", "--states=all"], ["sinfo", "--json"]
