"""A secret is never echoed (issue 23, item 1).

For any secret value accepted into a secret field (munge_key), refused from one (a munge key
with a trailing newline, the YAML block-scalar case), or carried in a URI's userinfo or query
(presigned signatures, tokens): no output holds it. The outputs are the ones an operator or a
local user reads: the exception text, state.json, agent.log, `node status` (JSON and text), the
hook log and the drain reason Slurm shows. And the files that hold params or errors are
root-only.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import stat
import string
import tempfile
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nodeforge import redact
from nodeforge.bootstrap.agent import StepFailed
from nodeforge.bootstrap.cli import agent_logging
from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.bootstrap.paths import Paths
from nodeforge.bootstrap.state import State
from nodeforge.bootstrap.status import as_json, as_text
from nodeforge.cli import main
from tests.unit.support import COMPUTE, make  # the agent harness (fake machine)

pytestmark = pytest.mark.unit

# Bounded: each agent example boots a fake node (~0.1-0.5 s); no example database on disk.
AGENT_PROPS = settings(
    max_examples=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FAST_PROPS = settings(
    max_examples=300, deadline=None, database=None
)  # no flaky deadline on a busy CI

# Characters RFC 3986 allows in userinfo (unreserved, sub-delims, ':' in the password) and in a
# query value (also '/', '?', ':', '@'; '&' and '#' would end it).
USERINFO = string.ascii_letters + string.digits + "-._~!$&'()*+,;="
QUERY = string.ascii_letters + string.digits + "-._~!$'()*+,;=:@/?"
user_s = st.text(USERINFO.replace(":", ""), min_size=8, max_size=24)
password_s = st.text(USERINFO + ":", min_size=8, max_size=40)
# Not ending in '/': params read such a URI as a prefix (a separate rule, not redaction's).
query_s = st.text(QUERY, min_size=8, max_size=64).filter(lambda s: not s.endswith("/"))
QUERY_KEYS = ("X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "Signature", "sig",
              "token", "access_token", "t")  # fmt: skip
munge_keys = st.binary(min_size=32, max_size=192).map(lambda b: base64.b64encode(b).decode())
# What a copy-paste or a YAML block scalar leaves around a key.
HOSTILE_SUFFIX = ("\n", "\r\n", " ", "\t", "\x00", "\u2028", "\n\n", "=\n", "\x1b[0m")


@contextlib.contextmanager
def agent_log(paths):
    """The agent's real log set-up (agent.log, stderr), taken down again after the test."""
    logger = logging.getLogger("nodeforge")
    level, propagate = logger.level, logger.propagate
    with contextlib.redirect_stderr(io.StringIO()) as err:
        handlers = agent_logging(paths)
        try:
            yield err
        finally:
            for h in handlers:
                logger.removeHandler(h)
                h.close()
            logger.setLevel(level)
            logger.propagate = propagate


