"""Pal's own image recipes: Dockerfiles in pal/images/recipes/<name>/, built FROM Pal's
default image by ``pal image build NAME`` (no ``-f``): ``code-interpreter`` today.

The default image is built when missing and exported as an OCI layout (a staging dir,
removed after), passed as the build argument ``BASE``. A recipe image whose Dockerfile is
unchanged (``recipeHash`` in its meta) is kept unless ``force``; when only Pal's guest
files changed it is re-assembled from its kept source, as a server start would.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pal.errors import BackendError
from pal.images import assemble, builder
from pal.images.dockerfile import Log, build_dockerfile
from pal.images.export import export_image
from pal.images.importer import refresh
from pal.images.paths import ImageNotFound, ImagePaths, image_dir, load_image, read_meta, write_meta
from pal.pids import pid_alive

if TYPE_CHECKING:
    from pal.config import Settings
    from pal.images.assemble import Progress

RECIPES = Path(__file__).resolve().parent / "recipes"
BASE_IMAGE = "default"
# buildah (1.28, Debian 12's) names an ``oci:DIR`` base after DIR's path, parsed as an image
# reference: lowercase letters, digits and separators only. A data dir's path may hold
# anything (/home/Alice/pal, mktemp's /tmp/tmp.aB3xY), so the base's staging dir is
# bind-mounted for the build at a path of Pal's own: <this>/<pid>.
BASE_MOUNTS = Path("/run/pal/recipe-bases")


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
    log: Log | None = None,
) -> ImagePaths:
    """Build recipe image ``name`` on the base image (built first if need be); ``log``
    gets each line of the build's output (its RUN steps take minutes: they are the
    progress a person sees)."""
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
        _build_on_the_base(settings, name, dockerfile, report, progress, tenants, log)
    d = image_dir(settings, name)
    meta = read_meta(d) or {}
    meta["recipeHash"] = want
    write_meta(d, meta)
    return load_image(settings, name)


def _build_on_the_base(
    settings: Settings,
    name: str,
    dockerfile: Path,
    report: Progress,
    progress: Progress | None,
    tenants: list[str] | None,
    log: Log | None,
) -> None:
    """Export the base image into a staging dir and build ``dockerfile`` FROM it."""
    staging = assemble.new_staging(settings, "recipe-base")  # a dead build's is swept
    try:
        with _at_a_reference_path(staging) as at:
            report(f"exporting {BASE_IMAGE} as the base", 0.02)
            args = {"BASE": export_image(settings, BASE_IMAGE, at / "base")}
            build_dockerfile(
                settings, name, dockerfile, dockerfile.parent, progress, log, build_args=args, tenants=tenants
            )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _at_a_reference_path(staging: Path) -> Iterator[Path]:
    """``staging``, bind-mounted at BASE_MOUNTS/<pid> while the build reads it (see there).
    A build killed before its unmount leaves its mount to the next build's sweep."""
    BASE_MOUNTS.mkdir(parents=True, exist_ok=True, mode=0o700)
    for old in BASE_MOUNTS.iterdir():
        if old.name.isdigit() and (old.name == str(os.getpid()) or not pid_alive(int(old.name))):
            _unmount(old)
    at = BASE_MOUNTS / str(os.getpid())
    at.mkdir()
    try:
        done = subprocess.run(["mount", "--bind", str(staging), str(at)], capture_output=True, text=True)
        if done.returncode != 0:
            raise BackendError(f"cannot bind-mount the recipe's base at {at}: {done.stderr.strip()}")
        yield at
    finally:
        _unmount(at)


def _unmount(at: Path) -> None:
    subprocess.run(["umount", "--lazy", str(at)], capture_output=True, check=False)
    with contextlib.suppress(OSError):
        at.rmdir()
