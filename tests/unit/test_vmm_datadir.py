"""Making the data dir reflink-capable."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pal.config import Settings
from pal.errors import Unavailable
from pal.vmm import datadir, disks, versions

XFS_DIR = Path(os.environ.get("PAL_TEST_DATA_DIR", "/var/lib/pal-test"))


def test_reflink_dir_is_left_alone() -> None:
    if not XFS_DIR.is_dir() or not disks.reflink_supported(XFS_DIR):
        pytest.skip(f"{XFS_DIR} is not on a reflink file system")
    action = datadir.ensure_reflink_datadir(Settings(data_dir=XFS_DIR), log=lambda _m: None)
    assert action in (datadir.NATIVE, datadir.ALREADY_MOUNTED)


def test_non_empty_non_reflink_dir_is_refused(tmp_path: Path) -> None:
    if disks.reflink_supported(tmp_path):
        pytest.skip("tmp dir reflinks")
    data = tmp_path / "data"
    data.mkdir()
    (data / "pal.db").write_bytes(b"x")
    with pytest.raises(Unavailable, match="not empty"):
        datadir.ensure_reflink_datadir(Settings(data_dir=data), log=lambda _m: None)
    assert not datadir.xfs_image_path(data).exists()
    assert (data / "pal.db").read_bytes() == b"x"


def test_versions() -> None:
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", versions.qemu_version())
    assert versions.host_kernel_version()


def test_image_kernel_version_from_meta(tmp_path: Path) -> None:
    (tmp_path / "meta.json").write_text('{"kernelVersion": "6.1.0-57-cloud-amd64"}')
    assert versions.image_kernel_version(tmp_path) == "6.1.0-57-cloud-amd64"
    assert versions.image_kernel_version(tmp_path / "missing") is None
