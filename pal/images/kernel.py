"""Guest kernel from Debian's linux-image-cloud-amd64: an uncompressed PVH vmlinux + modules.

QEMU's microvm boots an ELF vmlinux directly by PVH, which skips the bzImage decompressor
(~0.3 s under TCG). Debian ships only the bzImage; its payload is an LZ4 legacy frame we
cut out and decompress.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

META_PACKAGE = "linux-image-cloud-amd64"
LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class KernelPackage:
    package: str  # linux-image-6.1.0-57-cloud-amd64
    version: str  # Debian package version, e.g. 6.1.192-3


@dataclass(frozen=True)
class ExtractedKernel:
    release: str  # uname -r, e.g. 6.1.0-57-cloud-amd64
    vmlinuz: Path
    modules_dir: Path  # .../lib/modules/<release>


def resolve_package() -> KernelPackage:
    """The versioned package the meta package currently depends on."""
    out = _run(["apt-cache", "depends", META_PACKAGE])
    match = re.search(r"Depends:\s*(linux-image-[0-9][\w.+-]*-cloud-amd64)\b", out)
    if not match:
        raise RuntimeError(f"cannot resolve {META_PACKAGE} to a kernel package: {out.strip()}")
    package = match.group(1)
    version = _run(["apt-cache", "policy", package])
    cand = re.search(r"Candidate:\s*(\S+)", version)
    if not cand or cand.group(1) == "(none)":
        raise RuntimeError(f"{package} has no installable version; run apt-get update")
    return KernelPackage(package, cand.group(1))


def download(pkg: KernelPackage, cache_dir: Path) -> Path:
    """The kernel .deb, downloaded once into the image cache."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    safe_version = pkg.version.replace(":", "%3a")
    cached = cache_dir / f"{pkg.package}_{safe_version}_amd64.deb"
    if cached.is_file():
        return cached
    # apt fetches as its sandbox user `_apt`, which must be able to write where it saves,
    # and cannot enter the root-only data dir. So: a private temp dir (0700) outside it,
    # owned by `_apt` (root's where that user does not exist), never a world-writable one.
    with tempfile.TemporaryDirectory(prefix="pal-kernel-") as tmp:
        work = Path(tmp)
        with contextlib.suppress(KeyError):
            os.chown(work, pwd.getpwnam("_apt").pw_uid, 0)
        _run(["apt-get", "download", "-q", f"{pkg.package}={pkg.version}"], cwd=work)
        debs = sorted(work.glob("*.deb"))
        if len(debs) != 1:
            raise RuntimeError(f"apt-get download produced {debs}")
        partial = cached.with_name(f".{cached.name}.partial")
        shutil.copyfile(debs[0], partial)  # another file system, probably: copy, then rename
        partial.replace(cached)
    return cached


def extract(deb: Path, dest: Path) -> ExtractedKernel:
    dest.mkdir(parents=True, exist_ok=True)
    _run(["dpkg-deb", "-x", str(deb), str(dest)])
    vmlinuzes = sorted((dest / "boot").glob("vmlinuz-*"))
    if len(vmlinuzes) != 1:
        raise RuntimeError(f"expected one vmlinuz in {deb.name}, found {vmlinuzes}")
    release = vmlinuzes[0].name.removeprefix("vmlinuz-")
    modules = dest / "lib/modules" / release
    if not modules.is_dir():
        modules = dest / "usr/lib/modules" / release
    if not modules.is_dir():
        raise RuntimeError(f"no modules directory for {release} in {deb.name}")
    return ExtractedKernel(release, vmlinuzes[0], modules)


def vmlinux_from_bzimage(bzimage: Path, out: Path) -> None:
    """Decompress the bzImage's LZ4 payload into an ELF vmlinux."""
    blob = bzimage.read_bytes()
    offset = blob.find(LZ4_LEGACY_MAGIC)
    if offset < 0:
        raise RuntimeError(f"{bzimage.name}: no LZ4 payload (kernel not LZ4-compressed?)")
    # The payload is followed by the bzImage trailer; lz4 reports it as a bad block after
    # writing the whole kernel, so judge success by the output, not the exit status.
    with out.open("wb") as f:
        proc = subprocess.run(
            ["lz4", "-dc"], input=blob[offset:], stdout=f, stderr=subprocess.PIPE, check=False
        )
    with out.open("rb") as f:
        head = f.read(4)
    if head != ELF_MAGIC or out.stat().st_size < 4 * 1024 * 1024:
        raise RuntimeError(f"lz4 did not yield an ELF kernel: {proc.stderr.decode(errors='replace')}")


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc.stdout
