"""Snapshots on this node: the capture of a live VM (a pause, a fork's source, a
checkpoint), and the snapshots kept in the store (status, upload, listing, deletion).

A snapshot pause ends with the VM parked (parked.py) or stopped; a capture that fails
leaves the VM as it was before (``capture_failed``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal import failpoints
from pal.errors import Conflict
from pal.manager import admission
from pal.manager.live import LiveControl
from pal.manager.parked import Parking
from pal.manager.stop import Stopper
from pal.manager.vm import LiveVm, VmRegistry
from pal.manager.vm_states import VmPhase, check_move
from pal.manager.vmnet import VmNetworking
from pal.snapshots.layout import SnapshotRef
from pal.snapshots.store import SnapshotStore
from pal.vmm.qemu import SnapshotArtifacts
from pal.wire.models import SnapshotInfo, SnapshotOwners, SnapshotRequest, SnapshotResult, SnapshotStatus

log = logging.getLogger(__name__)


@dataclass
class SnapshotDeps:
    """Exactly what snapshots need of the node."""

    registry: VmRegistry
    store: SnapshotStore
    net: VmNetworking
    parking: Parking
    live: LiveControl
    stopper: Stopper
    accel: str


class Snapshots:
    def __init__(self, deps: SnapshotDeps) -> None:
        self.d = deps

    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        lv = self.d.registry.live(vm_id)
        async with lv.op_lock:
            # Before the guest stops: a snapshot that cannot fit is refused, the VM runs on.
            await asyncio.to_thread(
                admission.check_disk, self.d.store.root, lv.memory_mib, f"a snapshot of VM {vm_id}"
            )
            staging = self.d.store.staging_dir(req.snapshot_id)
            t0 = time.perf_counter()
            art = await self._capture(lv, req, staging)
            t_capture = time.perf_counter()
            failpoints.hit("manager:captured")
            if req.keep_running and lv.live is None:
                # The capture is independent reflinked files: the guest may run on while
                # they are checksummed and committed. (A live-paused source stays paused.)
                await lv.qemu.cont()
            path = await self._commit(lv, req, staging, art)
            t_commit = time.perf_counter()
            failpoints.hit("manager:committed")
            counters = None if req.keep_running else await self._leave(lv, req.snapshot_id)
            t_end = time.perf_counter()
            await self._retention(vm_id, req)
            durations = dict(art.durations_ms)
            durations.update(
                capture=(t_capture - t0) * 1000,
                commit=(t_commit - t_capture) * 1000,
                stop=(t_end - t_commit) * 1000,
                total=(t_end - t0) * 1000,
            )
            log.info(
                "snapshot %s of %s: %s",
                req.snapshot_id,
                vm_id,
                {k: round(v, 1) for k, v in durations.items()},
            )
        return SnapshotResult(
            snapshot_id=req.snapshot_id,
            path=str(path),
            sizes=art.sizes,
            durations_ms=durations,
            memory_kind="stream" if art.memory_kind == "stream" else "file",
            egress_counters=counters,
            stored_bytes=await self._stored_bytes(req.agent_version_id, vm_id),
        )

    async def _stored_bytes(self, agent_version_id: str, vm_id: str) -> int | None:
        """What the VM's snapshots here take, for the answer (the control plane's books
        then need no second call); None when it cannot be read."""
        try:
            return sum(s.stored_bytes for s in await self.list_vm(agent_version_id, vm_id))
        except Exception as exc:
            log.warning("could not measure the snapshots of %s: %s", vm_id, exc)
            return None

    async def _capture(self, lv: LiveVm, req: SnapshotRequest, staging: Path) -> SnapshotArtifacts:
        """The VM's memory, disk, device state and DNS names into ``staging``; the guest is
        stopped after it (or running again, or gone, when it failed)."""
        try:
            art = await lv.qemu.capture(staging)  # on failure the guest runs again (or is gone)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            await self.capture_failed(lv, req.keep_running, running=True)
            raise
        try:
            await self.d.net.save_names(lv.vm_id, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            await self.capture_failed(lv, req.keep_running, running=False)
            raise
        return art

    async def _commit(self, lv: LiveVm, req: SnapshotRequest, staging: Path, art: SnapshotArtifacts) -> Path:
        meta: dict[str, Any] = {
            "tenantId": req.tenant_id,
            "vmId": lv.vm_id,
            "agentVersionId": req.agent_version_id,
            "parentSnapshotId": req.parent_snapshot_id or lv.mem_snapshot_id,
            "image": lv.image.name,
            "boot": lv.image.boot_id,
            "memoryMib": lv.memory_mib,
            "vcpus": lv.vcpus,
            "diskMib": lv.disk_mib,
            "memoryKind": art.memory_kind,
            "qemuVersion": art.meta.get("qemuVersion"),
            "kernelVersion": lv.image.meta.get("kernelVersion"),
            "accel": self.d.accel,
        }
        ref = SnapshotRef(req.agent_version_id, lv.vm_id, req.snapshot_id, req.tenant_id)
        try:
            return await asyncio.to_thread(self.d.store.commit, staging, ref, meta)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            if not req.keep_running:
                await self.capture_failed(lv, False, running=False)
            raise

    async def _leave(self, lv: LiveVm, snapshot_id: str) -> dict[str, Any] | None:
        """A snapshot pause is committed: the VM leaves, parked or stopped; returns its
        final egress counters."""
        if not self._may_park(lv):
            return await self.d.stopper.stop(lv.vm_id)
        check_move(lv, VmPhase.PARKED)
        self.d.stopper.forget(lv.vm_id)
        lv.parked_snapshot = snapshot_id
        self.d.registry.write_state(lv)  # a restarted manager discards it, never adopts it
        return await self.d.parking.park(lv, snapshot_id)

    def _may_park(self, lv: LiveVm) -> bool:
        """Park the QEMU of a VM just snapshot-paused (parked.py) instead of killing it?
        Only a plain running VM whose RAM is its own shared file (a fork child maps its
        parent's snapshot privately: its dirty pages could not be handed back)."""
        return (
            self.d.parking.enabled
            and lv.live is None
            and lv.qemu.mem_share
            and lv.mem_snapshot_id is None
            and not lv.qemu.exited.is_set()
        )

    async def _retention(self, vm_id: str, req: SnapshotRequest) -> None:
        """Retention after every write; the snapshot just made is always kept."""
        keep = set(req.protected) | self.d.registry.mapped_snapshots() | {req.snapshot_id}
        try:
            await asyncio.to_thread(self.d.store.apply_retention, req.agent_version_id, vm_id, keep)
        except Exception:
            log.exception("retention after snapshot %s failed; it runs again next time", req.snapshot_id)

    async def capture_failed(self, lv: LiveVm, keep_running: bool, *, running: bool) -> None:
        """A snapshot failed (``running``: QEMU already continued the guest). The VM is
        left as it was before: running, or live-paused for a fork of a live-paused source;
        a pause's live-paused VM runs again (the scheduler rolls it back to running)."""
        if lv.qemu.exited.is_set():
            return
        with contextlib.suppress(Exception):
            if lv.live is None:
                if not running:
                    await lv.qemu.cont()
            elif keep_running:
                if running:
                    await lv.qemu.pause()
            else:
                await self.d.live.end_after_capture(lv, running=running)

    # ------------------------------------------------------------------ the store
    async def status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        ref = SnapshotRef(agent_version_id, vm_id, snapshot_id, "")
        # Complete where a resume finds it: here, or only in S3 (a node that lost its
        # local tier, or a copy cleaned after upload).
        ok = await asyncio.to_thread(self.d.store.restorable, ref)
        meta = await asyncio.to_thread(self.d.store.read_meta, ref) if ok else None
        return SnapshotStatus(complete=ok, meta=meta)

    async def ensure_uploaded(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        await asyncio.to_thread(
            self.d.store.ensure_uploaded, SnapshotRef(agent_version_id, vm_id, snapshot_id)
        )

    async def delete(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        # A VM whose snapshot goes (deleted, or resumed elsewhere and cleaned up) will
        # never continue its parked process here.
        await self.d.parking.discard(vm_id)
        if snapshot_id in self.d.registry.mapped_snapshots():
            raise Conflict(f"snapshot {snapshot_id} is mapped by a live fork")
        await asyncio.to_thread(self.d.store.delete, SnapshotRef(agent_version_id, vm_id, snapshot_id, ""))

    async def list_vm(self, agent_version_id: str, vm_id: str) -> list[SnapshotInfo]:
        """The VM's complete local snapshots, oldest first, with their artifact sizes."""
        store = self.d.store

        def read() -> list[tuple[dict[str, Any], int]]:
            metas = store.list_vm(agent_version_id, vm_id)
            return [
                (m, store.stored_bytes(SnapshotRef(agent_version_id, vm_id, str(m.get("snapshotId")))))
                for m in metas
            ]

        out = []
        for m, stored in await asyncio.to_thread(read):
            raw = m.get("sizes")
            sizes: dict[str, Any] = raw if isinstance(raw, dict) else {}
            out.append(
                SnapshotInfo(
                    snapshot_id=str(m.get("snapshotId")),
                    created_at=m.get("createdAt"),
                    sizes={str(k): int(v) for k, v in sizes.items() if isinstance(v, int)},
                    sealed=bool(m.get("sealed")),
                    memory_kind=m.get("memoryKind"),
                    parent_snapshot_id=m.get("parentSnapshotId"),
                    stored_bytes=stored,
                )
            )
        return out

    async def delete_vm(self, agent_version_id: str, vm_id: str, keep: list[str]) -> list[str]:
        """Delete every snapshot of the VM on both tiers except ``keep`` and those a live
        fork on this node maps. Returns the local ids deleted."""
        keep_all = set(keep) | self.d.registry.mapped_snapshots()
        return await asyncio.to_thread(self.d.store.delete_vm, agent_version_id, vm_id, keep_all)

    async def owners(self) -> SnapshotOwners:
        return SnapshotOwners(vms=sorted(await asyncio.to_thread(self.d.store.vms)))
