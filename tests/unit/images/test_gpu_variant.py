"""The gpu image variant's inputs: artifacts per variant, base components and key, CLI option."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from nodeforge.errors import NodeforgeError
from nodeforge.images import base as base_mod
from nodeforge.images import versions
from tests.fixtures.mirror import make_mirror

pytestmark = pytest.mark.unit

GPU_ARTIFACTS = {
    "libnvidia_container1_deb",
    "libnvidia_container_tools_deb",
    "nvidia_container_toolkit_base_deb",
    "nvidia_container_toolkit_deb",
    "nvidia_fabricmanager_deb",
}


def test_cpu_build_needs_no_nvidia_artifact_and_gpu_build_needs_all():
    v = versions.load()
    for arch in ("amd64", "arm64"):
        cpu = {a.name for a in v.for_arch(arch)}
        gpu = {a.name for a in v.for_arch(arch, "gpu")}
        assert cpu == {"enroot_deb", "enroot_caps_deb", "pyxis_src"}
        assert gpu == cpu | GPU_ARTIFACTS


def test_nvidia_artifacts_are_gpu_only_and_match_the_driver():
    # The live file's pins are not read: README's `nodeforge versions lock` may have pinned
    # them (the loader already refuses a sha256 that is not 64 hex characters).
    for a in versions.load().all_artifacts():
        if a.name in GPU_ARTIFACTS:
            assert a.variant == "gpu"
    fm = [a for a in versions.load().all_artifacts() if a.name == "nvidia_fabricmanager_deb"]
    assert all("_550.163.01-" in a.file for a in fm)  # the driver's exact version


def test_unknown_variant_in_versions_file_names_the_field(tmp_path):
    raw = yaml.safe_load(versions.VERSIONS_FILE.read_text())
    raw["artifacts"]["enroot_deb"]["variant"] = "tpu\n"
    p = tmp_path / "v.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(NodeforgeError, match=r"artifacts\.enroot_deb\.variant"):
        versions.load(p)


def test_missing_nvidia_artifact_in_mirror_names_it_and_the_option(tmp_path):
    m = tmp_path / "m"
    make_mirror(m, gpu=False)  # a CPU-only mirror
    arts = versions.load().for_arch("amd64", "gpu")
    with pytest.raises(NodeforgeError, match=r"libnvidia_container1_deb.*--artifact-mirror"):
        versions.fetch(arts, tmp_path / "dl", mirror=str(m), allow_unpinned=True)


def test_fixture_mirror_has_every_gpu_artifact_labelled_fixture(tmp_path):
    import subprocess

    sums = make_mirror(tmp_path / "m")
    for a in versions.load().for_arch("amd64", "gpu"):
        assert a.file in sums, a.file
        if a.file.endswith(".deb"):
            desc = subprocess.run(
                ["dpkg-deb", "-f", str(tmp_path / "m" / a.file), "Description"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "FIXTURE" in desc


def test_base_components_and_key_per_variant():
    args = ("trixie", "http://deb.debian.org/debian", "amd64", "minbase", ("systemd",), "1.5.6")
    cpu = base_mod.BaseSpec(*args)
    gpu = base_mod.BaseSpec(*args, base_mod.COMPONENTS["gpu"])
    assert set(base_mod.COMPONENTS["gpu"]) >= {"main", "contrib", "non-free", "non-free-firmware"}
    assert cpu.key() != gpu.key()
    # The cpu key is the one it had before variants existed (cached bases stay valid).
    import hashlib
    import json

    old = {
        "suite": args[0],
        "mirror": args[1],
        "arch": args[2],
        "variant": args[3],
        "packages": list(args[4]),
        "mmdebstrap": args[5],
    }
    assert cpu.key() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]


def test_cli_variant_option():
    from nodeforge.images import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    assert parser.parse_args(["build"]).variant == "cpu"
    assert parser.parse_args(["build", "--variant", "gpu"]).variant == "gpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["build", "--variant", "gpu;rm"])


def test_gpu_role_runs_only_for_the_gpu_variant():
    site = yaml.safe_load((Path(versions.__file__).parent / "site.yml").read_text())
    main = site[1]
    assert main["vars"]["nodeforge_variant"] == "cpu"
    gpu = [r for r in main["roles"] if r["role"] == "gpu"]
    # tagged with its name, as every role is (the layered cache re-applies roles by tag)
    assert gpu == [{"role": "gpu", "when": 'nodeforge_variant == "gpu"', "tags": ["gpu"]}]
    names = [r["role"] for r in main["roles"]]
    assert names.index("gpu") < names.index("seal")  # before the seal cleans up


def test_gpu_role_checks_versions_and_builds_for_the_image_kernel():
    tasks = yaml.safe_load(
        (Path(versions.__file__).parents[1] / "roles/gpu/tasks/install.yml").read_text()
    )

    def walk(ts):
        for t in ts:
            yield t
            for key in ("block", "rescue", "always"):
                yield from walk(t.get(key, []))

    argvs = [t.get("ansible.builtin.command", {}).get("argv") for t in walk(tasks)]
    assert [a for a in argvs if a and a[0] == "dkms"] == [
        ["dkms", "autoinstall", "-k", "{{ gpu_kernel_version }}"]
    ]
    text = (Path(versions.__file__).parents[1] / "roles/gpu/tasks/install.yml").read_text()
    assert "version mismatch" in text and "linux-headers-" in text
    assert "/var/lib/dkms/mok.key" in text  # no private key ships in the image
    assert "make.log" in text  # a failed module build shows why


PCI_H_NEW = """int __must_check pci_resize_resource(struct pci_dev *dev, int i, int size,
\t\t\t\t     int exclude_bars);
"""
PCI_H_OLD = "int __must_check pci_resize_resource(struct pci_dev *dev, int i, int size);\n"
NV_PCI_C = "    r = pci_resize_resource(pci_dev, NV_GPU_BAR1, requested_size);\n"


@pytest.mark.parametrize("header,patched", [(PCI_H_NEW, True), (PCI_H_OLD, False)])
def test_dkms_compat_fix_only_for_kernels_with_exclude_bars(tmp_path, header, patched):
    """FIXTURE trees: the PRE_BUILD fix patches NVIDIA 550's call only for the 4-argument form
    (Linux 6.12.117's linux/pci.h, quoted above) and leaves older kernels' builds untouched."""
    import shutil
    import subprocess

    import jinja2

    tpl = Path(versions.__file__).parents[1] / "roles/gpu/templates/nvidia-dkms-compat.sh.j2"
    script = jinja2.Template(tpl.read_text()).render(
        ansible_managed="test",
        gpu_dkms_module="nvidia-current-open",
        gpu_driver_version="550.163.01",
    )
    # The script reads /lib/modules/$1/source/include/linux/pci.h: point it into tmp_path.
    script = script.replace("/lib/modules/", f"{tmp_path}/lib/modules/")
    kdir = tmp_path / "lib/modules/6.12.117+deb13-amd64/source/include/linux"
    kdir.mkdir(parents=True)
    (kdir / "pci.h").write_text(header)
    build = tmp_path / "build"
    (build / "nvidia").mkdir(parents=True)
    (build / "nvidia/nv-pci.c").write_text(NV_PCI_C)
    (build / "compat.sh").write_text(script)
    cp = subprocess.run(
        [shutil.which("sh"), "compat.sh", "6.12.117+deb13-amd64"],
        cwd=build,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cp.returncode == 0, cp.stderr
    text = (build / "nvidia/nv-pci.c").read_text()
    assert ("requested_size, 0);" in text) is patched
    cp = subprocess.run(
        [shutil.which("sh"), "compat.sh", "9.9.9-amd64"],
        cwd=build,
        capture_output=True,
        text=True,
        check=False,
    )
    assert cp.returncode == 1 and "no linux/pci.h for kernel 9.9.9-amd64" in cp.stderr


def test_missing_non_free_package_fails_naming_it_and_the_mirror_option():
    """The assert that runs before anything is installed: a package without an apt candidate
    (a mirror without contrib/non-free) fails the build with its name and where the mirror is
    set. Rendered here as Ansible would for one loop item."""
    import jinja2

    role = Path(versions.__file__).parents[1] / "roles/gpu"
    tasks = yaml.safe_load((role / "tasks/install.yml").read_text())
    [check] = [
        t for t in tasks if t.get("name", "").startswith("Assert the archive has the non-free")
    ]
    assert "nvidia-smi" in check["loop"] and "slurm-wlm-nvml-plugin" in check["loop"]
    msg = jinja2.Template(check["ansible.builtin.assert"]["fail_msg"]).render(item="nvidia-smi")
    assert msg.startswith("package nvidia-smi has no candidate")
    assert "non-free" in msg and "base.mirror" in msg and "--versions-file" in msg
    # ... and the check runs before the install task (nothing half-installed)
    names = [t.get("name", "") for t in tasks]
    install = next(i for i, t in enumerate(tasks) if "block" in t)
    assert names.index(check["name"]) < install
