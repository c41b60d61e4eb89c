"""How a request for the guest (exec, files, ports, processes, code) gets its VM: resolved
once into a :class:`ResolvedVm` that every later step of the request uses.

:meth:`Waker.resolve`: the tenant's VM or 404 (its record read once), counted in flight
while the request lasts (the idle sweeper leaves it alone), running by the state table
(EXEC allowed) or else woken transparently when it was paused automatically (idle suspend,
either tier, or wait management; an operator's pause is 409), its activity stamped once
when the request ends. A long-lived call also holds one of the tenant's and the VM's
stream slots meanwhile (429 past them: streams.py).

:meth:`ResolvedVm.retry` is THE wake-and-retry loop: a node that answers 409 LIVE_PAUSED
(an automatic live pause came between the check and the node) gets the VM woken and the
call again, at most WAKE_RETRIES times.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

from pal.errors import LivePaused, PalError
from pal.scheduler import states
from pal.scheduler.deps import Deps
from pal.scheduler.states import AUTO_LIVE_MARKERS, Action, VmState
from pal.scheduler.streams import StreamBudget
from pal.store import VmRecord
from pal.wire.handlers import NodeCalls
from pal.wire.tunnel import TunnelStream
from pal.wire.verbs import Call, Stream, Tunnel

log = logging.getLogger(__name__)
S, A = VmState, Action
R = TypeVar("R")
Req = TypeVar("Req", bound=BaseModel)
Ans = TypeVar("Ans", bound=BaseModel)
Ev = TypeVar("Ev", bound=BaseModel)

# A call that meets a VM live-paused automatically after our state check wakes it and tries
# again (at most this many times).
WAKE_RETRIES = 2
AUTO_RESUME_EVENT = "auto_resume"

# The two resumes a wake may take (the caller holds the VM's operation lock and hands them
# the record it read under it): live.py's (record, trigger, why) and pause_resume.py's
# restore (record, trigger); each answers the running VM's record.
LiveResume = Callable[[VmRecord, str, str], Awaitable[VmRecord]]
SnapshotResume = Callable[[VmRecord, str], Awaitable[VmRecord]]


def runs(vm: VmRecord) -> bool:
    """Whether the VM's guest takes requests: the state table's word (EXEC allowed)."""
    return states.allowed(S(vm.state), A.EXEC)


def is_live_paused_error(exc: BaseException) -> bool:
    """The node's answer to a guest call on a live-paused VM (the one check of it)."""
    return isinstance(exc, PalError) and exc.code == LivePaused.code


@dataclass(frozen=True)
class Waker:
    d: Deps
    live_resume: LiveResume
    snapshot_resume: SnapshotResume
    streams: StreamBudget  # long-lived calls per tenant and per VM (streams.py)

    @contextlib.asynccontextmanager
    async def resolve(self, tenant_id: str, vm_id: str, *, long: bool = False) -> AsyncIterator[ResolvedVm]:
        """The tenant's running VM for the duration of the context (see the module's doc).
        Failure: 404 (not the tenant's), 409 (not running and not woken: an operator's
        pause, a VM that never ran or is gone), 429 (``long`` past a stream budget), or the
        resume's error."""
        # Ownership first: a request naming another tenant's VM is 404 and leaves no trace
        # on it (no in-flight count, no activity stamp that would keep it awake).
        vm = self.d.own(tenant_id, vm_id)
        with self.streams.lease(tenant_id, vm_id) if long else contextlib.nullcontext():
            # Counted in flight before the wake, so the sweeper cannot suspend it between.
            self.d.locks.enter(vm_id)
            try:
                if not runs(vm):
                    vm = await self.wake(vm_id)
                yield ResolvedVm(vm, self.d.node(vm), self)
            finally:
                self.d.locks.leave(vm_id)
                self._stamp(vm_id)

    async def wake(self, vm_id: str) -> VmRecord:
        """Prerequisites: a VM the caller owns. Success: its running record, after a
        transparent resume of an automatic pause (an auto_resume event says so). Failure:
        409 for any other state (an operator's pause: "resume it first"), or the resume's."""
        d = self.d
        async with d.locks.op_lock(vm_id):
            vm = d.reload(vm_id)
            if runs(vm):
                return vm
            if vm.state == S.PAUSED and vm.marker in AUTO_LIVE_MARKERS:
                running = await self.live_resume(vm, "wake", "resumed for an exec or file request")
                why = "live-resumed for an exec or file request"
            elif vm.paused_by == "idle" and states.allowed(S(vm.state), A.RESUME, vm.marker):
                running = await self.snapshot_resume(vm, "wake")
                why = "resumed for an exec or file request"
            else:
                hint = (
                    f"VM {vm_id} was paused by an operator; resume it first" if vm.state == S.PAUSED else None
                )
                states.check(vm_id, vm.state, A.EXEC, vm.marker, hint=hint)
                raise AssertionError("the table allows EXEC only on running VMs")
            d.store.add_event(vm_id, vm.tenant_id, AUTO_RESUME_EVENT, reason=why)
            return running

    def _stamp(self, vm_id: str) -> None:
        # Best effort: a store that cannot write (disk full) must not fail the request; the
        # in-flight count kept the VM awake meanwhile.
        try:
            self.d.store.update_vm(vm_id, last_activity_unix_ms=self.d.now_ms())
        except Exception as exc:
            log.warning("could not stamp activity of %s: %s", vm_id, exc)


@dataclass
class ResolvedVm:
    """The VM one guest request works on: its record (as read once, or as a wake left it)
    and the client of its node. Every call of the request goes through :meth:`retry`."""

    vm: VmRecord
    node: NodeCalls
    waker: Waker

    @property
    def vm_id(self) -> str:
        return self.vm.vm_id

    @property
    def incarnation(self) -> int:
        return self.vm.incarnation

    async def retry(self, attempt: Callable[[NodeCalls], Awaitable[R]]) -> R:
        """``attempt`` on the VM's node; after a 409 LIVE_PAUSED the VM is woken and
        ``attempt`` made again (at most WAKE_RETRIES times)."""
        for n in range(WAKE_RETRIES + 1):
            try:
                return await attempt(self.node)
            except PalError as exc:
                if not is_live_paused_error(exc) or n == WAKE_RETRIES:
                    raise
            self.vm = await self.waker.wake(self.vm.vm_id)
            self.node = self.waker.d.node(self.vm)
        raise AssertionError("the loop returns or raises on its last attempt")

    async def call(self, verb: Call[Req, Ans], req: Req) -> Ans:
        return await self.retry(lambda node: node.call(verb, req))

    async def open(self, verb: Tunnel[Req], req: Req) -> TunnelStream:
        return await self.retry(lambda node: node.open(verb, req))

    async def stream(self, verb: Stream[Req, Ev], req: Req) -> tuple[Ev, AsyncGenerator[Ev, None]] | None:
        """The stream's first event and the rest (None: it ended before one). A refusal is
        raised here, before any event, so it keeps its status."""

        async def first(node: NodeCalls) -> tuple[Ev, AsyncGenerator[Ev, None]] | None:
            events = node.stream(verb, req)
            try:
                return await events.__anext__(), events
            except StopAsyncIteration:
                return None

        return await self.retry(first)
