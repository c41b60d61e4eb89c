"""In-memory test doubles. ``FakeManager`` implements pal.manager.api.RuntimeManager."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pal.config import Settings
from pal.errors import NotFound, PalError
from pal.manager.models import (
    ExecEvent,
    FileList,
    FileWritten,
    NodeHeartbeat,
    SnapshotRequest,
    SnapshotResult,
    SnapshotStatus,
    SpawnRequest,
    SpawnResult,
    VmActivity,
)
from pal.scheduler.scheduler import Scheduler
from pal.scheduler.spec import ExecRequest
from pal.store import Store

AGENT_VERSION = "default-0123456789ab"


@dataclass
class FakeVm:
    vm_id: str
    incarnation: int
    token: str
    mem_mode: str | None = None
    has_active_exec: bool = False
    last_activity_unix_ms: int = 0
    last_heartbeat_unix_ms: int = 0  # 0: never reported (not judged stale)
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass
class _Failure:
    exc: Exception
    vm_id: str | None
    times: int
    kill: bool


class FakeManager:
    """A node in memory: ``alive`` VMs, ``snapshots`` (key -> complete), scripted failures.

    ``fail(call, exc, vm_id=..., times=..., kill=...)`` makes the next ``times`` matching
    calls raise ``exc``; with ``kill`` the VM's "QEMU" dies as it fails.
    """

    def __init__(self, node_id: str = "node-1") -> None:
        self.node_id = node_id
        self.alive: dict[str, FakeVm] = {}
        self.snapshots: dict[tuple[str, str, str], bool] = {}
        self.calls: list[tuple[str, str]] = []
        self.spawn_requests: list[SpawnRequest] = []
        self.snapshot_requests: list[tuple[str, SnapshotRequest]] = []
        self.deleted_snapshots: list[tuple[str, str, str]] = []
        self.spawn_delay = 0.0
        self.concurrent_spawns = 0
        self.max_concurrent_spawns = 0
        self.heartbeat_error: Exception | None = None
        self._failures: dict[str, list[_Failure]] = {}

    # -- scripting ------------------------------------------------------------------------

    def fail(
        self, call: str, exc: Exception, *, vm_id: str | None = None, times: int = 1, kill: bool = False
    ) -> None:
        self._failures.setdefault(call, []).append(_Failure(exc, vm_id, times, kill))

    def _maybe_fail(self, call: str, vm_id: str) -> None:
        for f in self._failures.get(call, []):
            if f.times > 0 and (f.vm_id is None or f.vm_id == vm_id):
                f.times -= 1
                if f.kill:
                    self.alive.pop(vm_id, None)
                raise f.exc

    def kill(self, vm_id: str) -> None:
        """Simulate a QEMU crash."""
        self.alive.pop(vm_id, None)

    # -- RuntimeManager ---------------------------------------------------------------------

    async def spawn(self, req: SpawnRequest) -> SpawnResult:
        self.calls.append(("spawn", req.vm_id))
        self.spawn_requests.append(req)
        self.concurrent_spawns += 1
        self.max_concurrent_spawns = max(self.max_concurrent_spawns, self.concurrent_spawns)
        try:
            if self.spawn_delay:
                await asyncio.sleep(self.spawn_delay)
            if req.vm_id in self.alive:
                raise PalError(f"VM {req.vm_id} already runs", status=409, code="FAILED_PRECONDITION")
            self._maybe_fail("spawn", req.vm_id)
            mem_snapshot_id = None
            if req.restore is not None:
                r = req.restore
                if not self.snapshots.get((r.agent_version_id, r.source_vm_id, r.snapshot_id)):
                    raise NotFound(f"snapshot {r.snapshot_id} not found")
                if r.mem_mode == "private":
                    mem_snapshot_id = r.snapshot_id
            self.alive[req.vm_id] = FakeVm(
                req.vm_id, req.incarnation, req.token, req.restore.mem_mode if req.restore else None
            )
            return SpawnResult(
                vm_id=req.vm_id,
                pid=1000 + len(self.spawn_requests),
                incarnation=req.incarnation,
                boot_ms=1.0,
                method="restore" if req.restore else "cold",
                agent_version_id=AGENT_VERSION,
                mem_snapshot_id=mem_snapshot_id,
            )
        finally:
            self.concurrent_spawns -= 1

    async def stop(self, vm_id: str) -> None:
        self.calls.append(("stop", vm_id))
        self._maybe_fail("stop", vm_id)
        self.alive.pop(vm_id, None)

    async def snapshot(self, vm_id: str, req: SnapshotRequest) -> SnapshotResult:
        self.calls.append(("snapshot", vm_id))
        self.snapshot_requests.append((vm_id, req))
        if vm_id not in self.alive:
            raise PalError(f"VM {vm_id} is not running", status=409, code="FAILED_PRECONDITION")
        self._maybe_fail("snapshot", vm_id)
        self.snapshots[(req.agent_version_id, vm_id, req.snapshot_id)] = True
        if not req.keep_running:
            self.alive.pop(vm_id, None)
        return SnapshotResult(
            snapshot_id=req.snapshot_id, path="/fake", sizes={}, durations_ms={}, memory_kind="file"
        )

    async def exec_stream(self, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        self.calls.append(("exec", vm_id))
        if vm_id not in self.alive:
            raise PalError(f"VM {vm_id} is not running", status=409, code="FAILED_PRECONDITION")
        self._maybe_fail("exec", vm_id)
        yield ExecEvent(type="stdout", data=" ".join([req.command, *req.argv]))
        yield ExecEvent(type="exit", exit_code=0)

    def _vm(self, call: str, vm_id: str) -> FakeVm:
        self.calls.append((call, vm_id))
        vm = self.alive.get(vm_id)
        if vm is None:
            raise PalError(f"VM {vm_id} is not running", status=409, code="FAILED_PRECONDITION")
        self._maybe_fail(call, vm_id)
        return vm

    async def list_files(self, vm_id: str, path: str) -> FileList:
        vm = self._vm("list_files", vm_id)
        entries: list[dict[str, object]] = [
            {"name": n, "type": "file", "size": len(b)} for n, b in sorted(vm.files.items())
        ]
        return FileList(path=path, entries=entries, truncated=False)

    async def read_file(self, vm_id: str, path: str) -> tuple[bytes, bool]:
        vm = self._vm("read_file", vm_id)
        if path not in vm.files:
            raise NotFound(f"{path} not found")
        return vm.files[path], False

    async def write_file(self, vm_id: str, path: str, data: bytes) -> FileWritten:
        vm = self._vm("write_file", vm_id)
        vm.files[path] = data
        return FileWritten(path=path, bytes_written=len(data))

    async def heartbeat(self) -> NodeHeartbeat:
        self.calls.append(("heartbeat", ""))
        if self.heartbeat_error is not None:
            raise self.heartbeat_error
        return NodeHeartbeat(
            node_id=self.node_id,
            accel="tcg",
            vms=[
                VmActivity(
                    vm_id=v.vm_id,
                    alive=True,
                    pid=1,
                    incarnation=v.incarnation,
                    has_active_exec=v.has_active_exec,
                    last_activity_unix_ms=v.last_activity_unix_ms,
                    last_heartbeat_unix_ms=v.last_heartbeat_unix_ms,
                )
                for v in self.alive.values()
            ],
        )

    async def snapshot_status(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> SnapshotStatus:
        self.calls.append(("snapshot_status", vm_id))
        return SnapshotStatus(complete=self.snapshots.get((agent_version_id, vm_id, snapshot_id), False))

    async def delete_snapshot(self, agent_version_id: str, vm_id: str, snapshot_id: str) -> None:
        self.calls.append(("delete_snapshot", vm_id))
        self.deleted_snapshots.append((agent_version_id, vm_id, snapshot_id))
        self.snapshots.pop((agent_version_id, vm_id, snapshot_id), None)

    async def apply_retention(self, agent_version_id: str, vm_id: str, protected: list[str]) -> list[str]:
        self.calls.append(("apply_retention", vm_id))
        return []


class FakeClock:
    """A settable ``time.time`` for the scheduler (seconds)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += secs


@dataclass
class SchedEnv:
    store: Store
    manager: FakeManager
    sched: Scheduler
    clock: FakeClock
    tenant_id: str
    settings: Settings


def make_env(tmp_path: Path, *, max_vms: int = 10, **settings_kw: Any) -> SchedEnv:
    """A real store (SQLite in tmp_path), a FakeManager and a Scheduler on a fake clock."""
    settings = Settings(data_dir=tmp_path, **settings_kw)
    store = Store.open(settings)
    tenant, _key = store.create_tenant("acme", max_vms)
    manager = FakeManager()
    clock = FakeClock()
    sched = Scheduler(settings, store, manager, clock=clock)
    return SchedEnv(store, manager, sched, clock, tenant.id, settings)
