"""The idle sweeper on a fake clock: who gets suspended, and how."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pal.errors import BackendError, NotFound
from pal.scheduler.pause_resume import IDLE_REASON
from pal.scheduler.states import Marker, VmState
from pal.spec import AgentSpec, ExecRequest
from pal.wire import verbs
from pal.wire.models import ExecCall, FileWrite, on_vm
from tests.fakes import SchedEnv, make_env

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=5)


async def _vm(env: SchedEnv, idle_secs: int) -> str:
    return (await env.sched.scheduling.schedule(env.tenant_id, AgentSpec(idle_timeout_secs=idle_secs)))[
        0
    ].vm_id


async def test_idle_vm_is_suspended_after_its_timeout_not_before(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    sweeper = env.sched.sweeper
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
    assert await env.sched.sweeper.sweep() == []


async def test_guest_activity_and_active_exec_keep_it_running(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    sweeper = env.sched.sweeper
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
    sweeper = env.sched.sweeper
    env.clock.advance(50)
    await env.sched.guest.call(env.tenant_id, verbs.WRITE_FILE, FileWrite(vm_id=vm_id, path="a", data=b"x"))
    env.clock.advance(50)  # 100 s since schedule, 50 s since the write
    assert await sweeper.sweep() == []
    env.sched.locks.inflight[vm_id] = 1  # a request in flight, whatever the clock says
    env.clock.advance(100)
    assert await sweeper.sweep() == []
    env.sched.locks.inflight.clear()
    assert await sweeper.sweep() == [vm_id]


async def test_resumed_vm_gets_a_fresh_timeout(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    sweeper = env.sched.sweeper
    env.clock.advance(61)
    assert await sweeper.sweep() == [vm_id]
    env.clock.advance(1000)
    await env.sched.pauses.resume(env.tenant_id, vm_id)
    assert await sweeper.sweep() == []


async def test_failed_idle_pause_leaves_vm_running_and_sweeper_alive(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    other = await _vm(env, 60)
    env.manager.fail("snapshot", BackendError("no space"), vm_id=vm_id)
    env.clock.advance(61)
    assert await env.sched.sweeper.sweep() == [other]
    assert env.store.get_vm(vm_id).state == S.RUNNING  # type: ignore[union-attr]


async def test_the_started_scheduler_sweeps_on_its_own(tmp_path: Path) -> None:
    """The background loop ticks by itself (a real 20 ms interval); time is the fake clock."""
    env = make_env(tmp_path, idle_sweep_interval_s=0.02)
    await env.sched.start()
    try:
        vm_id = await _vm(env, 60)

        def sweeps() -> int:
            return sum(1 for call, _ in env.manager.calls if call == "heartbeat")

        async def until(cond: Callable[[], bool]) -> None:
            deadline = time.monotonic() + 60  # a hang guard, not a speed bound
            while not cond():
                assert time.monotonic() < deadline, "the background loop did not get there"
                await asyncio.sleep(0.01)

        seen = sweeps()
        await until(lambda: sweeps() >= seen + 3)
        assert env.store.get_vm(vm_id).state == S.RUNNING  # type: ignore[union-attr]
        env.clock.advance(61)
        await until(lambda: env.store.get_vm(vm_id).state == S.PAUSED)  # type: ignore[union-attr]
    finally:
        await env.sched.close()


async def test_a_guest_claiming_constant_activity_is_suspended_one_timeout_late_at_most(
    env: SchedEnv,
) -> None:
    """A hostile guest says it is always busy and its last activity is in the future: the
    claim counts at most one idle timeout past the host-observed activity (idle.py)."""
    vm_id = await _vm(env, 60)
    liar = env.manager.alive[vm_id]
    liar.guest_active = True
    liar.guest_last_activity_unix_ms = int((env.clock.now + 10**6) * 1000)
    sweeper = env.sched.sweeper
    env.clock.advance(100)  # past the timeout, within the guest's one-timeout extension
    assert await sweeper.sweep() == []
    env.clock.advance(21)  # > 2 x 60 s after the last host-observed activity
    assert await sweeper.sweep() == [vm_id]


async def test_a_guest_claim_extends_idleness_only_up_to_now(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    env.clock.advance(50)
    env.manager.alive[vm_id].guest_last_activity_unix_ms = int(env.clock.now * 1000)  # honest: a job ended
    env.clock.advance(50)  # 100 s since the last request, 50 s since the guest's activity
    assert await env.sched.sweeper.sweep() == []
    env.clock.advance(11)
    assert await env.sched.sweeper.sweep() == [vm_id]


async def test_another_tenants_request_does_not_stamp_the_vm(env: SchedEnv) -> None:
    vm_id = await _vm(env, 60)
    other, _ = env.store.create_tenant("mallory", 5)
    sweeper = env.sched.sweeper
    for _ in range(3):
        env.clock.advance(30)
        with pytest.raises(NotFound):
            await env.sched.guest.call(
                other.id, verbs.WRITE_FILE, FileWrite(vm_id=vm_id, path="a", data=b"x")
            )
        with pytest.raises(NotFound):
            async for _ev in env.sched.guest.exec_stream(
                other.id, on_vm(ExecCall, vm_id, ExecRequest(command="true"))
            ):
                pass
        assert vm_id not in env.sched.locks.inflight
    # 90 s after the only request of its owner (schedule): idle, whatever mallory did.
    assert await sweeper.sweep() == [vm_id]
