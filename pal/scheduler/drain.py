"""Suspending many VMs at once: `pal node drain` (a node's VMs snapshot-paused, published to
S3, optionally resumed elsewhere) and its undo, and `pal up`'s shutdown (every VM suspended,
none lost). Both take the same crash-safe snapshot pause as the idle sweeper
(pause_resume.py); an operator's live pause stays the operator's (PAUSE, never woken).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from pal.errors import Conflict, NotFound
from pal.scheduler import nodes as nodes_mod
from pal.scheduler import states
from pal.scheduler.delete import Deleting
from pal.scheduler.deps import Deps, as_pal
from pal.scheduler.pause_resume import DRAIN_REASON, SHUTDOWN_REASON, PauseResume
from pal.scheduler.snapshot_books import SnapshotBooks
from pal.scheduler.states import Action, Marker, VmState, has_live_qemu
from pal.store import VmRecord

log = logging.getLogger(__name__)
S, A, M = VmState, Action, Marker


def _suspend_action(vm: VmRecord) -> Action:
    """An operator's live pause stays the operator's (never woken); anything else wakes on
    its next request."""
    return A.PAUSE if vm.marker == M.LIVE else A.IDLE_PAUSE


@dataclass(frozen=True)
class Draining:
    d: Deps
    pauses: PauseResume
    books: SnapshotBooks
    deleting: Deleting

    async def set_node_active(self, node_id: str) -> dict[str, Any]:
        """Undo a drain: the node takes new VMs again (a lost node must heartbeat instead)."""
        rec = self.d.nodes.get(node_id)
        if rec is None:
            raise NotFound(f"node {node_id} not found")
        if rec.state == nodes_mod.LOST:
            raise Conflict(f"node {node_id} is lost: it becomes active when it heartbeats again")
        self.d.nodes.set_state(node_id, nodes_mod.ACTIVE)
        return {"nodeId": node_id, "state": nodes_mod.ACTIVE}

    async def drain_node(self, node_id: str, *, migrate: bool = False) -> dict[str, Any]:
        """`pal node drain`: nothing new is placed on the node; its VMs with a live QEMU are
        snapshot-paused (the idle-suspend path, so their next request resumes them on
        another node) and their snapshots published to S3. With ``migrate`` they resume
        elsewhere at once. Returns what happened to each VM.

        Prerequisites: a known node (404) that is not lost (409). Each VM: a live QEMU on
        this node, checked again under its lock (else skipped). A VM that fails is listed
        in ``failed`` with its error; the others go on."""
        d = self.d
        rec = d.nodes.get(node_id)
        if rec is None:
            raise NotFound(f"node {node_id} not found")
        if rec.state == nodes_mod.LOST:
            raise Conflict(
                f"node {node_id} is lost: its running VMs have failed, its paused ones resume elsewhere"
            )
        d.nodes.set_state(node_id, nodes_mod.DRAINING)
        paused: list[str] = []
        migrated: dict[str, str | None] = {}
        failed: dict[str, str] = {}

        async def one(vm: VmRecord) -> None:
            try:
                async with d.locks.op_lock(vm.vm_id):
                    fresh = d.reload(vm.vm_id)
                    if not has_live_qemu(fresh.state, fresh.marker) or fresh.node_id != node_id:
                        return
                    action = _suspend_action(fresh)
                    done = await self.pauses.pause_locked(vm.vm_id, action, reason=DRAIN_REASON)
                    await self.books.publish(done, node_id, done.snapshot_id or "")
                    paused.append(vm.vm_id)
                    if migrate:
                        moved = await self.pauses.resume_locked(d.reload(vm.vm_id), trigger="migrate")
                        migrated[vm.vm_id] = moved.node_id
            except Exception as exc:
                failed[vm.vm_id] = as_pal(exc).message

        running = [v for v in d.occupying(node_id) if has_live_qemu(v.state, v.marker)]
        sem = asyncio.Semaphore(max(1, d.settings.fork_concurrency))

        async def bounded(vm: VmRecord) -> None:
            async with sem:
                await one(vm)

        await asyncio.gather(*(bounded(vm) for vm in running))
        return {
            "nodeId": node_id,
            "state": nodes_mod.DRAINING,
            "paused": sorted(paused),
            "migrated": migrated,
            "failed": failed,
        }

    async def shutdown_vms(self) -> None:
        """`pal up` on SIGTERM: leave no QEMU running, and lose no sandbox.

        Running VMs are suspended exactly like an idle suspend (same crash-safe pause path),
        so the next exec or file request after the restart wakes them transparently;
        VMs caught mid-spawn or mid-drain, or whose pause fails, are stopped (terminated).
        A live-paused VM becomes a snapshot too: an operator's stays the operator's (never
        woken), an automatic one wakes on its next request. Limits are not checked: a
        shutdown suspends every VM rather than lose one.
        """
        d = self.d
        live = d.occupying()

        async def settle(vm: VmRecord) -> None:
            action = _suspend_action(vm)
            if states.allowed(S(vm.state), action, vm.marker):
                try:
                    async with d.locks.op_lock(vm.vm_id):
                        await self.pauses.pause_locked(vm.vm_id, action, reason=SHUTDOWN_REASON)
                    return
                except Exception as exc:
                    log.warning("shutdown: could not suspend VM %s (%s); stopping it", vm.vm_id, exc)
            if d.reload(vm.vm_id).state not in (S.PAUSED, S.TERMINATED):
                await self.deleting.delete_vm(vm.vm_id)

        results = await asyncio.gather(*(settle(vm) for vm in live), return_exceptions=True)
        for vm, res in zip(live, results, strict=True):
            if isinstance(res, BaseException):
                log.error("shutdown: could not stop VM %s: %s", vm.vm_id, res)
