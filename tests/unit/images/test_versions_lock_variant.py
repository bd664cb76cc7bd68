"""`versions lock` per variant: a CPU-only mirror pins the cpu build, names what the gpu build
still lacks, and the README's two commands (lock, then build) work offline from it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeforge.cli import main
from nodeforge.errors import NodeforgeError
from nodeforge.images import template, versions
from tests.fixtures.mirror import make_mirror

pytestmark = pytest.mark.unit

GPU_ONLY = {
    "libnvidia_container1_deb",
    "libnvidia_container_tools_deb",
    "nvidia_container_toolkit_base_deb",
    "nvidia_container_toolkit_deb",
    "nvidia_fabricmanager_deb",
}


def _copy(tmp_path: Path) -> Path:
    """The test's own versions file, every artifact unpinned (the live one may be locked)."""
    dst = tmp_path / "versions.yaml"
    text = versions.VERSIONS_FILE.read_text()
    dst.write_text(re.sub(r"(?m)^(\s*sha256:\s*)\S+", r"\1null", text))
    return dst


@pytest.fixture(scope="module")
def cpu_mirror(tmp_path_factory) -> Path:
    """FIXTURE mirror with the cpu build's amd64 files only (no NVIDIA .debs, no arm64)."""
    m = tmp_path_factory.mktemp("cpu-mirror")
    sums = make_mirror(m, "amd64", gpu=False)
    assert not any("nvidia" in name for name in sums)
    return m


def _lock(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["versions", "lock", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("variant", versions.VARIANTS)
@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_lock_targets_of_a_variant_are_what_its_build_fetches(arch, variant):
    v = versions.load()  # names and architectures only: no pin is read
    got = {(a.name, a.arch) for a in versions.lock_targets(v, arch=arch, variant=variant)}
    assert got == {(a.name, a.arch) for a in v.for_arch(arch, variant)}
    every = {a.name for a in versions.lock_targets(v, variant=variant)}  # every architecture
    assert (every & GPU_ONLY == set()) == (variant == "cpu")


def test_cpu_only_mirror_pins_the_cpu_build_and_names_what_gpu_lacks(tmp_path, capsys, cpu_mirror):
    f = _copy(tmp_path)
    rc, out, err = _lock(capsys, "--versions-file", str(f), "--artifact-mirror", str(cpu_mirror),
                         "--arch", "amd64")  # fmt: skip
    assert rc == 0, err
    v = versions.load(f)
    cpu = v.for_arch("amd64", "cpu")
    assert all(a.pinned for a in cpu)
    assert {a.url for a in cpu} == {line.split()[1] for line in out.splitlines()}
    for a in cpu:
        assert a.sha256 == versions.sha256_file(cpu_mirror / a.file)
    # what stays unpinned is named, per variant, with the command that pins it
    assert "the gpu variant: libnvidia_container1_deb [amd64]" in err
    assert "'nodeforge versions lock --variant gpu --arch amd64'" in err
    assert "every variant: enroot_deb [arm64]" in err
    # the README's second command: the cpu build fetches from the same mirror, verified
    seen = versions.fetch(cpu, tmp_path / "dl", mirror=str(cpu_mirror), versions_path=f)
    assert set(seen) == {a.name for a in cpu}
    # a gpu build from this file is refused, and told how to pin what it lacks
    gpu = v.for_arch("amd64", "gpu")
    with pytest.raises(NodeforgeError) as exc:
        versions.fetch(gpu, tmp_path / "dl2", mirror=str(cpu_mirror), versions_path=f)
    msg = str(exc.value)
    assert "nodeforge versions lock --variant gpu --arch amd64" in msg
    assert "libnvidia_container1_deb" in msg and "enroot_deb" not in msg


def test_lock_json_lists_what_stays_unpinned(tmp_path, capsys, cpu_mirror):
    f = _copy(tmp_path)
    rc, out, err = _lock(capsys, "--versions-file", str(f), "--artifact-mirror", str(cpu_mirror),
                         "--arch", "amd64", "--json")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    left = {(u["artifact"], u["arch"], u["variant"]) for u in doc["unpinned"]}
    assert ("nvidia_fabricmanager_deb", "amd64", "gpu") in left
    assert ("enroot_deb", "arm64", "every") in left
    assert not any(a == "pyxis_src" or (arch == "amd64" and var == "every")
                   for a, arch, var in left)  # fmt: skip


def test_gpu_lock_from_a_cpu_only_mirror_fails_naming_the_file_and_changes_nothing(
    tmp_path, capsys, cpu_mirror
):
    f = _copy(tmp_path)
    before = f.read_text()
    rc, _, err = _lock(capsys, "--versions-file", str(f), "--artifact-mirror", str(cpu_mirror),
                       "--arch", "amd64", "--variant", "gpu")  # fmt: skip
    assert rc == 2
    assert "libnvidia-container1_1.17.8-1_amd64.deb' is not in the mirror directory" in err
    assert f.read_text() == before  # nothing half-pinned


def test_lock_defaults_to_the_build_hosts_architecture_and_the_cpu_variant(
    tmp_path, capsys, cpu_mirror, monkeypatch
):
    from nodeforge.images import base

    monkeypatch.setattr(base, "host_arch", lambda: "amd64")
    f = _copy(tmp_path)
    rc, _, err = _lock(capsys, "--versions-file", str(f), "--artifact-mirror", str(cpu_mirror))
    assert rc == 0, err
    pinned = {(a.name, a.arch) for a in versions.load(f).all_artifacts() if a.pinned}
    assert pinned == {(a.name, a.arch) for a in versions.load(f).for_arch("amd64")}


@pytest.mark.parametrize("bad", ["tpu", "", "cpu\n", "ALL"])
def test_lock_variant_is_one_of_the_build_variants(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["versions", "lock", "--variant", bad])
    assert exc.value.code == 2
    assert "--variant" in capsys.readouterr().err


def test_variant_targets_cover_exactly_the_versions_file_variants():
    assert tuple(template.VARIANT_TARGETS) == versions.VARIANTS
    assert set(template.VARIANT_TARGETS["cpu"]) == set(template.TARGETS)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(arch=st.text(max_size=12))
def test_any_arch_value_pins_or_is_refused_in_one_line_and_changes_nothing(
    tmp_path, capsys, cpu_mirror, arch
):
    f = tmp_path / "versions.yaml"
    if not f.exists():
        _copy(tmp_path)
    before = f.read_text()
    try:
        rc = main(["versions", "lock", "--versions-file", str(f), "--artifact-mirror",
                   str(cpu_mirror), f"--arch={arch}"])  # fmt: skip
    except SystemExit as exc:  # argparse's own usage error
        rc = exc.code
    err = capsys.readouterr().err
    if arch == "amd64":
        assert rc == 0, err
        f.write_text(before)  # the next example starts unpinned again
        return
    assert rc == 2, err
    assert err.startswith(("nodeforge: error:", "usage:")) and "Traceback" not in err
    assert f.read_text() == before  # nothing half-pinned


def test_hyperpod_build_needs_the_aws_cli_and_jq_before_anything_starts(monkeypatch):
    from nodeforge.errors import MissingToolError
    from nodeforge.images import packer_build as remote

    monkeypatch.setattr(remote.proc, "require_tool", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(remote, "aws_credentials_present", lambda env=None: True)
    monkeypatch.setattr(remote.shutil, "which", lambda tool: None)
    with pytest.raises(MissingToolError, match=r"'aws' not found.*apt-get install awscli"):
        remote.check_target("amazon-ebs", {"encrypt_boot": False})
    assert remote.check_target("amazon-ebs", {}) == 0  # encrypted: the check never runs
