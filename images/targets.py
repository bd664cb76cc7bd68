"""The build targets and the image variants: one table that the CLI's choices, the build's
checks, render/validate and the Packer templates read. Standard library only: the CLI's
`--help` imports it."""

from __future__ import annotations

from dataclasses import dataclass

# Image variants (`nodeforge build --variant`); cpu is the default and keeps the image's name.
VARIANTS = ("cpu", "gpu")
DEFAULT_VARIANT = "cpu"

# Host tools the qemu target checks before anything starts (the base disk, the seal's mounts).
_QEMU_TOOLS = (
    "qemu-system-x86_64", "qemu-img", "mkfs.ext4", "fstrim", "mount", "sfdisk",
    "losetup", "partx", "blkid", "mkfs.vfat", "mcopy",
)  # fmt: skip


@dataclass(frozen=True)
class Target:
    """One `--target`: how it builds and what it needs."""

    name: str
    packer_builder: bool  # Packer's own builder (images/packer_build.py); False: the nspawn build
    variants: tuple[str, ...]  # the image variants it builds
    plugins: tuple[str, ...]  # Packer >= 1.7 plugins (template.PLUGINS) its template requires
    tools: tuple[str, ...] = ()  # host tools beyond Packer's, checked before anything starts
    root_why: str = ""  # why it needs root ("" when it does not)
    disk: bool = False  # builds and seals a qcow2 disk on this host (console log, disk size)
    cloud: bool = False  # an AMI in an AWS account (credentials, amazon var checks)
    kill_grace: float = 30.0  # seconds Packer gets after SIGTERM to delete its VM or instance


TABLE: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "local",
            packer_builder=False,
            variants=VARIANTS,
            plugins=("ansible",),  # the null builder is built in
            root_why="the local target needs root (mmdebstrap, systemd-nspawn and mkfs.ext4 -d "
            "with real ownership); run it with sudo",
        ),
        Target(
            "qemu",
            packer_builder=True,
            variants=("cpu",),
            plugins=("qemu", "ansible", "vagrant"),
            tools=_QEMU_TOOLS,
            root_why="the qemu target needs root (the base disk is made with real ownership and "
            "the built disk is loop-mounted to seal it); run it with sudo",
            disk=True,
        ),
        Target(
            "amazon-ebs",
            packer_builder=True,
            variants=("cpu",),
            plugins=("amazon", "ansible"),
            cloud=True,
            kill_grace=300.0,
        ),
    )
}
TARGETS = tuple(TABLE)
DEFAULT_TARGET = "local"


def get(name: str) -> Target:
    """The target called *name*, or an error that lists the choices."""
    if name not in TABLE:
        from nodeforge.errors import NodeforgeError

        raise NodeforgeError(f"unknown target '{name}'; choose one of: {', '.join(TARGETS)}")
    return TABLE[name]


def variant_targets(variant: str) -> tuple[str, ...]:
    """The targets that build *variant*, in the table's order."""
    return tuple(t.name for t in TABLE.values() if variant in t.variants)
