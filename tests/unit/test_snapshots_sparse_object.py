"""The pal-sparse-v1 object encoding: round trip, size, holes, and malformed streams."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import pytest

from pal.errors import BackendError
from pal.snapshots.hashing import BLOCK, sparse_sha256
from pal.snapshots.sparse_object import SparseEncoder, decode_to_file


def _write_sparse(path: Path, size: int, chunks: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in chunks.items():
            f.seek(off)
            f.write(data)


def _encode(path: Path, read_size: int = 3 * BLOCK + 17) -> tuple[bytes, SparseEncoder]:
    out = bytearray()
    with SparseEncoder(path) as enc:
        while chunk := enc.read(read_size):  # odd sizes: parts never align with records
            out += chunk
    return bytes(out), enc


def test_round_trip_keeps_content_size_and_holes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    size = 64 * BLOCK + 4321  # the last block is short
    pages = {5 * BLOCK + i * 64 * 1024: os.urandom(4096) for i in range(8)}  # scattered pages
    _write_sparse(src, size, {0: b"boot", 40 * BLOCK - 2: b"edge", size - 5: b"tail!", **pages})
    encoded, enc = _encode(src)

    assert (enc.size, enc.digest) == sparse_sha256(src)
    # 4 data blocks (0, 5, 39+40, 64) of 1 MiB: the 64 MiB of holes are not sent
    assert len(encoded) < 5 * BLOCK and enc.bytes_out == len(encoded)

    dest = tmp_path / "dest"
    got = decode_to_file(io.BytesIO(encoded).read, dest)
    assert got == sparse_sha256(src)
    assert dest.read_bytes() == src.read_bytes()
    # zero pages inside the sent blocks are not written either
    assert os.stat(dest).st_blocks * 512 <= 16 * 4096 + 8 * 4096


def test_empty_and_all_hole_files(tmp_path: Path) -> None:
    for size in (0, 10 * BLOCK):
        src = tmp_path / f"f{size}"
        _write_sparse(src, size, {})
        encoded, _ = _encode(src)
        assert len(encoded) == 16 + 16  # header + end record
        dest = tmp_path / f"d{size}"
        assert decode_to_file(io.BytesIO(encoded).read, dest) == sparse_sha256(src)
        assert os.stat(dest).st_size == size


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda b: b"NOTSPARS" + b[8:], id="bad-magic"),
        pytest.param(lambda b: b[:-16], id="no-end-record"),
        pytest.param(lambda b: b[: 16 + 16 + 100], id="truncated-data"),
        pytest.param(lambda b: b + b"x", id="trailing-bytes"),
        pytest.param(lambda b: b[:16] + struct.pack("<QQ", 7, BLOCK) + b[32:], id="misaligned-record"),
        pytest.param(lambda b: b[:16] + struct.pack("<QQ", 0, 10) + b[32:], id="short-record"),
        pytest.param(lambda b: b[:8] + struct.pack("<Q", BLOCK) + b[16:], id="record-beyond-size"),
    ],
)
def test_malformed_streams_are_refused(tmp_path: Path, mangle: object) -> None:
    src = tmp_path / "src"
    _write_sparse(src, 4 * BLOCK, {2 * BLOCK: os.urandom(1000)})
    encoded, _ = _encode(src)
    with pytest.raises(BackendError):
        decode_to_file(io.BytesIO(mangle(encoded)).read, tmp_path / "dest")  # type: ignore[operator]
