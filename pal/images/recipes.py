"""Pal's own image recipes: Dockerfiles in pal/images/recipes/<name>/, built FROM Pal's
default image by ``pal image build NAME`` (no ``-f``): ``code-interpreter`` today.

The default image is built when missing and exported as an OCI layout (a staging dir,
removed after), passed as the build argument ``BASE``. A recipe image whose Dockerfile is
unchanged (``recipeHash`` in its meta) is kept unless ``force``; when only Pal's guest
files changed it is re-assembled from its kept source, as a server start would.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from pal.images import assemble, builder
from pal.images.dockerfile import build_dockerfile
from pal.images.export import export_image
from pal.images.importer import refresh
from pal.images.paths import ImageNotFound, ImagePaths, image_dir, load_image, read_meta, write_meta

if TYPE_CHECKING:
    from pal.config import Settings
    from pal.images.assemble import Progress

RECIPES = Path(__file__).resolve().parent / "recipes"
BASE_IMAGE = "default"


def recipe(name: str) -> Path | None:
    """The Dockerfile of Pal's recipe ``name``, or None."""
    path = RECIPES / name / "Dockerfile"
    return path if path.is_file() else None


def names() -> list[str]:
    return sorted(p.parent.name for p in RECIPES.glob("*/Dockerfile"))


def recipe_hash(dockerfile: Path) -> str:
    return hashlib.sha256(dockerfile.read_bytes()).hexdigest()


def _current(settings: Settings, name: str, want: str) -> ImagePaths | None:
    try:
        image = load_image(settings, name)
    except ImageNotFound:
        return None
    return image if image.meta.get("recipeHash") == want else None


def build_recipe(
    settings: Settings,
    name: str,
    progress: Progress | None = None,
    force: bool = False,
    tenants: list[str] | None = None,
) -> ImagePaths:
    dockerfile = recipe(name)
    if dockerfile is None:
        raise ImageNotFound(name)
    report = progress or assemble.quiet
    want = recipe_hash(dockerfile)
    kept = None if force else _current(settings, name, want)
    if kept is not None:
        if builder.is_current(kept.meta):
            return kept
        refresh(settings, kept, progress)
    else:
        builder.build_image(settings, BASE_IMAGE, progress=progress)
        # Not under images/.build-*: buildah reads an oci: path as a reference name, whose
        # components may not start with a dot.
        staging = settings.data_dir / f"recipe-base-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            report(f"exporting {BASE_IMAGE} as the base", 0.02)
            base = export_image(settings, BASE_IMAGE, staging / "base")
            build_dockerfile(
                settings, name, dockerfile, dockerfile.parent, progress, None, {"BASE": base}, tenants=tenants
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    d = image_dir(settings, name)
    meta = read_meta(d) or {}
    meta["recipeHash"] = want
    write_meta(d, meta)
    return load_image(settings, name)
