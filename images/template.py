"""Packer HCL2 templates for the three targets, written with python-hcl2 and `packer fmt`-ed.

One playbook (images/site.yml) provisions every target; only the source block differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import hcl2

from . import targets as targets_mod
from .targets import VARIANTS

TARGETS = targets_mod.TARGETS

# Which targets build which image variant (the target table); build, render and validate
# refuse the same combinations with the same message (check_variant).
VARIANT_TARGETS = {v: targets_mod.variant_targets(v) for v in VARIANTS}

# Packer >= 1.7 installs these with `packer init` (images/packer.py runs it before validate
# and build): exact versions, so a build does not change under us when a plugin is released.
# Packer 1.6 has the builders built in and gets no required_plugins block.
PLUGINS: dict[str, tuple[str, str]] = {
    "ansible": ("github.com/hashicorp/ansible", "1.1.4"),
    "qemu": ("github.com/hashicorp/qemu", "1.1.0"),
    "vagrant": ("github.com/hashicorp/vagrant", "1.1.6"),
    "amazon": ("github.com/hashicorp/amazon", "1.8.0"),
}
TARGET_PLUGINS = {t.name: t.plugins for t in targets_mod.TABLE.values()}

# amazon-ebs builds from the official Debian AMI of the build's base (--base), so the
# manifest's base is the one the AMI was made from. The playbook supports Debian only.
SOURCE_AMIS = {
    "debian12": ("debian-12", "136693071363"),
    "debian13": ("debian-13", "136693071363"),
}


def q(s: str) -> str:
    """An HCL string literal (python-hcl2 keeps quotes as part of the value)."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class Variable:
    name: str
    type: str  # HCL type expression: string, number, bool, map(string), list(string)
    default: object = None  # None = required
    description: str = ""
    sensitive: bool = False


def _common_vars() -> list[Variable]:
    return [
        Variable("image_name", "string", "nodeforge", "name of the image (prefix of the AMI name)"),
        Variable("playbook_file", "string", None, "path of images/site.yml"),
        Variable(
            "extra_vars_file", "string", None, "JSON file of Ansible variables from nodeforge"
        ),
        Variable("ansible_playbook", "string", "ansible-playbook", "ansible-playbook executable"),
        Variable("ansible_config", "string", None, "path of the repository's ansible.cfg"),
        Variable(
            "ansible_vars", "map(string)", {}, "extra role variables (see meta/argument_specs.yml)"
        ),
    ]


