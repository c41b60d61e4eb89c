"""Root file system: a cached Debian minbase tarball plus Pal's files, packed into ext4.

The mmdebstrap tarball is the slow part (~1 min) and does not depend on the harness, so it
is cached under ``images/.cache``; a harness change re-runs only the quick customise and
mkfs steps.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from pal.images.apt_sources import AptSource

PACKAGES = ("python3", "bash", "coreutils", "procps")
ROOTFS_BYTES = 2 * 1024**3
WORKLOAD_UID = 1000
GUEST_FILES = ("harness.py", "protocol.py")  # from pal/guest, installed to /usr/lib/pal
GUEST_DIR = Path(__file__).resolve().parent.parent / "guest"
# Things the guest never needs; dropped at unpack time by dpkg so the image stays small.
DPKG_EXCLUDES = (
    "/usr/share/doc/*",
    "/usr/share/man/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
)
INIT_SCRIPT = """#!/bin/sh
# PID 1 after switch_root: the Pal guest harness (stdlib-only Python).
# -S skips site.py (no site-packages needed; faster start), -u keeps output unbuffered.
exec /usr/bin/python3 -u -S /usr/lib/pal/harness.py
"""


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


def guest_files_hash() -> str:
    """Hash of everything we install into the image ourselves; part of the content hash."""
    h = hashlib.sha256(INIT_SCRIPT.encode())
    for name in GUEST_FILES:
        h.update(name.encode() + b"\0" + (GUEST_DIR / name).read_bytes())
    return h.hexdigest()


def unpack(tarball: Path, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    # tar(1) keeps devices, xattrs and numeric owners exactly; tarfile would be slower.
    _run(["tar", "-C", str(root), "--numeric-owner", "-xpf", str(tarball)])


def customise(root: Path, hostname: str = "pal") -> None:
    """Add the workload user, /workspace and the harness; strip what the guest never uses."""
    _add_user(root, "pal", WORKLOAD_UID)
    for d, mode in ((root / "workspace", 0o755), (root / "home/pal", 0o750)):
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, WORKLOAD_UID, WORKLOAD_UID)
        d.chmod(mode)
    lib = root / "usr/lib/pal"
    lib.mkdir(parents=True, exist_ok=True)
    for name in GUEST_FILES:
        shutil.copyfile(GUEST_DIR / name, lib / name)
        (lib / name).chmod(0o644)
    (lib / "init").write_text(INIT_SCRIPT)
    (lib / "init").chmod(0o755)
    (root / "etc/hostname").write_text(hostname + "\n")
    (root / "etc/hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n::1 localhost\n")
    # Pre-compile protocol.py so the first boot does not pay for it (harness.py runs as
    # __main__ and is compiled on each start anyway; it is small).
    _run(["chroot", str(root), "/usr/bin/python3", "-m", "py_compile", "/usr/lib/pal/protocol.py"])
    for junk in ("var/lib/apt/lists", "var/cache/apt", "var/cache/debconf", "var/log"):
        path = root / junk
        if path.is_dir():
            for child in path.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()


def _add_user(root: Path, name: str, uid: int) -> None:
    # Edit the files directly: no chroot'd useradd, no dependency on the host's shadow tools.
    passwd, group, shadow = root / "etc/passwd", root / "etc/group", root / "etc/shadow"
    if any(line.split(":")[0] == name for line in passwd.read_text().splitlines()):
        return
    with passwd.open("a") as f:
        f.write(f"{name}:x:{uid}:{uid}:Pal workload:/home/{name}:/bin/bash\n")
    with group.open("a") as f:
        f.write(f"{name}:x:{uid}:\n")
    if shadow.exists():
        with shadow.open("a") as f:
            f.write(f"{name}:!:19000:0:99999:7:::\n")


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
