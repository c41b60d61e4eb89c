"""Stop: a VM leaves this node. Its QEMU is killed (or, parked, discarded), whatever
watched it forgets it, and what it held besides its QEMU is freed: its gateway state and
network namespace, its uid, its files."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from pal.ids import validate_id
from pal.manager.fork import ForkMemory
from pal.manager.parked import Parking
from pal.manager.vm import LiveVm, VmRegistry
from pal.manager.vmnet import VmNetworking
from pal.vmm.jail import Jail


class VmFiles:
    """What a VM holds besides its QEMU (parked.ParkingHost)."""

    def __init__(self, registry: VmRegistry, net: VmNetworking, jail: Jail) -> None:
        self.registry = registry
        self.net = net
        self.jail = jail

    async def free_vm_files(self, vm_id: str, slot: str | None = None) -> dict[str, Any] | None:
        """Gateway state, namespace, uid, files of ``vm_id``'s slot (``slot``: that one, as
        the VM being stopped held it); returns the VM's final egress counters."""
        slot = slot or self.registry.slots.get(validate_id(vm_id, "vm_id"))
        if slot is None:  # nothing of it on this node but, maybe, gateway state
            return await self.net.unregister(vm_id)
        counters = await self.net.release(vm_id, slot)
        self.jail.release(slot)
        with contextlib.suppress(OSError):
            shutil.rmtree(self.registry.slot_dir(slot))
        self.registry.slots.release(vm_id, slot)
        return counters


class Stopper:
    def __init__(
        self,
        registry: VmRegistry,
        files: VmFiles,
        parking: Parking,
        forks: ForkMemory,
        watchers: Sequence[Callable[[str], object]],
    ) -> None:
        self.registry, self.files, self.parking, self.forks = registry, files, parking, forks
        self.watchers = watchers  # what watches a live VM forgets it: metrics, ports, waits, live

    def runs_other_incarnation(self, vm_id: str, incarnation: int) -> bool:
        """A stop order for ``incarnation`` must not stop a newer one (stray cleanup)."""
        lv = self.registry.vms.get(vm_id)
        return lv is not None and lv.incarnation != incarnation

    def forget(self, vm_id: str) -> LiveVm | None:
        """Take the VM out of the live ones (and everything that watches them)."""
        for forget in self.watchers:
            forget(vm_id)
        return self.registry.vms.pop(vm_id, None)

    async def stop(self, vm_id: str) -> dict[str, Any] | None:
        """Kill the VM and free its files and network; returns its final egress counters."""
        lv = self.forget(vm_id)
        if lv is not None:
            await lv.channel.close()
            await lv.qemu.kill()
            if lv.mem_snapshot_id:
                await self.forks.unmap(lv.mem_snapshot_id)
            return await self.files.free_vm_files(vm_id, lv.slot)
        if await self.parking.discard(vm_id):
            return None
        return await self.files.free_vm_files(vm_id)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(v) for v in list(self.registry.vms)), return_exceptions=True)
        await self.parking.discard_all()