TARGET_VARS: dict[str, list[Variable]] = {
    "local": [
        Variable("ssh_port", "number", None, "sshd port of the nspawn sandbox on 127.0.0.1"),
        Variable("ssh_private_key_file", "string", None, "throwaway build key"),
    ],
    "qemu": [
        Variable(
            "base_disk",
            "string",
            None,
            "base qcow2: made from the mmdebstrap base, or a cloud image URL",
        ),
        Variable(
            "base_disk_checksum",
            "string",
            "none",
            "sha256:<hex> of a downloaded base disk; 'none' for a local file",
        ),
        Variable(
            "kernel", "string", "", "direct-boot kernel for a base disk without a boot loader"
        ),
        Variable(
            "seed_directory",
            "string",
            "",
            "NoCloud seed (user-data, meta-data) served to a cloud image; set by nodeforge",
        ),
        Variable("initrd", "string", "", "direct-boot initrd beside kernel"),
        Variable(
            "accelerator",
            "string",
            "tcg",
            "kvm or tcg (nodeforge probes KVM and falls back to tcg)",
        ),
        Variable("disk_size", "string", "8G", "size of the built disk"),
        Variable("memory", "number", 2048, "guest memory in MiB"),
        Variable("cpus", "number", 2, "guest vCPUs"),
        Variable("ssh_username", "string", "root", "user Packer logs in as"),
        Variable("ssh_private_key_file", "string", None, "key authorized in the base disk"),
        Variable("output_directory", "string", "output-qemu", "where Packer writes the qcow2"),
        Variable("box_output", "string", "nodeforge-libvirt.box", "Vagrant box path"),
        Variable(
            "console_log", "string", "console.log", "file that receives the guest's serial console"
        ),
        Variable(
            "seal_command",
            "string",
            None,
            "host command that seals the powered-off disk (set by nodeforge)",
        ),
        Variable(
            "box_vagrantfile", "string", None, "the box's own Vagrantfile (images/box/Vagrantfile)"
        ),
    ],
    "amazon-ebs": [
        Variable("region", "string", "us-east-1", "AWS region"),
        Variable("instance_type", "string", "c6i.xlarge", "builder instance type"),
        Variable("subnet_id", "string", "", "subnet for the builder (default VPC when empty)"),
        Variable(
            "source_os",
            "string",
            "debian-13",
            "debian-13 or debian-12 (official Debian AMIs); nodeforge sets it from --base",
        ),
        Variable(
            "arch",
            "string",
            "amd64",
            "amd64 or arm64; nodeforge sets it to the build host's (the artifacts' architecture)",
        ),
        Variable("root_volume_size", "number", 30, "GiB of the gp3 root volume"),
        Variable(
            "encrypt_boot",
            "bool",
            True,
            "encrypt the AMI's root snapshot; false for SageMaker HyperPod (CustomAmiId takes "
            "only an unencrypted AMI)",
        ),
        Variable(
            "kms_key_id",
            "string",
            "",
            "KMS key for EBS encryption (AWS-managed key when empty; only with encrypt_boot)",
        ),
        Variable(
            "ami_tags", "map(string)", {}, "extra tags; nodeforge adds the manifest's versions"
        ),
        Variable("ami_regions", "list(string)", [], "regions to copy the AMI to"),
    ],
}


def variables_for(target: str) -> list[Variable]:
    return _common_vars() + TARGET_VARS[target]


def _hcl_value(v: object) -> object:
    if isinstance(v, str):
        return q(v)
    if isinstance(v, dict):
        return {k: _hcl_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_hcl_value(x) for x in v]
    return v


def _declare(b: hcl2.Builder, target: str) -> None:
    for v in variables_for(target):
        attrs: dict = {"type": "${" + v.type + "}"}
        if v.default is not None:
            attrs["default"] = _hcl_value(v.default)
        if v.description:
            attrs["description"] = q(v.description)
        b.block("variable", [q(v.name)], **attrs)


# Environment of every ansible-playbook run (besides ANSIBLE_CONFIG): Packer's provisioner
# and the local target's passes over a cached layer (images/nspawn_build.py) use the same.
ANSIBLE_ENV = {"ANSIBLE_HOST_KEY_CHECKING": "False", "ANSIBLE_FORCE_COLOR": "0"}


def _ansible(build: hcl2.Builder, *, user: str, become: bool) -> None:
    args = ["--extra-vars", "@${var.extra_vars_file}"]
    if become:
        args += ["--become"]
    build.block(
        "provisioner",
        [q("ansible")],
        playbook_file="${var.playbook_file}",
        command="${var.ansible_playbook}",
        user=q(user),
        # Packer's SSH proxy breaks with current ansible-core; connect directly.
        use_proxy=False,
        extra_arguments=[q(a) for a in args],
        ansible_env_vars=[
            q("ANSIBLE_CONFIG=${var.ansible_config}"),
            *(q(f"{k}={v}") for k, v in ANSIBLE_ENV.items()),
        ],
    )


def _local(b: hcl2.Builder) -> None:
    b.block(
        "source",
        [q("null"), q("sandbox")],
        communicator=q("ssh"),
        ssh_host=q("127.0.0.1"),
        ssh_port="${var.ssh_port}",
        ssh_username=q("root"),
        ssh_private_key_file="${var.ssh_private_key_file}",
        ssh_timeout=q("3m"),
    )
    build = b.block("build", name=q("nodeforge-local"), sources=[q("source.null.sandbox")])
    _ansible(build, user="root", become=False)


