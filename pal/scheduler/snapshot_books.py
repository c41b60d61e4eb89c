"""A VM's snapshots as the scheduler keeps track of them: which ones live fork children
still map (so retention keeps them), what they take (the tenant's snapshot limit), making
one restorable on other nodes (S3), and releasing them when the VM is gone.

Decisions the spec leaves open: delete of a paused VM releases its pause snapshot right
away (and fork snapshots its children mapped), except while a live fork child still maps
one; failures are left to retention and to the sweep (reconcile.py). Older snapshots of the
VM are left to the manager's retention.
"""

from __future__ import annotations

import logging

from pal.scheduler import nodes as nodes_mod
from pal.scheduler import placement
from pal.scheduler.deps import Deps
from pal.scheduler.states import FINAL, NEVER_STARTS
from pal.store import VmRecord
from pal.store import kept as kept_rows
from pal.wire import verbs
from pal.wire.models import SnapshotAt, SnapshotResult, VmSnapshots, VmSnapshotsDelete

log = logging.getLogger(__name__)


class SnapshotBooks:
    def __init__(self, deps: Deps) -> None:
        self.d = deps

    def protected(self, vm: VmRecord) -> list[str]:
        """Snapshots of ``vm`` that retention must keep: those live fork children still map,
        and the tenant's kept snapshots of it (pal/scheduler/kept.py)."""
        children = self.d.store.list_vms(parent_vm_id=vm.vm_id)
        mapped = {c.mem_snapshot_id for c in children if c.mem_snapshot_id and c.state not in NEVER_STARTS}
        return sorted(mapped | self.kept_of(vm.vm_id))

    def kept_of(self, *vm_ids: str) -> set[str]:
        """The kept snapshots of these VMs: never released with them, nor swept."""
        return {k.snapshot_id for k in kept_rows.of_vms(self.d.store, vm_ids)}

    @staticmethod
    def estimate(vm: VmRecord) -> int:
        """About what a new snapshot of ``vm`` takes, before it exists: its RAM (the disk
        is a reflink whose own bytes are what the guest wrote since)."""
        return int(placement.vm_memory_mib(vm)) << 20

    def _stamp_bytes(self, vm_id: str, value: int | None, taken_on: VmRecord | None = None) -> None:
        """Record the bytes the VM's snapshots take, and (``taken_on``: its row when they
        were measured on its node) that this node holds some: a delete asks it."""
        if value is None:
            return
        fields: dict[str, object] = {"snapshot_bytes": value}
        known = taken_on.snapshot_nodes if taken_on is not None else None
        if taken_on is not None and taken_on.node_id and known is not None and taken_on.node_id not in known:
            fields["snapshot_nodes"] = sorted({*known, taken_on.node_id})
        try:
            self.d.store.update_vm(vm_id, **fields)
        except Exception as exc:
            log.warning("could not record the snapshot bytes of %s: %s", vm_id, exc)

    async def record_bytes(self, vm_id: str, taken: SnapshotResult) -> None:
        """After a snapshot: what the node said the VM's snapshots take now (asked again
        only when it could not tell)."""
        if taken.stored_bytes is None:
            await self.refresh_bytes(vm_id)
        else:
            self._stamp_bytes(vm_id, taken.stored_bytes)

    async def refresh_bytes(self, vm_id: str) -> None:
        """Record what the VM's snapshots take on its node now (after a snapshot, a
        retention or a delete); best effort."""
        vm = self.d.store.get_vm(vm_id)
        if vm is None or not vm.agent_version_id or not vm.node_id:
            return
        try:
            at = VmSnapshots(agent_version_id=vm.agent_version_id, vm_id=vm_id)
            snaps = (await self.d.node(vm).call(verbs.LIST_SNAPSHOTS, at)).snapshots
        except Exception as exc:
            log.warning("could not measure the snapshots of %s: %s", vm_id, exc)
            return
        self._stamp_bytes(vm_id, sum(x.stored_bytes for x in snaps), vm if snaps else None)

    async def publish(self, vm: VmRecord, node_id: str, snapshot_id: str) -> None:
        """Make ``vm``'s snapshot restorable on other nodes: S3 must hold it. Asks the node
        that took it to upload it now; when that node is lost, S3's copy (uploaded after the
        pause) is all there is, and the restoring node says so if it is missing."""
        nodes = self.d.nodes
        if nodes.state_of(node_id) == nodes_mod.LOST:
            return
        try:
            at = SnapshotAt(
                agent_version_id=vm.agent_version_id or "", vm_id=vm.vm_id, snapshot_id=snapshot_id
            )
            await nodes.client(node_id).call(verbs.ENSURE_UPLOADED, at)
        except Exception as exc:
            log.warning(
                "could not publish snapshot %s of %s from %s: %s", snapshot_id, vm.vm_id, node_id, exc
            )

    async def release(self, vm: VmRecord) -> None:
        """Delete the snapshots a terminated VM leaves, locally and in S3, except those a
        live VM still needs: a snapshot its live fork children map stays until the last of
        them goes (that child's delete releases it, the parent being gone). When this VM is
        a fork child whose parent is gone, the parent's snapshot it mapped goes too unless
        another live child maps it. Best effort on every node that answers; what is left
        (an unreachable node, a crash) is found by the sweep (reconcile.py)."""
        if not vm.agent_version_id:
            return
        store = self.d.store
        live = [v for v in store.list_vms(parent_vm_id=vm.vm_id) if v.state not in NEVER_STARTS]
        kept = self.kept_of(vm.vm_id)
        keep = sorted({c.mem_snapshot_id for c in live if c.mem_snapshot_id} | kept)
        await self._delete_of(vm.agent_version_id, vm.vm_id, keep, self._holders(vm))
        if kept:
            await self.refresh_bytes(vm.vm_id)  # what its kept snapshots take stays counted
        else:
            self._stamp_bytes(vm.vm_id, 0 if not keep else None)
        if not (vm.parent_vm_id and vm.mem_snapshot_id) or self.kept_of(vm.parent_vm_id) & {
            vm.mem_snapshot_id
        }:
            return  # no parent's snapshot to let go, or one the tenant keeps
        parent = store.get_vm(vm.parent_vm_id)
        if parent is not None and parent.state not in FINAL:
            return
        users = [
            v
            for v in store.list_vms(mem_snapshot_id=vm.mem_snapshot_id)
            if v.state not in NEVER_STARTS and v.vm_id != vm.vm_id
        ]
        if users:
            return
        try:
            at = SnapshotAt(
                agent_version_id=vm.agent_version_id, vm_id=vm.parent_vm_id, snapshot_id=vm.mem_snapshot_id
            )
            await self.d.node(vm).call(verbs.DELETE_SNAPSHOT, at)
        except Exception as exc:
            log.warning("could not delete snapshot %s of %s: %s", vm.mem_snapshot_id, vm.parent_vm_id, exc)
        await self.refresh_bytes(vm.parent_vm_id)

    def _holders(self, vm: VmRecord) -> list[str]:
        """The nodes that may hold the VM's snapshots: those it took them on, and its own
        (every node, for a VM from before that was kept: asking all of them costs a delete
        a call per node, docs/scale.md)."""
        reachable = self.d.nodes.reachable_ids()
        if vm.snapshot_nodes is None:
            return reachable
        return [n for n in reachable if n in {*vm.snapshot_nodes, vm.node_id}]

    async def _delete_of(self, agent_version_id: str, vm_id: str, keep: list[str], nodes: list[str]) -> None:
        """Every snapshot of one VM but ``keep``, on ``nodes`` (a VM's older snapshots may
        sit on a node it ran on before) and in S3."""
        for node_id in nodes:
            try:
                doomed = VmSnapshotsDelete(agent_version_id=agent_version_id, vm_id=vm_id, keep=keep)
                await self.d.nodes.client(node_id).call(verbs.DELETE_VM_SNAPSHOTS, doomed)
            except Exception as exc:
                log.warning("could not delete the snapshots of %s on %s: %s", vm_id, node_id, exc)
