"""The idle sweeper on a fake clock: who gets suspended, and how."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pal.errors import BackendError
from pal.scheduler.idle import IdleSweeper
from pal.scheduler.scheduler import IDLE_REASON
from pal.scheduler.spec import AgentSpec
from pal.scheduler.states import Marker, VmState
from tests.fakes import SchedEnv, make_env

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=5)


async def _vm(env: SchedEnv, idle_secs: int) -> str:
    return (await env.sched.schedule(env.tenant_id, AgentSpec(idle_timeout_secs=idle_secs))).vm_id


async def test_idle_vm_is_suspended_after_its_timeout_not_before(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    sweeper = IdleSweeper(env.sched)
    env.clock.advance(59)
    assert await sweeper.sweep() == []
    env.clock.advance(2)
    assert await sweeper.sweep() == [vm_id]
    vm = env.store.get_vm(vm_id)
    assert vm is not None and vm.state == S.PAUSED and vm.paused_by == "idle"
    assert vm.reason == IDLE_REASON and not vm.holds_slot and vm_id not in env.manager.alive
    draining = [e for e in env.store.list_events(vm_id) if e.to_state == "draining"]
    assert draining[0].marker == Marker.IDLE_PAUSING


async def test_timeout_zero_means_never(env: SchedEnv) -> None:
    await _vm(env, 0)
    env.clock.advance(10**6)
    assert await IdleSweeper(env.sched).sweep() == []


async def test_guest_activity_and_active_exec_keep_it_running(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    sweeper = IdleSweeper(env.sched)
    env.clock.advance(100)
    env.manager.alive[vm_id].last_activity_unix_ms = int((env.clock.now - 30) * 1000)
    assert await sweeper.sweep() == []
    env.clock.advance(100)
    env.manager.alive[vm_id].has_active_exec = True
    assert await sweeper.sweep() == []
    env.manager.alive[vm_id].has_active_exec = False
    assert await sweeper.sweep() == [vm_id]


async def test_host_side_requests_count_as_activity(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    sweeper = IdleSweeper(env.sched)
    env.clock.advance(50)
    await env.sched.write_file(env.tenant_id, vm_id, "a", b"x")
    env.clock.advance(50)  # 100 s since schedule, 50 s since the write
    assert await sweeper.sweep() == []
    env.sched.inflight[vm_id] = 1  # a request in flight, whatever the clock says
    env.clock.advance(100)
    assert await sweeper.sweep() == []
    env.sched.inflight.clear()
    assert await sweeper.sweep() == [vm_id]


async def test_resumed_vm_gets_a_fresh_timeout(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    sweeper = IdleSweeper(env.sched)
    env.clock.advance(61)
    assert await sweeper.sweep() == [vm_id]
    env.clock.advance(1000)
    await env.sched.resume(env.tenant_id, vm_id)
    assert await sweeper.sweep() == []


async def test_failed_idle_pause_leaves_vm_running_and_sweeper_alive(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    other = await _vm(env, 60)
    env.manager.fail("snapshot", BackendError("no space"), vm_id=vm_id)
    env.clock.advance(61)
    assert await IdleSweeper(env.sched).sweep() == [other]
    assert env.store.get_vm(vm_id).state == S.RUNNING  # type: ignore[union-attr]


async def test_background_loop_suspends_within_timeout_plus_interval(tmp_path: Path) -> None:
    """The started scheduler polls on its own; real time here, so keep numbers tiny."""

    env = make_env(tmp_path, idle_sweep_interval_s=0.05)
    env.sched.clock = time.time
    await env.sched.start()
    try:
        vm_id = (await env.sched.schedule(env.tenant_id, AgentSpec(idle_timeout_secs=1))).vm_id
        t0 = time.monotonic()
        while env.store.get_vm(vm_id).state != S.PAUSED:  # type: ignore[union-attr]
            assert time.monotonic() - t0 < 3, "not suspended within timeout + interval"
            await asyncio.sleep(0.02)
        assert time.monotonic() - t0 >= 0.9
    finally:
        await env.sched.close()
