"""Encode a sparse file as a ``pal-sparse-v1`` stream and decode it back (format: layout.py).

Both directions run in constant memory and compute the file's ``sha256-sparse-v1`` on the
way, so the uploader can check that what it sent is what meta.json promises and the
downloader that what it wrote is, without reading the file a second time.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from pal.errors import BackendError
from pal.snapshots.hashing import SparseDigest, data_blocks
from pal.snapshots.layout import SPARSE_BLOCK, SPARSE_END_OFFSET, SPARSE_MAGIC
from pal.snapshots.upload_stream import UploadStream

_U64 = struct.Struct("<Q")
# Zero pages inside a 1 MiB record are not written on decode, so the rebuilt file is as
# sparse as the original at page granularity (guest RAM is scattered pages), not merely
# at block granularity.
_PAGE = 4096
_ZERO_PAGE = bytes(_PAGE)
_RECORD = struct.Struct("<QQ")


class SparseEncoder(UploadStream):
    """A read-only, non-seekable file object producing the encoding of ``path``.

    Hand it to boto3's ``upload_fileobj`` (which reads it in part-sized chunks). After
    the stream is exhausted, ``size`` and ``digest`` describe the file as it was read.
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._file = open(path, "rb", buffering=0)  # closed by close()
        self._chunks = self._generate()
        self._buf = bytearray()
        self._done = False
        self.size: int | None = None
        self.digest: str | None = None
        self.bytes_out = 0

    def _generate(self) -> Iterator[bytes | memoryview]:
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        digest = SparseDigest()
        yield SPARSE_MAGIC + _U64.pack(size)
        for off, chunk in data_blocks(fd, size):
            digest.block(off, chunk)
            yield _RECORD.pack(off, len(chunk))
            yield chunk  # a view into a reused buffer: read() copies it before moving on
        yield _RECORD.pack(SPARSE_END_OFFSET, 0)
        self.size = size
        self.digest = digest.finish(size)

    def read(self, size: int | None = -1) -> bytes:
        want = None if size is None or size < 0 else size
        while not self._done and (want is None or len(self._buf) < want):
            try:
                self._buf += next(self._chunks)
            except StopIteration:
                self._done = True
        if want is None or want >= len(self._buf):
            out = bytes(self._buf)
            self._buf.clear()
        else:
            out = bytes(self._buf[:want])
            del self._buf[:want]
        self.bytes_out += len(out)
        return out

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def _read_exact(read: Callable[[int], bytes], n: int, what: str) -> bytes:
    parts: list[bytes] = []
    left = n
    while left:
        got = read(left)
        if not got:
            raise BackendError(f"sparse object truncated in {what}")
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def decode_to_file(
    read: Callable[[int], bytes], dest: Path, expected_size: int | None = None
) -> tuple[int, str]:
    """Rebuild a file from a ``pal-sparse-v1`` stream (``read(n)`` returns up to n bytes,
    b"" at the end). Holes stay holes. Returns (size, sha256-sparse-v1 digest) of what was
    written; the file is fsynced. Raises BackendError on a malformed stream, or before
    anything is written when the header's size is not ``expected_size``."""
    head = _read_exact(read, len(SPARSE_MAGIC) + _U64.size, "header")
    if head[: len(SPARSE_MAGIC)] != SPARSE_MAGIC:
        raise BackendError("not a pal-sparse-v1 object (bad magic)")
    (size,) = _U64.unpack_from(head, len(SPARSE_MAGIC))
    if expected_size is not None and size != expected_size:
        raise BackendError(f"sparse object is {size} bytes, not the {expected_size} recorded")
    digest = SparseDigest()
    with open(dest, "wb", buffering=0) as f:
        fd = f.fileno()
        os.ftruncate(fd, size)
        next_allowed = 0
        while True:
            off, length = _RECORD.unpack(_read_exact(read, _RECORD.size, "record header"))
            if off == SPARSE_END_OFFSET and length == 0:
                break
            # Exactly the blocks the encoder emits: aligned, ascending, full-size except
            # the file's last block. Anything else is corruption, not a variant.
            aligned = off % SPARSE_BLOCK == 0 and next_allowed <= off < size
            if not aligned or length != min(SPARSE_BLOCK, size - off):
                raise BackendError(f"sparse object has a bad record (offset {off}, length {length})")
            data = _read_exact(read, length, "record data")
            _write_skipping_zero_pages(fd, data, off)
            digest.block(off, data)
            next_allowed = off + SPARSE_BLOCK
        if read(1):
            raise BackendError("sparse object has bytes after its end record")
        os.fsync(fd)
    return size, digest.finish(size)


def _write_skipping_zero_pages(fd: int, data: bytes, off: int) -> None:
    view = memoryview(data)
    run_start: int | None = None
    for pos in range(0, len(data), _PAGE):
        page = view[pos : pos + _PAGE]
        zero = page == _ZERO_PAGE[: len(page)]
        if not zero and run_start is None:
            run_start = pos
        elif zero and run_start is not None:
            os.pwrite(fd, view[run_start:pos], off + run_start)
            run_start = None
    if run_start is not None:
        os.pwrite(fd, view[run_start:], off + run_start)
