"""Copying VM files cheaply: reflink first, a qcow2 overlay or a byte copy as fallbacks.

Snapshots and forks copy the guest RAM file and the root disk. On a reflink file system
(XFS ``reflink=1``, btrfs) a FICLONE makes the copy in a few ms whatever the size; that is
what makes the whole design cheap, so callers learn which method was used and `pal doctor`
can name it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import tempfile
import uuid
from pathlib import Path

from pal.vmm.errors import VmmError

# linux/fs.h: _IOW(0x94, 9, int). Python 3.11's fcntl module has no FICLONE constant.
FICLONE = 0x40049409

METHOD_REFLINK = "reflink"
METHOD_QCOW2 = "qcow2"
METHOD_COPY = "copy"

# errnos meaning "this file system (or pair of paths) cannot reflink", not a real failure.
_NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS}


def _ficlone(src: Path, dst: Path) -> None:
    with open(src, "rb") as s, open(dst, "wb") as d:
        fcntl.ioctl(d.fileno(), FICLONE, s.fileno())


def reflink_into(src: Path | str, dst: Path | str) -> None:
    """Make the existing file ``dst`` hold ``src``'s content by reflink, in place: the same
    inode, so a process that has ``dst`` open or mapped (a pre-started QEMU,
    pal/manager/prestart.py) sees the new content; the kernel drops ``dst``'s cached pages.
    ``dst`` keeps its size when it is larger (the tail stays a hole). No fallback: a copy
    would be slow and racy, so the caller starts a QEMU the usual way instead."""
    try:
        with open(src, "rb") as s:
            fd = os.open(dst, os.O_WRONLY | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, FICLONE, s.fileno())
            finally:
                os.close(fd)
    except OSError as exc:
        raise VmmError(f"reflink {src} into {dst} failed: {exc}") from exc


def reflink_supported(directory: Path | str) -> bool:
    """True when files in ``directory`` can be cloned with FICLONE."""
    d = Path(directory)
    name = f".pal-reflink-probe-{uuid.uuid4().hex}"
    src, dst = d / name, d / (name + ".clone")
    try:
        src.write_bytes(b"pal")
        _ficlone(src, dst)
        return True
    except OSError:
        return False
    finally:
        for p in (src, dst):
            p.unlink(missing_ok=True)


def _copy_range(src_fd: int, dst_fd: int, count: int, offset: int) -> int:
    """copy_file_range, or read+write where the kernel refuses it (across file systems)."""
    try:
        return os.copy_file_range(src_fd, dst_fd, count, offset, offset)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    data = os.pread(src_fd, min(count, 1 << 20), offset)
    return os.pwrite(dst_fd, data, offset) if data else 0


def _sparse_copy(src: Path, dst: Path) -> None:
    """Byte copy that keeps holes: guest RAM files are mostly holes and must stay so."""
    with open(src, "rb") as s, open(dst, "wb") as d:
        size = os.fstat(s.fileno()).st_size
        pos = 0
        while pos < size:
            try:
                data = os.lseek(s.fileno(), pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole remains
                    break
                raise
            hole = os.lseek(s.fileno(), data, os.SEEK_HOLE)
            off = data
            while off < hole:
                n = _copy_range(s.fileno(), d.fileno(), hole - off, off)
                if n == 0:
                    break
                off += n
            pos = hole
        os.ftruncate(d.fileno(), size)


def _grow(path: Path, size_bytes: int | None) -> None:
    # The guest file system is not resized: the extra space is only visible to a guest
    # that grows its fs itself. Never shrink (that would cut the fs).
    if size_bytes is not None and path.stat().st_size < size_bytes:
        os.truncate(path, size_bytes)


def clone(src: Path | str, dst: Path | str, size_bytes: int | None = None, *, qcow2_ok: bool = True) -> str:
    """Copy ``src`` (a raw file) to ``dst``; return the method: "reflink" | "qcow2" | "copy".

    "qcow2" means ``dst`` is a qcow2 overlay backed by ``src`` (which must then outlive
    it): the caller must open it with ``format=qcow2``. Pass ``qcow2_ok=False`` for files
    QEMU maps directly (guest RAM), which get a sparse byte copy when reflink is missing.
    """
    s, d = Path(src), Path(dst)
    if not s.exists():
        raise VmmError(f"cannot clone {s}: no such file")
    d.unlink(missing_ok=True)
    try:
        _ficlone(s, d)
        _grow(d, size_bytes)
        return METHOD_REFLINK
    except OSError as exc:
        d.unlink(missing_ok=True)
        if exc.errno not in _NO_REFLINK:
            raise VmmError(f"reflink {s} -> {d} failed: {exc}") from exc
    if qcow2_ok:
        argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(s.resolve()), "-F", "raw", str(d)]
        if size_bytes is not None:
            argv.append(str(max(size_bytes, s.stat().st_size)))
        res = subprocess.run(argv, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            d.unlink(missing_ok=True)
            raise VmmError(f"qemu-img create overlay {d} failed: {res.stderr.strip()}")
        return METHOD_QCOW2
    try:
        _sparse_copy(s, d)
        _grow(d, size_bytes)
    except OSError as exc:
        d.unlink(missing_ok=True)
        raise VmmError(f"copy {s} -> {d} failed: {exc}") from exc
    return METHOD_COPY


def capture_raw(src: Path | str, src_format: str, dst: Path | str) -> str:
    """Make ``dst`` a standalone raw image of the disk ``src`` (of ``src_format``).

    A snapshot's rootfs must not depend on the VM's live files, so a qcow2 overlay is
    flattened with ``qemu-img convert`` (slow, but only on hosts without reflink); a raw
    disk is cloned (reflink, else sparse copy). Returns the method used.
    """
    s, d = Path(src), Path(dst)
    if src_format == "raw":
        return clone(s, d, qcow2_ok=False)
    if src_format != "qcow2":
        raise VmmError(f"unknown disk format {src_format!r}")
    d.unlink(missing_ok=True)
    res = subprocess.run(
        ["qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", "-S", "4k", str(s), str(d)],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        d.unlink(missing_ok=True)
        raise VmmError(f"qemu-img convert {s} -> {d} failed: {res.stderr.strip()}")
    return "convert"


def disk_format_for(method: str) -> str:
    """The QEMU drive format of a file produced by :func:`clone` with ``method``."""
    return "qcow2" if method == METHOD_QCOW2 else "raw"


def new_sparse_file(path: Path | str, size_bytes: int) -> None:
    """Create (or reset) a sparse file of ``size_bytes``: fresh guest RAM costs nothing."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        os.ftruncate(fd, size_bytes)
    finally:
        os.close(fd)
    os.replace(tmp, p)