def outputs(paths, fm, exc: BaseException | None, stderr: str) -> dict[str, str]:
    """Everything the failed run left for people to read."""
    out = {
        "exception": "".join(traceback.format_exception(exc)) if exc else "",
        "stderr": stderr,
        "state.json": paths.state_file.read_text(),
        "agent.log": (paths.log_dir / "agent.log").read_text(),
        "drain reason": "\n".join(" ".join(c) for c in fm.calls if c and "scontrol" in c[0]),
    }
    if paths.params_json.exists():  # the params copy hooks read (NODEFORGE_PARAMS)
        out["params.json"] = paths.params_json.read_text()
    if paths.hooks_log_dir.is_dir():
        out["hook logs"] = "".join(p.read_text() for p in sorted(paths.hooks_log_dir.iterdir()))
    for flag in ([], ["--json"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(["node", "status", "--root", str(paths.root), *flag])
        out[f"node status {flag}"] = buf.getvalue()
    state = State.load(paths.state_file)
    out["status api"] = as_json(state) + as_text(state)
    return out


def run_agent(node_yaml: dict, prepare=None) -> tuple[dict[str, str], object]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        agent, fm, paths, _ = make(tmp, node_yaml)
        if prepare:
            prepare(paths)
        exc = None
        with agent_log(paths) as err:
            try:
                agent.init()
            except StepFailed as e:
                exc = e
        return outputs(paths, fm, exc, err.getvalue()), exc


# What the outputs say anyway: a generated "secret" that is a piece of it ("partitio") proves
# nothing. Filled per scenario from a run with placeholder secrets.
NATURAL: dict[str, str] = {}


def natural(kind: str, make_outputs) -> str:
    if kind not in NATURAL:
        NATURAL[kind] = "\n".join(make_outputs().values())
    return NATURAL[kind]


def assert_absent(secret: str, outs: dict[str, str], natural_text: str = "") -> None:
    if secret in natural_text:
        return  # not a secret-shaped string here: the run without it says the same words
    for where, text in outs.items():
        assert secret not in text, f"the secret leaked into {where}"


# -- the munge key -------------------------------------------------------------------------------
def test_munge_key_with_trailing_newline_is_named_never_shown():
    """The issue's case: a key from a YAML block scalar (`|`) ends in a newline."""
    key = base64.b64encode(os.urandom(48)).decode()
    with pytest.raises(ParamsError) as ei:
        parse_params({**COMPUTE, "munge_key": key + "\n"}, "/etc/nodeforge/node.yaml")
    msg = str(ei.value)
    assert msg.startswith("/etc/nodeforge/node.yaml: munge_key: contains a control character")
    assert "U+000A" in msg and "at the end" in msg and "block scalar" in msg
    assert key not in msg and key[:12] not in msg


@AGENT_PROPS
@given(key=munge_keys, suffix=st.sampled_from(HOSTILE_SUFFIX), front=st.booleans())
def test_refused_munge_key_in_no_output(key, suffix, front):
    bad = suffix + key if front else key + suffix
    outs, exc = run_agent({**COMPUTE, "munge_key": bad})
    assert isinstance(exc, StepFailed) and "munge_key" in str(exc)
    assert_absent(key, outs)


@AGENT_PROPS
@given(key=munge_keys, failure=st.sampled_from(["hook", "field"]))
def test_accepted_munge_key_in_no_output(key, failure):
    """A valid key, then a failure later on (a bad field, or a failing hook that drains)."""
    if failure == "field":
        outs, exc = run_agent({**COMPUTE, "munge_key": key, "node_address": "0.0.0.0"})
    else:

        def hook(paths):
            paths.on_init_d.mkdir(parents=True)
            (paths.on_init_d / "10-bad").write_text("#!/bin/sh\necho failing\nexit 3\n")
            (paths.on_init_d / "10-bad").chmod(0o755)

        outs, exc = run_agent({**COMPUTE, "munge_key": key, "hook_retries": 0}, hook)
        assert "hook 10-bad failed (exit 3)" in outs["drain reason"]
    assert isinstance(exc, StepFailed)
    assert_absent(key, outs)


# -- URI userinfo and query ----------------------------------------------------------------------
@AGENT_PROPS
@given(
    user=user_s,
    password=password_s,
    qkey=st.sampled_from(QUERY_KEYS),
    qval=query_s,
    kind=st.sampled_from(["fetch fails", "space in uri", "control char", "bad scheme"]),
)
def test_uri_credentials_in_no_output(user, password, qkey, qval, kind):
    def run(user, password, qval):
        uri = f"http://{user}:{password}@127.0.0.1:1/x.sh?{qkey}={qval}"
        if kind == "space in uri":
            uri += " x"
        elif kind == "control char":
            uri += "\x01"
        elif kind == "bad scheme":
            uri = "ftp" + uri[4:]
        hook = {"uri": uri, "sha256": "a" * 64}
        return run_agent({**COMPUTE, "hooks": [hook], "hook_retries": 0})

    outs, exc = run(user, password, qval)
    said = natural(f"uri {kind} {qkey}", lambda: run("uuuuuuuu", "pppppppp", "qqqqqqqq")[0])
    assert isinstance(exc, StepFailed)
    if kind == "fetch fails":  # refused by 127.0.0.1:1: the hook step fails and drains
        assert "could not be fetched" in outs["drain reason"]
        assert "FETCH FAILED" in outs["hook logs"]
    else:
        assert "hooks[0].uri" in str(exc)
    for secret in (password, qval, f"{user}:{password}"):
        assert_absent(secret, outs, said)


@AGENT_PROPS
@given(user=user_s, password=password_s, qkey=st.sampled_from(QUERY_KEYS), qval=query_s)
def test_params_check_output_hides_uri_credentials(user, password, qkey, qval):
    """`params check` prints the resolved params: the hook URI without its secrets."""

    def check(user, password, qval) -> dict[str, str]:
        outs = {}
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "node.yaml"
            uri = f"https://{user}:{password}@h.example/x.sh?{qkey}={qval}"
            f.write_text(json.dumps({**COMPUTE, "hooks": [uri]}))
            f.chmod(0o600)
            for flag in ("", "--json"):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    assert main(["params", "check", "--node-yaml", str(f), *flag.split()]) == 0
                outs[f"params check {flag}"] = out.getvalue()
        return outs

    outs = check(user, password, qval)
    said = natural(f"params check {qkey}", lambda: check("uuuuuuuu", "pppppppp", "qqqqqqqq"))
    assert all(f"https://h.example/x.sh?{qkey}=" in text for text in outs.values())
    for secret in (password, qval):
        assert_absent(secret, outs, said)


@FAST_PROPS
@given(
    scheme=st.sampled_from(["http", "https", "s3", "ftp", "file"]),
    user=user_s,
    password=password_s,
    qkey=st.sampled_from(QUERY_KEYS),
    qval=query_s,
    frag=st.text(QUERY, max_size=20),
    quote=st.sampled_from(["{!r}", "{}", "<{}>", "({})."]),
)
def test_redact_hides_userinfo_and_query_in_any_text(
    scheme, user, password, qkey, qval, frag, quote
):
    uri = f"{scheme}://{user}:{password}@host.example:8443/a/b.sh?{qkey}={qval}#{frag}"
    for shown in (
        redact.url(uri),
        redact.value(uri),
        redact.text("fetch " + quote.format(uri) + " failed"),
        str(ParamsError("x: " + quote.format(uri))),
    ):
        assert password not in shown and qval not in shown, shown
    assert redact.url(uri) == f"{scheme}://host.example:8443/a/b.sh?{qkey}=…"


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("https://u:p%40ss@h/x", "https://h/x"),
        ("https://u:pa/ss@h/x?sig=abc", "https://h/x?sig=…"),  # unencoded '/' in the password
        ("https://h/x?X-Amz-Signature=deadbeef&X-Amz-Credential=AKIA%2F", "https://h/x?X-Amz-Signature=…&X-Amz-Credential=…"),
        ("https://h/x?justatokenvalue", "https://h/x?…"),  # a bare query word may be a token
        ("https://h/x#access_token=abc", "https://h/x"),
        ("https://[::1/x?sig=abc", "<unparseable URL>"),
    ],
)  # fmt: skip
def test_redact_url_cases(uri, shown):
    assert redact.url(uri) == shown


