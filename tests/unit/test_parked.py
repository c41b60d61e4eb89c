"""Parked QEMUs (pal/manager/parked.py): which one a resume may continue, and the bounds of
the cache. The QEMU, channel and network are fakes; the real path is
tests/integration/test_pause_resume.py::test_a_paused_vm_parks_its_qemu_and_its_resume_continues_it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pal.manager import parked
from pal.manager.parked import Parking


class FakeQemu:
    def __init__(self) -> None:
        self.exited = asyncio.Event()
        self.pid = 4242
        self.mem_path = Path("/nonexistent/mem")
        self.killed = False

    async def kill(self) -> None:
        self.killed = True
        self.exited.set()


class FakeRuntime:
    def __init__(self) -> None:
        self.freed: list[str] = []
        self.unregistered: list[str] = []

        async def unregister(vm_id: str) -> dict[str, int]:
            self.unregistered.append(vm_id)
            return {"bytesIn": 1}

        self.net = SimpleNamespace(unregister=unregister)

    async def free_vm_files(self, vm_id: str, slot: str | None = None) -> None:
        assert slot == f"slot-of-{vm_id}"  # the slot the parked VM held, not a lookup
        self.freed.append(vm_id)


def lv(vm_id: str) -> Any:
    async def close() -> None:
        return None

    return SimpleNamespace(
        vm_id=vm_id, slot=f"slot-of-{vm_id}", qemu=FakeQemu(), channel=SimpleNamespace(close=close)
    )


@pytest.fixture
def offloads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Offloads run at once (no 2 s grace) and are counted."""
    done: list[int] = []

    def offload(pid: int, mem_path: Path) -> Any:
        done.append(pid)
        return SimpleNamespace(working_set=[(0, 4096)], freed=1 << 20, ms=1.0)

    monkeypatch.setattr(parked.offload, "offload", offload)
    monkeypatch.setattr(parked, "OFFLOAD_DELAY_S", 0.0)
    return done


async def test_a_resume_continues_only_the_same_snapshots_live_process(offloads: list[int]) -> None:
    rt = FakeRuntime()
    parking = Parking(rt, capacity=4, max_age_s=900)  # type: ignore[arg-type]
    a = lv("vm-a")
    assert await parking.park(a, "snap-1") == {"bytesIn": 1}
    assert rt.unregistered == ["vm-a"], "its gateway state and connections are dropped at once"
    assert parking.take("vm-a", "snap-other") is None, "another snapshot: not this process"
    a.qemu.exited.set()
    assert parking.take("vm-a", "snap-1") is None, "a process that died is never continued"
    b = lv("vm-b")
    await parking.park(b, "snap-2")
    await parking.vms["vm-b"].settled()
    assert offloads == [4242] and parking.vms["vm-b"].offloaded
    pv = parking.take("vm-b", "snap-2")
    assert pv is not None and pv.lv is b and "vm-b" not in parking.vms


async def test_a_resume_right_after_the_pause_calls_the_offload_off(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[int] = []
    monkeypatch.setattr(parked.offload, "offload", lambda pid, path: called.append(pid))
    parking = Parking(FakeRuntime(), capacity=4, max_age_s=900)  # type: ignore[arg-type]
    await parking.park(lv("vm-a"), "s")
    pv = parking.take("vm-a", "s")
    assert pv is not None
    await pv.settled()
    assert called == [] and not pv.offloaded, "its RAM is still resident: nothing to read back"


async def test_the_cache_keeps_the_newest_and_forgets_the_old(offloads: list[int]) -> None:
    rt = FakeRuntime()
    parking = Parking(rt, capacity=2, max_age_s=900)  # type: ignore[arg-type]
    vms = [lv(f"vm-{i}") for i in range(3)]
    for i, v in enumerate(vms):
        await parking.park(v, f"s{i}")
    assert set(parking.vms) == {"vm-1", "vm-2"}, "the oldest went"
    assert vms[0].qemu.killed and rt.freed == ["vm-0"]
    parking.max_age_s = 0.0
    assert parking.take("vm-2", "s2") is None, "too old to continue"
    await parking.evict(keep=10)
    assert parking.vms == {} and all(v.qemu.killed for v in vms)
    assert sorted(rt.freed) == ["vm-0", "vm-1", "vm-2"]


async def test_parking_off_and_discard(offloads: list[int]) -> None:
    parking = Parking(FakeRuntime(), capacity=0, max_age_s=900)  # type: ignore[arg-type]
    assert not parking.enabled
    on = Parking(FakeRuntime(), capacity=1, max_age_s=900)  # type: ignore[arg-type]
    v = lv("vm-a")
    await on.park(v, "s")
    assert await on.discard("vm-a") is True and v.qemu.killed
    assert await on.discard("vm-a") is False
