"""Typed fields mean what they say (issue 23, item 3): YAML 1.1 no longer retypes a scalar
(`max_time: 2:00:00` was 7200 minutes, `cpus: 010` was 8); each typed field in params,
gang.yaml and the versions file parses its value strictly and names the accepted forms."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeforge import scalars, strict_yaml
from nodeforge.bootstrap.params import ParamsError, parse_params
from nodeforge.bootstrap.params_check import check_cmdline
from nodeforge.errors import NodeforgeError
from nodeforge.gang import config as gang_config
from nodeforge.images import versions

pytestmark = pytest.mark.unit
PROPS = settings(max_examples=200, deadline=None, database=None)

BASE = "role: compute\ncluster_name: demo\ncontroller: 10.0.0.1\n"


def params(text: str):
    return parse_params(strict_yaml.load(BASE + text), "node.yaml")


@pytest.mark.parametrize(
    "given_, slurm_gets",
    [
        ("2:00:00", "2:00:00"),  # hours:minutes:seconds (YAML 1.1: 7200, i.e. five days)
        ("90", "90"),  # minutes
        ("30:00", "30:00"),  # minutes:seconds (YAML 1.1: 1800)
        ("2-12", "2-12"),  # days-hours
        ("2-12:30", "2-12:30"),
        ("1-00:00:00", "1-00:00:00"),
        ("INFINITE", "INFINITE"),
        ("UNLIMITED", "UNLIMITED"),
        ("0", "0"),
    ],
)
def test_max_time_in_slurms_own_forms(given_, slurm_gets):
    p = params(f"partitions:\n  - name: p\n    max_time: {given_}\n")
    assert p.partitions[0].max_time == slurm_gets


@pytest.mark.parametrize(
    "given_, why",
    [
        ("010", "leading zero on bare minutes"),
        ("1-24", "hours out of range"),
        ("1:60", "seconds out of range"),
        ("1:60:00", "minutes out of range"),
        ("2.5", "got float"),
        ("true", "got bool"),
        ("1h", "is not a Slurm time"),
        ("'1:00\n'", "is not a Slurm time"),
        ("-1", "out of range"),
        ("100000-0", "is not a Slurm time"),
    ],
)
def test_max_time_refused_names_field_and_forms(given_, why):
    with pytest.raises(ParamsError) as ei:
        params(f"partitions:\n  - name: p\n    max_time: {given_}\n")
    msg = str(ei.value)
    assert msg.startswith("node.yaml: partitions[0].max_time: ")
    assert why in msg
    assert "days-hours:minutes:seconds" in msg  # the accepted forms are named


@pytest.mark.parametrize(
    "value, why",
    [
        ("010", "leading zero is octal in YAML 1.1"),
        ("0o10", "0x/0o/0b forms are not accepted"),
        ("0x10", "0x/0o/0b forms are not accepted"),
        ("0b10", "0x/0o/0b forms are not accepted"),
        ("1_000", "'_' separators are not accepted"),
        ("1:30", "base 60 in YAML 1.1"),
        ("'16'", "it is quoted"),
        ("16.0", "got float 16.0"),
        ("true", "got bool"),
        ("1e3", "expected a decimal integer"),
        ("99999999999999999999999", "too many digits"),
    ],
)
@pytest.mark.parametrize(
    "field", ["cpus", "real_memory", "max_node_count", "hook_output_max", "health_interval"]
)
def test_integer_fields_refuse_other_notations(field, value, why):
    with pytest.raises(ParamsError) as ei:
        params(f"{field}: {value}\n")
    assert str(ei.value).startswith(f"node.yaml: {field}: expected an integer, got ")
    assert why in str(ei.value)


def test_nested_integer_fields_too():
    with pytest.raises(ParamsError, match=r"hooks\[0\]\.retries: .*leading zero"):
        params("hooks:\n  - uri: file:///x\n    retries: 03\n")
    with pytest.raises(ParamsError, match=r"expected_gpus: .*0x/0o/0b"):
        params("expected_gpus: 0x8\n")


@pytest.mark.parametrize("field", ["hook_timeout", "wait_timeout", "hook_backoff"])
def test_seconds_refuse_base_60(field):
    with pytest.raises(
        ParamsError,
        match=rf"node\.yaml: {field}: expected a number \(seconds\), got str '1:30': a:b is base 60",
    ):
        params(f"{field}: 1:30\n")
    assert getattr(params(f"{field}: 90\n"), field) == 90.0
    assert getattr(params(f"{field}: 2.5\n"), field) == 2.5


def test_string_fields_keep_what_was_written():
    """`cluster_name: 010` was the int 8 (refused as not a string); it is the name "010"."""
    p = params(
        "features: [010, 1_000, 0x1f]\nextra: {born: 2024-01-01, code: 0o7}\n".replace(
            "cluster_name: demo", "x"
        )
    )
    assert p.features == ("010", "1_000", "0x1f")
    assert p.extra == {"born": "2024-01-01", "code": "0o7"}
    assert (
        parse_params(strict_yaml.load("role: controller\ncluster_name: 010\n"), "y").cluster_name
        == "010"
    )


def test_kernel_command_line_integers_refuse_a_leading_zero():
    with pytest.raises(
        ParamsError, match=r"nodeforge\.cpus: expected an integer, got '010': a leading zero"
    ):
        check_cmdline(
            "nodeforge.role=compute nodeforge.cluster=d nodeforge.controller=c nodeforge.cpus=010",
            "c",
        )
    ok = check_cmdline(
        "nodeforge.role=compute nodeforge.cluster=d nodeforge.controller=c nodeforge.cpus=10", "c"
    )
    assert ok.params.cpus == 10


@PROPS
@given(st.from_regex(r"[-+]?[0-9_:.xXoObBeE]{1,12}", fullmatch=True))
def test_a_number_always_reads_back_as_its_decimal_text(s):
    """Whatever YAML 1.1 would retype: the loader gives the decimal number the text spells,
    or the text itself; never a different number."""
    try:
        got = strict_yaml.load(f"v: {s}\n")["v"]
    except Exception:  # not a YAML scalar at all ("- " etc.): a YAMLError, nothing built
        return
    if isinstance(got, bool) or got is None:
        return
    if isinstance(got, int):
        assert (
            str(got) == s.lstrip("+") or (s.startswith("-") and str(got) == s) or s in ("-0", "+0")
        )
        assert not s.lstrip("+-").startswith("0") or s.lstrip("+-") == "0"
    elif isinstance(got, float):
        assert got != got or got == float(s)  # NaN, or the exact decimal float
        assert ":" not in s and "_" not in s
    else:
        assert got == s


@PROPS
@given(
    st.integers(0, 99999), st.integers(0, 23), st.integers(0, 59), st.integers(0, 59),
    st.sampled_from(["d-h", "d-h:m", "d-h:m:s", "h:m:s", "m:s", "m"]),
)  # fmt: skip
def test_every_slurm_time_form_in_range_is_accepted_verbatim(d, h, m, s, form):
    text = {
        "d-h": f"{d}-{h}", "d-h:m": f"{d}-{h}:{m:02d}", "d-h:m:s": f"{d}-{h:02d}:{m:02d}:{s:02d}",
        "h:m:s": f"{h}:{m:02d}:{s:02d}", "m:s": f"{m}:{s:02d}", "m": str(d),
    }[form]  # fmt: skip
    p = params(f"partitions: [{{name: p, max_time: {text}}}]\n")
    assert p.partitions[0].max_time == text
    assert scalars.slurm_time(text) == text


# -- gang.yaml ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "doc, field, why",
    [
        ("timeout: 5:00\n", "'timeout'", "base 60"),  # YAML 1.1: 300 s, silently
        ("command_timeout: 010\n", "'command_timeout'", "leading zero"),
        ("seed: 010\n", "'seed'", "leading zero is octal"),
        (
            "requeuing:\n  backoff_limit_count: 0x10\n",
            "'requeuing.backoff_limit_count'",
            "0x/0o/0b",
        ),
        ("gangs:\n  min_nodes: 1_0\n", "'gangs.min_nodes'", "'_' separators"),
        ("node_strike_limit: 2.0\n", "'node_strike_limit'", "no decimal point"),
    ],
)
def test_gang_config_typed_fields(tmp_path, doc, field, why):
    p = tmp_path / "gang.yaml"
    p.write_text(doc)
    with pytest.raises(gang_config.ConfigError) as ei:
        gang_config.load(p)
    assert str(ei.value).startswith(f"{p}: {field}: ")
    assert why in str(ei.value)


def test_gang_config_durations_still_read_their_forms(tmp_path):
    p = tmp_path / "gang.yaml"
    p.write_text("timeout: 5m\ncommand_timeout: 250ms\ninterval_seconds: 2\nseed: 10\n")
    cfg = gang_config.load(p)
    assert (cfg.timeout, cfg.command_timeout, cfg.interval_seconds, cfg.seed) == (300, 0.25, 2, 10)


# -- versions file ------------------------------------------------------------------------
def test_versions_file_refuses_a_version_that_yaml_reads_as_a_number(tmp_path):
    text = versions.VERSIONS_FILE.read_text()
    p = tmp_path / "versions.yaml"
    p.write_text(text.replace("    version: 4.1.2\n", "    version: 4.10\n", 1))
    with pytest.raises(
        NodeforgeError,
        match=r"artifacts\.enroot_deb\.version must be a string, got the number 4\.1; quote it",
    ):
        versions.load(p)
    p.write_text(text.replace('slurm: "24.11"', "slurm: 24.10", 1))
    with pytest.raises(
        NodeforgeError, match=r"bases\.debian13\.slurm must be a string, got the number 24\.1"
    ):
        versions.load(p)
    for schema, shown in (("01", "'01'"), ("true", "True"), ("1.0", "1.0")):
        p.write_text(text.replace("schema: 1", f"schema: {schema}", 1))
        with pytest.raises(NodeforgeError, match=f"schema must be 1, got {shown}"):
            versions.load(p)
