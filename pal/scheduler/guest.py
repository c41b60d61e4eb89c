"""Calls into a running guest, routed to the VM's node: every guest verb of the node RPC
(pal/wire/verbs.py: exec, files, ports, processes, code contexts) goes through here, each
the same way:

1. :meth:`Waker.resolve` (wake.py): the tenant's VM, running (woken if it was paused
   automatically), counted in flight while the call lasts; a long-lived call (by the
   verb's declaration: a stream, a long poll, a kernel's start, a port connection) holds
   one of the tenant's and the VM's stream slots meanwhile (429 past them: streams.py);
2. the verb on the VM's node, through :meth:`ResolvedVm.retry` (woken and asked again when
   an automatic live pause came between);
3. node errors pass through as they are (PalError with the node's status and code).

So a new guest verb needs nothing here: its route calls :meth:`GuestCalls.call` (or
:meth:`GuestCalls.stream`) with the verb and its request. Nothing here changes a VM's
state: EXEC is an action that keeps it (states.py, STAYS).

Prerequisites of every call: the tenant's VM (404), EXEC allowed (running) after an
automatic wake (409 otherwise, e.g. an operator's pause). Success: the node's answer; the
VM's activity stamped. Failure: the node's error (404 path, 502 nothing listening, ...).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

from pal.errors import Unavailable
from pal.scheduler.deps import Deps
from pal.scheduler.node_client import UNREACHABLE
from pal.scheduler.wake import Waker
from pal.wire import verbs
from pal.wire.models import ExecCall, ExecEvent, PortOpen
from pal.wire.processes import AttachFrom, ProcessEvent
from pal.wire.tunnel import TunnelStream
from pal.wire.verbs import Call, Stream

Req = TypeVar("Req", bound=BaseModel)
Ans = TypeVar("Ans", bound=BaseModel)
Ev = TypeVar("Ev", bound=BaseModel)


@dataclass(frozen=True)
class GuestCalls:
    d: Deps
    waker: Waker

    async def call(self, tenant_id: str, verb: Call[Req, Ans], req: Req) -> Ans:
        """A guest verb answered once, on the VM ``req`` names."""
        async with self.waker.resolve(tenant_id, _vm_of(req), long=verb.is_long(req)) as vm:
            return await vm.call(verb, req)

    async def stream(self, tenant_id: str, verb: Stream[Req, Ev], req: Req) -> AsyncGenerator[Ev, None]:
        """A guest verb's events; errors (404/409/402/429 and the node's) are raised on the
        first ``__anext__``, before any event."""
        async with self.waker.resolve(tenant_id, _vm_of(req), long=True) as vm:
            opened = await vm.stream(verb, req)
            if opened is None:
                return
            first, events = opened
            async with contextlib.aclosing(events):
                yield first
                async for ev in events:
                    yield ev

    # -- exec ----------------------------------------------------------------------------------

    async def exec_stream(self, tenant_id: str, req: ExecCall) -> AsyncIterator[ExecEvent]:
        """An exec's events (as :meth:`stream`), its first one timed (telemetry.py)."""
        t0 = time.perf_counter()
        first = True
        async with contextlib.aclosing(self.stream(tenant_id, verbs.EXEC, req)) as events:
            async for ev in events:
                if first:
                    self.d.telemetry.first_exec_done(req.vm_id, time.perf_counter() - t0)
                    first = False
                yield ev

    # -- a process's output ----------------------------------------------------------------------

    async def attach(self, tenant_id: str, req: AttachFrom) -> AsyncGenerator[ProcessEvent, None]:
        """The process's output from ``from`` on, as it comes (as :meth:`stream`). It ends
        with ``exit``, or with ``detached`` (never a made-up exit) when the VM stopped
        running or its node went away; the reader reattaches from the last offset."""
        try:
            async with contextlib.aclosing(self.stream(tenant_id, verbs.ATTACH_PROCESS, req)) as events:
                async for ev in events:
                    yield ev
        except Unavailable as exc:
            if exc.code != UNREACHABLE:
                raise
            yield ProcessEvent(type="detached", reason="node-unreachable")

    # -- ports ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def port_stream(self, tenant_id: str, req: PortOpen) -> AsyncIterator[TunnelStream]:
        """A byte stream to the server on ``port`` in the VM, open while the context is.

        Like an exec, the request wakes an idle-suspended VM and waits for it (a VM an
        operator paused is 409), and counts as in flight until the context ends, so the
        idle sweeper leaves the VM alone meanwhile; bytes moved count as activity on the
        node. Failure: 404, 409, 502 when nothing listens on the port."""
        async with self.waker.resolve(tenant_id, req.vm_id, long=True) as vm:
            stream = await vm.open(verbs.PORT, req)
            try:
                yield stream
            finally:
                await stream.aclose()

    async def open_port(self, tenant_id: str, req: PortOpen) -> TunnelStream:
        """The same for long-lived streams (WebSockets, port-forward): in flight only while
        it opens, so an open but silent stream does not keep the VM awake; the bytes it
        moves count as activity. It holds one of the tenant's and the VM's slots until the
        caller closes it."""
        self.d.own(tenant_id, req.vm_id)  # 404 before 429
        give = self.waker.streams.take(tenant_id, req.vm_id)
        try:
            async with self.waker.resolve(tenant_id, req.vm_id) as vm:
                stream = await vm.open(verbs.PORT, req)
        except BaseException:
            give()
            raise
        stream.on_close(give)
        return stream


def _vm_of(req: BaseModel) -> str:
    return str(req.model_dump(include={"vm_id"})["vm_id"])
