"""`build_image`: kernel + initramfs + rootfs into images/<name>/, swapped in atomically."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from pal.config import Settings
from pal.errors import BackendError
from pal.images import initramfs, kernel, rootfs
from pal.images.apt_sources import host_codename, host_sources
from pal.images.paths import INITRD, META, ROOTFS, VMLINUX, ImagePaths, image_dir, read_meta

# Bump when the build recipe changes in a way the input hashes do not capture.
BUILDER_VERSION = 1
Progress = Callable[[str, float], None]


def _quiet(_step: str, _fraction: float) -> None:
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _swap_into_place(staging: Path, final: Path) -> None:
    """Make ``staging`` visible as ``final`` in one step; readers never see a half image."""
    if not final.exists():
        os.rename(staging, final)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    rename_exchange = 2  # RENAME_EXCHANGE: atomically swap two paths (Linux >= 3.15)
    at_fdcwd = -100
    rc = libc.renameat2(at_fdcwd, bytes(staging), at_fdcwd, bytes(final), rename_exchange)
    if rc != 0:  # file system without RENAME_EXCHANGE: brief window with no image
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(staging, final)
        staging = old
    shutil.rmtree(staging, ignore_errors=True)


def is_current(meta: dict[str, object] | None) -> bool:
    """True when an existing image was built from today's harness and recipe."""
    return bool(
        meta
        and meta.get("harnessHash") == rootfs.guest_files_hash()
        and meta.get("builderVersion") == BUILDER_VERSION
    )


def build_image(
    settings: Settings,
    name: str = "default",
    progress: Progress | None = None,
    force: bool = False,
) -> ImagePaths:
    """Build (or reuse) the image ``name``; returns its paths once complete on disk.

    Without ``force`` an existing image is kept unless the harness, protocol or recipe
    changed since it was built. Cached downloads make such a rebuild take seconds.
    """
    report = progress or _quiet
    final = image_dir(settings, name)
    existing = read_meta(final)
    if not force and existing is not None and is_current(existing):
        report("up to date", 1.0)
        return ImagePaths.at(name, final, existing)
    settings.images_dir.mkdir(parents=True, exist_ok=True)
    cache = settings.images_dir / ".cache"
    staging = settings.images_dir / f".build-{name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    started = time.monotonic()
    try:
        meta = _build_into(staging, cache, name, report)
        meta["buildSeconds"] = round(time.monotonic() - started, 1)
        (staging / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for p in staging.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
        _swap_into_place(staging, final)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, BackendError):
            raise
        raise BackendError(f"image build failed: {exc}") from exc
    report("done", 1.0)
    return ImagePaths.at(name, final, meta)


def _build_into(staging: Path, cache: Path, name: str, report: Progress) -> dict[str, object]:
    report("resolving kernel package", 0.0)
    pkg = kernel.resolve_package()
    report(f"downloading {pkg.package}", 0.03)
    deb = kernel.download(pkg, cache)
    report("extracting kernel", 0.1)
    extracted = kernel.extract(deb, staging / "kernel")
    kernel.vmlinux_from_bzimage(extracted.vmlinuz, staging / VMLINUX)
    report("building initramfs", 0.18)
    modules = initramfs.build_initramfs(extracted.modules_dir, staging, staging / INITRD)

    codename = host_codename()
    sources = host_sources(codename=codename)
    report("debian base system (mmdebstrap; cached after the first build)", 0.22)
    tarball = rootfs.base_tarball(cache, sources, codename)
    report("unpacking root file system", 0.75)
    root = staging / "root"
    rootfs.unpack(tarball, root)
    report("installing harness", 0.82)
    rootfs.customise(root)
    report("making ext4", 0.86)
    rootfs.make_ext4(root, staging / ROOTFS)

    report("hashing", 0.95)
    harness_hash = rootfs.guest_files_hash()
    sha = {VMLINUX: _sha256(staging / VMLINUX), INITRD: _sha256(staging / INITRD)}
    content = hashlib.sha256()
    for part in (
        str(BUILDER_VERSION),
        f"{pkg.package}={pkg.version}",
        sha[VMLINUX],
        sha[INITRD],
        tarball.name,  # encodes codename, package list and mirrors
        harness_hash,
    ):
        content.update(part.encode() + b"\n")
    rootfs_path = staging / ROOTFS
    return {
        "name": name,
        "kernelVersion": extracted.release,
        "kernelPackage": f"{pkg.package}={pkg.version}",
        "modules": modules,
        "debianSuite": codename,
        "builtAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "builderVersion": BUILDER_VERSION,
        "harnessHash": harness_hash,
        "contentHash": content.hexdigest(),
        "sha256": sha,
        "rootfsBytes": rootfs_path.stat().st_size,
        "rootfsAllocatedBytes": rootfs_path.stat().st_blocks * 512,
        "sizes": {n: (staging / n).stat().st_size for n in (VMLINUX, INITRD, ROOTFS)},
    }
