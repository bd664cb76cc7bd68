"""Hook runner: baked scripts in /etc/nodeforge/on-init.d/ plus extension scripts from params.

Contract (extensions/README.md is the operator-facing copy):
- Order: all hooks sorted lexically by name (baked file name, or the extension's `name` /
  last URI segment); on a tie the baked one runs first. Names must be unique.
- Extension scripts are fetched (file://, http(s)://, s3:// with boto3) into
  /var/lib/nodeforge/hooks/, their sha256 checked BEFORE anything runs; a mismatch is refused.
- Each attempt runs in its own process group with a timeout; on timeout the whole group gets
  SIGTERM then SIGKILL. Anything left in the group when the hook exits is stopped too.
- Retries with exponential backoff (hook_backoff · 2^(n-1), capped at hook_backoff_max).
- Environment: NODEFORGE_ROLE/CLUSTER/NODE/CONTROLLER/PARAMS (+ HOOK, ATTEMPT, LOG_DIR).
- Output of every attempt goes to /var/log/nodeforge/hooks/<name>.log with a header line.
- The first hook that fails for good stops the run; its reason drains the node.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nodeforge import proc
from nodeforge.errors import NodeforgeError
from nodeforge.fsutil import write_atomic

from .params import Params
from .paths import Paths

log = logging.getLogger("nodeforge.hooks")

_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")
_SKIP_SUFFIXES = (".dpkg-old", ".dpkg-new", ".dpkg-dist", ".disabled", "~", ".swp", ".md")
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Hook:
    name: str
    path: Path | None  # None until fetched (extension hooks)
    timeout: float
    retries: int
    origin: str  # "baked" or the URI
    sha256: str | None = None


@dataclass
class HookResult:
    name: str
    status: str  # ok | failed | timeout | signal | refused | fetch-failed
    attempts: int = 0
    exit_code: int | None = None
    signal: int | None = None
    duration: float = 0.0
    reason: str = ""  # for the drain reason (set when not ok)
    log: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class RunReport:
    results: list[HookResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failure(self) -> HookResult | None:
        return next((r for r in self.results if not r.ok), None)


@dataclass
class HookEnv:
    role: str
    cluster: str
    node: str
    controller: str
    params_file: Path


class HookError(NodeforgeError):
    pass


def discover(paths: Paths, params: Params) -> list[Hook]:
    """Baked + extension hooks in run order. Raises on duplicate or invalid names."""
    hooks: list[tuple[str, int, Hook]] = []
    if paths.on_init_d.is_dir():
        for p in sorted(paths.on_init_d.iterdir()):
            if not p.is_file() or p.name.startswith(".") or p.name.endswith(_SKIP_SUFFIXES):
                continue
            if not os.access(p, os.X_OK):
                log.warning("skipping %s: not executable (chmod +x to run it)", p)
                continue
            hooks.append(
                (p.name, 0, Hook(p.name, p, params.hook_timeout, params.hook_retries, "baked"))
            )
    for i, spec in enumerate(params.hooks):
        name = spec.name or _uri_name(spec.uri)
        if not _NAME_OK.match(name):
            raise HookError(
                f"hooks[{i}].uri: cannot derive a file name from {spec.uri!r}; set hooks[{i}].name"
            )
        hooks.append(
            (
                name,
                1,
                Hook(
                    name,
                    None,
                    spec.timeout if spec.timeout is not None else params.hook_timeout,
                    spec.retries if spec.retries is not None else params.hook_retries,
                    spec.uri,
                    spec.sha256,
                ),
            )
        )
    seen: dict[str, str] = {}
    for name, _, h in hooks:
        if name in seen:
            raise HookError(
                f"two hooks are named {name!r} ({seen[name]} and {h.origin}); give the extension "
                "hook a distinct `name` in params"
            )
        seen[name] = h.origin
    hooks.sort(key=lambda t: (t[0], t[1]))
    return [h for _, _, h in hooks]


def _uri_name(uri: str) -> str:
    tail = uri.split("://", 1)[-1].split("?", 1)[0].rstrip("/")
    return tail.rsplit("/", 1)[-1]


# -- fetching ----------------------------------------------------------------------------------
def fetch(hook: Hook, cache: Path, timeout: float = 60.0) -> Path:
    """Bring an extension hook's script into *cache*, verify its sha256, make it executable."""
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    uri = hook.origin
    dest = cache / hook.name
    if uri.startswith("file://"):
        src = Path(uri[len("file://") :])
        try:
            data = src.read_bytes()
        except OSError as exc:
            raise HookError(f"hook {hook.name}: cannot read {src}: {exc.strerror}") from exc
    elif uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri, timeout=timeout) as r:
                data = r.read()
        except (urllib.error.URLError, OSError) as exc:
            raise HookError(f"hook {hook.name}: cannot fetch {uri}: {exc}") from exc
    elif uri.startswith("s3://"):
        data = _fetch_s3(hook.name, uri)
    else:  # parse_params already refuses other schemes
        raise HookError(f"hook {hook.name}: unsupported URI {uri!r}")
    if hook.sha256 is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != hook.sha256:
            raise ShaMismatch(
                f"hook {hook.name}: sha256 mismatch for {uri}: expected {hook.sha256}, got {got}; "
                "the script was NOT run. Fix hooks[].sha256 (sha256sum <script>) or the script"
            )
    write_atomic(dest, data, 0o700)
    return dest


class ShaMismatch(HookError):
    pass


