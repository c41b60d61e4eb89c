"""Snapshot pause and resume (docs/lifecycle.md): the operator's pause and resume, the idle
sweeper's two tiers, and the locked steps that drain.py and wake.py reuse.
A live pause or resume is live.py's; the operator's entry points here route to it.

Every operation checks its action against the table in states.py before any work, and
changes state only through the transition function. ``*_locked`` steps expect the caller
to hold the VM's operation lock (deps.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from pal import failpoints
from pal.errors import BackendError, Conflict, InsufficientStorage
from pal.scheduler import states
from pal.scheduler.deps import Deps, SpawnChore, as_pal, new_snapshot_id, new_token
from pal.scheduler.live import LiveOps, live_paused
from pal.scheduler.node_client import UNREACHABLE
from pal.scheduler.snapshot_books import SnapshotBooks
from pal.scheduler.spawning import Spawner, came_up
from pal.scheduler.states import Action, VmState
from pal.scheduler.transition import Audit
from pal.scheduler.views import Paused, add_counters, add_live_stats
from pal.spec import PauseRequest
from pal.store import VmRecord, utcnow
from pal.wire import verbs
from pal.wire.models import RestoreFrom, SnapshotRequest, StopVm

S, A = VmState, Action

IDLE_REASON = "auto-suspended (idle timeout)"
SHUTDOWN_REASON = "suspended (server shutdown); wakes on the next request"
LIFETIME_REASON = "paused (its lifetime ended)"
DRAIN_REASON = "suspended (node draining); wakes on another node on the next request"
MAX_RESUME_NODES = 3  # a resume tries at most this many nodes that turn out unreachable


@dataclass(frozen=True)
class PauseResume:
    d: Deps
    spawner: Spawner
    books: SnapshotBooks
    live: LiveOps
    spawn_chore: SpawnChore

    # -- the operator's ------------------------------------------------------------------------

    async def pause(self, tenant_id: str, vm_id: str, req: PauseRequest | None = None) -> Paused:
        """The operator's pause: a snapshot pause (default), or a live one (``mode: live``,
        optionally offloading the guest's RAM). Neither is ever woken automatically.

        Prerequisites: snapshot pause (PAUSE): running, or live-paused by anyone; live pause
        (LIVE_PAUSE): running, or live-paused (the operator takes an automatic one over).
        Success: paused (snapshot: the slot freed; live: the slot kept, marker live:operator).
        Failure: 404 (not the tenant's), 409 (the table), 402 (max_paused, snapshot bytes);
        a snapshot that fails leaves the VM running (500, 507 for no disk) or, its QEMU gone,
        failed (500)."""
        self.d.own(tenant_id, vm_id)
        async with self.d.locks.op_lock(vm_id):
            if req is not None and req.mode == "live":
                paused = await self.live.pause(
                    vm_id, A.LIVE_PAUSE, offload=req.offload, reason="live-paused by operator"
                )
                assert paused is not None  # only a wait pause may find nothing to do
                return paused
            return Paused(await self.pause_locked(vm_id, A.PAUSE, reason="paused by operator"))

    async def resume(self, tenant_id: str, vm_id: str) -> VmRecord:
        """A live-paused VM continues in its QEMU; a snapshot-paused one is restored.

        Prerequisites: paused (live: LIVE_RESUME; snapshot: RESUME, which needs its snapshot).
        Success: running (a snapshot resume: a new incarnation and token, maybe on another
        node). Failure: 404, 409, 402 (no slot), 503 (no node); a restore that fails leaves
        the VM paused and resumable again."""
        self.d.own(tenant_id, vm_id)
        async with self.d.locks.op_lock(vm_id):
            vm = self.d.reload(vm_id)
            if live_paused(vm):
                return await self.live.resume(vm, "api", "resumed by operator")
            return await self.resume_locked(vm)

    # -- the idle sweeper's (idle.py) ------------------------------------------------------------

    async def idle_live_pause(self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]) -> VmRecord | None:
        """The idle sweeper's first tier (idleLivePauseSecs): live-pause and offload.

        Prerequisites: IDLE_LIVE_PAUSE allowed (running), no request in flight, and
        ``still_idle`` of the fresh row. Success: paused (live:idle). None: skipped."""
        async with self.d.locks.op_lock(vm_id):
            if not self._still_idle(vm_id, A.IDLE_LIVE_PAUSE, still_idle):
                return None
            paused = await self.live.pause(
                vm_id, A.IDLE_LIVE_PAUSE, offload=True, reason="live-paused (idle; wakes on the next request)"
            )
            return paused.vm if paused is not None else None

    async def idle_pause(self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]) -> VmRecord | None:
        """The idle sweeper's suspend: same path as pause; skipped if the VM woke meanwhile.

        Prerequisites: IDLE_PAUSE allowed (running, or an automatic live pause), no request
        in flight, ``still_idle``. Success: paused (snapshot, by idle). None: skipped."""
        async with self.d.locks.op_lock(vm_id):
            if not self._still_idle(vm_id, A.IDLE_PAUSE, still_idle):
                return None
            return await self.pause_locked(vm_id, A.IDLE_PAUSE, reason=IDLE_REASON)

    def _still_idle(self, vm_id: str, action: Action, still_idle: Callable[[VmRecord], bool]) -> bool:
        """Under the VM's lock, against the fresh row: the table allows ``action``, no
        request is in flight, and the sweeper's ``still_idle`` holds."""
        vm = self.d.reload(vm_id)
        if not states.allowed(S(vm.state), action, vm.marker):
            return False
        return not self.d.locks.busy(vm_id) and still_idle(vm)

    # -- the locked steps ----------------------------------------------------------------------

    async def pause_locked(
        self, vm_id: str, action: Action, *, reason: str, audit: Audit | None = None, **fields: Any
    ) -> VmRecord:
        """A snapshot pause. ``action``: PAUSE (by the operator; never woken) or IDLE_PAUSE
        (woken on demand). running or live-paused -> draining -> paused; on failure back to
        running (the node kept it) or failed (its QEMU is gone). ``audit`` and ``fields``
        go with the transition to paused."""
        d = self.d
        t0 = time.perf_counter()
        vm = d.reload(vm_id)
        states.check(vm_id, vm.state, action, vm.marker)
        by = "idle" if action == A.IDLE_PAUSE else "operator"
        prev = vm.snapshot_id
        snap_id = new_snapshot_id()
        # A live pause ending in a snapshot (the idle tiers, shutdown, drain, the operator):
        # its time counts with the VM's live-paused time.
        was_live = live_paused(vm)
        live_ms = int((utcnow() - vm.paused_at).total_seconds() * 1000) if was_live and vm.paused_at else 0
        # The snapshot id is persisted with DRAINING, before the manager stops anything, so a
        # restarted control plane can check whether this snapshot completed (reconcile.py).
        await d.transitions.transition(
            vm_id,
            action,
            reason=reason,
            snapshot_id=snap_id,
            new_snapshot_bytes=self.books.estimate(vm),
            # a shutdown or a lifetime's end pauses whatever the tenant's limits
            tenant_limits=reason not in (SHUTDOWN_REASON, LIFETIME_REASON),
        )
        failpoints.hit("pause:draining")
        try:
            result = await d.node(vm).call(
                verbs.SNAPSHOT,
                SnapshotRequest(
                    vm_id=vm_id,
                    snapshot_id=snap_id,
                    agent_version_id=vm.agent_version_id or "",
                    tenant_id=vm.tenant_id,
                    keep_running=False,
                    parent_snapshot_id=prev,
                    protected=self.books.protected(vm),
                ),
            )
        except Exception as exc:
            await self._pause_failed(vm, prev, live_ms, exc)
        failpoints.hit("pause:snapshotted")
        paused = await d.transitions.transition(
            vm_id,
            A.FINISH_PAUSE,
            reason=reason,
            paused_by=by,
            paused_at=utcnow(),
            mem_snapshot_id=None,
            egress_stats=add_counters(vm.egress_stats, result.egress_counters),
            live_stats=add_live_stats(vm.live_stats, livePausedMs=live_ms),
            audit=audit,
            **fields,
        )
        d.telemetry.pause.labels(by=by).observe(time.perf_counter() - t0)
        d.telemetry.forget(vm_id)
        await self.books.record_bytes(vm_id, result)
        return paused

    async def _pause_failed(self, vm: VmRecord, prev: str | None, live_ms: int, exc: Exception) -> NoReturn:
        """The snapshot failed: roll back to running if the node kept the VM, else lose it."""
        d, vm_id = self.d, vm.vm_id
        err = as_pal(exc)
        alive = await d.is_alive(vm, vm.incarnation)
        if alive:
            # The node leaves the VM running (a live-paused one too: it was resumed).
            await d.transitions.transition(
                vm_id,
                A.ROLL_BACK_PAUSE,
                reason=f"pause failed: {err.message}",
                snapshot_id=prev,
                paused_by=None,
                paused_at=None,
                live_stats=add_live_stats(vm.live_stats, livePausedMs=live_ms),
            )
            if isinstance(err, InsufficientStorage):  # refused before any work: say so (507)
                raise InsufficientStorage(
                    f"pause of VM {vm_id} refused (it is still running): {err.message}"
                ) from exc
            raise BackendError(f"pause of VM {vm_id} failed (it is still running): {err.message}") from exc
        await d.stop_quietly(vm)  # in case the heartbeat was wrong or failed
        await d.transitions.transition(
            vm_id, A.LOSE, reason=f"pause failed and the VM is gone: {err.message}", snapshot_id=prev
        )
        raise BackendError(f"pause of VM {vm_id} failed and the VM is gone: {err.message}") from exc

    async def resume_locked(self, vm: VmRecord, trigger: str = "api") -> VmRecord:
        """Restore a snapshot-paused VM: paused -> spawning -> running, on its previous node
        when it fits, else elsewhere (its snapshot published to S3 first); an unreachable
        node is tried around (MAX_RESUME_NODES). On failure back to paused, resumable.
        ``vm``: its record as the caller read it under the VM's operation lock, which it
        holds."""
        d = self.d
        t0 = time.perf_counter()
        vm_id = vm.vm_id
        states.check(vm_id, vm.state, A.RESUME, vm.marker)
        if not vm.snapshot_id:
            raise Conflict(f"VM {vm_id} has no snapshot to resume from")
        old_node = vm.node_id
        tried: list[str] = []
        while True:
            async with self.spawner.placing:
                # Its previous node when that is healthy and has room, else any node that
                # fits (which pulls the snapshot from S3 and verifies it).
                choice = await self.spawner.choose(
                    vm, restore=True, prefer=old_node, prefer_why="its previous node", exclude=tuple(tried)
                )
                d.live.hold(vm, choice.node_id)  # the next placement counts it already
            try:
                # Reserves the slot in the same transaction: 402 changes nothing.
                vm = await d.transitions.transition(
                    vm_id,
                    A.RESUME,
                    reason=choice.reason,
                    node_id=choice.node_id,
                    # a new incarnation and token: credentials frozen in the snapshot are refused
                    incarnation=vm.incarnation + 1,
                    token=new_token(),
                )
            except BaseException:
                d.live.apply(vm)  # still paused, on no node's count
                raise
            failpoints.hit("resume:spawning")
            if old_node is not None and choice.node_id != old_node:
                await self.books.publish(vm, old_node, vm.snapshot_id or "")
            restore = RestoreFrom(
                snapshot_id=vm.snapshot_id or "",
                agent_version_id=vm.agent_version_id or "",
                source_vm_id=vm_id,
                tenant_id=vm.tenant_id,
                mem_mode="shared",
            )
            try:
                res = await d.node(vm).call(verbs.SPAWN, self.spawner.request(vm, restore))
                break
            except Exception as exc:
                err = as_pal(exc)
                # SPAWNING -> PAUSED releases the slot; the snapshot is untouched, so
                # resumable again. The VM stays attached to its previous node.
                vm = await d.transitions.transition(
                    vm_id, A.ROLL_BACK_RESUME, reason=f"resume failed: {err.message}", node_id=old_node
                )
                if err.code == UNREACHABLE and len(tried) < MAX_RESUME_NODES - 1:
                    # Its node died before anyone noticed: nothing happened there, try another.
                    tried.append(choice.node_id)
                    continue
                raise err from exc
        failpoints.hit("resume:spawned")
        if old_node is not None and choice.node_id != old_node:
            # It runs elsewhere now: its previous node lets go of its parked QEMU, if any.
            # In the background (that node may be the unreachable one this resume avoided),
            # best effort: a parked QEMU also goes when it is too old.
            self.spawn_chore(self._let_go(old_node, vm_id), f"let-go-{vm_id}")
        running = await d.transitions.transition(
            vm_id,
            A.COME_UP,
            **came_up(res),
            paused_by=None,
            paused_at=None,
            mem_snapshot_id=res.mem_snapshot_id,
            agent_version_id=res.agent_version_id or vm.agent_version_id,
            last_activity_unix_ms=d.now_ms(),
        )
        d.telemetry.resume.labels(trigger=trigger).observe(time.perf_counter() - t0)
        d.telemetry.started(vm_id, "resume" if trigger == "api" else trigger)
        return running

    async def _let_go(self, node_id: str, vm_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.d.nodes.client(node_id).call(verbs.STOP, StopVm(vm_id=vm_id))
