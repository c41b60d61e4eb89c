"""The default image's root file system: a cached Debian minbase tarball plus Pal's user,
and the ext4 packing every image shares.

The mmdebstrap tarball is the slow part (~1 min) and does not depend on the harness, so it
is cached under ``images/.cache``; a harness change re-runs only the quick assembly steps.
It is also where the guest bundle's Python comes from (bundle.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from pal.images.apt_sources import AptSource
from pal.images.config import WORKLOAD_UID, add_user

PACKAGES = ("python3", "bash", "coreutils", "procps", "curl", "ca-certificates")
ROOTFS_BYTES = 2 * 1024**3  # the smallest root fs an image gets (sparse)
# Things the guest never needs; dropped at unpack time by dpkg so the image stays small.
DPKG_EXCLUDES = (
    "/usr/share/doc/*",
    "/usr/share/man/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
)


def tarball_key(sources: list[AptSource], codename: str) -> str:
    spec = "\n".join([codename, *PACKAGES, *DPKG_EXCLUDES, *(s.line() for s in sources)])
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def base_tarball(cache_dir: Path, sources: list[AptSource], codename: str) -> Path:
    """The cached mmdebstrap tarball for these inputs, building it when missing."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"rootfs-{codename}-{tarball_key(sources, codename)}.tar"
    if target.is_file():
        return target
    tmp = target.with_suffix(".tar.partial")
    cmd = [
        "mmdebstrap",
        "--variant=minbase",
        "--include=" + ",".join(PACKAGES),
        "--format=tar",
        *(f"--dpkgopt=path-exclude={p}" for p in DPKG_EXCLUDES),
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        codename,
        str(tmp),
        *(s.line() for s in sources),
    ]
    try:
        _run(cmd)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def unpack(tarball: Path, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    # tar(1) keeps devices, xattrs and numeric owners exactly; tarfile would be slower.
    _run(["tar", "-C", str(root), "--numeric-owner", "-xpf", str(tarball)])


def customise(root: Path) -> None:
    """Add the workload user and its home; strip what the guest never uses."""
    add_user(root, "pal", WORKLOAD_UID)
    home = root / "home/pal"
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, WORKLOAD_UID, WORKLOAD_UID)
    home.chmod(0o750)
    cheap_login_profile(root)
    for junk in ("var/lib/apt/lists", "var/cache/apt", "var/cache/debconf", "var/log"):
        path = root / junk
        if path.is_dir():
            for child in path.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()


# Debian's /etc/profile asks `id -u` (a fork and an exec: tens of ms under TCG) for every
# login shell, and E2B runs each command through `/bin/bash -l -c`. bash knows its EUID; any
# other sh still asks id. The profile stays a login shell's profile: only that fork goes.
ID_FORK = '"$(id -u)"'
ID_CHEAP = '"${EUID:-$(id -u)}"'


def cheap_login_profile(root: Path) -> None:
    profile = root / "etc/profile"
    if profile.is_file() and not profile.is_symlink():
        text = profile.read_text()
        if ID_FORK in text:
            profile.write_text(text.replace(ID_FORK, ID_CHEAP))


def tree_bytes(root: Path) -> int:
    """Bytes the tree needs on ext4: file data rounded to 4 KiB blocks plus one block per inode."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        total += 4096 * len(dirnames)
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += 4096 + -(-st.st_blocks * 512 // 4096) * 4096
    return total


def ext4_size_for(tree: int) -> int:
    """Root fs size for a tree: room for a third more, at least ROOTFS_BYTES, MiB-aligned."""
    want = max(ROOTFS_BYTES, int(tree * 4 / 3) + 256 * 1024**2)
    return -(-want // 1024**2) * 1024**2


def make_ext4(root: Path, image: Path, size: int = ROOTFS_BYTES) -> None:
    image.unlink(missing_ok=True)
    with image.open("wb") as f:
        f.truncate(size)  # sparse: only written blocks take disk space
    _run(["mkfs.ext4", "-q", "-F", "-L", "palroot", "-d", str(root), str(image)])


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): " + "\n".join(tail))
