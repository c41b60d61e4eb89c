"""Checksums of snapshot artifacts that stay fast on large sparse files.

``sha256-sparse-v1``: the file is cut into aligned blocks of ``BLOCK`` bytes (the last one
may be short). The digest is SHA-256 over, for every block that is not all zeros, the
little-endian u64 pair (offset, length) followed by the block's bytes, and finally
``b"size"`` + u64 file size. Holes found with ``SEEK_DATA``/``SEEK_HOLE`` are all zeros by
definition, so they are skipped without being read.

Why zero blocks rather than raw extents: extent boundaries depend on how a file was
written (reflink, ``cp --sparse``, an S3 download that punches zeros back into holes), so
a digest over extents would change when identical bytes are stored differently. Skipping
zero blocks makes the digest a function of the content and size only, whatever the layout.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HASH_ALGO = "sha256-sparse-v1"
BLOCK = 1 << 20
_ZERO_BLOCK = bytes(BLOCK)


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """Yield (start, end) of the file's data regions; the whole file if the fs can't say."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after pos: the rest is a hole
                return
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # fs without SEEK_DATA
                yield (pos, size)
                return
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield (start, end)
        pos = end


def data_blocks(fd: int, size: int) -> Iterator[tuple[int, memoryview]]:
    """Yield (offset, bytes) of every aligned ``BLOCK`` of the file that is not all zeros,
    in ascending order; holes are skipped unread. The view is a reused buffer: valid only
    until the next iteration (copy it to keep it). This is the one definition of "the
    data of a sparse file" shared by the checksum and the S3 sparse encoding."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    next_block = 0  # first block offset not visited yet (extents may share a block)
    for start, end in data_extents(fd, size):
        off = max(next_block, start - start % BLOCK)
        while off < end:
            length = min(BLOCK, size - off)
            got = os.preadv(fd, [view[:length]], off)
            if got != length:
                raise OSError(errno.EIO, f"short read at {off} (file changed?)")
            chunk = view[:length]
            is_zero = buf == _ZERO_BLOCK if length == BLOCK else chunk == bytes(length)
            if not is_zero:
                yield off, chunk
            off += BLOCK
        next_block = off


class SparseDigest:
    """Incremental ``sha256-sparse-v1``: feed the non-zero blocks in order, then the size."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def block(self, offset: int, data: memoryview | bytes) -> None:
        self._h.update(struct.pack("<QQ", offset, len(data)))
        self._h.update(data)

    def finish(self, size: int) -> str:
        self._h.update(b"size" + struct.pack("<Q", size))
        return self._h.hexdigest()


def sparse_sha256(path: Path) -> tuple[int, str]:
    """Return (size, hex digest) of ``path`` per ``sha256-sparse-v1``."""
    digest = SparseDigest()
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        for off, chunk in data_blocks(fd, size):
            digest.block(off, chunk)
    return size, digest.finish(size)


def hash_files(paths: Mapping[str, Path], *, fsync: bool = False) -> dict[str, tuple[int, str]]:
    """Hash several artifacts in parallel threads (hashlib releases the GIL on large
    updates). With ``fsync`` each file is also flushed to disk in its own thread, so a
    commit pays for both once, overlapped."""

    def one(path: Path) -> tuple[int, str]:
        result = sparse_sha256(path)
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return result

    if not paths:
        return {}
    workers = max(1, min(len(paths), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pal-hash") as pool:
        futures = {name: pool.submit(one, path) for name, path in paths.items()}
        return {name: fut.result() for name, fut in futures.items()}