# A PEM-shaped FIXTURE (a truncated body, no key): its markers are put together at run time
# so that no private-key-shaped text is tracked in git.
_PEM_KIND = "OPENSSH " + "PRIVATE KEY"
SECRETISH = {
    "pem": f"-----BEGIN {_PEM_KIND}-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9u\n"
    f"-----END {_PEM_KIND}-----",
    "aws secret key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "aws key id": "AKIAIOSFODNN7EXAMPLE",
    "base64 blob": base64.b64encode(b"\x8f" + os.urandom(40)).decode().replace("/", "A"),
    "password=": "password=Hunter2Hunter2",
}


ACCEPTS_KEY_ID = ("node_name", "controller", "features", "partitions", "hooks", "extra_key")


@pytest.mark.parametrize("kind", sorted(SECRETISH))
@pytest.mark.parametrize(
    "field",
    ["cluster_name", "node_name", "controller", "features", "partitions", "hooks", "extra_key",
     "unknown_key"],
)  # fmt: skip
def test_a_secret_pasted_into_the_wrong_field_is_not_echoed(kind, field):
    s = SECRETISH[kind]
    core = s.split("=", 1)[1] if kind == "password=" else s
    data = dict(COMPUTE)
    if field == "features":
        data["features"] = [s]
    elif field == "partitions":
        data["partitions"] = [{"name": s}]
    elif field == "hooks":
        data["hooks"] = [{"uri": "https://h/x.sh", "name": s}]
    elif field == "extra_key":
        data["extra"] = {s: 1, "bad": "x\x00"}
    elif field == "unknown_key":
        data[s] = 1
    else:
        data[field] = s
    try:
        parse_params(data, "node.yaml")
    except ParamsError as exc:
        msg = str(exc)
    else:  # a key id is also a valid node name / feature: accepted, so nothing to show
        assert kind == "aws key id" and field in ACCEPTS_KEY_ID, (kind, field)
        return
    assert msg.startswith("node.yaml: ")
    for part in (core, *core.splitlines()):
        if len(part) >= 16:
            assert part not in msg, msg


