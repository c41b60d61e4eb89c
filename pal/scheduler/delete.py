"""Delete: a VM's QEMU stopped and its snapshots released (snapshot_books.py); and the
removal of a tenant `pal tenants rm` marked, VM by VM.

Decision the spec leaves open: a delete whose stop fails answers 500 and leaves the VM
DRAINING (scheduler:deleting); a repeated delete, or reconciliation, retries the stop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pal import failpoints
from pal.errors import BackendError
from pal.scheduler import nodes as nodes_mod
from pal.scheduler import states
from pal.scheduler.deps import Deps, as_pal
from pal.scheduler.snapshot_books import SnapshotBooks
from pal.scheduler.states import Action, VmState
from pal.scheduler.transition import Audit
from pal.scheduler.volumes import Volumes
from pal.store import VmRecord
from pal.store import kept as kept_rows
from pal.store import volumes as volume_rows
from pal.wire import verbs
from pal.wire.models import StopVm

log = logging.getLogger(__name__)
S, A = VmState, Action


@dataclass(frozen=True)
class Deleting:
    d: Deps
    books: SnapshotBooks
    volumes: Volumes

    async def delete(self, tenant_id: str, vm_id: str) -> VmRecord:
        """Prerequisites: the tenant's VM (404); DELETE allowed (every state but
        terminated and draining for a pause), or already draining for a delete (its stop is
        retried), or terminated (answered as it is).
        Success: terminated; its snapshots released, but those live fork children map.
        Failure: 500 when the node does not stop it; it stays draining (scheduler:deleting)."""
        self.d.own(tenant_id, vm_id)
        return await self.delete_vm(vm_id)

    async def delete_vm(self, vm_id: str, *, audit: Audit | None = None, **fields: Any) -> VmRecord:
        """The delete of any VM (the tenant's delete, a removed tenant, a shutdown, a
        lifetime's end). ``audit`` and ``fields`` go with the transition to terminated."""
        d = self.d
        d.telemetry.forget(vm_id)
        async with d.locks.op_lock(vm_id):
            vm = d.reload(vm_id)
            if vm.state == S.TERMINATED:
                return vm  # deleting twice answers the same
            # A delete whose stop failed left the VM draining for deletion: finish that one.
            if not states.allowed(S(vm.state), A.FINISH_DELETE, vm.marker):
                to = states.check(vm_id, vm.state, A.DELETE, vm.marker)
                reason = "deleted" if to == S.TERMINATED else "deleting"
                end = {"audit": audit, **fields} if to == S.TERMINATED else {}
                vm = await d.transitions.transition(vm_id, A.DELETE, reason=reason, **end)
            if vm.state == S.DRAINING:
                failpoints.hit("delete:draining")
                try:
                    if d.nodes.state_of(vm.node_id) != nodes_mod.LOST:  # a lost node stops it on return
                        await d.node(vm).call(verbs.STOP, StopVm(vm_id=vm_id))
                except Exception as exc:
                    # Stays DRAINING+deleting: a repeated delete or reconciliation retries.
                    raise BackendError(f"stopping VM {vm_id} failed: {as_pal(exc).message}") from exc
                failpoints.hit("delete:stopped")
                vm = await d.transitions.transition(
                    vm_id, A.FINISH_DELETE, reason="deleted", audit=audit, **fields
                )
        if vm.state == S.TERMINATED:
            volume_rows.remove_mounts(d.store, vm_id)  # its volumes are no longer mounted
        await self.books.release(vm)
        return vm

    async def purge_deleted_tenants(self) -> list[str]:
        """`pal tenants rm` marked a tenant (its keys refused since): delete its VMs and
        their snapshots (its kept ones too), its volumes, then the tenant and its rows.
        Leader only; resumed after a crash. Returns the tenants removed."""
        store = self.d.store
        done = []
        for tenant in store.deleting_tenants():
            kept_rows.remove_of_tenant(store, tenant.id)  # so the releases below delete them
            for vm in store.list_vms(tenant_id=tenant.id):
                try:
                    if vm.state == S.TERMINATED:
                        await self.books.release(vm)
                    else:
                        await self.delete_vm(vm.vm_id)
                except Exception as exc:
                    log.warning(
                        "deleting VM %s of removed tenant %s: %s (retried)", vm.vm_id, tenant.name, exc
                    )
            await self.volumes.purge(tenant.id)
            if store.delete_tenant(tenant.id):
                log.info("tenant %s (%s) deleted with its VMs and snapshots", tenant.name, tenant.id)
                done.append(tenant.id)
        return done
