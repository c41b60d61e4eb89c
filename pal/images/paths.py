"""Where a built image lives and how to load one: the contract the VMM and manager rely on."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.errors import BackendError, InvalidRequest
from pal.images import boot
from pal.images.config import ImageConfig
from pal.spec import IMAGE_NAME

VMLINUX = boot.VMLINUX
INITRD = boot.INITRD
ROOTFS = "rootfs.ext4"
META = "meta.json"
SOURCE = "source"  # the OCI layout an imported or built image was assembled from
ARTIFACTS = (ROOTFS, META)
DIGEST_PREFIX = "sha256-"


class ImageNotFound(InvalidRequest):
    code = "IMAGE_NOT_FOUND"

    def __init__(self, name: str) -> None:
        # Said to tenants (the API) and operators (the CLI) alike.
        super().__init__(f"unknown image '{name}': GET /v1/images lists the images you may use")
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
        """The image's content digest (``sha256-<hex>``): snapshots and templates are filed
        under it, so one never restores onto a different image of the same name."""
        return DIGEST_PREFIX + str(self.meta.get("contentHash", ""))

    @property
    def boot_id(self) -> str | None:
        b = self.meta.get("boot")
        return str(b) if b else None

    @property
    def config(self) -> ImageConfig:
        return ImageConfig.from_json(self.meta.get("config"))

    def with_boot(self, boot_set: boot.BootSet) -> ImagePaths:
        """The same image booting ``boot_set`` (a restore uses the snapshot's own)."""
        meta = {**self.meta, "boot": boot_set.id, "kernelVersion": boot_set.kernel_version}
        return dataclasses.replace(self, vmlinux=boot_set.vmlinux, initrd=boot_set.initrd, meta=meta)

    @property
    def kernel(self) -> Path:
        """Alias of ``vmlinux`` (the VMM's name for it)."""
        return self.vmlinux

    @classmethod
    def at(cls, name: str, directory: Path, meta: dict[str, Any] | None = None) -> ImagePaths:
        meta = meta or {}
        # Kernel and initrd live in the shared boot set the image names (images/.boot/<id>);
        # an image built before boot sets existed has its own copies.
        boot_dir = boot.boot_root(directory.parent) / str(meta["boot"]) if meta.get("boot") else directory
        return cls(
            name=name,
            dir=directory,
            vmlinux=boot_dir / VMLINUX,
            initrd=boot_dir / INITRD,
            rootfs=directory / ROOTFS,
            meta=meta,
        )


def validate_name(name: str) -> None:
    # The name becomes a directory: the AgentSpec's rule (one definition, pal/spec.py).
    if not isinstance(name, str) or not IMAGE_NAME.match(name):
        raise InvalidRequest(
            f"invalid image name {name!r}: use lowercase letters, digits, '.', '_' and '-' "
            "(up to 63, starting with a letter or digit)"
        )


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
    paths = ImagePaths.at(directory.name, directory, meta)
    if not (paths.vmlinux.is_file() and paths.initrd.is_file()):
        return None
    return meta


def list_images(settings: Settings) -> list[ImagePaths]:
    """Every complete image in the data dir, by name."""
    root = settings.images_dir
    found = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        meta = read_meta(d) if d.is_dir() and not d.name.startswith(".") else None
        if meta is not None:
            found.append(ImagePaths.at(d.name, d, meta))
    return found


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """Replace meta.json atomically (readers see the old or the new one, never half)."""
    tmp = directory / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    tmp.replace(directory / META)


def load_image(settings: Settings, name: str = "default") -> ImagePaths:
    directory = image_dir(settings, name)
    meta = read_meta(directory)
    if meta is None:
        raise ImageNotFound(name)
    return ImagePaths.at(name, directory, meta)


def image_for_restore(settings: Settings, name: str, boot_id: str | None) -> ImagePaths:
    """The image a snapshot (or a live VM being adopted) of image ``name`` runs on.

    A restore needs the kernel and initrd the snapshot was taken with (its boot set), not
    the image's current ones, and never the image's root fs (the snapshot has its own): so
    it works after the image was rebuilt, replaced or removed. Only a legacy snapshot,
    which records no boot set, needs the image itself.
    """
    try:
        image = load_image(settings, name)
    except ImageNotFound:
        if not boot_id:
            raise
        image = ImagePaths.at(name, image_dir(settings, name), {})
    if not boot_id or boot_id == image.boot_id:
        return image
    boot_set = boot.load(settings.images_dir, boot_id)
    if boot_set is None:
        raise BackendError(f"boot set {boot_id} (kernel and initrd of this snapshot) is missing")
    return image.with_boot(boot_set)
