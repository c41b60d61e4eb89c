"""Restores admitted by the CPU that is free (restore_gate.py), the load read from /proc and
the cgroup (host_cpu.py, v1 and v2), and timeouts stretched by the load."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pal.manager.restore_gate import RestoreGate
from pal.vmm import host_cpu
from pal.vmm.host_cpu import LoadSampler, Stretch


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0  # every sample is a fresh one
        return self.t


def sampler(cpus: float, runnable: list[int]) -> LoadSampler:
    """A host whose runnable count is ``runnable[i]`` at the i-th read (the last one after)."""
    seq = iter(runnable)
    last = [runnable[-1]]

    def read() -> int:
        last[0] = next(seq, last[0])
        return last[0]

    return LoadSampler(cpus, read, Clock())


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu" / "box").mkdir(parents=True)
    (tmp_path / "cpu" / "box" / "cpu.cfs_quota_us").write_text("150000\n")
    (tmp_path / "cpu" / "box" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("4:memory:/x\n1:cpu:/box\n0::/\n")
    assert host_cpu.quota_cpus(tmp_path, proc) == 1.5
    (tmp_path / "cpu" / "box" / "cpu.cfs_quota_us").write_text("-1\n")
    assert host_cpu.quota_cpus(tmp_path, proc) is None


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "svc").mkdir()
    (tmp_path / "svc" / "cpu.max").write_text("50000 100000\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("0::/svc\n")
    assert host_cpu.quota_cpus(tmp_path, proc) == 0.5
    assert host_cpu.capacity(tmp_path, proc) == 0.5
    (tmp_path / "svc" / "cpu.max").write_text("max 100000\n")
    assert host_cpu.quota_cpus(tmp_path, proc) is None


def test_runnable_now_reads_loadavg_without_the_reader(tmp_path: Path) -> None:
    f = tmp_path / "loadavg"
    f.write_text("3.87 1.00 0.33 8/135 31952\n")
    assert host_cpu.runnable_now(f) == 7
    f.write_text("garbage")
    assert host_cpu.runnable_now(f) is None
    assert host_cpu.runnable_now(Path("/proc/loadavg")) is not None


def test_the_real_host_has_a_capacity() -> None:
    assert host_cpu.capacity() > 0


class Wall:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_stretch_gives_a_loaded_host_longer() -> None:
    wall = Wall()
    idle = LoadSampler(2, lambda: 0, wall)
    t = Stretch(5.0, idle)
    wall.t += 4.9
    assert not t.expired
    wall.t += 0.2
    assert t.expired, "an idle host: 5 s of wall time"
    others = [8]  # 4 tasks share each CPU
    busy = LoadSampler(2, lambda: others[0], wall)
    t = Stretch(5.0, busy)
    for _ in range(19):
        wall.t += 1.0
        assert not t.expired
    wall.t += 1.1
    assert t.expired and "CPU time" in t.describe(), "a busy host: 4x as long"


def test_the_cpu_clock_counts_silence_in_cpu_time() -> None:
    wall = Wall()
    others = [0]
    s = LoadSampler(2, lambda: others[0], wall)
    heard = wall.t
    for _ in range(10):  # 10 s idle
        wall.t += 1.0
        s.sample()
    others[0] = 6  # then 3 tasks share each CPU: 30 s wall are 10 s of CPU
    for _ in range(30):
        wall.t += 1.0
        s.sample()
    assert 19.0 < s.cpu_since(heard) < 23.0  # the smoothed load takes a few samples to rise
    assert 6.0 < s.cpu_since(heard + 20.0) < 7.5  # the last 20 s of wall, at 1/3
    assert s.cpu_since(heard - 5.0) > s.cpu_since(heard), "before the first point: wall time"


def test_slots_follow_the_free_cpu() -> None:
    assert RestoreGate(16, sampler(2, [0])).slots() == 4
    assert RestoreGate(16, sampler(2, [1])).slots() == 2
    assert RestoreGate(16, sampler(2, [9])).slots() == 2, "never fewer than one per CPU"
    assert RestoreGate(16, sampler(0.5, [9])).slots() == 1, "nor than one"
    assert RestoreGate(3, sampler(64, [0])).slots() == 3, "never more than the ceiling"


def host_with(gate_ref: list[RestoreGate], others: float) -> LoadSampler:
    """A 2-CPU host running ``others`` tasks besides the gate's own restores (each one
    runnable, as a restoring QEMU is)."""
    return LoadSampler(2, lambda: others + (gate_ref[0].in_flight if gate_ref else 0), Clock())


async def test_the_gate_admits_by_free_cpu_first_come_first_served() -> None:
    ref: list[RestoreGate] = []
    gate = RestoreGate(16, host_with(ref, 1.5))  # half a CPU free: 1 at once, but 2 CPUs: 2
    ref.append(gate)
    order: list[int] = []
    release = asyncio.Event()

    async def restore(i: int) -> None:
        async with gate.admit():
            order.append(i)
            await release.wait()

    tasks = [asyncio.create_task(restore(i)) for i in range(6)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == [0, 1] and gate.in_flight == 2 and gate.waiting == 4
    release.set()
    await asyncio.gather(*tasks)
    assert order == list(range(6)) and gate.in_flight == 0 and gate.max_in_flight == 2


async def test_a_busy_host_admits_one_per_cpu_and_more_when_load_drops() -> None:
    load = [9] * 8 + [0] * 1000
    gate = RestoreGate(16, sampler(2, load))
    running = 0
    peak: list[int] = []

    async def restore() -> None:
        nonlocal running
        async with gate.admit():
            running += 1
            peak.append(running)
            await asyncio.sleep(0.01)
            running -= 1

    await asyncio.gather(*(restore() for _ in range(30)))
    assert max(peak[:2]) == 2 and max(peak) > 2 and gate.admitted_total == 30


async def test_a_cancelled_waiter_leaves_no_slot_taken() -> None:
    gate = RestoreGate(1, sampler(2, [0]))
    hold = asyncio.Event()

    async def first() -> None:
        async with gate.admit():
            await hold.wait()

    t1 = asyncio.create_task(first())
    await asyncio.sleep(0)
    t2 = asyncio.create_task(first())
    await asyncio.sleep(0)
    assert gate.waiting == 1
    t2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t2
    hold.set()
    await t1
    assert gate.in_flight == 0 and gate.waiting == 0
