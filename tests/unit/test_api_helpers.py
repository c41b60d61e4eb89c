"""Shared by the API, SDK and CLI tests: a scripted in-memory Scheduler with the real
interface, a real SQLite Store for API keys, and a real uvicorn server on loopback (the
only way to see SSE chunks arrive before a command ends; httpx's ASGI transport buffers).

Holds no tests itself.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from pal.api.app import create_app
from pal.config import Settings
from pal.errors import Conflict, InvalidRequest, NotFound, QuotaExceeded
from pal.manager.models import ExecEvent, FileList, FileWritten
from pal.scheduler.spec import AgentSpec, ExecRequest
from pal.scheduler.states import IllegalTransition, VmState
from pal.scheduler.views import EventView, ForkChild, ForkResult, VmView
from pal.store import Store


@dataclass
class StubScheduler:
    """Behaves like the Scheduler towards the API: tenant scoping, quota, states, exec
    scripts. `gate` lets a test hold the `slow` command between its two chunks."""

    max_vms: int = 2
    vms: dict[str, VmView] = field(default_factory=dict)
    files: dict[tuple[str, str], bytes] = field(default_factory=dict)
    gate: threading.Event = field(default_factory=threading.Event)
    written: list[tuple[str, int]] = field(default_factory=list)
    slow_done: bool = False  # the `slow` command got past its gate
    slow_cancelled: threading.Event = field(default_factory=threading.Event)

    def _live(self, tenant: str) -> int:
        return sum(1 for v in self.vms.values() if v.tenant_id == tenant and v.state == VmState.RUNNING)

    async def schedule(self, tenant_id: str, spec: AgentSpec) -> VmView:
        if spec.image != "default":
            raise InvalidRequest(f"unknown image {spec.image!r}: run `pal image build {spec.image}`")
        if self._live(tenant_id) >= self.max_vms:
            raise QuotaExceeded(f"tenant has {self.max_vms} running VMs (max_vms)")
        vm = VmView(
            vm_id="vm-" + uuid.uuid4().hex[:12],
            tenant_id=tenant_id,
            state=VmState.RUNNING,
            image=spec.image,
            limits=spec.limits,
            created_at=datetime.now(UTC),
            snapshot_id=None,
            parent_vm_id=None,
            reason=None,
            idle_timeout_secs=spec.idle_timeout_secs,
            marker="",
            paused_by=None,
        )
        self.vms[vm.vm_id] = vm
        return vm

    async def get(self, tenant_id: str, vm_id: str) -> VmView:
        vm = self.vms.get(vm_id)
        if vm is None or vm.tenant_id != tenant_id:
            raise NotFound(f"no VM {vm_id}")
        return vm

    async def list(self, tenant_id: str) -> list[VmView]:
        return [v for v in self.vms.values() if v.tenant_id == tenant_id]

    async def delete(self, tenant_id: str, vm_id: str) -> VmView:
        vm = await self.get(tenant_id, vm_id)
        vm.state = VmState.TERMINATED
        return vm

    async def pause(self, tenant_id: str, vm_id: str) -> VmView:
        vm = await self.get(tenant_id, vm_id)
        if vm.state != VmState.RUNNING:
            raise IllegalTransition(vm_id, vm.state, VmState.DRAINING)
        vm.state, vm.snapshot_id, vm.paused_by = VmState.PAUSED, "snap-1", "operator"
        return vm

    async def resume(self, tenant_id: str, vm_id: str) -> VmView:
        vm = await self.get(tenant_id, vm_id)
        if vm.state != VmState.PAUSED:
            raise Conflict(f"VM {vm_id} is {vm.state.value}, not paused")
        if self._live(tenant_id) >= self.max_vms:
            raise QuotaExceeded("quota exhausted")
        vm.state, vm.paused_by = VmState.RUNNING, None
        return vm

    async def fork(self, tenant_id: str, vm_id: str, count: int) -> ForkResult:
        await self.get(tenant_id, vm_id)
        if not 1 <= count <= 100:
            raise InvalidRequest("count must be between 1 and 100")
        kids = [ForkChild(vm_id=f"{vm_id}-f{i}", state=VmState.RUNNING) for i in range(count - 1)]
        kids.append(ForkChild(vm_id=f"{vm_id}-bad", state=VmState.FAILED, error="restore failed"))
        return ForkResult(source_vm_id=vm_id, snapshot_id="snap-f", forks=kids)

    async def exec_stream(self, tenant_id: str, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        vm = await self.get(tenant_id, vm_id)
        if vm.state != VmState.RUNNING:
            raise Conflict(f"VM {vm_id} is {vm.state.value} (paused by an operator)")
        if req.command == "echo":
            yield ExecEvent(type="stdout", data=" ".join(req.argv) + "\n")
            yield ExecEvent(type="stderr", data="warn\n")
            yield ExecEvent(type="exit", exit_code=3 if "fail" in req.argv else 0)
        elif req.command == "slow":
            try:
                yield ExecEvent(type="stdout", data="first\n")
                # the test releases the gate only after it has received "first"
                await asyncio.to_thread(self.gate.wait, 30)
                self.slow_done = True
            except (asyncio.CancelledError, GeneratorExit):
                self.slow_cancelled.set()  # what the real scheduler turns into a guest cancel
                raise
            yield ExecEvent(type="stdout", data="second\n")
            yield ExecEvent(type="exit", exit_code=0)
        elif req.command == "sleepy":
            yield ExecEvent(type="stdout", data="partial")
            yield ExecEvent(type="error", code="ETIMEDOUT", message="killed after 1s")
        else:
            yield ExecEvent(type="error", code="ENOENT", message=f"{req.command}: not found")

    async def list_files(self, tenant_id: str, vm_id: str, path: str) -> FileList:
        await self.get(tenant_id, vm_id)
        entries: list[dict[str, object]] = [
            {"name": name, "type": "file", "size": len(data)}
            for (vid, name), data in self.files.items()
            if vid == vm_id
        ]
        return FileList(path=path, entries=entries, truncated=False)

    async def read_file(self, tenant_id: str, vm_id: str, path: str) -> tuple[bytes, bool]:
        await self.get(tenant_id, vm_id)
        if (vm_id, path) not in self.files:
            raise NotFound(f"no file {path}")
        data = self.files[(vm_id, path)]
        return data[: 1024 * 1024], len(data) > 1024 * 1024

    async def write_file(self, tenant_id: str, vm_id: str, path: str, data: bytes) -> FileWritten:
        await self.get(tenant_id, vm_id)
        self.files[(vm_id, path)] = data
        self.written.append((path, len(data)))
        return FileWritten(path=path, bytes_written=len(data))

    async def events(self, tenant_id: str, vm_id: str) -> list[EventView]:
        vm = await self.get(tenant_id, vm_id)
        now = datetime.now(UTC)
        return [
            EventView(at=vm.created_at, kind="status", from_state=None, to_state="running", reason=None),
            EventView(at=now, kind="auto_resume", from_state="paused", to_state="running", reason="exec"),
        ]


@dataclass
class Env:
    app: FastAPI
    scheduler: StubScheduler
    store: Store
    key_a: str
    key_b: str


def make_env(tmp: Path, health: object = None) -> Env:
    store = Store(f"sqlite:///{tmp / 'pal.db'}")
    _, key_a = store.create_tenant("alice", 2)
    _, key_b = store.create_tenant("bob", 2)
    sched = StubScheduler()
    app = create_app(sched, store, Settings(data_dir=tmp), health=health)  # type: ignore[arg-type]
    return Env(app, sched, store, key_a, key_b)


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` on an ephemeral loopback port in a thread; yields its base URL and
    always stops the server."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(500):
            if server.started:
                break
            threading.Event().wait(0.01)
        assert server.started, "test server did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
