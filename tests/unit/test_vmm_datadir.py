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


def test_the_xfs_image_is_created_root_only_and_said(tmp_path: Path) -> None:
    """The image holds every snapshot (guest memory): never readable by other users, even
    with a permissive umask or when an older Pal left it so; and its creation is said."""
    if disks.reflink_supported(tmp_path) or os.geteuid() != 0:
        pytest.skip("needs a non-reflink tmp dir and root (loop mount)")
    data = tmp_path / "data"
    settings = Settings(data_dir=data, xfs_image_size_gib=1)
    said: list[str] = []
    old = os.umask(0o022)
    try:
        assert datadir.ensure_reflink_datadir(settings, log=said.append) == datadir.CREATED
    finally:
        os.umask(old)
    image = datadir.xfs_image_path(data)
    try:
        assert image.stat().st_mode & 0o777 == 0o600
        assert any(f"creating 1 GiB sparse XFS image {image}" in m for m in said), said
        assert datadir.umount_reflink_datadir(settings, log=said.append) == datadir.UNMOUNTED
        image.chmod(0o644)  # as an older Pal created it
        assert datadir.ensure_reflink_datadir(settings, log=said.append) == datadir.MOUNTED
        assert image.stat().st_mode & 0o777 == 0o600
    finally:
        datadir.umount_reflink_datadir(settings, log=said.append)
