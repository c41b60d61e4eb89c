"""Pre-started QEMUs' pure rules (pal/manager/prestart.py, vmm_meta.misfit, PAL_PRESTART) and
the in-place reflink they are filled by (disks.reflink_into) on a real reflink file system."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from pal.config import Settings
from pal.config_env import parse_pool
from pal.manager.prestart import Prestarted, PrestartSet
from pal.sizes import DEFAULT_PRESTART
from pal.vmm import disks
from pal.vmm.cmdline import ImageFiles, VmSpec
from pal.vmm.errors import VmmError
from pal.vmm.qemu import QemuVm
from pal.vmm.vmm_meta import misfit

XFS_DIR = Path(os.environ.get("PAL_TEST_DATA_DIR", "/var/lib/pal-test"))
MIB = 1 << 20
META = {"memoryMib": 256, "vcpus": 1, "configDrive": True, "nic": True, "balloon": True, "memoryKind": "file"}


@pytest.fixture
def reflink_dir() -> Iterator[Path]:
    if not XFS_DIR.is_dir() or not disks.reflink_supported(XFS_DIR):
        pytest.skip(f"{XFS_DIR} is not on a reflink file system")
    d = XFS_DIR / "unit-prestart"
    d.mkdir(exist_ok=True)
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def spec(tmp: Path, name: str, kernel: str = "vmlinux", disk_mib: int = 2048) -> VmSpec:
    vm_dir = tmp / name
    vm_dir.mkdir()
    with open(vm_dir / "disk", "wb") as f:
        f.truncate(disk_mib * MIB)
    image = ImageFiles(tmp / kernel, tmp / "initrd.img", tmp / "rootfs.ext4")
    return VmSpec(name, vm_dir, image, 1, 256, vm_dir / "disk", config_drive=vm_dir / "config.img")


def test_pal_prestart_names_sizes_and_counts_and_can_be_off() -> None:
    assert DEFAULT_PRESTART and Settings().prestart == DEFAULT_PRESTART
    assert parse_pool("0", DEFAULT_PRESTART, "PAL_PRESTART") == ()
    assert parse_pool("", DEFAULT_PRESTART, "PAL_PRESTART") == DEFAULT_PRESTART
    assert parse_pool("512m-2c-4096d:3", DEFAULT_PRESTART, "PAL_PRESTART") == (("512m-2c-4096d", 3),)
    with pytest.raises(ValueError, match="PAL_PRESTART"):
        parse_pool("256m:2", DEFAULT_PRESTART, "PAL_PRESTART")


def test_a_snapshot_fits_only_the_machine_it_was_taken_on(tmp_path: Path) -> None:
    s = spec(tmp_path, "a")
    disk = s.disk_path
    assert misfit(META, s, 1024 * MIB, disk) is None
    assert misfit({**META, "memoryMib": 512}, s, MIB, disk) == "512 MiB of RAM, not 256"
    assert misfit({**META, "vcpus": 2}, s, MIB, disk) == "2 vCPUs, not 1"
    assert misfit({**META, "configDrive": False}, s, MIB, disk) is not None
    assert misfit({k: v for k, v in META.items() if k != "nic"}, s, MIB, disk) is not None  # before NICs
    before_balloons = {k: v for k, v in META.items() if k != "balloon"}
    assert misfit(before_balloons, s, MIB, disk) == "another device set (balloon)"
    assert misfit(META, s, 4096 * MIB, disk) is not None  # a larger disk than the QEMU holds


def prestart_set(tmp: Path, *ready: Prestarted) -> PrestartSet:
    ps = PrestartSet.__new__(PrestartSet)
    ps.targets = {"256m-1c-2048d": len(ready)}
    ps.ready = {q.prestart_id: q for q in ready}
    ps.taken = ps.misses = 0
    ps._wake = cast(Any, type("W", (), {"set": lambda self: None})())
    return ps


def waiting(tmp: Path, name: str, made_at: float, kernel: str = "vmlinux") -> Prestarted:
    s = spec(tmp, name, kernel)
    return Prestarted(QemuVm(s), name, "slot-" + name, "256m-1c-2048d", cast(Any, s.image), made_at)


def test_a_take_pops_the_oldest_fitting_qemu_and_never_the_same_twice(tmp_path: Path) -> None:
    old, new = waiting(tmp_path, "old", 1.0), waiting(tmp_path, "new", 2.0)
    ps = prestart_set(tmp_path, new, old)
    image = cast(Any, old.image)
    first = ps.take(256, 1, 2048, image, META, MIB)
    second = ps.take(256, 1, 2048, image, META, MIB)
    assert first is old and second is new
    assert ps.take(256, 1, 2048, image, META, MIB) is None
    assert (ps.taken, ps.misses, ps.ready) == (2, 1, {})


def test_a_take_skips_what_the_snapshot_does_not_fit(tmp_path: Path) -> None:
    other_kernel = waiting(tmp_path, "k", 1.0, kernel="vmlinux-other")
    dead = waiting(tmp_path, "dead", 2.0)
    dead.qemu.exited.set()
    ps = prestart_set(tmp_path, other_kernel, dead)
    image = cast(Any, waiting(tmp_path, "ref", 0.0).image)
    assert ps.take(256, 1, 2048, image, META, MIB) is None  # another kernel; an exited QEMU
    assert ps.take(512, 1, 2048, image, META, MIB) is None  # a size with no pre-started QEMUs
    assert ps.take(256, 1, 2048, cast(Any, other_kernel.image), {**META, "vcpus": 2}, MIB) is None
    assert ps.take(256, 1, 2048, cast(Any, other_kernel.image), META, MIB) is other_kernel


def test_reflink_into_changes_the_content_a_mapping_of_the_same_file_sees(reflink_dir: Path) -> None:
    src, dst = reflink_dir / "snapshot-mem", reflink_dir / "placeholder"
    with open(src, "wb") as f:
        f.truncate(4 * MIB)
        f.seek(MIB)
        f.write(b"snapshot page")
    with open(dst, "wb") as f:
        f.truncate(8 * MIB)  # a larger placeholder keeps its size; its tail stays zeros
    inode = dst.stat().st_ino
    with open(dst, "r+b") as held, mmap.mmap(held.fileno(), 8 * MIB, mmap.MAP_SHARED) as m:
        assert m[MIB : MIB + 13] == b"\0" * 13  # mapped (and read) before the reflink
        disks.reflink_into(src, dst)
        assert m[MIB : MIB + 13] == b"snapshot page"
        assert m[6 * MIB : 6 * MIB + 4] == b"\0" * 4
    assert dst.stat().st_ino == inode and dst.stat().st_size == 8 * MIB
    with pytest.raises(VmmError):
        disks.reflink_into(reflink_dir / "missing", dst)
