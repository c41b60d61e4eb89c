"""Where a built image lives and how to load one: the contract the VMM and manager rely on."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.errors import InvalidRequest

VMLINUX = "vmlinux"
INITRD = "initrd.img"
ROOTFS = "rootfs.ext4"
META = "meta.json"
ARTIFACTS = (VMLINUX, INITRD, ROOTFS, META)


class ImageNotFound(InvalidRequest):
    code = "IMAGE_NOT_FOUND"

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown image '{name}'; build it with `pal image build {name}`")
        self.name = name


@dataclass(frozen=True)
class ImagePaths:
    name: str
    dir: Path
    vmlinux: Path
    initrd: Path
    rootfs: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def agent_version_id(self) -> str:
        """Groups snapshots of VMs made from the same image build (`default-<12 hex>`)."""
        return f"{self.name}-{str(self.meta.get('contentHash', ''))[:12]}"

    @property
    def kernel(self) -> Path:
        """Alias of ``vmlinux`` (the VMM's name for it)."""
        return self.vmlinux

    @classmethod
    def at(cls, name: str, directory: Path, meta: dict[str, Any] | None = None) -> ImagePaths:
        return cls(
            name=name,
            dir=directory,
            vmlinux=directory / VMLINUX,
            initrd=directory / INITRD,
            rootfs=directory / ROOTFS,
            meta=meta or {},
        )


def validate_name(name: str) -> None:
    # The name becomes a directory and part of agent_version_id: keep it a plain token.
    ok = name and len(name) <= 64 and all(c.isalnum() or c in "-_" for c in name)
    if not ok or name.startswith(("-", ".")):
        raise InvalidRequest(f"invalid image name {name!r}: use letters, digits, '-' and '_'")


def image_dir(settings: Settings, name: str) -> Path:
    validate_name(name)
    return settings.images_dir / name


def read_meta(directory: Path) -> dict[str, Any] | None:
    """The image's meta.json, or None when the image is missing or incomplete."""
    if not all((directory / a).is_file() for a in ARTIFACTS):
        return None
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not meta.get("contentHash"):
        return None
    return meta


def load_image(settings: Settings, name: str = "default") -> ImagePaths:
    directory = image_dir(settings, name)
    meta = read_meta(directory)
    if meta is None:
        raise ImageNotFound(name)
    return ImagePaths.at(name, directory, meta)
