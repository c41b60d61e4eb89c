"""The leader's view of the VMs that use a node (a slot: running, live-paused, or in a
transition), kept in memory so that placement and the reconciler never read the fleet
(docs/scale.md):

- placement weighs each node's load (:meth:`LiveView.loads`: guest RAM held, VMs, VMs per
  tenant) without reading a row;
- the reconciler compares each node's report with what the view expects there
  (:meth:`LiveView.on_node`) and reads the rows of the VMs that differ only.

It is read from the store once (:meth:`load`: the slot-holding rows, ``ix_vms_slots``) and
then follows every committed change of a VM's lifecycle: the transition function, the one
writer of those columns, hands it each row it wrote (:meth:`apply`). Only the leader
changes VMs, so while it leads its view is the store's; a replica that takes over loads
it again (reconcile.py); a scheduler that places before it took over loads it then.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pal.scheduler import placement
from pal.store import Store, VmRecord
from pal.store.due import slot_rows


@dataclass(frozen=True)
class LiveVm:
    """One VM using a node, as its last committed row says."""

    vm_id: str
    tenant_id: str
    node_id: str | None
    state: str
    marker: str
    incarnation: int
    held_mib: int  # what placement counts against its node (placement.held_memory_mib)
    since: float  # monotonic: when the view last saw it change


class LiveView:
    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self.vms: dict[str, LiveVm] = {}
        self._by_node: dict[str | None, dict[str, LiveVm]] = {}
        self._loads: dict[str, placement.NodeLoad] = {}
        self.loaded = False

    def load(self, rows: Iterable[VmRecord] | None = None) -> int:
        """Read the slot-holding rows (or take ``rows``); the number of VMs it holds."""
        self.vms, self._by_node, self._loads = {}, {}, {}
        for vm in slot_rows(self._store) if rows is None else rows:
            self._add(vm)
        self.loaded = True
        return len(self.vms)

    async def aload(self, rows: Iterable[VmRecord]) -> int:
        """:meth:`load` of ``rows``, letting the event loop turn every few thousand (10^5
        of them at 10^6 records: seconds of work the lease's pulse must not wait for)."""
        self.vms, self._by_node, self._loads = {}, {}, {}
        for i, vm in enumerate(rows):
            if i % 5000 == 0:
                await asyncio.sleep(0)
            self._add(vm)
        self.loaded = True
        return len(self.vms)

    def reset(self) -> None:
        """Forget it all (this replica no longer leads: others change VMs now)."""
        self.vms, self._by_node, self._loads = {}, {}, {}
        self.loaded = False

    def apply(self, vm: VmRecord) -> None:
        """A row as a committed transaction left it."""
        if not self.loaded:
            return
        self._drop(vm.vm_id)
        self._add(vm)

    def hold(self, vm: VmRecord, node_id: str) -> None:
        """Count ``vm`` on ``node_id`` now, before the transaction that places it commits:
        placement holds its lock only this long, and the next placement sees the room it
        took. The placing operation puts the view back (``apply`` of the row as it was,
        or ``forget`` of a row never written) if that transaction fails."""
        self._ensure()
        self.apply(dataclasses.replace(vm, node_id=node_id, holds_slot=True, state="spawning", marker=""))

    def forget(self, vm_id: str) -> None:
        self._drop(vm_id)

    def _ensure(self) -> None:
        if not self.loaded:  # a scheduler that never took over (`pal up` before its first tick, tests)
            self.load()

    def _add(self, vm: VmRecord) -> None:
        if not vm.holds_slot:  # the books' word, as placement.loads takes it
            return
        live = LiveVm(
            vm.vm_id,
            vm.tenant_id,
            vm.node_id,
            vm.state,
            vm.marker,
            vm.incarnation,
            placement.held_memory_mib(vm),
            self._clock(),
        )
        self.vms[vm.vm_id] = live
        self._by_node.setdefault(vm.node_id, {})[vm.vm_id] = live
        if vm.node_id:
            self._loads.setdefault(vm.node_id, placement.NodeLoad()).add(vm.tenant_id, live.held_mib)

    def _drop(self, vm_id: str) -> None:
        old = self.vms.pop(vm_id, None)
        if old is None:
            return
        on_node = self._by_node.get(old.node_id, {})
        on_node.pop(vm_id, None)
        if not on_node:
            self._by_node.pop(old.node_id, None)
        load = self._loads.get(old.node_id or "")
        if load is not None:
            load.remove(old.tenant_id, old.held_mib)
            if load.vms <= 0:
                self._loads.pop(old.node_id or "", None)

    def on_node(self, node_id: str | None) -> dict[str, LiveVm]:
        """The VMs the view expects on ``node_id`` (None: those placed nowhere yet)."""
        return dict(self._by_node.get(node_id, {}))

    def node_ids(self) -> set[str]:
        return {n for n in self._by_node if n is not None}

    def loads(self) -> dict[str, placement.NodeLoad]:
        """What each node holds, as placement counts it (a copy: the caller may add to it)."""
        self._ensure()
        return {n: load.copy() for n, load in self._loads.items()}