def _qemu(b: hcl2.Builder) -> None:
    b.block(
        "source",
        [q("qemu"), q("node")],
        iso_url="${var.base_disk}",
        iso_checksum="${var.base_disk_checksum}",
        disk_image=True,
        use_backing_file=False,
        format=q("qcow2"),
        disk_size="${var.disk_size}",
        accelerator="${var.accelerator}",
        headless=True,
        memory="${var.memory}",
        cpus="${var.cpus}",
        net_device=q("virtio-net"),
        disk_interface=q("virtio"),
        communicator=q("ssh"),
        ssh_username="${var.ssh_username}",
        ssh_private_key_file="${var.ssh_private_key_file}",
        ssh_timeout=q("20m"),
        shutdown_command=q("systemctl poweroff"),
        output_directory="${var.output_directory}",
        vm_name=q("nodeforge.qcow2"),
        # Direct kernel boot for the locally made base disk (it has no boot loader); with
        # a cloud image leave kernel empty and the disk's own loader is used.
        # A cloud image gets the build key from cloud-init's NoCloud source, served by
        # Packer's HTTP server (guest 10.0.2.2 is the host's loopback under slirp).
        http_directory="${var.seed_directory}",
        http_bind_address=q("127.0.0.1"),
        # SSH forward on loopback only (Packer's default listens on every address), and the
        # serial console in a file so a guest that never answers can be diagnosed. The
        # locally made base disk has no boot loader: its kernel is booted directly.
        qemuargs=(
            '${concat([["-netdev", "user,id=user.0,hostfwd=tcp:127.0.0.1:{{ .SSHHostPort }}-:22"], '
            '["-serial", "file:${var.console_log}"]], '
            'var.kernel == "" ? '
            '[["-smbios", "type=1,serial=ds=nocloud-net;s=http://{{ .HTTPIP }}:{{ .HTTPPort }}/"]] : '
            '[["-kernel", var.kernel], ["-initrd", var.initrd], '
            '["-append", "root=LABEL=nodeforge-root rw console=ttyS0 net.ifnames=0"]])}'
        ),
    )
    build = b.block("build", name=q("nodeforge-qemu"), sources=[q("source.qemu.node")])
    _ansible(build, user="root", become=False)
    # One chain: the powered-off disk is sealed on the host first (images/disk_seal.py), so
    # the box is made from the sealed disk, not from the build VM's.
    chain = build.block("post-processors")
    chain.block("post-processor", [q("shell-local")], inline=["${var.seal_command}"])
    chain.block(
        "post-processor",
        [q("vagrant")],
        provider_override=q("libvirt"),
        output="${var.box_output}",
        keep_input_artifact=True,
        # Nothing but the disk, metadata.json and the Vagrantfile: the sealed disk carries
        # its own boot loader, so the box boots from firmware (no kernel of its own).
        vagrantfile_template="${var.box_vagrantfile}",
    )


def _amazon(b: hcl2.Builder, modern: bool) -> None:
    _amazon_source(b, modern)
    _amazon_build(b, modern)