def test_hashes_paths_and_hints_are_not_redacted():
    """The net must not hide what an operator needs: sha256 sums, paths, placeholders."""
    for text in (
        "expected 3f786850e387550fdab836ed7e6dc881de23001b3f786850e387550fdab836ed, got 0a1b",
        "/tmp/pytest-of-root/pytest-3/test_controller_order0/etc/nodeforge/node.yaml: role",
        "/var/lib/nodeforge/hooks/Lifecycle/OnCreate2/x.sh: refused",
        "host spec 'nspawn://': expected nspawn://[CLUSTER] or nspawn://PID",
        "hooks[0].script: only with an s3:// prefix uri ending in /",
        "munge_key: not valid base64 (encode the key with: base64 -w0 munge.key)",
        # a release path mixes upper, lower and digits across its segments; it is no key
        "artifact enroot: download failed from "
        "https://github.com/NVIDIA/enroot/releases/download/v4.1.2/enroot_4.1.2-1_amd64.deb: "
        "HTTP 404",
    ):
        assert redact.text(text) == text


@settings(max_examples=200, deadline=None)
@given(key=st.binary(min_size=24, max_size=64).map(lambda b: base64.b64encode(b).decode()))
def test_a_key_in_one_url_path_segment_is_hidden(key):
    """The URL's path is judged segment by segment: a key that is one segment is still hidden
    (a '/' inside a base64 key splits it; each 32+ part is still a candidate)."""
    seg = key.replace("/", "_")
    assume(redact._looks_secret(seg))  # a rare draw lacks one of the three character classes
    out = redact.text(f"GET https://hooks.example/services/{seg}/x failed")
    assert seg not in out, out


# -- what holds params or errors is root-only -----------------------------------------------------
def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_outputs_are_root_only_and_wider_ones_are_narrowed(tmp_path):
    agent, _fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "10-ok").write_text("#!/bin/sh\necho hi\n")
    (paths.on_init_d / "10-ok").chmod(0o755)
    # What an older agent left: world-readable state, log and hook log.
    for f in (paths.state_file, paths.log_dir / "agent.log", paths.hooks_log_dir / "10-ok.log",
              paths.params_json):  # fmt: skip
        f.parent.mkdir(parents=True, exist_ok=True)
        f.parent.chmod(0o755)
        f.write_text("{}\n" if f.suffix == ".json" else "old line\n")
        f.chmod(0o644)
    with agent_log(paths):
        assert agent.init().status == "ready"
    for f in (paths.state_file, paths.params_json, paths.log_dir / "agent.log",
              paths.hooks_log_dir / "10-ok.log"):  # fmt: skip
        assert _mode(f) == 0o600, f
    for d in (paths.log_dir, paths.hooks_log_dir, paths.state_file.parent):
        assert _mode(d) == 0o700, d
    assert "old line" in (paths.log_dir / "agent.log").read_text()  # narrowed, not replaced


def test_fresh_outputs_are_root_only(tmp_path):
    agent, _fm, paths, _ = make(tmp_path, {**COMPUTE, "hook_retries": 0})
    paths.on_init_d.mkdir(parents=True)
    (paths.on_init_d / "10-ok").write_text("#!/bin/sh\necho hi\n")
    (paths.on_init_d / "10-ok").chmod(0o755)
    old = os.umask(0o022)
    try:
        with agent_log(paths):
            agent.init()
    finally:
        os.umask(old)
    for f in (paths.state_file, paths.params_json, paths.log_dir / "agent.log",
              paths.hooks_log_dir / "10-ok.log"):  # fmt: skip
        assert _mode(f) == 0o600, f


