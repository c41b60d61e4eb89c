"""QemuVm's explicit runstate (issue 16): one table of changes, guards that raise a typed
error before any work, EXITED terminal; and the jail's fail-closed spawn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pal.errors import Unavailable
from pal.vmm import cgroups
from pal.vmm.cmdline import ImageFiles, VmSpec
from pal.vmm.errors import RunstateError, VmExited
from pal.vmm.qemu import QemuVm, Runstate


def _spec(tmp_path: Path, **kw: object) -> VmSpec:
    img = tmp_path / "img"
    img.mkdir(exist_ok=True)
    for name in ("vmlinux", "initrd.img", "rootfs.ext4"):
        (img / name).write_bytes(b"x")
    args: dict = dict(
        vm_id="vm1",
        vm_dir=tmp_path / "vm",
        image=ImageFiles.from_dir(img),
        vcpus=1,
        memory_mib=64,
        disk_path=tmp_path / "vm" / "disk",
    )
    args.update(kw)
    return VmSpec(**args)


async def test_operations_are_refused_outside_their_runstates(tmp_path: Path) -> None:
    vm = QemuVm(_spec(tmp_path))
    assert vm.runstate is Runstate.IDLE and not vm.alive
    with pytest.raises(RunstateError, match="idle; cont needs paused"):
        await vm.cont()
    with pytest.raises(RunstateError, match="capture needs running"):
        await vm.capture(tmp_path / "snap")
    assert not (tmp_path / "snap").exists(), "refused before any work"
    with pytest.raises(RunstateError, match="load needs incoming"):
        await vm.load()
    assert RunstateError.status == 409


def test_changes_follow_one_table_and_exit_is_terminal(tmp_path: Path) -> None:
    vm = QemuVm(_spec(tmp_path))
    with pytest.raises(RunstateError):
        vm._set_state(Runstate.RUNNING)  # IDLE -> RUNNING skips the process start
    for s in (Runstate.STARTING, Runstate.RUNNING, Runstate.PAUSED, Runstate.CAPTURING, Runstate.PAUSED):
        vm._set_state(s)
    assert vm.alive, "a running process, whether we spawned or adopted it"
    with pytest.raises(RunstateError):
        vm._set_state(Runstate.INCOMING)
    vm._set_state(Runstate.EXITED)
    assert vm.exited.is_set() and not vm.alive
    vm._set_state(Runstate.RUNNING)  # a late success report never revives a dead QEMU
    assert vm.runstate is Runstate.EXITED


async def test_calls_on_an_exited_qemu_say_so(tmp_path: Path) -> None:
    vm = QemuVm(_spec(tmp_path))
    vm._set_state(Runstate.STARTING)
    vm._set_state(Runstate.EXITED)
    with pytest.raises(VmExited):
        await vm.capture(tmp_path / "snap")


async def test_no_qemu_is_started_when_its_limits_cannot_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_limits(*_: object) -> cgroups.VmCgroup:
        raise cgroups._unavailable("no pids controller")

    async def must_not_exec(*_: object, **__: object) -> None:
        raise AssertionError("QEMU was exec'd without its limits")

    monkeypatch.setattr(cgroups, "create_for", no_limits)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", must_not_exec)
    with pytest.raises(Unavailable, match="PAL_CGROUPS=off") as err:
        await QemuVm.boot(_spec(tmp_path))
    assert err.value.status == 503