def _amazon_source(b: hcl2.Builder, modern: bool) -> None:
    """The source AMIs and the amazon-ebs source: the builder instance and its root volume."""
    b.block(
        "locals",
        build_stamp='${formatdate("YYYYMMDDhhmmss", timestamp())}',
        source_amis={
            q(os_name): {
                "owner": q(owner),
                "name": q(f"{os_name}-%s-*"),
                "user": q("admin"),
                "root_device": q("/dev/xvda"),
            }
            for os_name, owner in SOURCE_AMIS.values()
        },
    )
    src = b.block(
        "source",
        [q("amazon-ebs"), q("node")],
        region="${var.region}",
        instance_type="${var.instance_type}",
        subnet_id="${var.subnet_id}",
        # Unique per build: AMI names must be unique within an account and region.
        ami_name='${"${var.image_name}-${var.source_os}-${var.arch}-${local.build_stamp}"}',
        ami_description=q("nodeforge Slurm node image (controller/login/compute)"),
        ami_regions="${var.ami_regions}",
        ssh_username="${local.source_amis[var.source_os].user}",
        # Encrypted by default (plain EC2). encrypt_boot = false makes the AMI SageMaker
        # HyperPod takes as CustomAmiId: unencrypted, and (below) one root mapping only.
        encrypt_boot="${var.encrypt_boot}",
        kms_key_id="${var.kms_key_id}",
        **({"imds_support": q("v2.0")} if modern else {}),
        tags='${merge(var.ami_tags, {"Name" = "${var.image_name}-${local.build_stamp}", "nodeforge:image" = var.image_name, "nodeforge:source_os" = var.source_os})}',
    )
    src.block(
        "source_ami_filter",
        filters={
            "name": '${format(local.source_amis[var.source_os].name, var.arch == "amd64" ? "amd64" : "arm64")}',
            q("virtualization-type"): q("hvm"),
            q("root-device-type"): q("ebs"),
            "architecture": '${var.arch == "amd64" ? "x86_64" : "arm64"}',
        },
        owners=["${local.source_amis[var.source_os].owner}"],
        most_recent=True,
    )
    if modern:
        # IMDSv2 only: on the builder instance, and registered on the AMI for its instances.
        src.block(
            "metadata_options",
            http_endpoint=q("enabled"),
            http_tokens=q("required"),
            http_put_response_hop_limit=1,
        )
    # The root volume only: no ami_block_device_mappings and no second launch mapping, so
    # the AMI is its root snapshot alone (HyperPod uses only that one).
    src.block(
        "launch_block_device_mappings",
        device_name="${local.source_amis[var.source_os].root_device}",
        volume_type=q("gp3"),
        # gp3 baseline; Packer requires both to be explicit for gp3.
        iops=3000,
        throughput=125,
        volume_size="${var.root_volume_size}",
        encrypted="${var.encrypt_boot}",
        delete_on_termination=True,
    )


def _amazon_build(b: hcl2.Builder, modern: bool) -> None:
    """The build: Ansible, then the post-processors that check and record the AMI."""
    build = b.block("build", name=q("nodeforge-ami"), sources=[q("source.amazon-ebs.node")])
    _ansible(build, user="${local.source_amis[var.source_os].user}", become=True)
    # The AMI id, recorded beside manifest.json (nodeforge runs Packer in its work dir).
    build.block(
        "post-processor", [q("manifest")], output=q("packer-manifest.json"), strip_path=True
    )
    # An account with EBS encryption by default encrypts every new volume whatever the
    # template says; HyperPod would then refuse the AMI at CreateCluster. Check the AMI
    # itself, so an unencrypted build (encrypt_boot = false) fails here instead.
    build.block(
        "post-processor",
        [q("shell-local")],
        inline=[q(line) for line in UNENCRYPTED_AMI_CHECK],
    )
    if not modern:
        # Packer 1.6's built-in amazon builder cannot set IMDS options; require IMDSv2 on
        # the AMI afterwards with the AWS CLI, from the AMI id Packer's manifest records.
        build.block(
            "post-processor",
            [q("shell-local")],
            inline=[
                q("set -eu"),
                q("ami=$(jq -r '.builds[-1].artifact_id' packer-manifest.json | cut -d: -f2)"),
                q(
                    'aws ec2 modify-image-attribute --region ${var.region} --image-id "$ami" --imds-support v2.0'
                ),
            ],
        )


# Shell lines (HCL interpolates only ${var.…}; shell expansions are written $x / $(…)).
UNENCRYPTED_AMI_CHECK = (
    "set -eu",
    "test ${var.encrypt_boot} = false || exit 0",
    "ami=$(jq -r '.builds[-1].artifact_id' packer-manifest.json | cut -d, -f1 | cut -d: -f2)",
    'got=$(aws ec2 describe-images --region ${var.region} --image-ids "$ami" --query '
    "'Images[0].BlockDeviceMappings[?Ebs].Ebs.Encrypted' --output text)",
    'if [ "$got" != False ]; then echo "nodeforge: AMI $ami is not one unencrypted root '
    "snapshot (Ebs.Encrypted per mapping: $got); SageMaker HyperPod refuses it. Turn off EBS "
    "encryption by default in ${var.region} for the build (aws ec2 disable-ebs-encryption-by-"
    'default) or build with encrypt_boot = true for plain EC2" >&2; exit 1; fi',
)


