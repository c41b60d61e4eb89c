"""Lifetimes (docs/lifecycle.md, "Lifetime"): a VM scheduled with ``lifetimeSecs`` ends that
long after its schedule, busy or idle, the way ``onLifetimeEnd`` says:

- ``delete``: it is deleted, whatever its state (a paused VM too);
- ``pause``: a running or live-paused VM is snapshot-paused, as an operator's pause (never
  woken by a request; ``resume`` brings it back, then without a lifetime until it is given
  a new one), whatever the tenant's paused-VM and snapshot limits; a paused VM stays paused.

The end is a deadline in the VM's row (``lifetime_ends_at``), never a timer in memory, and
the leader's sweep (background.py, with the idle sweep) acts on the rows past it: a restart
or a failover finds them in the store. Each end leaves a ``lifetime_ended`` audit event,
written in the transaction of the VM's last transition (transition.Audit: a client that sees
it terminated or paused sees the event too); a VM in a transition (spawning, draining) is
taken at the next sweep. ``PUT .../lifetime``
moves the deadline (``lifetime_changed`` event). Fork children inherit the source's
lifetime, counted from the fork.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from pal.errors import Conflict
from pal.scheduler import states
from pal.scheduler.delete import Deleting
from pal.scheduler.deps import Deps
from pal.scheduler.pause_resume import LIFETIME_REASON, PauseResume
from pal.scheduler.states import Action, VmState
from pal.scheduler.transition import Audit
from pal.spec import LifetimeUpdate
from pal.store import VmRecord, utcnow
from pal.store.paging import lifetime_over

log = logging.getLogger(__name__)
S, A = VmState, Action
ENDED_EVENT = "lifetime_ended"
CHANGED_EVENT = "lifetime_changed"


def ends_at(created_at: datetime, lifetime_secs: int) -> datetime | None:
    """The deadline of a lifetime counted from ``created_at`` (0: none)."""
    return created_at + timedelta(seconds=lifetime_secs) if lifetime_secs > 0 else None


def lifetime_secs(vm: VmRecord) -> int | None:
    """The VM's lifetime in seconds from its schedule, as GET shows it (None: none)."""
    if vm.lifetime_ends_at is None:
        return None
    return round((vm.lifetime_ends_at - vm.created_at).total_seconds())


def inherited_end(src: VmRecord, now: datetime) -> datetime | None:
    """A fork child's deadline: the source's lifetime, counted from the fork."""
    secs = lifetime_secs(src)
    return ends_at(now, max(secs, 1)) if secs is not None else None


@dataclass(frozen=True)
class Lifetimes:
    d: Deps
    pauses: PauseResume
    deleting: Deleting

    async def set_lifetime(self, tenant_id: str, vm_id: str, upd: LifetimeUpdate) -> VmRecord:
        """PUT .../lifetime. Prerequisites: the tenant's VM (404), not terminated (409).
        Success: the new deadline stored (a deadline already past ends the VM at the next
        sweep) and a ``lifetime_changed`` event."""
        d = self.d
        d.own(tenant_id, vm_id)
        async with d.locks.op_lock(vm_id):
            vm = d.reload(vm_id)
            if vm.state == S.TERMINATED:
                raise Conflict(f"VM {vm_id} is terminated")
            if upd.lifetime_secs is not None:
                new_end = ends_at(vm.created_at, upd.lifetime_secs)
            else:
                base = vm.lifetime_ends_at or utcnow()
                new_end = base + timedelta(seconds=upd.extend_secs or 0)
            on_end = upd.on_lifetime_end or vm.on_lifetime_end
            with d.store.write() as tx:
                tx.update_vm(vm_id, lifetime_ends_at=new_end, on_lifetime_end=on_end)
                vm.lifetime_ends_at = new_end
                tx.add_event(
                    vm_id,
                    vm.tenant_id,
                    CHANGED_EVENT,
                    reason="lifetime changed",
                    details={"lifetimeSecs": lifetime_secs(vm), "onLifetimeEnd": on_end},
                )
            return d.reload(vm_id)

    async def sweep(self) -> list[str]:
        """One tick (leader only): end every VM whose lifetime is over; the ids ended."""
        ended = []
        for vm in lifetime_over(self.d.store, utcnow()):
            try:
                if await self._end(vm):
                    ended.append(vm.vm_id)
            except Exception as exc:
                log.warning("ending the lifetime of %s failed (retried): %s", vm.vm_id, exc)
        return ended

    async def _end(self, vm: VmRecord) -> bool:
        """End one VM as its ``onLifetimeEnd`` says; False: not now (in a transition).
        The ``lifetime_ended`` event is written with the VM's last transition, so whoever
        sees it terminated (or paused) by its lifetime sees the event too."""
        d, vm_id = self.d, vm.vm_id
        st = S(vm.state)

        def ended(done: str) -> Audit:
            details = {"onLifetimeEnd": vm.on_lifetime_end, "action": done, "lifetimeSecs": lifetime_secs(vm)}
            return Audit(ENDED_EVENT, f"lifetime ended ({vm.on_lifetime_end})", details, from_state=st.value)

        if vm.on_lifetime_end == "delete":
            if not (
                states.allowed(st, A.DELETE, vm.marker) or states.allowed(st, A.FINISH_DELETE, vm.marker)
            ):
                return False
            await self.deleting.delete_vm(vm_id, audit=ended("deleted"), lifetime_ends_at=None)
            done = "deleted"
        else:
            async with d.locks.op_lock(vm_id):
                vm = d.reload(vm_id)
                st = S(vm.state)
                if states.allowed(st, A.PAUSE, vm.marker):
                    await self.pauses.pause_locked(
                        vm_id, A.PAUSE, reason=LIFETIME_REASON, audit=ended("paused"), lifetime_ends_at=None
                    )
                    done = "paused"
                elif st in (S.PAUSED, S.FAILED, S.TERMINATED):
                    done = "none"  # already stopped: it stays as it is
                    event = ended(done)
                    with d.store.write() as tx:
                        tx.update_vm(vm_id, lifetime_ends_at=None)
                        tx.add_event(
                            vm_id, vm.tenant_id, event.kind, from_state=st.value, reason=event.reason,
                            details=event.details,
                        )  # fmt: skip
                else:
                    return False
        log.info("lifetime of VM %s ended: %s", vm_id, done)
        return True