def _fetch_s3(name: str, uri: str) -> bytes:
    try:
        import boto3  # optional extra: pip install 'nodeforge[s3]' (or apt-get install python3-boto3)
    except ImportError:
        raise HookError(
            f"hook {name}: {uri} needs boto3, which is not installed; install it into the agent "
            "(apt-get install python3-boto3, or /opt/nodeforge/bin/pip install 'nodeforge[s3]') "
            "or serve the script over https:// instead"
        ) from None
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket or not key:
        raise HookError(f"hook {name}: {uri!r} is not s3://bucket/key")
    try:
        obj = boto3.client("s3").get_object(Bucket=bucket, Key=key)
        return obj["Body"].read()
    except Exception as exc:  # botocore errors are many; report them all the same way
        raise HookError(f"hook {name}: cannot fetch {uri}: {exc}") from exc


# -- running -----------------------------------------------------------------------------------
@dataclass
class Runner:
    paths: Paths
    env: HookEnv
    sleep: Callable[[float], None] = time.sleep
    backoff: float = 2.0
    backoff_max: float = 60.0
    grace: float = 5.0  # SIGTERM -> SIGKILL
    on_result: Callable[[HookResult], None] | None = None

    def delay(self, attempt: int) -> float:
        """Wait before retry number *attempt* (1-based): backoff · 2^(attempt-1), capped."""
        return min(self.backoff * (2 ** (attempt - 1)), self.backoff_max)

    def run_all(self, hooks: list[Hook]) -> RunReport:
        report = RunReport()
        for hook in hooks:
            res = self.run_one(hook)
            report.results.append(res)
            if self.on_result:
                self.on_result(res)
            if not res.ok:
                break
        return report

    def run_one(self, hook: Hook) -> HookResult:
        logdir = self.paths.hooks_log_dir
        logdir.mkdir(parents=True, exist_ok=True)
        logpath = logdir / f"{hook.name}.log"
        res = HookResult(hook.name, "ok", log=str(logpath))
        start = time.monotonic()
        path = hook.path
        if path is None:
            try:
                path = fetch(hook, self.paths.hook_cache)
            except ShaMismatch as exc:
                _append(logpath, f"=== {hook.name}: REFUSED: {exc}\n")
                res.status, res.reason = "refused", f"hook {hook.name} sha256 mismatch (not run)"
                res.duration = time.monotonic() - start
                return res
            except HookError as exc:
                _append(logpath, f"=== {hook.name}: FETCH FAILED: {exc}\n")
                res.status, res.reason = "fetch-failed", f"hook {hook.name} could not be fetched"
                res.duration = time.monotonic() - start
                return res
        attempts = hook.retries + 1
        for attempt in range(1, attempts + 1):
            res.attempts = attempt
            with open(logpath, "a") as out:
                out.write(
                    f"=== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {hook.name} attempt {attempt}/"
                    f"{attempts} (timeout {hook.timeout:g}s) {path}\n"
                )
                out.flush()
                gr = proc.run_group(
                    [str(path)],
                    timeout=hook.timeout,
                    output=out,
                    env=self._env(hook, attempt),
                    replace_env=True,
                    cwd="/",
                    grace=self.grace,
                )
                out.write(
                    f"=== {hook.name} attempt {attempt}: {_describe(gr, hook.timeout)} "
                    f"after {gr.duration:.1f}s\n"
                )
            res.duration = time.monotonic() - start
            if gr.returncode == 0 and not gr.timed_out:
                res.status, res.exit_code, res.reason = "ok", 0, ""
                return res
            res.exit_code = gr.returncode if gr.returncode >= 0 else None
            res.signal = gr.signal
            if gr.timed_out:
                res.status = "timeout"
                res.reason = f"hook {hook.name} timed out after {hook.timeout:g}s"
            elif gr.signal is not None:
                res.status = "signal"
                res.reason = f"hook {hook.name} killed by signal {_signame(gr.signal)}"
            else:
                res.status = "failed"
                res.reason = f"hook {hook.name} failed (exit {gr.returncode})"
            if attempt < attempts:
                self.sleep(self.delay(attempt))
        if attempts > 1:
            res.reason += f" after {attempts} attempts"
        res.duration = time.monotonic() - start
        return res

    def _env(self, hook: Hook, attempt: int) -> dict[str, str]:
        e = self.env
        keep = {
            k: os.environ[k]
            for k in ("LANG", "LC_ALL", "TZ", "http_proxy", "https_proxy", "no_proxy")
            if k in os.environ
        }
        return {
            **keep,
            "PATH": SAFE_PATH,
            "HOME": "/root",
            "NODEFORGE_ROLE": e.role,
            "NODEFORGE_CLUSTER": e.cluster,
            "NODEFORGE_NODE": e.node,
            "NODEFORGE_CONTROLLER": e.controller,
            "NODEFORGE_PARAMS": str(e.params_file),
            "NODEFORGE_HOOK": hook.name,
            "NODEFORGE_HOOK_ATTEMPT": str(attempt),
            "NODEFORGE_LOG_DIR": str(self.paths.hooks_log_dir),
        }


def _describe(gr: proc.GroupResult, timeout: float) -> str:
    if gr.timed_out:
        return f"TIMED OUT after {timeout:g}s (process group killed)"
    if gr.signal is not None:
        return f"killed by signal {_signame(gr.signal)}"
    return f"exit {gr.returncode}"


def _signame(sig: int) -> str:
    try:
        return f"{sig} ({signal.Signals(sig).name})"
    except ValueError:
        return str(sig)


def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)