@pytest.mark.parametrize("first", ["", "/", "+", "A"])
def test_status_redacts_a_state_file_written_before_the_fix(tmp_path, first):
    """state.json written by an older agent holds the whole key: `node status` hides it (a
    key that starts with '/' too, which a path also does)."""
    key = first + base64.b64encode(os.urandom(48)).decode()[len(first) :]
    uri = "https://u:hunter2hunter2@h/x.sh?X-Amz-Signature=0123456789abcdef"
    st_ = State(status="failed", last_error=f"params: munge_key: {key!r} contains a control")
    st_.steps["hooks"].error = f"hook x.sh: cannot download {uri}: refused"
    (tmp_path / "var/lib/nodeforge").mkdir(parents=True)
    (tmp_path / "var/lib/nodeforge/state.json").write_text(json.dumps(st_.to_dict()))
    for flag in ([], ["--json"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(["node", "status", "--root", str(tmp_path), *flag])
        out = buf.getvalue()
        assert key not in out and "hunter2" not in out and "0123456789abcdef" not in out
        assert "munge_key" in out and "https://h/x.sh?X-Amz-Signature=" in out


# -- the nets under every log line and every crash ------------------------------------------------
URI = "https://builder:Hunter2Hunter2@h.example/x.sh?X-Amz-Signature=5f2b9c0d11e4a7"


def test_every_agent_log_line_is_redacted(tmp_path):
    paths = Paths.under(tmp_path)
    with agent_log(paths) as err:
        logging.getLogger("nodeforge.test").warning("fetching %s", URI)
    for text in ((paths.log_dir / "agent.log").read_text(), err.getvalue()):
        assert "fetching https://h.example/x.sh?X-Amz-Signature=…" in text
        assert "Hunter2" not in text and "5f2b9c0d11e4a7" not in text


def test_a_crash_message_is_redacted_everywhere(tmp_path):
    """Not a NodeforgeError (a bug): its text reaches state.json, the log and the drain."""
    agent, fm, paths, _ = make(tmp_path, COMPUTE)

    def crash():
        raise RuntimeError(f"boom while reading {URI}")

    agent._ready = crash
    with agent_log(paths) as err, pytest.raises(RuntimeError):
        agent.init()
    outs = outputs(paths, fm, None, err.getvalue())
    assert "boom while reading https://h.example/x.sh" in outs["state.json"]
    assert "Traceback" in outs["agent.log"]
    for secret in ("Hunter2", "5f2b9c0d11e4a7"):
        assert_absent(secret, outs)


def test_yaml_syntax_error_on_the_key_line_quotes_no_part_of_it(tmp_path):
    """PyYAML's message carries a snippet of the line: a key cut short of what redaction
    recognises (here lower case and digits only, still valid base64) must not show at all."""
    from nodeforge.bootstrap.params_sources import load_node_yaml

    key = "abcdefghijklmnopqrstuvwxyz0123456789abcdefgh"
    f = tmp_path / "node.yaml"
    f.write_text(f"role: compute\nmunge_key: {key}: x\n")
    f.chmod(0o600)
    with pytest.raises(ParamsError) as ei:
        load_node_yaml(f)
    text = "".join(traceback.format_exception(ei.value))
    # libyaml's C parser (the bounded pre-scan) says "in this context", PyYAML's "here"
    assert "not valid YAML: mapping values are not allowed" in text and "(line 2, column" in text
    assert not any(key[i : i + 8] in text for i in range(len(key) - 8))


@pytest.mark.parametrize(
    "hostile",
    [
        "a_" * 500_000 + " api_key=abcdef",  # many word starts before a named secret
        "Ab1" * 350_000,  # one endless blob
        "https://u:p@h/?x=1 " * 50_000,
        "-----BEGIN X-----" * 60_000,  # PEM openings, never closed
        "token=abcdef " * 80_000,
    ],
    ids=["word-starts", "blob", "urls", "pem", "named"],
)
def test_redaction_cost_stays_linear_on_a_megabyte(hostile):
    import time

    t0 = time.perf_counter()
    out = redact.text(hostile)
    # ~0.04-0.3 s measured on the 2-core CI host; a quadratic rule would take minutes.
    assert time.perf_counter() - t0 < 5
    assert "abcdef" not in out and "Ab1Ab1" not in out and "u:p@" not in out


def test_params_check_hides_a_secret_pasted_into_extra(tmp_path):
    f = tmp_path / "node.yaml"
    f.write_text(json.dumps({**COMPUTE, "extra": {"note": SECRETISH["aws secret key"],
                                                  "url": URI}}))  # fmt: skip
    f.chmod(0o600)
    for flag in ([], ["--json"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["params", "check", "--node-yaml", str(f), *flag]) == 0
        assert SECRETISH["aws secret key"] not in out.getvalue()
        assert "Hunter2" not in out.getvalue() and "5f2b9c0d11e4a7" not in out.getvalue()
        assert "<redacted" in out.getvalue()


def test_a_symlinked_agent_log_is_refused_not_followed(tmp_path):
    from nodeforge.errors import NodeforgeError

    paths = Paths.under(tmp_path)
    paths.log_dir.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.write_text("")
    (paths.log_dir / "agent.log").symlink_to(target)
    with (
        pytest.raises(NodeforgeError, match="agent.log: cannot open the agent's log"),
        agent_log(paths),
    ):
        pass
    assert target.read_text() == ""
