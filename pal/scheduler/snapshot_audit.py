"""Snapshots the control plane checks on their nodes, a page per sweep (docs/scale.md):

- ``audit``: a page of snapshot-paused VMs whose snapshot is checked on their node (a paused
  VM whose snapshot is gone or incomplete fails);
- ``sweep``: snapshots no VM owns any more, deleted on one node per call (one round of the
  nodes per leadership: ``again``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from pal.scheduler import nodes as nodes_mod
from pal.scheduler.deps import Deps
from pal.scheduler.states import FINAL, NEVER_STARTS, Action
from pal.store import VmRecord
from pal.store import kept as kept_rows
from pal.store.due import mapped_by_children, paused_page, vms_by_ids
from pal.wire import verbs
from pal.wire.models import Empty, SnapshotAt, VmSnapshotsDelete

log = logging.getLogger(__name__)
A = Action
ASK_AT_ONCE = 32  # nodes asked at the same time
AUDIT_PAGE = 50  # snapshot-paused VMs whose snapshot the audit checks per sweep
SWEEP_PAGE = 100  # VMs of a node's snapshot list the sweep looks at per tick


async def snapshot_complete(d: Deps, vm: VmRecord, snapshot_id: str | None) -> bool | None:
    """True/False, or None when the manager could not tell (then we change nothing)."""
    if not snapshot_id or not vm.agent_version_id:
        return False
    try:
        at = SnapshotAt(agent_version_id=vm.agent_version_id, vm_id=vm.vm_id, snapshot_id=snapshot_id)
        st = await d.node(vm).call(verbs.SNAPSHOT_STATUS, at)
    except Exception as exc:
        log.warning("snapshot status of %s/%s unknown: %s", vm.vm_id, snapshot_id, exc)
        return None
    return st.complete


@dataclass
class SnapshotChecks:
    d: Deps
    _audit_after: str = ""  # the audit's place: the last VM id it checked
    _sweep_turn: int = 0  # the sweep's next node (this leadership's round)
    # (node, agent version, vm id) the node listed, not looked at yet
    _sweep_queue: list[tuple[str, str, str]] = field(default_factory=list)

    async def audit(self) -> list[str]:
        """A page of snapshot-paused VMs (by id, from where the last page ended; round and
        round): each whose snapshot its node says is missing or incomplete fails. A node
        that does not answer is asked again on the next round."""
        page = paused_page(self.d.store, self._audit_after, AUDIT_PAGE)
        self._audit_after = page[-1].vm_id if len(page) == AUDIT_PAGE else ""
        nodes = self.d.nodes
        asked = [
            vm for vm in page if nodes.state_of(vm.node_id) != nodes_mod.LOST and not nodes.silent(vm.node_id)
        ]
        gate = asyncio.Semaphore(ASK_AT_ONCE)

        async def complete(vm: VmRecord) -> bool | None:
            async with gate:
                return await snapshot_complete(self.d, vm, vm.snapshot_id)

        answers = await asyncio.gather(*(complete(vm) for vm in asked))
        fixes = []
        for vm in (vm for vm, ok in zip(asked, answers, strict=True) if ok is False):
            async with self.d.locks.op_lock(vm.vm_id):
                fresh = self.d.store.get_vm(vm.vm_id)
                if fresh is None or (fresh.state, fresh.marker, fresh.snapshot_id) != (
                    vm.state,
                    vm.marker,
                    vm.snapshot_id,
                ):
                    continue
                if await snapshot_complete(self.d, fresh, fresh.snapshot_id) is not False:
                    continue
                await self.d.transitions.transition(
                    vm.vm_id, A.LOSE, reason="its snapshot is missing or incomplete"
                )
            fixes.append(f"{vm.vm_id}: paused without a complete snapshot -> failed")
            log.warning("snapshot audit: %s", fixes[-1])
        return fixes

    def again(self) -> None:
        """A new leadership: one more round of the snapshot sweep."""
        self._sweep_turn, self._sweep_queue = 0, []

    async def sweep(self) -> list[str]:
        """Delete snapshots no VM owns any more on one node (the next one at each call, one
        round of the nodes per leadership: what a crash left; SWEEP_PAGE of a node's list
        a call, its next page at the next): those of terminated VMs (a
        delete cut short by a crash or an unreachable node) and of VMs whose row is gone (a
        removed tenant), on that node and in S3. Snapshots a live fork child maps stay.

        The node's list is read *before* the VM rows, so a VM made meanwhile (its row exists
        before its first snapshot) is never taken for an orphan; the rows read are those
        the node names."""
        if not self._sweep_queue:
            ids = self.d.nodes.reachable_ids()
            if self._sweep_turn >= len(ids):
                return []  # one round per leadership (sweep_again)
            node_id = ids[self._sweep_turn]
            self._sweep_turn += 1
            try:
                owners = list((await self.d.nodes.client(node_id).call(verbs.SNAPSHOT_OWNERS, Empty())).vms)
            except Exception as exc:
                log.warning("snapshot sweep: node %s did not list its snapshots: %s", node_id, exc)
                return []
            self._sweep_queue = [(node_id, av, vm_id) for av, vm_id in owners]
        page, self._sweep_queue = self._sweep_queue[:SWEEP_PAGE], self._sweep_queue[SWEEP_PAGE:]
        if not page:
            return []  # the node holds no snapshots
        node_id = page[0][0]
        rows = vms_by_ids(self.d.store, {vm_id for _, _, vm_id in page})
        orphans = [(av, v) for _, av, v in page if v not in rows or rows[v].state in FINAL]
        owned = {v for _, v in orphans}
        kept_rows_ = kept_rows.of_vms(self.d.store, owned)
        kept = {k.source_vm_id for k in kept_rows_}
        mapped = sorted(
            mapped_by_children(self.d.store, owned, NEVER_STARTS) | {k.snapshot_id for k in kept_rows_}
        )
        fixes = []
        for agent_version_id, vm_id in orphans:
            vm = rows.get(vm_id)
            try:
                doomed = VmSnapshotsDelete(agent_version_id=agent_version_id, vm_id=vm_id, keep=mapped)
                gone = (await self.d.nodes.client(node_id).call(verbs.DELETE_VM_SNAPSHOTS, doomed)).deleted
            except Exception as exc:
                log.warning("snapshot sweep: could not delete those of %s on %s: %s", vm_id, node_id, exc)
                continue
            if vm is not None and vm.snapshot_bytes and vm_id not in kept:  # a kept one stays counted
                self.d.store.update_vm(vm_id, snapshot_bytes=0)
            if gone:
                fixes.append(f"{vm_id}: {len(gone)} snapshot(s) of a {'terminated' if vm else 'removed'} VM")
        for f in fixes:
            log.warning("sweep: %s", f)
        return fixes
