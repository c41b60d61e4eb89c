"""Reconciliation: bring every VM row to a true state after a crash, from what the node
reports (``manager.heartbeat()``) and whether snapshots are complete
(``manager.snapshot_status``). Every fix goes through the one transition function.

``reconcile_all`` runs once at start (leader); ``reconcile_light`` runs every sweep and only
fails RUNNING VMs whose QEMU is gone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pal.errors import Unavailable
from pal.manager.models import VmActivity
from pal.scheduler import quotas
from pal.scheduler.states import SLOT_HOLDING, Marker, VmState
from pal.store import VmRecord

if TYPE_CHECKING:
    from pal.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)
S = VmState
PAUSE_MARKERS = {Marker.PAUSING.value, Marker.IDLE_PAUSING.value}


async def _snapshot_complete(sched: Scheduler, vm: VmRecord, snapshot_id: str | None) -> bool | None:
    """True/False, or None when the manager could not tell (then we change nothing)."""
    if not snapshot_id or not vm.agent_version_id:
        return False
    try:
        st = await sched.manager.snapshot_status(vm.agent_version_id, vm.vm_id, snapshot_id)
    except Exception as exc:
        log.warning("snapshot status of %s/%s unknown: %s", vm.vm_id, snapshot_id, exc)
        return None
    return st.complete


STALE_HEARTBEATS = 6  # heartbeat periods without one before a harness counts as gone (5 s x 6)


def _alive(alive: dict[str, VmActivity], vm: VmRecord) -> bool:
    a = alive.get(vm.vm_id)
    return a is not None and (a.incarnation is None or a.incarnation == vm.incarnation)


async def _fix(sched: Scheduler, vm: VmRecord, alive: dict[str, VmActivity]) -> str | None:
    """Settle one VM (caller holds its operation lock). Returns a description of the fix."""
    t = sched.transitions
    state, vid = S(vm.state), vm.vm_id
    live = vid in alive
    if state == S.DRAINING and vm.marker in PAUSE_MARKERS:
        complete = await _snapshot_complete(sched, vm, vm.snapshot_id)
        if complete is None:
            return None
        if complete:
            if live:
                await sched.stop_quietly(vid)
            idle = vm.marker == Marker.IDLE_PAUSING
            await t.transition(
                vid, S.PAUSED, reason=vm.reason, expect=S.DRAINING, paused_by="idle" if idle else "operator"
            )
            return "interrupted pause completed -> paused"
        if live:
            await t.transition(
                vid, S.RUNNING, reason="pause interrupted; still running", expect=S.DRAINING, snapshot_id=None
            )
            return "interrupted pause rolled back -> running"
        await t.transition(
            vid, S.FAILED, reason="pause interrupted and no complete snapshot", expect=S.DRAINING
        )
        return "interrupted pause, VM gone -> failed"
    if state == S.DRAINING:
        if vm.marker != Marker.DELETING and live:
            await t.transition(vid, S.RUNNING, reason="drain interrupted", expect=S.DRAINING)
            return "unknown drain -> running"
        if not await sched.stop_quietly(vid):
            return None
        await t.transition(vid, S.TERMINATED, reason="deleted", expect=S.DRAINING)
        return "interrupted delete -> terminated"
    if state == S.SPAWNING and vm.marker == Marker.RESUMING:
        if _alive(alive, vm):
            await t.transition(vid, S.RUNNING, expect=S.SPAWNING, paused_by=None)
            return "interrupted resume came up -> running"
        if live:
            await sched.stop_quietly(vid)
        await t.transition(vid, S.PAUSED, reason="resume interrupted; resumable again", expect=S.SPAWNING)
        return "interrupted resume -> paused"
    if state == S.SPAWNING:
        if _alive(alive, vm):
            await t.transition(vid, S.RUNNING, expect=S.SPAWNING)
            return "interrupted spawn came up -> running"
        if live:
            await sched.stop_quietly(vid)
        await t.transition(vid, S.FAILED, reason="control plane restarted during spawn", expect=S.SPAWNING)
        return "interrupted spawn -> failed"
    if state == S.PENDING:
        await t.transition(vid, S.FAILED, reason="control plane restarted before placement", expect=S.PENDING)
        return "pending -> failed"
    if state == S.RUNNING and not _alive(alive, vm):
        if live:  # a stale incarnation is running: it is not the VM we think it is
            await sched.stop_quietly(vid)
        await t.transition(vid, S.FAILED, reason="QEMU exited", expect=S.RUNNING)
        return "running but gone -> failed"
    if state == S.PAUSED:
        if live:
            await sched.stop_quietly(vid)  # a paused VM has no process; this one is stray
        complete = await _snapshot_complete(sched, vm, vm.snapshot_id)
        if complete is False:
            await t.transition(vid, S.FAILED, reason="its snapshot is missing or incomplete", expect=S.PAUSED)
            return "paused without a complete snapshot -> failed"
        return None
    if state in (S.FAILED, S.TERMINATED) and live:
        await sched.stop_quietly(vid)
        return f"stray QEMU of a {state.value} VM stopped"
    return None


async def reconcile_all(sched: Scheduler) -> list[str]:
    """Settle every VM; returns a log of the fixes (also logged)."""
    try:
        hb = await sched.manager.heartbeat()
    except Exception as exc:
        raise Unavailable(
            f"cannot reconcile: the runtime manager did not answer its heartbeat: {exc}"
        ) from exc
    sched.node_id = hb.node_id
    alive = {a.vm_id: a for a in hb.vms if a.alive}
    fixes: list[str] = []
    rows = sched.store.list_vms()
    known = {vm.vm_id for vm in rows}
    for vm in rows:
        async with sched.op_lock(vm.vm_id):
            fresh = sched.store.get_vm(vm.vm_id)
            if fresh is None:
                continue
            try:
                fix = await _fix(sched, fresh, alive)
            except Exception as exc:
                log.error("reconcile of %s failed: %s", vm.vm_id, exc)
                continue
        if fix:
            fixes.append(f"{vm.vm_id}: {fix}")
    for vid in sorted(set(alive) - known):
        await sched.stop_quietly(vid)
        fixes.append(f"{vid}: unknown VM on the node stopped")
    fixes.extend(fix_slots(sched))
    for f in fixes:
        log.warning("reconcile: %s", f)
    return fixes


def fix_slots(sched: Scheduler) -> list[str]:
    """Make ``holds_slot`` agree with SLOT_HOLDING for every row."""
    fixes = []
    for vm in sched.store.list_vms():
        should = S(vm.state) in SLOT_HOLDING
        if vm.holds_slot == should:
            continue
        with sched.store.write() as tx:
            changed = quotas.force_in(tx, vm.vm_id, should)
        if changed:
            fixes.append(f"{vm.vm_id}: slot {'reserved' if should else 'released'} ({vm.state})")
    return fixes


async def reconcile_light(sched: Scheduler) -> list[str]:
    """A RUNNING VM whose QEMU died, or whose harness went silent (no heartbeat for
    STALE_HEARTBEATS periods: spec's "stale after 30 s"), -> FAILED, its QEMU stopped.
    Rows are read before the heartbeat, and each is re-checked under its lock, so a VM
    that came up meanwhile is never failed."""
    rows = sched.store.list_vms(states=[S.RUNNING])
    if not rows:
        return []
    hb = await sched.manager.heartbeat()
    alive = {a.vm_id: a for a in hb.vms if a.alive}
    stale_ms = int(sched.settings.heartbeat_interval_s * STALE_HEARTBEATS * 1000)
    now = sched.now_ms()
    fixes = []
    for vm in rows:
        a = alive.get(vm.vm_id)
        silent_ms = now - a.last_heartbeat_unix_ms if a is not None and a.last_heartbeat_unix_ms else 0
        if _alive(alive, vm) and silent_ms <= stale_ms:
            continue
        reason = f"harness silent for {silent_ms // 1000} s" if silent_ms > stale_ms else "QEMU exited"
        async with sched.op_lock(vm.vm_id):
            fresh = sched.store.get_vm(vm.vm_id)
            if fresh is None or fresh.state != S.RUNNING or fresh.incarnation != vm.incarnation:
                continue
            if vm.vm_id in alive:
                await sched.stop_quietly(vm.vm_id)
            await sched.transitions.transition(vm.vm_id, S.FAILED, reason=reason, expect=S.RUNNING)
        fixes.append(f"{vm.vm_id}: running but {reason} -> failed")
        log.warning("reconcile: %s running but %s -> failed", vm.vm_id, reason)
    return fixes
