"""The runtime scheduler: schedule, pause, resume, fork, delete, exec/files, per the spec's
sequences (microvm-lifecycle.txt). Every state change goes through ``Transitioner.transition``.

Locking: besides the per-VM transition lock, each multi-step operation on a VM holds that
VM's *operation* lock from its first check to its last transition, so a concurrent exec
waits for an in-progress idle pause and then resumes, and two pauses cannot interleave.
Store calls are synchronous and short (SQLite, WAL); they run on the event loop.

Decisions the spec leaves open:
- delete of a paused VM releases its pause snapshot right away (and fork snapshots its
  children mapped), except while a live fork child still maps one; failures are left to
  retention. Older snapshots of the VM are left to the manager's retention.
- list() shows every VM of the tenant except those terminated more than an hour ago.
- a fork whose snapshot fails returns normally with every child FAILED (error set), so the
  caller sees the child ids; the source stays RUNNING unless its QEMU died.
- a delete whose stop fails answers 500 and leaves the VM DRAINING (scheduler:deleting);
  a repeated delete, or reconciliation, retries the stop.
- exec_stream raises its 404/409/402 on the first ``__anext__``, before any event.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta

from pal import failpoints
from pal.config import Settings
from pal.errors import BackendError, Conflict, InvalidRequest, NotFound, PalError
from pal.manager.api import RuntimeManager
from pal.manager.models import (
    ExecEvent,
    FileList,
    FileWritten,
    RestoreFrom,
    SnapshotRequest,
    SpawnRequest,
)
from pal.scheduler import quotas
from pal.scheduler.leader import Leadership, SingleProcessLeader
from pal.scheduler.spec import AgentSpec, ExecRequest
from pal.scheduler.states import FINAL, Marker, VmState
from pal.scheduler.transition import Transitioner
from pal.scheduler.views import EventView, ForkChild, ForkResult, VmView
from pal.store import Store, VmRecord, utcnow

__all__ = ["EventView", "ForkChild", "ForkResult", "Scheduler", "VmView"]

log = logging.getLogger(__name__)
S = VmState

IDLE_REASON = "auto-suspended (idle timeout)"
AUTO_RESUME_EVENT = "auto_resume"
# list() keeps showing a terminated VM this long, then hides it (the row and events stay).
TERMINATED_VISIBLE = timedelta(hours=1)


def new_vm_id() -> str:
    return "vm-" + uuid.uuid4().hex[:24]


SHUTDOWN_REASON = "suspended (server shutdown); wakes on the next request"


def new_snapshot_id() -> str:
    return "snap-" + uuid.uuid4().hex[:24]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def as_pal(exc: BaseException) -> PalError:
    """A manager failure as a PalError: its own status if it has one, else 500."""
    if isinstance(exc, PalError):
        return exc
    return BackendError(f"{type(exc).__name__}: {exc}")


class Scheduler:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        manager: RuntimeManager,
        *,
        clock: Callable[[], float] = time.time,
        leader: Leadership | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.manager = manager
        self.clock = clock
        self.leader: Leadership = leader or SingleProcessLeader()
        self.transitions = Transitioner(store)
        self.node_id: str | None = None
        self._ops: dict[str, asyncio.Lock] = {}
        # Requests (exec/files) in flight per VM: the idle sweeper never suspends such a VM,
        # whatever the (possibly stale) guest heartbeat says.
        self.inflight: dict[str, int] = {}
        self._background: asyncio.Task[None] | None = None

    # -- lifecycle of the scheduler itself ----------------------------------------------

    async def start(self) -> None:
        """Reconcile the store with the node, then start background loops (leader only)."""
        from pal.scheduler import reconcile

        if await self.leader.acquire():
            await reconcile.reconcile_all(self)
        self._background = asyncio.create_task(self._loop(), name="pal-scheduler-loop")

    async def close(self) -> None:
        """Stop background tasks; VMs keep running."""
        task, self._background = self._background, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.leader.release()

    async def _loop(self) -> None:
        from pal.scheduler import idle, reconcile

        sweeper = idle.IdleSweeper(self)
        while True:
            await asyncio.sleep(self.settings.idle_sweep_interval_s)
            try:
                if not await self.leader.is_leader():
                    continue
                await reconcile.reconcile_light(self)
                await sweeper.sweep()
            except Exception:
                log.exception("scheduler background tick failed")

    async def shutdown_vms(self) -> None:
        """`pal up` on SIGTERM: leave no QEMU running, and lose no sandbox.

        Running VMs are suspended exactly like an idle suspend (same crash-safe pause path),
        so the next exec or file request after the restart wakes them transparently;
        VMs caught mid-spawn or mid-drain, or whose pause fails, are stopped (terminated).
        """
        live = self.store.list_vms(states=[S.PENDING, S.SPAWNING, S.RUNNING, S.DRAINING])

        async def settle(vm: VmRecord) -> None:
            if vm.state == S.RUNNING:
                try:
                    async with self.op_lock(vm.vm_id):
                        await self._pause_locked(
                            vm.vm_id, by="idle", marker=Marker.IDLE_PAUSING, reason=SHUTDOWN_REASON
                        )
                    return
                except Exception as exc:
                    log.warning("shutdown: could not suspend VM %s (%s); stopping it", vm.vm_id, exc)
            if self._reload(vm.vm_id).state not in (S.PAUSED, S.TERMINATED):
                await self._delete(vm.vm_id)

        results = await asyncio.gather(*(settle(vm) for vm in live), return_exceptions=True)
        for vm, res in zip(live, results, strict=True):
            if isinstance(res, BaseException):
                log.error("shutdown: could not stop VM %s: %s", vm.vm_id, res)

    # -- helpers ------------------------------------------------------------------------------

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def op_lock(self, vm_id: str) -> asyncio.Lock:
        return self._ops.setdefault(vm_id, asyncio.Lock())

    def _own(self, tenant_id: str, vm_id: str) -> VmRecord:
        vm = self.store.get_vm(vm_id)
        if vm is None or vm.tenant_id != tenant_id:
            raise NotFound(f"VM {vm_id} not found")
        return vm

    def _reload(self, vm_id: str) -> VmRecord:
        vm = self.store.get_vm(vm_id)
        if vm is None:
            raise NotFound(f"VM {vm_id} not found")
        return vm

    async def is_alive(self, vm_id: str, incarnation: int | None = None) -> bool | None:
        """Whether the node reports the VM alive (None: the heartbeat itself failed)."""
        try:
            hb = await self.manager.heartbeat()
        except Exception as exc:
            log.warning("heartbeat failed while checking %s: %s", vm_id, exc)
            return None
        for a in hb.vms:
            if a.vm_id == vm_id and a.alive:
                return incarnation is None or a.incarnation in (None, incarnation)
        return False

    async def stop_quietly(self, vm_id: str) -> bool:
        try:
            await self.manager.stop(vm_id)
            return True
        except Exception as exc:
            log.warning("stop of %s failed: %s", vm_id, exc)
            return False

    def _spawn_request(self, vm: VmRecord, restore: RestoreFrom | None) -> SpawnRequest:
        return SpawnRequest(
            vm_id=vm.vm_id,
            tenant_id=vm.tenant_id,
            image=vm.image,
            vcpus=int(vm.limits.get("vcpus", 1)),
            memory_mib=int(vm.limits.get("memory_mib", 256)),
            disk_mib=int(vm.limits.get("disk_mib", 2048)),
            incarnation=vm.incarnation,
            token=vm.token,
            env=dict(vm.secrets),
            boot="cold" if vm.boot == "cold" else "auto",
            restore=restore,
        )

    def _protected_snapshots(self, vm: VmRecord) -> builtins.list[str]:
        """Snapshots of ``vm`` that live fork children still map (retention must keep them)."""
        children = self.store.list_vms(parent_vm_id=vm.vm_id)
        return sorted({c.mem_snapshot_id for c in children if c.mem_snapshot_id and c.state not in FINAL})

    # -- schedule -----------------------------------------------------------------------------

    async def schedule(self, tenant_id: str, spec: AgentSpec) -> VmView:
        now = utcnow()
        vm = VmRecord(
            vm_id=new_vm_id(),
            tenant_id=tenant_id,
            state=S.PENDING.value,
            image=spec.image,
            limits=spec.limits.model_dump(),
            created_at=now,
            updated_at=now,
            idle_timeout_secs=spec.idle_timeout_secs,
            secrets=dict(spec.secrets),
            boot=spec.boot,
            incarnation=1,
            token=new_token(),
            last_activity_unix_ms=self.now_ms(),
        )
        async with self.op_lock(vm.vm_id):
            await self.transitions.create(tenant_id, [vm])  # 402 here leaves no row
            vm = await self.transitions.transition(
                vm.vm_id, S.SPAWNING, marker=Marker.SPAWNING, expect=S.PENDING
            )
            try:
                res = await self.manager.spawn(self._spawn_request(vm, None))
            except Exception as exc:
                err = as_pal(exc)
                # The manager leaves no QEMU behind on failure (api.py), so FAILED is final.
                await self.transitions.transition(
                    vm.vm_id, S.FAILED, reason=f"spawn failed: {err.message}", expect=S.SPAWNING
                )
                raise err from exc
            vm = await self.transitions.transition(
                vm.vm_id,
                S.RUNNING,
                expect=S.SPAWNING,
                agent_version_id=res.agent_version_id,
                node_id=self.node_id,
                last_activity_unix_ms=self.now_ms(),
            )
        return VmView.of(vm, boot_method=res.method)

    # -- reads --------------------------------------------------------------------------------

    async def get(self, tenant_id: str, vm_id: str) -> VmView:
        return VmView.of(self._own(tenant_id, vm_id))

    async def list(self, tenant_id: str) -> builtins.list[VmView]:
        """All the tenant's VMs except those terminated more than an hour ago."""
        cutoff = utcnow() - TERMINATED_VISIBLE
        return [
            VmView.of(vm)
            for vm in self.store.list_vms(tenant_id=tenant_id)
            if not (vm.state == S.TERMINATED and vm.updated_at < cutoff)
        ]

    async def events(self, tenant_id: str, vm_id: str) -> builtins.list[EventView]:
        self._own(tenant_id, vm_id)
        return [EventView.of(e) for e in self.store.list_events(vm_id)]

    # -- delete -------------------------------------------------------------------------------

    async def delete(self, tenant_id: str, vm_id: str) -> VmView:
        self._own(tenant_id, vm_id)
        return VmView.of(await self._delete(vm_id))

    async def _delete(self, vm_id: str) -> VmRecord:
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            state = S(vm.state)
            if state == S.TERMINATED:
                return vm
            if state == S.PENDING:
                vm = await self.transitions.transition(
                    vm_id, S.TERMINATED, reason="deleted", expect=S.PENDING
                )
            else:
                if state == S.DRAINING and vm.marker != Marker.DELETING:
                    raise Conflict(f"VM {vm_id} is draining ({vm.marker}); try again when it settles")
                if state != S.DRAINING:
                    await self.transitions.transition(
                        vm_id, S.DRAINING, marker=Marker.DELETING, reason="deleting", expect=state
                    )
                try:
                    await self.manager.stop(vm_id)
                except Exception as exc:
                    # Stays DRAINING+deleting: a repeated delete or reconciliation retries.
                    raise BackendError(f"stopping VM {vm_id} failed: {as_pal(exc).message}") from exc
                vm = await self.transitions.transition(
                    vm_id, S.TERMINATED, reason="deleted", expect=S.DRAINING
                )
        await self._release_snapshots(vm)
        return vm

    async def _release_snapshots(self, vm: VmRecord) -> None:
        """Delete the snapshots a terminated VM leaves that no live VM still needs.

        Candidates: its pause snapshot, the fork snapshots its children map, and (when its
        parent is gone too) the parent snapshot it mapped itself. Best-effort: a failure is
        logged and the snapshot is left to retention.
        """
        candidates: set[tuple[str, str]] = set()  # (owner vm_id, snapshot_id)
        if vm.snapshot_id:
            candidates.add((vm.vm_id, vm.snapshot_id))
        for child in self.store.list_vms(parent_vm_id=vm.vm_id):
            if child.mem_snapshot_id:
                candidates.add((vm.vm_id, child.mem_snapshot_id))
        if vm.parent_vm_id and vm.mem_snapshot_id:
            parent = self.store.get_vm(vm.parent_vm_id)
            if parent is None or parent.state == S.TERMINATED:
                candidates.add((vm.parent_vm_id, vm.mem_snapshot_id))
        avid = vm.agent_version_id
        if not avid:
            return
        for owner, sid in sorted(candidates):
            users = [
                v
                for v in self.store.list_vms(mem_snapshot_id=sid)
                if v.state not in FINAL and v.vm_id != vm.vm_id
            ]
            owner_vm = self.store.get_vm(owner)
            if owner_vm and owner_vm.state not in FINAL and owner_vm.snapshot_id == sid:
                users.append(owner_vm)
            if users:
                continue
            try:
                await self.manager.delete_snapshot(avid, owner, sid)
            except Exception as exc:
                log.warning("could not delete snapshot %s of %s: %s", sid, owner, exc)

    # -- pause / resume ------------------------------------------------------------------------

    async def pause(self, tenant_id: str, vm_id: str) -> VmView:
        self._own(tenant_id, vm_id)
        async with self.op_lock(vm_id):
            vm = await self._pause_locked(
                vm_id, by="operator", marker=Marker.PAUSING, reason="paused by operator"
            )
        return VmView.of(vm)

    async def idle_pause(self, vm_id: str, *, still_idle: Callable[[VmRecord], bool]) -> VmRecord | None:
        """The idle sweeper's suspend: same path as pause; skipped if the VM woke meanwhile."""
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            if vm.state != S.RUNNING or self.inflight.get(vm_id, 0) or not still_idle(vm):
                return None
            return await self._pause_locked(vm_id, by="idle", marker=Marker.IDLE_PAUSING, reason=IDLE_REASON)

    async def _pause_locked(self, vm_id: str, *, by: str, marker: Marker, reason: str) -> VmRecord:
        vm = self._reload(vm_id)
        if vm.state != S.RUNNING:
            raise Conflict(f"VM {vm_id} is {vm.state}; only a running VM can be paused")
        prev = vm.snapshot_id
        snap_id = new_snapshot_id()
        # The snapshot id is persisted with DRAINING, before the manager stops anything, so a
        # restarted control plane can check whether this snapshot completed (reconcile.py).
        await self.transitions.transition(
            vm_id, S.DRAINING, marker=marker, reason=reason, expect=S.RUNNING, snapshot_id=snap_id
        )
        failpoints.hit("pause:draining")
        try:
            await self.manager.snapshot(
                vm_id,
                SnapshotRequest(
                    snapshot_id=snap_id,
                    agent_version_id=vm.agent_version_id or "",
                    tenant_id=vm.tenant_id,
                    keep_running=False,
                    parent_snapshot_id=prev,
                    protected=self._protected_snapshots(vm),
                ),
            )
        except Exception as exc:
            err = as_pal(exc)
            alive = await self.is_alive(vm_id, vm.incarnation)
            if alive:
                await self.transitions.transition(
                    vm_id,
                    S.RUNNING,
                    reason=f"pause failed: {err.message}",
                    expect=S.DRAINING,
                    snapshot_id=prev,
                )
                raise BackendError(
                    f"pause of VM {vm_id} failed (it is still running): {err.message}"
                ) from exc
            await self.stop_quietly(vm_id)  # in case the heartbeat was wrong or failed
            await self.transitions.transition(
                vm_id,
                S.FAILED,
                reason=f"pause failed and the VM is gone: {err.message}",
                expect=S.DRAINING,
                snapshot_id=prev,
            )
            raise BackendError(f"pause of VM {vm_id} failed and the VM is gone: {err.message}") from exc
        failpoints.hit("pause:snapshotted")
        return await self.transitions.transition(
            vm_id, S.PAUSED, reason=reason, expect=S.DRAINING, paused_by=by, mem_snapshot_id=None
        )

    async def resume(self, tenant_id: str, vm_id: str) -> VmView:
        self._own(tenant_id, vm_id)
        async with self.op_lock(vm_id):
            vm = await self._resume_locked(vm_id)
        return VmView.of(vm, boot_method="restore")

    async def _resume_locked(self, vm_id: str) -> VmRecord:
        vm = self._reload(vm_id)
        if vm.state != S.PAUSED:
            raise Conflict(f"VM {vm_id} is {vm.state}; only a paused VM can be resumed")
        if not vm.snapshot_id:
            raise Conflict(f"VM {vm_id} has no snapshot to resume from")
        quotas.reserve(self.store, vm.tenant_id, existing=[vm_id])  # first: 402 changes nothing
        try:
            vm = await self.transitions.transition(
                vm_id,
                S.SPAWNING,
                marker=Marker.RESUMING,
                expect=S.PAUSED,
                # a new incarnation and token: credentials frozen in the snapshot are refused
                incarnation=vm.incarnation + 1,
                token=new_token(),
            )
        except BaseException:
            quotas.release(self.store, vm_id)
            raise
        failpoints.hit("resume:spawning")
        restore = RestoreFrom(
            snapshot_id=vm.snapshot_id or "",
            agent_version_id=vm.agent_version_id or "",
            source_vm_id=vm_id,
            tenant_id=vm.tenant_id,
            mem_mode="shared",
        )
        try:
            res = await self.manager.spawn(self._spawn_request(vm, restore))
        except Exception as exc:
            err = as_pal(exc)
            # SPAWNING -> PAUSED releases the slot; the snapshot is untouched, so resumable again.
            await self.transitions.transition(
                vm_id, S.PAUSED, reason=f"resume failed: {err.message}", expect=S.SPAWNING
            )
            raise err from exc
        failpoints.hit("resume:spawned")
        return await self.transitions.transition(
            vm_id,
            S.RUNNING,
            expect=S.SPAWNING,
            paused_by=None,
            mem_snapshot_id=res.mem_snapshot_id,
            agent_version_id=res.agent_version_id or vm.agent_version_id,
            node_id=self.node_id,
            last_activity_unix_ms=self.now_ms(),
        )

    # -- fork ---------------------------------------------------------------------------------

    async def fork(self, tenant_id: str, vm_id: str, count: int) -> ForkResult:
        if isinstance(count, bool) or not isinstance(count, int):
            raise InvalidRequest("count must be an integer")
        limit = self.settings.max_fork_count
        if count < 1 or count > limit:
            raise InvalidRequest(f"count must be between 1 and {limit} (PAL_MAX_FORK_COUNT), got {count}")
        self._own(tenant_id, vm_id)
        async with self.op_lock(vm_id):
            src = self._reload(vm_id)
            if src.state not in (S.RUNNING, S.PAUSED):
                raise Conflict(f"VM {vm_id} is {src.state}; only a running or paused VM can be forked")
            if src.state == S.PAUSED and not src.snapshot_id:
                raise Conflict(f"paused VM {vm_id} has no snapshot to fork from")
            snap_id = src.snapshot_id if src.state == S.PAUSED and src.snapshot_id else new_snapshot_id()
            children = [self._child_row(src, snap_id) for _ in range(count)]
            # All N rows and slots in one transaction, before any snapshot I/O: 402 leaves nothing.
            await self.transitions.create(tenant_id, children, reason=f"fork of {vm_id}")
            if src.state == S.RUNNING:
                error = await self._fork_snapshot(src, snap_id)
                if error is not None:
                    for c in children:
                        await self.transitions.transition(
                            c.vm_id, S.FAILED, reason=error, expect=S.SPAWNING, mem_snapshot_id=None
                        )
                    return ForkResult(vm_id, snap_id, [ForkChild(c.vm_id, S.FAILED, error) for c in children])
        sem = asyncio.Semaphore(max(1, self.settings.fork_concurrency))
        forks = await asyncio.gather(*(self._spawn_child(src, c.vm_id, snap_id, sem) for c in children))
        return ForkResult(source_vm_id=vm_id, snapshot_id=snap_id, forks=list(forks))

    def _child_row(self, src: VmRecord, snap_id: str) -> VmRecord:
        now = utcnow()
        return VmRecord(
            vm_id=new_vm_id(),
            tenant_id=src.tenant_id,
            state=S.SPAWNING.value,
            marker=Marker.FORKING.value,
            image=src.image,
            limits=dict(src.limits),
            created_at=now,
            updated_at=now,
            agent_version_id=src.agent_version_id,
            idle_timeout_secs=src.idle_timeout_secs,
            secrets=dict(src.secrets),
            boot=src.boot,
            parent_vm_id=src.vm_id,
            mem_snapshot_id=snap_id,
            incarnation=1,  # its own identity: a fresh incarnation line and token
            token=new_token(),
            last_activity_unix_ms=self.now_ms(),
        )

    async def _fork_snapshot(self, src: VmRecord, snap_id: str) -> str | None:
        """Snapshot a running source, keeping it running; the error text on failure."""
        try:
            await self.manager.snapshot(
                src.vm_id,
                SnapshotRequest(
                    snapshot_id=snap_id,
                    agent_version_id=src.agent_version_id or "",
                    tenant_id=src.tenant_id,
                    keep_running=True,
                    parent_snapshot_id=src.snapshot_id,
                    protected=self._protected_snapshots(src),
                ),
            )
            return None
        except Exception as exc:
            err = as_pal(exc)
            if await self.is_alive(src.vm_id, src.incarnation) is False:
                await self.transitions.transition(
                    src.vm_id,
                    S.FAILED,
                    reason=f"QEMU exited during a fork snapshot: {err.message}",
                    expect=S.RUNNING,
                )
            return f"fork snapshot failed: {err.message}"

    async def _spawn_child(
        self, src: VmRecord, child_id: str, snap_id: str, sem: asyncio.Semaphore
    ) -> ForkChild:
        async with sem, self.op_lock(child_id):
            child = self._reload(child_id)
            if child.state != S.SPAWNING:  # deleted while it waited for its turn
                return ForkChild(child_id, S(child.state), child.reason)
            restore = RestoreFrom(
                snapshot_id=snap_id,
                agent_version_id=src.agent_version_id or "",
                source_vm_id=src.vm_id,
                tenant_id=src.tenant_id,
                mem_mode="private",
            )
            try:
                res = await self.manager.spawn(self._spawn_request(child, restore))
            except Exception as exc:
                err = as_pal(exc)
                await self.transitions.transition(
                    child_id, S.FAILED, reason=f"fork spawn failed: {err.message}", expect=S.SPAWNING
                )
                return ForkChild(child_id, S.FAILED, err.message)
            await self.transitions.transition(
                child_id,
                S.RUNNING,
                expect=S.SPAWNING,
                agent_version_id=res.agent_version_id or child.agent_version_id,
                mem_snapshot_id=res.mem_snapshot_id or snap_id,
                node_id=self.node_id,
                last_activity_unix_ms=self.now_ms(),
            )
            return ForkChild(child_id, S.RUNNING)

    # -- exec and files -----------------------------------------------------------------------

    async def _ensure_running(self, tenant_id: str, vm_id: str) -> None:
        """RUNNING: go. Idle-paused: resume transparently (audited). Anything else: 409."""
        vm = self._own(tenant_id, vm_id)
        if vm.state == S.RUNNING:
            return
        async with self.op_lock(vm_id):
            vm = self._reload(vm_id)
            if vm.state == S.RUNNING:
                return
            if vm.state == S.PAUSED and vm.paused_by == "idle":
                await self._resume_locked(vm_id)
                self.store.add_event(
                    vm_id, vm.tenant_id, AUTO_RESUME_EVENT, reason="resumed for an exec or file request"
                )
                return
            if vm.state == S.PAUSED:
                raise Conflict(f"VM {vm_id} was paused by an operator; resume it first")
            raise Conflict(f"VM {vm_id} is {vm.state}; it must be running")

    @contextlib.asynccontextmanager
    async def _request(self, tenant_id: str, vm_id: str) -> AsyncIterator[None]:
        # Counted in flight before ensure_running, so the sweeper cannot suspend it between.
        self.inflight[vm_id] = self.inflight.get(vm_id, 0) + 1
        try:
            await self._ensure_running(tenant_id, vm_id)
            self._stamp(vm_id)
            yield
        finally:
            n = self.inflight.get(vm_id, 1) - 1
            if n <= 0:
                self.inflight.pop(vm_id, None)
            else:
                self.inflight[vm_id] = n
            self._stamp(vm_id)

    def _stamp(self, vm_id: str) -> None:
        self.store.update_vm(vm_id, last_activity_unix_ms=self.now_ms())

    async def exec_stream(self, tenant_id: str, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Errors (404/409/402) are raised on the first ``__anext__``, before any event."""
        async with self._request(tenant_id, vm_id):
            async for ev in self.manager.exec_stream(vm_id, req):
                yield ev

    async def list_files(self, tenant_id: str, vm_id: str, path: str) -> FileList:
        async with self._request(tenant_id, vm_id):
            return await self.manager.list_files(vm_id, path)

    async def read_file(self, tenant_id: str, vm_id: str, path: str) -> tuple[bytes, bool]:
        async with self._request(tenant_id, vm_id):
            return await self.manager.read_file(vm_id, path)

    async def write_file(self, tenant_id: str, vm_id: str, path: str, data: bytes) -> FileWritten:
        async with self._request(tenant_id, vm_id):
            return await self.manager.write_file(vm_id, path, data)
