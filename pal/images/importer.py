"""`pal image import NAME SOURCE`: a container image as a Pal image.

SOURCE is a Docker archive (``docker save``), an OCI archive, an OCI layout directory or a
registry reference; skopeo reads it into ``images/<name>/source`` (kept, so the image can be
re-assembled when Pal's guest files change, and exported again), umoci unpacks its layers,
and the tree is assembled like every image (assemble.py).

Refused, with a message that says why: not linux/amd64, no ``/bin/sh``, bigger than
``PAL_IMAGE_MAX_GIB`` (compressed layers or unpacked tree), a corrupt or unreadable archive,
a ``USER`` the image does not define, a ``/workspace`` that is not a directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from pal.config import Settings
from pal.errors import BackendError, InvalidRequest, PalError
from pal.images import assemble, boot, builder, bundle, oci, rootfs
from pal.images.apt_sources import host_codename, host_sources
from pal.images.assemble import Progress
from pal.images.config import OciRunConfig
from pal.images.paths import SOURCE, ImageNotFound, ImagePaths, image_dir, list_images, validate_name
from pal.images.tree import is_executable_file

KIND_IMPORT = "import"
KIND_DOCKERFILE = "dockerfile"
SOURCE_KINDS = (KIND_IMPORT, KIND_DOCKERFILE)


def guest_bundle(settings: Settings, report: Progress = assemble.quiet) -> Path:
    """Today's guest bundle (its Python comes from the default image's Debian base system)."""
    cache = settings.images_dir / ".cache"
    codename = host_codename()
    report("debian base system for the guest bundle (cached after the first build)", 0.05)
    tarball = rootfs.base_tarball(cache, host_sources(codename=codename), codename)
    return bundle.ensure(cache, tarball, tarball.name)


def import_image(
    settings: Settings,
    name: str,
    source: str,
    progress: Progress | None = None,
    *,
    kind: str = KIND_IMPORT,
    source_label: str | None = None,
    tenants: list[str] | None = None,
) -> ImagePaths:
    """Import SOURCE as image ``name`` (replacing an image of that name once complete);
    ``tenants``: who may use it (assemble.publish)."""
    report = progress or assemble.quiet
    validate_name(name)
    staging = assemble.new_staging(settings, name)
    with _staged(staging, "image import"):
        report(f"reading {source}", 0.1)
        image = oci.copy_to_layout(source, staging / SOURCE)
        return _assemble(settings, name, staging, image, source_label or source, kind, report, tenants)


def from_layout(
    settings: Settings,
    name: str,
    staging: Path,
    source_label: str,
    kind: str,
    progress: Progress | None = None,
    tenants: list[str] | None = None,
) -> ImagePaths:
    """Assemble an image from an OCI layout already at ``staging/source`` (buildah's output)."""
    with _staged(staging, "image assembly"):
        image = oci.read_layout(staging / SOURCE)
        oci.check_platform(image.config, source_label)
        report = progress or assemble.quiet
        return _assemble(settings, name, staging, image, source_label, kind, report, tenants)


@contextlib.contextmanager
def _staged(staging: Path, what: str) -> Iterator[None]:
    """On any failure the staging dir goes; an unexpected error becomes a BackendError."""
    try:
        yield
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, PalError | KeyboardInterrupt):
            raise
        raise BackendError(f"{what} failed: {exc}") from exc


def _assemble(
    settings: Settings,
    name: str,
    staging: Path,
    image: oci.OciImage,
    source_label: str,
    kind: str,
    report: Progress,
    tenants: list[str] | None = None,
) -> ImagePaths:
    started = time.monotonic()
    max_bytes = settings.image_max_gib * 1024**3
    if image.layer_bytes > max_bytes:
        raise InvalidRequest(
            f"image is too big: {image.layer_bytes / 1024**3:.1f} GiB of compressed layers, over the "
            f"{settings.image_max_gib} GiB limit (PAL_IMAGE_MAX_GIB)"
        )
    boot_set = boot.ensure(settings, lambda step, f: report(step, 0.2 + 0.1 * f))
    bundle_dir = guest_bundle(settings, lambda step, f: report(step, 0.3))
    report("unpacking layers (umoci)", 0.4)
    root = staging / "root"
    oci.unpack(image, root)
    if not is_executable_file(root, "bin/sh"):
        raise InvalidRequest(
            f"image {source_label} has no /bin/sh; Pal needs a shell in the image (a glibc or musl "
            "userland, or busybox)"
        )
    report("adding the harness", 0.7)
    cfg = assemble.finish_tree(root, bundle_dir, OciRunConfig.parse(image.config), boot_set)
    report("making ext4", 0.8)
    sizes = assemble.pack(root, staging, max_bytes)
    meta = assemble.base_meta(name, boot_set, cfg, kind)
    meta.update(sizes)
    meta.update(
        source=source_label,
        sourceDigest=image.source_digest or image.config_digest,
        manifestDigest=image.manifest_digest,
        architecture=image.config.get("architecture"),
        contentHash=assemble.content_hash(
            kind, image.config_digest, boot_set.id, bundle_dir.name, str(sorted(cfg.to_json().items()))
        ),
        buildSeconds=round(time.monotonic() - started, 1),
    )
    published = assemble.publish(settings, name, staging, meta, tenants)
    report("done", 1.0)
    return published


def refresh(settings: Settings, image: ImagePaths, progress: Progress | None = None) -> ImagePaths:
    """Re-assemble an imported or built image from its kept source (Pal's guest files
    changed); the image's content digest changes, so its templates are rebuilt."""
    source = image.dir / SOURCE
    if not (source / "oci-layout").is_file():
        raise BackendError(f"image {image.name} has no kept source to re-assemble from; import it again")
    staging = assemble.new_staging(settings, image.name)
    # Reflinks on the data dir's file system: the copy costs nothing.
    subprocess.run(["cp", "-a", "--reflink=auto", str(source), str(staging / SOURCE)], check=True)
    label = str(image.meta.get("source") or image.name)
    return from_layout(settings, image.name, staging, label, str(image.meta.get("kind")), progress)


def refresh_stale(settings: Settings) -> dict[str, str]:
    """Re-assemble every imported or built image whose guest files are out of date;
    returns image name -> error ("" when it worked). One failure does not stop the rest:
    a stale image still boots (its old harness), it only misses the newer one."""
    done: dict[str, str] = {}
    for image in list_images(settings):
        if image.meta.get("kind") in SOURCE_KINDS and not builder.is_current(image.meta):
            try:
                refresh(settings, image)
                done[image.name] = ""
            except PalError as exc:
                done[image.name] = exc.message
    return done


def remove_image(settings: Settings, name: str) -> None:
    """Delete image ``name`` (the caller checked that nothing uses it)."""
    d = image_dir(settings, name)
    if not d.exists():
        raise ImageNotFound(name)
    trash = settings.images_dir / f".rm-{name}-{os.getpid()}"
    d.rename(trash)  # gone for readers in one step, then deleted
    shutil.rmtree(trash, ignore_errors=True)
