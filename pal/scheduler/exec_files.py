"""Exec, files and ports: the scheduler's calls into a running guest, routed to the VM's
node. THE room for what talks to the guest: background processes (journals, stdin,
signals, PTYs; issue 22) and code contexts (issue 26) go here, each the same way:

1. ``async with self.waker.request(tenant_id, vm_id)``: the tenant's VM, running (woken if
   it was paused automatically), counted in flight while the call lasts (wake.py); a
   long-lived call (a stream, a long poll, a cell, a port connection) says ``long=True``
   and holds one of the tenant's and the VM's slots meanwhile (429 past them: streams.py);
2. ``await self.waker.woken_call(tenant_id, vm_id, lambda n: n.<rpc>(vm_id, ...))``: the
   node's RPC (pal/manager/api.py), retried after a wake if an automatic live pause came
   between;
3. node errors pass through as they are (PalError with the node's status and code).

Nothing here changes a VM's state: EXEC is an action that keeps it (states.py, STAYS).

Prerequisites of every call: the tenant's VM (404), EXEC allowed (running) after an
automatic wake (409 otherwise, e.g. an operator's pause). Success: the node's answer; the
VM's activity stamped. Failure: the node's error (404 path, 502 nothing listening, ...).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pal.errors import InvalidRequest, PalError, Unavailable
from pal.manager.api import RuntimeManager
from pal.manager.code_models import CodeContext, CodeEvent, CodeRequest, ContextCreate
from pal.manager.models import ExecEvent, FileDeleted, FileList, FileWritten
from pal.manager.process_models import ProcessDeleted, ProcessEvent, ProcessInfo, ProcessOutput, StdinWritten
from pal.manager.tunnel import TunnelStream
from pal.scheduler.deps import Deps
from pal.scheduler.live import is_live_paused_error
from pal.scheduler.wake import WAKE_RETRIES, Waker
from pal.spec import ExecRequest, ProcessStartRequest, SignalRequest, Terminal

R = TypeVar("R")
E = TypeVar("E")


NODE_UNREACHABLE = "NODE_UNREACHABLE"  # pal/manager/client.py's code for a node gone away


def _check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"port {port} is outside 1-65535")


@dataclass(frozen=True)
class ExecAndFiles:
    d: Deps
    waker: Waker

    # -- exec ----------------------------------------------------------------------------------

    async def exec_stream(self, tenant_id: str, vm_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Errors (404/409/402) are raised on the first ``__anext__``, before any event."""
        t0 = time.perf_counter()
        async with self.waker.request(tenant_id, vm_id, long=True):
            opened = await self._woken_stream(tenant_id, vm_id, lambda n: n.exec_stream(vm_id, req))
            if opened is None:
                return
            first, events = opened
            self.d.telemetry.first_exec_done(vm_id, time.perf_counter() - t0)
            yield first
            async for ev in events:
                yield ev

    async def _woken_stream(
        self, tenant_id: str, vm_id: str, open_events: Callable[[RuntimeManager], AsyncIterator[E]]
    ) -> tuple[E, AsyncIterator[E]] | None:
        """A node stream and its first event (None: it ended before one), opened again after
        waking the VM when it was live-paused meanwhile. Called inside ``waker.request``."""
        d = self.d
        for attempt in range(WAKE_RETRIES + 1):
            events = open_events(d.node(d.reload(vm_id)))
            try:
                return await events.__anext__(), events
            except StopAsyncIteration:
                return None
            except PalError as exc:
                if is_live_paused_error(exc) and attempt < WAKE_RETRIES:
                    await self.waker.ensure_running(tenant_id, vm_id)  # paused meanwhile: wake it
                    continue
                raise
        raise AssertionError("the loop returns or raises on its last attempt")

    # -- code contexts (issue 26; docs/agents.md) ----------------------------------------------
    # As processes: the tenant's VM (404), woken when an automatic pause stopped it, in
    # flight while the call (or the cell) lasts.

    async def run_code(self, tenant_id: str, vm_id: str, req: CodeRequest) -> AsyncIterator[CodeEvent]:
        """A cell's events; errors (404/409/400/429) are raised on the first ``__anext__``."""
        d = self.d
        async with self.waker.request(tenant_id, vm_id, long=True):
            for attempt in range(WAKE_RETRIES + 1):
                events = d.node(d.reload(vm_id)).run_code(vm_id, req)
                try:
                    first = await events.__anext__()
                except StopAsyncIteration:
                    return
                except PalError as exc:
                    if is_live_paused_error(exc) and attempt < WAKE_RETRIES:
                        await self.waker.ensure_running(tenant_id, vm_id)
                        continue
                    raise
                yield first
                async for ev in events:
                    yield ev
                return

    async def create_context(self, tenant_id: str, vm_id: str, req: ContextCreate) -> CodeContext:
        # A kernel's start takes seconds to minutes: long-lived.
        return await self._files_call(tenant_id, vm_id, lambda n: n.create_context(vm_id, req), long=True)

    async def list_contexts(self, tenant_id: str, vm_id: str) -> list[CodeContext]:
        return await self._files_call(tenant_id, vm_id, lambda n: n.list_contexts(vm_id))

    async def delete_context(self, tenant_id: str, vm_id: str, ctx: str) -> None:
        await self._files_call(tenant_id, vm_id, lambda n: n.delete_context(vm_id, ctx))

    async def interrupt_context(self, tenant_id: str, vm_id: str, ctx: str) -> bool:
        return await self._files_call(tenant_id, vm_id, lambda n: n.interrupt_context(vm_id, ctx))

    # -- ports ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def port_stream(self, tenant_id: str, vm_id: str, port: int) -> AsyncIterator[TunnelStream]:
        """A byte stream to the server on ``port`` in the VM, open while the context is.

        Like an exec, the request wakes an idle-suspended VM and waits for it (a VM an
        operator paused is 409), and counts as in flight until the context ends, so the
        idle sweeper leaves the VM alone meanwhile; bytes moved count as activity on the
        node. Failure: 400 (port), 404, 409, 502 when nothing listens on the port."""
        _check_port(port)
        async with self.waker.request(tenant_id, vm_id, long=True):
            stream = await self.waker.woken_call(tenant_id, vm_id, lambda n: n.open_port(vm_id, port))
            try:
                yield stream
            finally:
                await stream.aclose()

    async def open_port(self, tenant_id: str, vm_id: str, port: int) -> TunnelStream:
        """The same for long-lived streams (WebSockets, port-forward): in flight only while
        it opens, so an open but silent stream does not keep the VM awake; the bytes it
        moves count as activity. It holds one of the tenant's and the VM's slots until the
        caller closes it."""
        _check_port(port)
        self.d.own(tenant_id, vm_id)  # 404 before 429
        give = self.waker.streams.take(tenant_id, vm_id)
        try:
            async with self.waker.request(tenant_id, vm_id):
                stream = await self.waker.woken_call(tenant_id, vm_id, lambda n: n.open_port(vm_id, port))
        except BaseException:
            give()
            raise
        stream.on_close(give)
        return stream

    # -- files ---------------------------------------------------------------------------------

    async def _files_call(
        self,
        tenant_id: str,
        vm_id: str,
        call: Callable[[RuntimeManager], Awaitable[R]],
        *,
        long: bool = False,
    ) -> R:
        async with self.waker.request(tenant_id, vm_id, long=long):
            return await self.waker.woken_call(tenant_id, vm_id, call)

    async def list_files(self, tenant_id: str, vm_id: str, path: str) -> FileList:
        return await self._files_call(tenant_id, vm_id, lambda n: n.list_files(vm_id, path))

    async def read_file(self, tenant_id: str, vm_id: str, path: str) -> tuple[bytes, bool]:
        return await self._files_call(tenant_id, vm_id, lambda n: n.read_file(vm_id, path))

    async def write_file(self, tenant_id: str, vm_id: str, path: str, data: bytes) -> FileWritten:
        return await self._files_call(tenant_id, vm_id, lambda n: n.write_file(vm_id, path, data))

    async def delete_file(self, tenant_id: str, vm_id: str, path: str) -> FileDeleted:
        async with self.waker.request(tenant_id, vm_id):
            return await self.d.node(self.d.reload(vm_id)).delete_file(vm_id, path)

    # -- processes (issue 22; docs/processes.md) -----------------------------------------------
    # Each one a guest request like the files': the tenant's VM (404), woken when an automatic
    # pause stopped it (an operator's pause: 409), in flight while it lasts (so a long poll or
    # an attached reader keeps the VM awake).

    async def start_process(self, tenant_id: str, vm_id: str, req: ProcessStartRequest) -> ProcessInfo:
        return await self._files_call(tenant_id, vm_id, lambda n: n.start_process(vm_id, req))

    async def list_processes(self, tenant_id: str, vm_id: str) -> list[ProcessInfo]:
        return await self._files_call(tenant_id, vm_id, lambda n: n.list_processes(vm_id))

    async def get_process(self, tenant_id: str, vm_id: str, pid: int) -> ProcessInfo:
        return await self._files_call(tenant_id, vm_id, lambda n: n.get_process(vm_id, pid))

    async def delete_process(self, tenant_id: str, vm_id: str, pid: int) -> ProcessDeleted:
        return await self._files_call(tenant_id, vm_id, lambda n: n.delete_process(vm_id, pid))

    async def read_output(
        self, tenant_id: str, vm_id: str, pid: int, start: int, max_bytes: int, wait_ms: int
    ) -> ProcessOutput:
        return await self._files_call(
            tenant_id, vm_id, lambda n: n.read_output(vm_id, pid, start, max_bytes, wait_ms), long=wait_ms > 0
        )

    async def write_stdin(self, tenant_id: str, vm_id: str, pid: int, data: bytes, eof: bool) -> StdinWritten:
        return await self._files_call(tenant_id, vm_id, lambda n: n.write_stdin(vm_id, pid, data, eof))

    async def signal_process(self, tenant_id: str, vm_id: str, pid: int, req: SignalRequest) -> None:
        await self._files_call(tenant_id, vm_id, lambda n: n.signal_process(vm_id, pid, req))

    async def resize_process(self, tenant_id: str, vm_id: str, pid: int, size: Terminal) -> None:
        await self._files_call(tenant_id, vm_id, lambda n: n.resize_process(vm_id, pid, size))

    async def wait_process(self, tenant_id: str, vm_id: str, pid: int, timeout_ms: int) -> ProcessInfo:
        return await self._files_call(
            tenant_id, vm_id, lambda n: n.wait_process(vm_id, pid, timeout_ms), long=timeout_ms > 0
        )

    async def attach_process(
        self, tenant_id: str, vm_id: str, pid: int, start: int
    ) -> AsyncIterator[ProcessEvent]:
        """The process's output from ``start`` on, as it comes; errors (404/409/400) are
        raised on the first ``__anext__``, before any event, like an exec's. The stream ends
        with ``exit``, or with ``detached`` (never a made-up exit) when the VM stopped
        running or its node went away; the reader reattaches from the last offset."""
        async with self.waker.request(tenant_id, vm_id, long=True):
            opened = await self._woken_stream(tenant_id, vm_id, lambda n: n.attach_process(vm_id, pid, start))
            if opened is None:
                return
            first, events = opened
            yield first
            try:
                async for ev in events:
                    yield ev
            except Unavailable as exc:
                if exc.code != NODE_UNREACHABLE:
                    raise
                yield ProcessEvent(type="detached", reason="node-unreachable")
