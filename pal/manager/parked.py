"""Parked QEMUs: the process of a snapshot-paused VM, kept stopped for its next resume.

A snapshot pause commits the VM's snapshot (memory, disk, device state) and, by the
spec, frees its slot and its compute. The QEMU process itself is then no longer needed:
a resume can always restore the snapshot into a new one. But a new process starts with an
empty TCG translation cache, and under TCG most of a restore is the guest re-running its
code through a cold translator (docs/lifecycle.md, "The restore path"). So instead of
killing it, the node *parks* the process: its vCPUs stay stopped, its guest RAM is handed
back to the host (written back to its file and dropped, as a live offload does), its
gateway state and connections are dropped, and it waits. When the same VM resumes from
the same snapshot on this node, the parked process continues instead of a new one: the
guest's RAM and disk are exactly the snapshot's (nothing ran since it was taken), and the
guest then takes a new identity over the same channel as any restored guest (incarnation,
token, MAC, clock, RNG, TCP reset).

A parked process holds no tenant slot and no CPU; it holds its own memory (mostly the
translation cache) and its files. So parking is a bounded cache, never a promise:

- at most ``PAL_PARKED_MAX`` per node (0 turns parking off), for ``PAL_PARKED_SECS`` at most;
  the oldest goes first;
- discarded whenever it could be wrong or in the way: another snapshot is asked for, the
  VM is deleted (its snapshots are), the VM resumes elsewhere, a spawn needs the memory, the
  manager restarts (a parked process is never adopted: its snapshot is on disk).

Everything that decides correctness is the snapshot: a parked process only ever makes a
resume faster, and any doubt makes it a normal restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pal.errors import InsufficientStorage
from pal.manager import admission
from pal.manager.vm import LiveVm, kill_quietly
from pal.vmm import offload

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# A parked guest's RAM is handed back this long after its pause: a resume that comes
# sooner (a quick pause/resume cycle) finds it resident and skips both the offload and
# reading it back.
OFFLOAD_DELAY_S = 2.0


@dataclass
class ParkedVm:
    lv: LiveVm
    snapshot_id: str
    parked_at: float  # monotonic
    working_set: list[tuple[int, int]] = field(default_factory=list)  # prefetched on resume
    offloaded: bool = False  # its guest RAM was handed back (else it is still resident)
    offload_started: bool = False
    offloading: asyncio.Task[None] | None = field(default=None, repr=False)

    async def settled(self) -> None:
        """No offload runs any more: one not started yet is called off, one under way
        (it cannot be stopped halfway) is waited for."""
        task = self.offloading
        if task is None or task.done():
            return
        if not self.offload_started:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.shield(task)


class _Network(Protocol):
    async def unregister(self, vm_id: str) -> dict[str, Any] | None: ...


class ParkingHost(Protocol):
    """Exactly what parking needs of the node: the gateway (a parked VM leaves it) and
    the freeing of what a discarded one held (stop.Stopper.free_vm_files)."""

    @property
    def net(self) -> _Network: ...

    async def free_vm_files(self, vm_id: str, slot: str | None = None) -> dict[str, Any] | None: ...


class Parking:
    """The node's parked processes (NodeRuntime delegates here)."""

    def __init__(self, host: ParkingHost, capacity: int, max_age_s: float) -> None:
        self.host = host
        self.capacity = capacity
        self.max_age_s = max_age_s
        self.vms: dict[str, ParkedVm] = {}

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    async def park(self, lv: LiveVm, snapshot_id: str) -> dict[str, int] | None:
        """Prerequisites: the VM's snapshot is committed, its QEMU stopped (after capture),
        it is no longer in the runtime's live VMs; the caller holds its op lock. Success:
        parked: gateway state and connections dropped, its namespace and tap kept, its
        guest RAM handed back OFFLOAD_DELAY_S later in the background (the pause does not
        wait for that); returns its final egress counters."""
        vm_id = lv.vm_id
        counters = await self.host.net.unregister(vm_id)
        pv = ParkedVm(lv, snapshot_id, time.monotonic())
        self.vms[vm_id] = pv
        pv.offloading = asyncio.create_task(self._offload(pv), name=f"park-offload-{vm_id}")
        await self.evict(keep=self.capacity)
        return counters

    async def _offload(self, pv: ParkedVm) -> None:
        await asyncio.sleep(OFFLOAD_DELAY_S)
        pv.offload_started = True
        lv = pv.lv
        pid = lv.qemu.pid
        try:
            if pid is None or lv.qemu.exited.is_set():
                raise RuntimeError("its QEMU is gone")
            res = await asyncio.to_thread(offload.offload, pid, lv.qemu.mem_path)
        except Exception as exc:
            if self.vms.get(lv.vm_id) is pv:  # not taken or discarded meanwhile
                log.info("VM %s: parked QEMU discarded, its RAM could not be handed back: %s", lv.vm_id, exc)
                await self.discard(lv.vm_id)
            return
        pv.working_set, pv.offloaded = res.working_set, True
        log.info(
            "VM %s parked after snapshot %s: %d MiB of guest RAM handed back in %.0f ms",
            lv.vm_id,
            pv.snapshot_id,
            res.freed // MIB,
            res.ms,
        )

    def take(self, vm_id: str, snapshot_id: str) -> ParkedVm | None:
        """The parked process of ``vm_id`` if it holds exactly ``snapshot_id`` and is still
        alive (the caller continues it); anything else is left for :meth:`discard`."""
        pv = self.vms.get(vm_id)
        if pv is None or pv.snapshot_id != snapshot_id or pv.lv.qemu.exited.is_set():
            return None
        if time.monotonic() - pv.parked_at > self.max_age_s:
            return None
        return self.vms.pop(vm_id)

    async def discard(self, vm_id: str) -> bool:
        """Kill the parked process of ``vm_id``, if any, and free what it held."""
        pv = self.vms.pop(vm_id, None)
        if pv is None:
            return False
        await pv.settled()
        await self._kill(pv.lv)
        log.info("VM %s: its parked QEMU is discarded", vm_id)
        return True

    async def evict(self, *, keep: int) -> None:
        """Discard the oldest beyond ``keep``, and every one older than the age limit."""
        now = time.monotonic()
        for vm_id, pv in list(self.vms.items()):
            if now - pv.parked_at > self.max_age_s or pv.lv.qemu.exited.is_set():
                await self.discard(vm_id)
        by_age = sorted(self.vms.items(), key=lambda kv: kv[1].parked_at)
        for vm_id, _ in by_age[: max(0, len(by_age) - keep)]:
            await self.discard(vm_id)

    async def admit_memory(self, need_mib: int, what: str) -> None:
        """507 unless the host has the memory; parked processes go first to make room."""
        try:
            admission.check_memory(need_mib, what)
        except InsufficientStorage:
            if not self.vms:
                raise
            await self.evict(keep=0)
            admission.check_memory(need_mib, what)

    async def park_failed(self, pv: ParkedVm) -> None:
        """A parked process taken for a resume could not continue: gone for good."""
        await pv.settled()
        await self._kill(pv.lv)

    async def discard_all(self) -> None:
        await asyncio.gather(*(self.discard(v) for v in list(self.vms)), return_exceptions=True)

    async def _kill(self, lv: LiveVm) -> None:
        await kill_quietly(lv)
        await self.host.free_vm_files(lv.vm_id, lv.slot)
