"""Reconciliation after a crash at each point of each operation.

Each test runs the real operation until the control plane "dies" at a crash point (a
:class:`tests.fakes.Crash` raised at a failpoint or by the fake node: no rollback runs),
scripts what the node did meanwhile, starts a fresh Scheduler on the same store and node,
and checks the VM's settled state and slot.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from pal.scheduler import quotas
from pal.scheduler.scheduler import Scheduler
from pal.scheduler.states import Action, Marker, VmState
from pal.spec import AgentSpec, PauseRequest
from pal.store import VmRecord
from tests.fakes import AGENT_VERSION, Crash, FakeVm, SchedEnv, crash_at, make_env

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=5)


async def _running(env: SchedEnv) -> str:
    return (await env.sched.scheduling.schedule(env.tenant_id, AgentSpec()))[0].vm_id


async def _restart(env: SchedEnv) -> tuple[Scheduler, list[str]]:
    """A new control plane on the same store and node, reconciled."""
    sched = Scheduler(env.settings, env.store, env.manager, clock=env.clock)
    fixes = await sched.reconciler.reconcile_all()
    return sched, fixes


async def _crashes(op: Awaitable[Any]) -> None:
    with pytest.raises(Crash):
        await op


def _vm(env: SchedEnv, vm_id: str) -> VmRecord:
    vm = env.store.get_vm(vm_id)
    assert vm is not None
    return vm


async def _crash_mid_pause(
    env: SchedEnv,
    mp: pytest.MonkeyPatch,
    vm_id: str,
    *,
    snapshot_done: bool,
    vm_alive: bool,
    idle: bool = False,
) -> None:
    """Die right after pause persisted DRAINING + its snapshot id; the node then had (or
    had not) committed the snapshot and stopped (or not) the QEMU."""
    crash_at(mp, "pause:draining")
    if idle:
        await _crashes(env.sched.pauses.idle_pause(vm_id, still_idle=lambda _vm: True))
    else:
        await _crashes(env.sched.pauses.pause(env.tenant_id, vm_id))
    vm = _vm(env, vm_id)
    assert vm.state == S.DRAINING and vm.snapshot_id
    if snapshot_done:
        env.manager.snapshots[(AGENT_VERSION, vm_id, vm.snapshot_id)] = True
    if not vm_alive:
        env.manager.kill(vm_id)


async def test_pause_crash_after_complete_snapshot_ends_paused(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    await _crash_mid_pause(env, monkeypatch, vm_id, snapshot_done=True, vm_alive=True)  # stop not reached
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.PAUSED and not vm.holds_slot and vm.paused_by == "operator"
    assert vm_id not in env.manager.alive  # the still-running QEMU was stopped


async def test_pause_crash_after_the_snapshot_step_ends_paused(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    crash_at(monkeypatch, "pause:snapshotted")
    await _crashes(env.sched.pauses.pause(env.tenant_id, vm_id))
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.PAUSED and not vm.holds_slot


async def test_pause_crash_before_snapshot_with_vm_alive_ends_running(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    await _crash_mid_pause(env, monkeypatch, vm_id, snapshot_done=False, vm_alive=True)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.RUNNING and vm.holds_slot


async def test_pause_crash_with_vm_gone_and_no_snapshot_ends_failed(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    await _crash_mid_pause(env, monkeypatch, vm_id, snapshot_done=False, vm_alive=False)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.FAILED and not vm.holds_slot


async def test_idle_pause_crash_keeps_idle_attribution(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    await _crash_mid_pause(env, monkeypatch, vm_id, snapshot_done=True, vm_alive=False, idle=True)
    assert _vm(env, vm_id).marker == Marker.IDLE_PAUSING
    await _restart(env)
    assert _vm(env, vm_id).paused_by == "idle"


async def test_slot_flag_out_of_step_with_the_state_is_repaired_once(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    with env.store.write() as tx:  # books corrupted behind the transition function's back
        tx.set_holds_slot(vm_id, True)
    _, fixes = await _restart(env)
    assert not _vm(env, vm_id).holds_slot and any("slot released" in f for f in fixes)
    with env.store.write() as tx:
        assert quotas.release_in(tx, vm_id) is False  # a late release is a no-op


async def test_delete_crash_ends_terminated(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.fail("stop", Crash("stop"))
    await _crashes(env.sched.deleting.delete(env.tenant_id, vm_id))
    assert _vm(env, vm_id).marker == Marker.DELETING
    await _restart(env)
    assert _vm(env, vm_id).state == S.TERMINATED and vm_id not in env.manager.alive


async def test_resume_crash_with_new_incarnation_alive_ends_running(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    crash_at(monkeypatch, "resume:spawned")  # spawn returned, RUNNING not written
    await _crashes(env.sched.pauses.resume(env.tenant_id, vm_id))
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.RUNNING and vm.holds_slot and vm.incarnation == 2


async def test_resume_crash_before_spawn_ends_paused(env: SchedEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    vm_id = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    crash_at(monkeypatch, "resume:spawning")
    await _crashes(env.sched.pauses.resume(env.tenant_id, vm_id))
    assert _vm(env, vm_id).holds_slot
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.PAUSED and not vm.holds_slot


async def test_resume_crash_with_stale_incarnation_stops_it_and_ends_paused(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    vm_id = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    env.manager.alive[vm_id] = FakeVm(vm_id, 1, "old")  # a stray QEMU of incarnation 1 survived
    crash_at(monkeypatch, "resume:spawning")  # the row already expects incarnation 2
    await _crashes(env.sched.pauses.resume(env.tenant_id, vm_id))
    await _restart(env)
    assert _vm(env, vm_id).state == S.PAUSED and vm_id not in env.manager.alive


def _spawn_then_crash(env: SchedEnv) -> Callable[..., Awaitable[Any]]:
    real = env.manager.spawn

    async def spawn(req: Any) -> Any:
        await real(req)
        raise Crash("spawned")

    return spawn


async def test_spawn_crash_ends_running_if_alive_else_failed(
    env: SchedEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = await _running(env)
    monkeypatch.setattr(env.manager, "spawn", _spawn_then_crash(env))
    await _crashes(env.sched.scheduling.schedule(env.tenant_id, AgentSpec()))
    await _crashes(env.sched.forking.fork(env.tenant_id, src, 1))
    up, down = (v.vm_id for v in env.store.list_vms(states=[S.SPAWNING]))
    env.manager.kill(down)
    await _restart(env)
    assert _vm(env, up).state == S.RUNNING
    assert _vm(env, down).state == S.FAILED and not _vm(env, down).holds_slot


async def test_pending_ends_failed(env: SchedEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    real = env.sched.transitions.transition

    async def transition(vm_id: str, action: Action, **kw: Any) -> VmRecord:
        if action == Action.PLACE:
            raise Crash("before placement")
        return await real(vm_id, action, **kw)

    monkeypatch.setattr(env.sched.transitions, "transition", transition)
    await _crashes(env.sched.scheduling.schedule(env.tenant_id, AgentSpec()))
    (vm,) = env.store.list_vms()
    assert vm.state == S.PENDING
    await _restart(env)
    assert _vm(env, vm.vm_id).state == S.FAILED and not _vm(env, vm.vm_id).holds_slot


async def test_running_whose_qemu_died_ends_failed(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.kill(vm_id)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.FAILED and vm.reason == "QEMU exited" and not vm.holds_slot


async def test_a_vm_whose_qemu_is_gone_comes_back_paused_from_its_newest_snapshot(env: SchedEnv) -> None:
    """A live VM whose QEMU could not be adopted after a restart, with a complete snapshot
    (here: a fork's, taken a moment before the crash), is paused from its newest one and
    resumable, never failed; an event says why and from when."""
    vm_id = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    await env.sched.pauses.resume(env.tenant_id, vm_id)
    fork = await env.sched.forking.fork(env.tenant_id, vm_id, 1)  # the newest snapshot
    env.manager.kill(vm_id)
    _, fixes = await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.PAUSED and vm.paused_by == "recovery" and vm.snapshot_id == fork.snapshot_id
    assert not vm.holds_slot and any("paused from snapshot" in f for f in fixes)
    (ev,) = [e for e in env.store.list_events(vm_id) if e.kind == "recovered"]
    assert ev.details is not None and ev.details["snapshotId"] == fork.snapshot_id
    assert ev.reason is not None and "resume it" in ev.reason
    resumed = await env.sched.pauses.resume(env.tenant_id, vm_id)
    assert resumed.state == S.RUNNING and ("spawn", vm_id) in env.manager.calls


async def test_a_live_paused_vm_whose_qemu_is_gone_comes_back_from_its_snapshot(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, vm_id)
    await env.sched.pauses.resume(env.tenant_id, vm_id)
    await env.sched.pauses.pause(env.tenant_id, vm_id, PauseRequest(mode="live"))
    env.manager.kill(vm_id)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.PAUSED and vm.marker == "" and vm.paused_by == "recovery"


async def test_paused_with_missing_snapshot_ends_failed(env: SchedEnv) -> None:
    """The snapshot audit (a page of paused VMs each sweep, round and round) fails a paused
    VM whose snapshot its node no longer has; a takeover does not ask for every one."""
    keep = await _running(env)
    lost = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, keep)
    paused = (await env.sched.pauses.pause(env.tenant_id, lost)).vm
    del env.manager.snapshots[(AGENT_VERSION, lost, paused.snapshot_id)]
    sched, _ = await _restart(env)
    assert _vm(env, lost).state == S.PAUSED
    assert await sched.snapshot_checks.audit() == [f"{lost}: paused without a complete snapshot -> failed"]
    assert _vm(env, keep).state == S.PAUSED
    assert _vm(env, lost).state == S.FAILED


async def test_the_snapshot_sweep_of_a_node_that_holds_none_finds_nothing(env: SchedEnv) -> None:
    """A fresh node lists no snapshots: the sweep's turn on it is empty, not an error that
    fails the leader's background tick."""
    await _running(env)
    assert not env.manager.snapshots
    assert await env.sched.snapshot_checks.sweep() == []
    assert ("snapshot_owners", "") in env.manager.calls


async def test_unknown_qemu_on_the_node_is_stopped(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.deleting.delete(env.tenant_id, vm_id)
    env.manager.alive["vm-stray"] = FakeVm("vm-stray", 1, "t")
    env.manager.alive[vm_id] = FakeVm(vm_id, 1, "t")
    await _restart(env)
    assert env.manager.alive == {}


async def test_slot_flag_set_for_a_live_vm_that_lost_it(env: SchedEnv) -> None:
    vm_id = await _running(env)
    with env.store.write() as tx:  # books corrupted behind the transition function's back
        quotas.release_in(tx, vm_id)
    await _restart(env)
    assert _vm(env, vm_id).holds_slot


async def test_light_reconcile_fails_dead_running_vms_only(env: SchedEnv) -> None:
    dead = await _running(env)
    fine = await _running(env)
    env.manager.kill(dead)
    fixes = await env.sched.reconciler.reconcile_light()
    assert len(fixes) == 1
    assert _vm(env, dead).state == S.FAILED and _vm(env, fine).state == S.RUNNING


async def test_light_reconcile_fails_a_vm_whose_harness_went_silent(env: SchedEnv) -> None:
    silent = await _running(env)
    fine = await _running(env)
    now = env.sched.deps.now_ms()
    env.manager.alive[silent].last_heartbeat_unix_ms = now - 31_000
    env.manager.alive[fine].last_heartbeat_unix_ms = now - 29_000
    fixes = await env.sched.reconciler.reconcile_light()
    assert len(fixes) == 1
    assert _vm(env, silent).state == S.FAILED and "silent" in (_vm(env, silent).reason or "")
    assert silent not in env.manager.alive, "its QEMU was stopped"
    assert _vm(env, fine).state == S.RUNNING
    assert env.store.count_slots(env.tenant_id) == 1


async def test_reconcile_changes_nothing_on_a_consistent_store(env: SchedEnv) -> None:
    a = await _running(env)
    b = await _running(env)
    await env.sched.pauses.pause(env.tenant_id, b)
    _, fixes = await _restart(env)
    assert fixes == []
    assert _vm(env, a).state == S.RUNNING and _vm(env, b).state == S.PAUSED


async def test_start_without_a_manager_heartbeat_is_503(env: SchedEnv) -> None:
    from pal.errors import Unavailable

    env.manager.heartbeat_error = ConnectionError("no socket")
    with pytest.raises(Unavailable):
        await env.sched.start()
    await env.sched.close()


async def test_a_harness_starved_of_cpu_is_slow_not_gone(env: SchedEnv) -> None:
    """A guest silent for 40 s of wall time on a host so busy that it was 12 s of CPU time
    (the node's count: pal/vmm/host_cpu.py) stays running; 31 s of CPU time fails it."""
    starved = await _running(env)
    stuck = await _running(env)
    now = env.sched.deps.now_ms()
    for vm_id, cpu_ms in ((starved, 12_000), (stuck, 31_000)):
        env.manager.alive[vm_id].last_heartbeat_unix_ms = now - 40_000
        env.manager.alive[vm_id].silent_cpu_ms = cpu_ms
    fixes = await env.sched.reconciler.reconcile_light()
    assert len(fixes) == 1 and "CPU time" in fixes[0]
    assert _vm(env, starved).state == S.RUNNING
    assert _vm(env, stuck).state == S.FAILED
