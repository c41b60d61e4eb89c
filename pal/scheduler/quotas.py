"""THE one place for concurrent-VM quota accounting.

A slot is held by a VM row with ``holds_slot = True``; nothing else counts (the tenant's
row keeps the running count of them, and of its paused VMs and snapshot bytes, in the same
transactions: pal/store/books.py; the checks read that, not the VMs). Reserving is
all-or-nothing inside one write transaction (SQLite ``BEGIN IMMEDIATE``), so concurrent
reservations serialise and can never exceed ``max_vms``. Releasing flips the flag only if it
is set, so two paths can both try and exactly one of them frees it. Every function runs
inside the caller's transaction: the transition function's (transition.py), the only caller.
"""

from __future__ import annotations

from collections.abc import Sequence

from pal.errors import NotFound, QuotaExceeded
from pal.store import VmRecord, WriteTx
from pal.store.books import counts_as_paused

NAMED_HOLDERS = 8  # a quota error names the VMs that hold the slots, this many at most


def reserve_in(
    tx: WriteTx, tenant_id: str, *, new_vms: Sequence[VmRecord] = (), existing: Sequence[str] = ()
) -> None:
    """Reserve one slot per new VM (inserted with ``holds_slot=True``) and per existing VM id.

    Raises :class:`QuotaExceeded` (402) before changing anything if the tenant would go over.
    """
    tenant = tx.tenant(tenant_id)
    # A tenant being removed gets no new VM (its own VMs may still move on their way out).
    if tenant is None or (tenant.deleting_at is not None and new_vms):
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
    in_use = tenant.slots_used  # the tenant's books (pal/store/books.py), read under its lock
    if in_use + wanted > tenant.max_vms:
        holders = tx.slot_holders(tenant_id, NAMED_HOLDERS)
        named = ", ".join(f"{vm_id} ({state})" for vm_id, state in holders)
        more = f" and {in_use - len(holders)} more" if in_use > len(holders) else ""
        raise QuotaExceeded(
            f"tenant {tenant.name!r} is limited to max_vms={tenant.max_vms} concurrent VMs: "
            f"{in_use} in use ({named}{more}), {wanted} more requested; delete one, or pause it"
            " (`pal vm pause`: a snapshot-paused VM holds no slot)"
        )
    for vm in new_vms:
        if vm.tenant_id != tenant_id:
            raise ValueError("new VM rows must belong to the reserving tenant")
        vm.holds_slot = True
        tx.insert_vm(vm)
    for vm_id in to_flip:
        tx.set_holds_slot(vm_id, True)


def check_pause_in(tx: WriteTx, vm: VmRecord) -> None:
    """A pause makes one more paused VM: QuotaExceeded (402) past the tenant's
    ``max_paused`` (VMs being paused count)."""
    tenant = tx.tenant(vm.tenant_id)
    if tenant is None:
        raise NotFound(f"tenant {vm.tenant_id} not found")
    if tenant.max_paused is None:
        return
    paused = tenant.paused_vms - int(counts_as_paused(vm.state, vm.marker))  # the others
    if paused + 1 > tenant.max_paused:
        raise QuotaExceeded(
            f"tenant {tenant.name!r} is limited to max_paused={tenant.max_paused} paused VMs: "
            f"{paused} paused already; delete or resume one first"
        )


def check_snapshot_bytes_in(tx: WriteTx, tenant_id: str, more: int) -> None:
    """A new snapshot of about ``more`` bytes: QuotaExceeded (402) if the tenant's snapshots
    would then take more than ``max_snapshot_bytes`` (what its VMs' rows say they take)."""
    tenant = tx.tenant(tenant_id)
    if tenant is None:
        raise NotFound(f"tenant {tenant_id} not found")
    if tenant.max_snapshot_bytes is None:
        return
    used = tenant.snapshot_bytes_used
    if used + more > tenant.max_snapshot_bytes:
        gib = 1 << 30
        raise QuotaExceeded(
            f"tenant {tenant.name!r} is limited to {tenant.max_snapshot_bytes / gib:.2f} GiB of snapshots: "
            f"{used / gib:.2f} GiB kept, this one needs about {more / gib:.2f} GiB more; "
            "delete VMs or snapshots first"
        )


def release_in(tx: WriteTx, vm_id: str) -> bool:
    """Free the VM's slot if it holds one; True only for the call that actually freed it."""
    return tx.set_holds_slot(vm_id, False)


def force_in(tx: WriteTx, vm_id: str, should_hold: bool) -> bool:
    """Reconciliation only: make the flag agree with the VM's state, quota or not.

    A VM found in a slot-holding state after a crash really is using a node's resources,
    so the flag is set even if that puts the tenant over its limit (logged by the caller).
    """
    return tx.set_holds_slot(vm_id, should_hold)
