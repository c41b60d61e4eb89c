"""Cloning VM files: reflink where the file system can, qcow2 overlay or sparse copy otherwise."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pal.vmm import disks
from pal.vmm.errors import VmmError

# The test data dir is a loop-mounted reflink XFS (see datadir.ensure_reflink_datadir).
XFS_DIR = Path(os.environ.get("PAL_TEST_DATA_DIR", "/var/lib/pal-test"))


@pytest.fixture
def plain_dir(tmp_path: Path) -> Path:
    if disks.reflink_supported(tmp_path):
        pytest.skip("tmp dir reflinks; need a non-reflink file system")
    return tmp_path


@pytest.fixture
def reflink_dir() -> Iterator[Path]:
    if not XFS_DIR.is_dir() or not disks.reflink_supported(XFS_DIR):
        pytest.skip(f"{XFS_DIR} is not on a reflink file system")
    d = XFS_DIR / "unit-disks"
    d.mkdir(exist_ok=True)
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _sparse(path: Path, size: int, chunks: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in chunks.items():
            f.seek(off)
            f.write(data)


def test_reflink_clone_is_independent_copy(reflink_dir: Path) -> None:
    src, dst = reflink_dir / "src", reflink_dir / "dst"
    _sparse(src, 8 << 20, {0: b"head", 5 << 20: b"middle"})
    assert disks.clone(src, dst, size_bytes=16 << 20) == "reflink"
    assert dst.stat().st_size == 16 << 20  # grown
    with open(dst, "r+b") as f:
        assert f.read(4) == b"head"
        f.seek(5 << 20)
        assert f.read(6) == b"middle"
        f.write(b"CHANGED")
    assert src.read_bytes()[5 << 20 : (5 << 20) + 6] == b"middle"  # source untouched


def test_without_reflink_disk_becomes_qcow2_overlay(plain_dir: Path) -> None:
    assert not disks.reflink_supported(plain_dir)
    src, dst = plain_dir / "base.raw", plain_dir / "vm.qcow2"
    _sparse(src, 4 << 20, {4096: b"data"})
    method = disks.clone(src, dst)
    assert method == "qcow2" and disks.disk_format_for(method) == "qcow2"
    out = subprocess.run(["qemu-img", "info", "--output=json", str(dst)], capture_output=True, check=True)
    info = json.loads(out.stdout)
    assert info["format"] == "qcow2" and info["backing-filename"] == str(src.resolve())
    # Flattening it gives back a standalone raw image with the same bytes.
    flat = plain_dir / "flat.raw"
    assert disks.capture_raw(dst, "qcow2", flat) == "convert"
    assert flat.read_bytes() == src.read_bytes()


def test_without_reflink_ram_file_gets_sparse_copy(plain_dir: Path) -> None:
    src, dst = plain_dir / "mem", plain_dir / "mem.copy"
    _sparse(src, 64 << 20, {0: b"x" * 4096, 32 << 20: b"y" * 4096})
    assert disks.clone(src, dst, qcow2_ok=False) == "copy"
    assert dst.read_bytes() == src.read_bytes()
    assert dst.stat().st_blocks * 512 < 1 << 20  # holes stayed holes


def test_clone_of_missing_source_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(VmmError, match="no such file"):
        disks.clone(tmp_path / "nope", tmp_path / "dst")


def test_new_sparse_file_allocates_nothing(tmp_path: Path) -> None:
    p = tmp_path / "mem"
    disks.new_sparse_file(p, 256 << 20)
    assert p.stat().st_size == 256 << 20 and p.stat().st_blocks == 0
