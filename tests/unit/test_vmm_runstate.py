"""QemuVm's explicit runstate (issue 16): one table of changes, guards that raise a typed
error before any work, EXITED terminal, an adopted QEMU recovered like our own after a
failed capture; and the jail's fail-closed spawn."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pal.errors import Unavailable
from pal.vmm import cgroups
from pal.vmm.cmdline import ImageFiles, VmSpec
from pal.vmm.errors import RunstateError, VmExited, VmmError
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


class FakeQmp:
    """A QMP server on the VM's socket standing in for an adopted QEMU (a real process, a
    ``sleep``, gives it a pid): it answers what a QEMU answers, fails what ``fail`` names,
    and ends the process on ``quit``. ``calls``: the commands, in order."""

    def __init__(self, proc: asyncio.subprocess.Process, *, status: str, fail: dict[str, str]) -> None:
        self.proc, self.status, self.fail = proc, status, fail
        self.calls: list[str] = []

    async def serve(self, path: Path) -> asyncio.AbstractServer:
        return await asyncio.start_unix_server(self._client, path=str(path))

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        greeting = {"QMP": {"version": {"qemu": {"major": 8, "minor": 2, "micro": 0}, "package": ""}}}
        greeting["QMP"]["capabilities"] = []  # type: ignore[index]
        writer.write(json.dumps(greeting).encode() + b"\n")
        dec = json.JSONDecoder()
        buf = ""
        while data := await reader.read(4096):
            buf += data.decode()
            while (buf := buf.lstrip()) and buf[0] == "{":  # " " = a passed fd (SCM_RIGHTS)
                try:
                    msg, end = dec.raw_decode(buf)
                except ValueError:
                    break  # a partial message: read on
                buf = buf[end:]
                cmd = msg["execute"]
                self.calls.append(cmd)
                if cmd in self.fail and self.fail[cmd] == "error":
                    reply: dict[str, object] = {"error": {"class": "GenericError", "desc": f"{cmd} failed"}}
                else:
                    reply = {"return": self._answer(cmd)}
                writer.write(json.dumps({**reply, "id": msg.get("id")}).encode() + b"\n")
                await writer.drain()
                if cmd == "quit":
                    self.proc.kill()
        writer.close()

    def _answer(self, cmd: str) -> object:
        if cmd == "query-status":
            return {"status": self.status, "running": self.status == "running"}
        if cmd == "query-migrate":
            return {"status": self.fail.get(cmd, "completed"), "error-desc": "injected"}
        if cmd == "stop":
            self.status = "paused"
        if cmd == "cont":
            self.status = "running"
        return {}


async def _adopted(tmp_path: Path, **fake: Any) -> tuple[QemuVm, FakeQmp, asyncio.AbstractServer]:
    spec = _spec(tmp_path, cgroup_limits=False)
    spec.vm_dir.mkdir()
    spec.mem_path.write_bytes(b"guest RAM")
    spec.disk_path.write_bytes(b"guest disk")
    proc = await asyncio.create_subprocess_exec("sleep", "300", start_new_session=True)
    qmp = FakeQmp(proc, **fake)
    server = await qmp.serve(spec.qmp_socket)
    vm = await QemuVm.adopt(spec, proc.pid, mem_path=spec.mem_path, mem_share=True)
    return vm, qmp, server


@pytest.mark.parametrize("status", ["running", "paused"])
async def test_an_adopted_qemu_whose_capture_fails_runs_again(tmp_path: Path, status: str) -> None:
    # The bug this runstate fixed: an adopted QEMU (not our child) looked dead, so a failed
    # capture skipped its recovery and left the guest stopped for good.
    vm, qmp, server = await _adopted(tmp_path, status=status, fail={"query-migrate": "failed"})
    try:
        assert vm.runstate is Runstate.RUNNING and vm.alive
        qmp.calls.clear()
        with pytest.raises(VmmError, match="migration failed"):
            await vm.capture(tmp_path / "snap")
        assert qmp.calls[-2:] == ["migrate_cancel", "cont"], qmp.calls
        assert vm.runstate is Runstate.RUNNING and qmp.status == "running"
        assert qmp.proc.returncode is None, "the guest was recovered, not killed"
        assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == [], "artifacts removed"
        # and it is a working VM again: the next capture goes through
        qmp.fail.clear()
        art = await vm.capture(tmp_path / "snap2")
        assert vm.runstate is Runstate.PAUSED and art.paths["snapshot"].exists()
    finally:
        await vm.kill()
        server.close()
        await qmp.proc.wait()


async def test_an_adopted_qemu_that_cannot_continue_after_a_failed_capture_is_killed(tmp_path: Path) -> None:
    vm, qmp, server = await _adopted(tmp_path, status="running", fail={"migrate": "error", "cont": "error"})
    try:
        with pytest.raises(VmmError, match="migrate failed"):
            await vm.capture(tmp_path / "snap")
        assert "cont" in qmp.calls and qmp.calls[-1] == "quit", qmp.calls
        assert vm.runstate is Runstate.EXITED and not vm.alive
        await asyncio.wait_for(qmp.proc.wait(), timeout=60)  # the stopped guest's QEMU is gone
    finally:
        await vm.kill()
        server.close()
        if qmp.proc.returncode is None:
            qmp.proc.kill()
        await qmp.proc.wait()
