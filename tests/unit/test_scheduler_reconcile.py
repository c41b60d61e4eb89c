"""Reconciliation after a crash at each point of each operation.

Each test builds the row a crash would leave (by running the real operation up to the
crash point through the store and the fake node), starts a fresh Scheduler on the same
store and node, and checks the VM's settled state and slot.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.scheduler import quotas, reconcile
from pal.scheduler.scheduler import Scheduler, new_snapshot_id
from pal.scheduler.spec import AgentSpec
from pal.scheduler.states import Marker, VmState
from tests.fakes import AGENT_VERSION, SchedEnv, make_env

S = VmState


@pytest.fixture
def env(tmp_path: Path) -> SchedEnv:
    return make_env(tmp_path, max_vms=5)


async def _running(env: SchedEnv) -> str:
    return (await env.sched.schedule(env.tenant_id, AgentSpec())).vm_id


async def _restart(env: SchedEnv) -> tuple[Scheduler, list[str]]:
    """A new control plane on the same store and node, reconciled."""
    sched = Scheduler(env.settings, env.store, env.manager, clock=env.clock)
    fixes = await reconcile.reconcile_all(sched)
    return sched, fixes


def _crash_mid_pause(env: SchedEnv, vm_id: str, *, snapshot_done: bool, vm_alive: bool) -> str:
    """Leave vm_id DRAINING+pausing as pause() persists it before the manager call."""
    snap = new_snapshot_id()
    with env.store.write() as tx:
        tx.update_vm(vm_id, state="draining", marker=Marker.PAUSING.value, snapshot_id=snap)
    if snapshot_done:
        env.manager.snapshots[(AGENT_VERSION, vm_id, snap)] = True
    if not vm_alive:
        env.manager.kill(vm_id)
    return snap


def _vm(env: SchedEnv, vm_id: str):  # type: ignore[no-untyped-def]
    vm = env.store.get_vm(vm_id)
    assert vm is not None
    return vm


async def test_pause_crash_after_complete_snapshot_ends_paused(env: SchedEnv) -> None:
    vm_id = await _running(env)
    _crash_mid_pause(env, vm_id, snapshot_done=True, vm_alive=True)  # stop not reached yet
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.PAUSED and not vm.holds_slot and vm.paused_by == "operator"
    assert vm_id not in env.manager.alive  # the still-running QEMU was stopped


async def test_pause_crash_before_snapshot_with_vm_alive_ends_running(env: SchedEnv) -> None:
    vm_id = await _running(env)
    _crash_mid_pause(env, vm_id, snapshot_done=False, vm_alive=True)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.RUNNING and vm.holds_slot


async def test_pause_crash_with_vm_gone_and_no_snapshot_ends_failed(env: SchedEnv) -> None:
    vm_id = await _running(env)
    _crash_mid_pause(env, vm_id, snapshot_done=False, vm_alive=False)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.FAILED and not vm.holds_slot


async def test_idle_pause_crash_keeps_idle_attribution(env: SchedEnv) -> None:
    vm_id = await _running(env)
    _crash_mid_pause(env, vm_id, snapshot_done=True, vm_alive=False)
    with env.store.write() as tx:
        tx.update_vm(vm_id, marker=Marker.IDLE_PAUSING.value)
    await _restart(env)
    assert _vm(env, vm_id).paused_by == "idle"


async def test_pause_crash_after_paused_but_before_release_frees_slot_once(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.pause(env.tenant_id, vm_id)
    with env.store.write() as tx:  # as if the release had not been committed
        tx.set_holds_slot(vm_id, True)
    _, fixes = await _restart(env)
    assert not _vm(env, vm_id).holds_slot and any("slot released" in f for f in fixes)
    assert quotas.release(env.store, vm_id) is False  # a late RPC-path release is a no-op


async def test_delete_crash_ends_terminated(env: SchedEnv) -> None:
    vm_id = await _running(env)
    with env.store.write() as tx:
        tx.update_vm(vm_id, state="draining", marker=Marker.DELETING.value)
    await _restart(env)
    assert _vm(env, vm_id).state == S.TERMINATED and vm_id not in env.manager.alive


async def test_resume_crash_with_new_incarnation_alive_ends_running(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.pause(env.tenant_id, vm_id)
    await env.sched.resume(env.tenant_id, vm_id)
    with env.store.write() as tx:  # crash after spawn returned, before RUNNING was written
        tx.update_vm(vm_id, state="spawning", marker=Marker.RESUMING.value)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.RUNNING and vm.holds_slot


async def test_resume_crash_before_spawn_ends_paused(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.pause(env.tenant_id, vm_id)
    quotas.reserve(env.store, env.tenant_id, existing=[vm_id])
    with env.store.write() as tx:
        tx.update_vm(vm_id, state="spawning", marker=Marker.RESUMING.value, incarnation=2)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.PAUSED and not vm.holds_slot


async def test_resume_crash_with_stale_incarnation_stops_it_and_ends_paused(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.pause(env.tenant_id, vm_id)
    await env.sched.resume(env.tenant_id, vm_id)  # node runs incarnation 2
    with env.store.write() as tx:  # the row already expects incarnation 3
        tx.update_vm(vm_id, state="spawning", marker=Marker.RESUMING.value, incarnation=3)
    await _restart(env)
    assert _vm(env, vm_id).state == S.PAUSED and vm_id not in env.manager.alive


async def test_spawn_crash_ends_running_if_alive_else_failed(env: SchedEnv) -> None:
    up = await _running(env)
    down = await _running(env)
    env.manager.kill(down)
    with env.store.write() as tx:
        for vid in (up, down):
            tx.update_vm(vid, state="spawning", marker=Marker.FORKING.value)
    await _restart(env)
    assert _vm(env, up).state == S.RUNNING
    assert _vm(env, down).state == S.FAILED and not _vm(env, down).holds_slot


async def test_pending_ends_failed(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.kill(vm_id)
    with env.store.write() as tx:
        tx.update_vm(vm_id, state="pending", marker="")
    await _restart(env)
    assert _vm(env, vm_id).state == S.FAILED and not _vm(env, vm_id).holds_slot


async def test_running_whose_qemu_died_ends_failed(env: SchedEnv) -> None:
    vm_id = await _running(env)
    env.manager.kill(vm_id)
    await _restart(env)
    vm = _vm(env, vm_id)
    assert vm.state == S.FAILED and vm.reason == "QEMU exited" and not vm.holds_slot


async def test_paused_with_missing_snapshot_ends_failed(env: SchedEnv) -> None:
    keep = await _running(env)
    lost = await _running(env)
    await env.sched.pause(env.tenant_id, keep)
    paused = await env.sched.pause(env.tenant_id, lost)
    del env.manager.snapshots[(AGENT_VERSION, lost, paused.snapshot_id)]
    await _restart(env)
    assert _vm(env, keep).state == S.PAUSED
    assert _vm(env, lost).state == S.FAILED


async def test_unknown_qemu_on_the_node_is_stopped(env: SchedEnv) -> None:
    vm_id = await _running(env)
    await env.sched.delete(env.tenant_id, vm_id)
    from tests.fakes import FakeVm

    env.manager.alive["vm-stray"] = FakeVm("vm-stray", 1, "t")
    env.manager.alive[vm_id] = FakeVm(vm_id, 1, "t")
    await _restart(env)
    assert env.manager.alive == {}


async def test_slot_flag_set_for_a_live_vm_that_lost_it(env: SchedEnv) -> None:
    vm_id = await _running(env)
    quotas.release(env.store, vm_id)
    await _restart(env)
    assert _vm(env, vm_id).holds_slot


async def test_light_reconcile_fails_dead_running_vms_only(env: SchedEnv) -> None:
    dead = await _running(env)
    fine = await _running(env)
    env.manager.kill(dead)
    fixes = await reconcile.reconcile_light(env.sched)
    assert len(fixes) == 1
    assert _vm(env, dead).state == S.FAILED and _vm(env, fine).state == S.RUNNING


async def test_light_reconcile_fails_a_vm_whose_harness_went_silent(env: SchedEnv) -> None:
    silent = await _running(env)
    fine = await _running(env)
    now = env.sched.now_ms()
    env.manager.alive[silent].last_heartbeat_unix_ms = now - 31_000
    env.manager.alive[fine].last_heartbeat_unix_ms = now - 29_000
    fixes = await reconcile.reconcile_light(env.sched)
    assert len(fixes) == 1
    assert _vm(env, silent).state == S.FAILED and "silent" in (_vm(env, silent).reason or "")
    assert silent not in env.manager.alive, "its QEMU was stopped"
    assert _vm(env, fine).state == S.RUNNING
    assert quotas.in_use(env.store, env.tenant_id) == 1


async def test_reconcile_changes_nothing_on_a_consistent_store(env: SchedEnv) -> None:
    a = await _running(env)
    b = await _running(env)
    await env.sched.pause(env.tenant_id, b)
    _, fixes = await _restart(env)
    assert fixes == []
    assert _vm(env, a).state == S.RUNNING and _vm(env, b).state == S.PAUSED


async def test_start_without_a_manager_heartbeat_is_503(env: SchedEnv) -> None:
    from pal.errors import Unavailable

    env.manager.heartbeat_error = ConnectionError("no socket")
    with pytest.raises(Unavailable):
        await env.sched.start()
    await env.sched.close()
