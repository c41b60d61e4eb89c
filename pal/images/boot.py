"""Boot sets: the guest kernel and initramfs, shared by every image and stored by content.

Neither depends on the image (the initramfs mounts whatever root disk it is given and
``switch_root``s into ``/.pal/init``), so every image boots the current boot set and each
is stored once, under ``images/.boot/<id>/``. Templates and snapshots record the id of the
boot set they were taken with, because a restore must load exactly that kernel and initrd:
the guest's memory holds that kernel, and QEMU refuses a migration stream whose ROM blobs
differ in size. So a VM paused before a kernel update, or before its image was replaced
or removed, still resumes. Boot sets are small (~55 MB), change only with the kernel
package or the initramfs recipe, and are never deleted automatically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.images import initramfs, kernel
from pal.images.bundle import file_sha256
from pal.images.modes import guest_umask

BOOT_VERSION = 2  # 2: the volume (NFS) modules kept in modules/
BOOT_DIRNAME = ".boot"
VMLINUX = "vmlinux"
INITRD = "initrd.img"
BOOT_META = "boot.json"
MODULES = "modules"  # the volume (NFS) client's modules, decompressed, with their load order

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class BootSet:
    id: str
    dir: Path
    meta: dict[str, Any]

    @property
    def vmlinux(self) -> Path:
        return self.dir / VMLINUX

    @property
    def initrd(self) -> Path:
        return self.dir / INITRD

    @property
    def kernel_version(self) -> str:
        return str(self.meta.get("kernelVersion", ""))


def boot_root(images_dir: Path) -> Path:
    return images_dir / BOOT_DIRNAME


def load(images_dir: Path, boot_id: str) -> BootSet | None:
    """The complete boot set ``boot_id``, or None."""
    if not boot_id or not all(c in "0123456789abcdef" for c in boot_id):
        return None
    d = boot_root(images_dir) / boot_id
    try:
        meta = json.loads((d / BOOT_META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not (d / VMLINUX).is_file() or not (d / INITRD).is_file():
        return None
    return BootSet(boot_id, d, meta)


def _key(pkg: kernel.KernelPackage) -> str:
    h = hashlib.sha256(f"boot-v{BOOT_VERSION}\n{pkg.package}={pkg.version}\n".encode())
    h.update(initramfs.recipe_hash().encode())
    return h.hexdigest()[:16]


def _quiet(_step: str, _fraction: float) -> None:
    pass


def ensure(settings: Settings, progress: Progress | None = None) -> BootSet:
    """The boot set of today's kernel package and initramfs recipe, built when missing."""
    with guest_umask():
        return _ensure(settings, progress)


def _ensure(settings: Settings, progress: Progress | None) -> BootSet:
    report = progress or _quiet
    report("resolving kernel package", 0.0)
    pkg = kernel.resolve_package()
    boot_id = _key(pkg)
    existing = load(settings.images_dir, boot_id)
    if existing is not None:
        return existing
    cache = settings.images_dir / ".cache"
    root = boot_root(settings.images_dir)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".build-{boot_id}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        report(f"downloading {pkg.package}", 0.1)
        deb = kernel.download(pkg, cache)
        report("extracting kernel", 0.4)
        extracted = kernel.extract(deb, staging / "kernel")
        kernel.vmlinux_from_bzimage(extracted.vmlinuz, staging / VMLINUX)
        report("building initramfs", 0.8)
        modules = initramfs.build_initramfs(extracted.modules_dir, staging, staging / INITRD)
        volume_modules = initramfs.save_volume_modules(extracted.modules_dir, staging / MODULES, modules)
        shutil.rmtree(staging / "kernel")
        shutil.rmtree(staging / "initramfs", ignore_errors=True)
        for name in (VMLINUX, INITRD):
            # Each jailed QEMU opens these itself (/proc/self/fd/N, as its own uid): they
            # are not secret, and the data dir around them is 0700 anyway.
            os.chmod(staging / name, 0o644)
        meta = {
            "id": boot_id,
            "kernelVersion": extracted.release,
            "kernelPackage": f"{pkg.package}={pkg.version}",
            "modules": modules,
            "volumeModules": volume_modules,
            "sha256": {VMLINUX: file_sha256(staging / VMLINUX), INITRD: file_sha256(staging / INITRD)},
        }
        (staging / BOOT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        final = root / boot_id
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report("boot set ready", 1.0)
    loaded = load(settings.images_dir, boot_id)
    assert loaded is not None
    return loaded
