"""THE one place for concurrent-VM quota accounting.

A slot is held by a VM row with ``holds_slot = True``; nothing else counts. Reserving is
all-or-nothing inside one write transaction (SQLite ``BEGIN IMMEDIATE``), so concurrent
reservations serialise and can never exceed ``max_vms``. Releasing flips the flag only if it
is set, so the RPC path and reconciliation can both try and exactly one of them frees it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pal.errors import NotFound, QuotaExceeded
from pal.store import Store, VmRecord, WriteTx

log = logging.getLogger(__name__)


def reserve_in(
    tx: WriteTx, tenant_id: str, *, new_vms: Sequence[VmRecord] = (), existing: Sequence[str] = ()
) -> None:
    """Reserve one slot per new VM (inserted with ``holds_slot=True``) and per existing VM id.

    Raises :class:`QuotaExceeded` (402) before changing anything if the tenant would go over.
    """
    tenant = tx.tenant(tenant_id)
    if tenant is None:
        raise NotFound(f"tenant {tenant_id} not found")
    # An existing VM that already holds its slot (a retried resume) needs no new one.
    to_flip = []
    for vm_id in existing:
        vm = tx.get_vm(vm_id)
        if vm is None or vm.tenant_id != tenant_id:
            raise NotFound(f"VM {vm_id} not found")
        if not vm.holds_slot:
            to_flip.append(vm_id)
    wanted = len(new_vms) + len(to_flip)
    in_use = tx.count_slots(tenant_id)
    if in_use + wanted > tenant.max_vms:
        raise QuotaExceeded(
            f"tenant {tenant.name!r} is limited to max_vms={tenant.max_vms} concurrent VMs: "
            f"{in_use} in use, {wanted} more requested"
        )
    for vm in new_vms:
        if vm.tenant_id != tenant_id:
            raise ValueError("new VM rows must belong to the reserving tenant")
        vm.holds_slot = True
        tx.insert_vm(vm)
    for vm_id in to_flip:
        tx.set_holds_slot(vm_id, True)


def reserve(
    store: Store, tenant_id: str, *, new_vms: Sequence[VmRecord] = (), existing: Sequence[str] = ()
) -> None:
    with store.write() as tx:
        reserve_in(tx, tenant_id, new_vms=new_vms, existing=existing)


def release_in(tx: WriteTx, vm_id: str) -> bool:
    return tx.set_holds_slot(vm_id, False)


def release(store: Store, vm_id: str) -> bool:
    """Free the VM's slot if it holds one; True only for the call that actually freed it."""
    with store.write() as tx:
        return release_in(tx, vm_id)


def in_use(store: Store, tenant_id: str) -> int:
    return store.count_slots(tenant_id)


def force_in(tx: WriteTx, vm_id: str, should_hold: bool) -> bool:
    """Reconciliation only: make the flag agree with the VM's state, quota or not.

    A VM found in a slot-holding state after a crash really is using a node's resources,
    so the flag is set even if that puts the tenant over its limit (logged by the caller).
    """
    return tx.set_holds_slot(vm_id, should_hold)
