"""`pal image export NAME --oci DIR`: a Pal image as an OCI layout, loadable by buildah/podman.

A Dockerfile can then start ``FROM oci:DIR`` (or ``oci:DIR:NAME``) with no registry. The
export is the image as a *user* sees it, without Pal's part: the `default` image is its
Debian tree with the `pal` user (rebuilt from the cached base system, then packed by
umoci); an imported or built image is its kept source. Pal adds /.pal again when the
result is imported or built.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pal.config import Settings
from pal.errors import InvalidRequest
from pal.images import assemble, builder, oci
from pal.images.assemble import Progress
from pal.images.paths import SOURCE, load_image

DEFAULT_ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"]


def export_image(settings: Settings, name: str, dest: Path, progress: Progress | None = None) -> str:
    """Write image ``name`` into the OCI layout ``dest`` (created, or added to) under the
    tag ``name``; returns the ``FROM`` reference to use."""
    report = progress or assemble.quiet
    image = load_image(settings, name)
    dest = dest.resolve()
    if dest.exists() and not (dest / "oci-layout").is_file() and any(dest.iterdir()):
        raise InvalidRequest(f"{dest} exists and is not an OCI layout; give a new or empty directory")
    if image.meta.get("kind") == builder.KIND_DEBIAN:
        staging = assemble.new_staging(settings, f"export-{name}")
        try:
            root = staging / "root"
            builder.debian_tree(settings, root, report)
            report("packing the tree as an OCI layer (umoci)", 0.85)
            oci.pack_tree(root, dest, name, {"env": DEFAULT_ENV})
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    else:
        source = image.dir / SOURCE
        if not (source / "oci-layout").is_file():
            raise InvalidRequest(f"image {name} has no kept source to export")
        oci.copy_layout(source, oci.TAG, dest, name)
    report("done", 1.0)
    return f"oci:{dest}:{name}"