def check_amazon_vars(user_vars: dict[str, object]) -> None:
    """Var-file combinations the amazon-ebs target refuses before anything is launched."""
    from nodeforge.errors import NodeforgeError

    if user_vars.get("encrypt_boot", True) is False and user_vars.get("kms_key_id"):
        raise NodeforgeError(
            "amazon-ebs: kms_key_id is set but encrypt_boot = false: an unencrypted AMI (for "
            "SageMaker HyperPod) has no KMS key; remove kms_key_id from the var file, or set "
            "encrypt_boot = true for an encrypted AMI"
        )


def check_variant(target: str, variant: str) -> None:
    """The --variant choices build, render and validate share."""
    from nodeforge.errors import NodeforgeError

    if variant not in VARIANT_TARGETS:
        raise NodeforgeError(f"--variant {variant!r}: choose one of {', '.join(VARIANT_TARGETS)}")
    if target not in VARIANT_TARGETS[variant]:
        raise NodeforgeError(
            f"--variant {variant} is built by the {' and '.join(VARIANT_TARGETS[variant])} "
            f"target only (for now); use --target local, or --variant cpu for {target}"
        )


def required_plugins_block(target: str) -> str:
    """`packer { required_plugins { … } }` for Packer >= 1.7: the target's plugins, pinned."""
    lines = ["packer {", "  required_plugins {"]
    for name in TARGET_PLUGINS[target]:
        source, version = PLUGINS[name]
        lines += [f"    {name} = {{", f'      source  = "{source}"', f'      version = "= {version}"',
                  "    }"]  # fmt: skip
    return "\n".join([*lines, "  }", "}", "", ""])


def amazon_source(user_vars: dict[str, object], base: str, arch: str) -> dict[str, str]:
    """source_os and arch for an amazon-ebs build of *base* on an *arch* build host.

    Checked before anything is fetched or launched: a source OS the playbook does not support,
    or one other than --base (the manifest would name the wrong base), and an AMI architecture
    other than the artifacts' fail here, not after an instance is running.
    """
    from nodeforge.errors import NodeforgeError

    if base not in SOURCE_AMIS:
        raise NodeforgeError(f"amazon-ebs: no official AMI for base '{base}'; use --base "
                             f"{' or '.join(SOURCE_AMIS)}")  # fmt: skip
    want = SOURCE_AMIS[base][0]
    got = user_vars.get("source_os", want)
    if got != want:
        supported = {name for name, _ in SOURCE_AMIS.values()}
        why = ("the playbook bakes Debian 12/13 only" if got not in supported
               else f"it differs from --base {base}")  # fmt: skip
        raise NodeforgeError(
            f"amazon-ebs: source_os = {got!r} is not built: {why}. The source AMI follows "
            f"--base (debian12 -> debian-12, debian13 -> debian-13); remove source_os from the "
            "var file and choose the base with --base"
        )
    ami_arch = user_vars.get("arch", arch)
    if ami_arch != arch:
        raise NodeforgeError(
            f"amazon-ebs: arch = {ami_arch!r}, but this build host is {arch} and the Enroot "
            f"artifacts are fetched for {arch}; build a {ami_arch} AMI from a {ami_arch} host "
            "(or remove arch from the var file)"
        )
    return {"source_os": want, "arch": arch}


def render_dict(target: str, *, modern: bool = False) -> dict:
    """*modern*: Packer >= 1.7 with external plugins (newer amazon-ebs options)."""
    targets_mod.get(target)  # an unknown target: the error lists the choices
    b = hcl2.Builder()
    _declare(b, target)
    if target == "amazon-ebs":
        _amazon(b, modern)
    else:
        {"local": _local, "qemu": _qemu}[target](b)
    return b.build()


def render(target: str, *, modern: bool = False) -> str:
    """HCL2 text (not yet `packer fmt`-ed; packer.fmt() does that)."""
    return hcl2.dumps(render_dict(target, modern=modern))
