"""Snapshot ids, paths, and the sparse checksum (sha256-sparse-v1)."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest

from pal.errors import InvalidRequest
from pal.snapshots.hashing import BLOCK, hash_files, sparse_sha256
from pal.snapshots.layout import SnapshotRef
from tests.fakes import bytes_read


@pytest.mark.parametrize("bad", ["", "..", ".", "a/b", "../x", ".staging", "a\x00b", "x" * 129, "a b"])
def test_unsafe_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        SnapshotRef("default-0123456789ab", "vm-1", bad, "t1")
    with pytest.raises(InvalidRequest):
        SnapshotRef(bad, "vm-1", "snap-1", "t1")
    with pytest.raises(InvalidRequest):
        SnapshotRef("default-0123456789ab", bad, "snap-1", "t1")


def test_paths_and_keys(tmp_path: Path) -> None:
    ref = SnapshotRef("default-0123456789ab", "vm-1", "snap-1", "t1")
    assert ref.local_dir(tmp_path) == tmp_path / "default-0123456789ab" / "vm-1" / "snap-1"
    assert ref.s3_key("mem") == "snapshots/default-0123456789ab/vm-1/snap-1/mem"
    assert SnapshotRef.from_json(ref.to_json()) == ref
    # an empty tenant means "no ownership check", like None
    assert SnapshotRef("default-0123456789ab", "vm-1", "snap-1", "").tenant_id is None


def _reference_digest(path: Path) -> str:
    """The documented definition, computed naively over every block of the file."""
    data = path.read_bytes()
    h = hashlib.sha256()
    for off in range(0, len(data), BLOCK):
        block = data[off : off + BLOCK]
        if block.count(0) != len(block):
            h.update(struct.pack("<QQ", off, len(block)) + block)
    h.update(b"size" + struct.pack("<Q", len(data)))
    return h.hexdigest()


def _write_sparse(path: Path, size: int, chunks: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in chunks.items():
            f.seek(off)
            f.write(data)


def test_digest_matches_definition_and_ignores_layout(tmp_path: Path) -> None:
    chunks = {0: b"head", 3 * BLOCK + 17: os.urandom(5000), 7 * BLOCK - 3: b"straddles a block edge"}
    sparse = tmp_path / "sparse"
    _write_sparse(sparse, 9 * BLOCK + 123, chunks)
    dense = tmp_path / "dense"
    dense.write_bytes(sparse.read_bytes())  # same bytes, no holes
    assert os.stat(dense).st_blocks > os.stat(sparse).st_blocks
    size, digest = sparse_sha256(sparse)
    assert size == 9 * BLOCK + 123
    assert digest == _reference_digest(sparse)
    assert sparse_sha256(dense) == (size, digest)


def test_digest_sees_a_flipped_byte_a_moved_block_and_a_longer_hole(tmp_path: Path) -> None:
    base = tmp_path / "a"
    _write_sparse(base, 4 * BLOCK, {BLOCK: b"payload"})
    _, digest = sparse_sha256(base)
    flipped = tmp_path / "b"
    _write_sparse(flipped, 4 * BLOCK, {BLOCK: b"paYload"})
    moved = tmp_path / "c"
    _write_sparse(moved, 4 * BLOCK, {2 * BLOCK: b"payload"})
    longer = tmp_path / "d"
    _write_sparse(longer, 4 * BLOCK + 1, {BLOCK: b"payload"})
    others = {sparse_sha256(p)[1] for p in (flipped, moved, longer)}
    assert digest not in others and len(others) == 3


def test_huge_hole_is_not_read(tmp_path: Path) -> None:
    big = tmp_path / "big"
    _write_sparse(big, 64 << 30, {123 << 20: b"x"})  # 64 GiB, one byte of data
    before = bytes_read()
    size, _ = sparse_sha256(big)
    assert size == 64 << 30
    assert bytes_read() - before < 8 * BLOCK  # the data block, not 64 GiB of holes


def test_hash_files_in_parallel_matches_single(tmp_path: Path) -> None:
    paths = {}
    for i in range(3):
        p = tmp_path / f"f{i}"
        _write_sparse(p, 3 * BLOCK, {i * BLOCK: os.urandom(1000)})
        paths[f"f{i}"] = p
    assert hash_files(paths, fsync=True) == {name: sparse_sha256(p) for name, p in paths.items()}
