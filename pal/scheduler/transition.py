"""The ONE way a VM's lifecycle state changes (and the one way a VM row is created).

Takes the per-VM lock, checks the table in states.py, persists state + marker + reason (and
any columns that must change atomically with it), appends a status event and, when the VM
enters a state that holds no quota slot, releases the slot through quotas.py — all in one
write transaction, so a crash can never leave a state without its event or its slot books.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from pal.errors import Conflict, NotFound
from pal.scheduler import quotas, states
from pal.scheduler.states import SLOT_HOLDING, START, Marker, VmState
from pal.store import Store, VmRecord

STATUS_EVENT = "status"


class IllegalTransitionError(Conflict):
    """states.IllegalTransition surfaced as a 409 (states.py's class is not a PalError)."""

    def __init__(self, exc: states.IllegalTransition) -> None:
        super().__init__(str(exc), code="ILLEGAL_TRANSITION")
        self.frm = exc.frm
        self.to = exc.to


def _check(vm_id: str, frm: VmState | None, to: VmState) -> None:
    try:
        states.check(vm_id, frm, to)
    except states.IllegalTransition as exc:
        raise IllegalTransitionError(exc) from None


class Transitioner:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._locks: dict[str, asyncio.Lock] = {}

    def lock(self, vm_id: str) -> asyncio.Lock:
        return self._locks.setdefault(vm_id, asyncio.Lock())

    async def create(self, tenant_id: str, rows: Sequence[VmRecord], *, reason: str | None = None) -> None:
        """Insert new VM rows (START -> their state), reserving one slot each, all or nothing."""
        for row in rows:
            _check(row.vm_id, START, VmState(row.state))
        with self._store.write() as tx:
            quotas.reserve_in(tx, tenant_id, new_vms=rows)
            for row in rows:
                tx.add_event(
                    row.vm_id, tenant_id, STATUS_EVENT, to_state=row.state, marker=row.marker, reason=reason
                )

    async def transition(
        self,
        vm_id: str,
        to: VmState,
        *,
        marker: Marker = Marker.NONE,
        reason: str | None = None,
        expect: VmState | Iterable[VmState] | None = None,
        **fields: Any,
    ) -> VmRecord:
        """Move ``vm_id`` to ``to``; ``expect`` guards against a concurrent change (409)."""
        expected = {expect} if isinstance(expect, VmState) else (set(expect) if expect else None)
        async with self.lock(vm_id):
            with self._store.write() as tx:
                vm = tx.get_vm(vm_id)
                if vm is None:
                    raise NotFound(f"VM {vm_id} not found")
                frm = VmState(vm.state)
                if expected is not None and frm not in expected:
                    want = " or ".join(sorted(s.value for s in expected))
                    raise Conflict(f"VM {vm_id} is {frm.value}, expected {want}")
                _check(vm_id, frm, to)
                tx.update_vm(
                    vm_id,
                    expect_state=frm.value,
                    state=to.value,
                    marker=marker.value,
                    reason=reason,
                    **fields,
                )
                tx.add_event(
                    vm_id,
                    vm.tenant_id,
                    STATUS_EVENT,
                    from_state=frm.value,
                    to_state=to.value,
                    marker=marker.value,
                    reason=reason,
                )
                if to not in SLOT_HOLDING:
                    quotas.release_in(tx, vm_id)
                after = tx.get_vm(vm_id)
        assert after is not None
        return after
