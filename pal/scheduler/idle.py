"""The idle sweeper: suspends RUNNING VMs that saw no activity for ``idle_timeout_secs``.

Each sweep polls the node heartbeat itself (the reference reads a 30 s-old node heartbeat
and trails the timeout by up to ~40 s; polling here bounds the lag to one sweep interval
plus the pause). A VM is idle when it is RUNNING, has ``idle_timeout_secs > 0``, no exec is
active (guest-reported or in flight through this scheduler), and
``now - max(guest last activity, host-side last request) > timeout``.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

from pal.manager.models import VmActivity
from pal.scheduler.states import VmState
from pal.store import VmRecord

if TYPE_CHECKING:
    from pal.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


def idle_for_ms(vm: VmRecord, activity: VmActivity | None, now_ms: int) -> int:
    guest = activity.last_activity_unix_ms if activity else 0
    return now_ms - max(guest, vm.last_activity_unix_ms)


class IdleSweeper:
    def __init__(self, scheduler: Scheduler) -> None:
        self.sched = scheduler

    def _is_idle(self, vm: VmRecord, activity: VmActivity | None) -> bool:
        if vm.state != VmState.RUNNING or vm.idle_timeout_secs <= 0:
            return False
        if activity is None or not activity.alive:
            return False  # not ours to judge: the reconciler handles VMs that are gone
        if activity.has_active_exec or self.sched.inflight.get(vm.vm_id, 0):
            return False
        return idle_for_ms(vm, activity, self.sched.now_ms()) > vm.idle_timeout_secs * 1000

    def _recheck(self, activity: VmActivity | None, vm: VmRecord) -> bool:
        return self._is_idle(vm, activity)

    async def sweep(self) -> list[str]:
        """One tick: suspend every idle VM; returns the ids suspended."""
        candidates = [
            vm for vm in self.sched.store.list_vms(states=[VmState.RUNNING]) if vm.idle_timeout_secs > 0
        ]
        if not candidates:
            return []
        hb = await self.sched.manager.heartbeat()
        by_id = {a.vm_id: a for a in hb.vms}
        suspended = []
        for vm in candidates:
            activity = by_id.get(vm.vm_id)
            if not self._is_idle(vm, activity):
                continue
            try:
                # Re-checked under the VM's operation lock against the fresh row, so a request
                # that arrived since the heartbeat keeps the VM running.
                done = await self.sched.idle_pause(
                    vm.vm_id, still_idle=functools.partial(self._recheck, activity)
                )
            except Exception as exc:
                log.warning("idle suspend of %s failed: %s", vm.vm_id, exc)
                continue
            if done is not None:
                log.info("suspended idle VM %s", vm.vm_id)
                suspended.append(vm.vm_id)
        return suspended
