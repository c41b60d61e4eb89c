"""`build_image`: the `default` image from Debian packages, into images/<name>/.

Debian minbase (+ python3, bash, coreutils, procps) with the `pal` user, assembled like
every other image (assemble.py): the shared boot set, the guest bundle at /.pal, ext4.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from pal.config import Settings
from pal.errors import BackendError, PalError
from pal.images import assemble, boot, bundle, initramfs, rootfs
from pal.images.apt_sources import host_codename, host_sources
from pal.images.assemble import BUILDER_VERSION, Progress
from pal.images.config import OciRunConfig
from pal.images.modes import guest_umask
from pal.images.paths import ImagePaths, image_dir, read_meta, write_meta

KIND_DEBIAN = "debian"


def is_current(meta: dict[str, object] | None) -> bool:
    """True when an existing image was built from today's harness, recipe and initramfs
    (a new initramfs, e.g. one more module, means a new boot set)."""
    return bool(
        meta
        and meta.get("harnessHash") == bundle.guest_files_hash()
        and meta.get("builderVersion") == BUILDER_VERSION
        and meta.get("initramfsHash") == initramfs.recipe_hash()
    )


def build_image(
    settings: Settings,
    name: str = "default",
    progress: Progress | None = None,
    force: bool = False,
    tenants: list[str] | None = None,
) -> ImagePaths:
    """Build (or reuse) the Debian image ``name``; returns its paths once complete on disk.

    Without ``force`` an existing image is kept unless the harness, protocol or recipe
    changed since it was built. Cached downloads make such a rebuild take seconds.
    ``tenants``: who may use it (assemble.publish; a kept image gets the list too).
    """
    with guest_umask():
        return _build_image(settings, name, progress, force, tenants)


def _build_image(
    settings: Settings, name: str, progress: Progress | None, force: bool, tenants: list[str] | None
) -> ImagePaths:
    report = progress or assemble.quiet
    final = image_dir(settings, name)
    existing = read_meta(final)
    if not force and existing is not None and is_current(existing):
        if tenants is not None and existing.get("tenants") != tenants:
            existing = {**existing, "tenants": list(tenants)}
            write_meta(final, existing)
        report("up to date", 1.0)
        return ImagePaths.at(name, final, existing)
    staging = assemble.new_staging(settings, name)
    started = time.monotonic()
    try:
        meta = _build_into(settings, staging, name, report)
        meta["buildSeconds"] = round(time.monotonic() - started, 1)
        image = assemble.publish(settings, name, staging, meta, tenants)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, PalError):
            raise
        raise BackendError(f"image build failed: {exc}") from exc
    report("done", 1.0)
    return image


def debian_tree(settings: Settings, root: Path, report: Progress) -> tuple[Path, Path]:
    """Unpack the (cached) Debian base system at ``root`` with the `pal` user added;
    returns (base tarball, guest bundle)."""
    cache = settings.images_dir / ".cache"
    codename = host_codename()
    sources = host_sources(codename=codename)
    report("debian base system (mmdebstrap; cached after the first build)", 0.22)
    tarball = rootfs.base_tarball(cache, sources, codename)
    report("unpacking root file system", 0.75)
    rootfs.unpack(tarball, root)
    report("guest bundle (harness + its own python)", 0.8)
    bundle_dir = bundle.ensure(cache, root, tarball.name)
    rootfs.customise(root)
    return tarball, bundle_dir


def _build_into(settings: Settings, staging: Path, name: str, report: Progress) -> dict[str, object]:
    boot_set = boot.ensure(settings, lambda step, f: report(step, 0.2 * f))
    root = staging / "root"
    tarball, bundle_dir = debian_tree(settings, root, report)
    report("installing harness", 0.84)
    cfg = assemble.finish_tree(root, bundle_dir, OciRunConfig(), boot_set)
    report("making ext4", 0.86)
    sizes = assemble.pack(root, staging)
    meta = assemble.base_meta(name, boot_set, cfg, KIND_DEBIAN)
    meta.update(sizes)
    meta.update(
        source="debian",
        debianSuite=host_codename(),
        kernelPackage=boot_set.meta.get("kernelPackage"),
        contentHash=assemble.content_hash(
            KIND_DEBIAN,
            boot_set.id,
            tarball.name,  # encodes codename, package list and mirrors
            bundle_dir.name,
            str(sorted(cfg.to_json().items())),
        ),
    )
    return meta
