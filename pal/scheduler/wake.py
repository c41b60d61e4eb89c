"""How a request for the guest (exec, files, ports; processes and code contexts next) gets
a running VM: the tenant's VM or 404, counted in flight (the idle sweeper leaves it alone),
woken transparently when it was paused automatically (idle suspend, either tier, or wait
management), its activity stamped. Used by exec_files.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pal.errors import PalError
from pal.manager.api import RuntimeManager
from pal.scheduler import states
from pal.scheduler.deps import Deps
from pal.scheduler.live import is_live_paused_error
from pal.scheduler.states import AUTO_LIVE_MARKERS, Action, VmState
from pal.scheduler.streams import StreamBudget
from pal.store import VmRecord

log = logging.getLogger(__name__)
S, A = VmState, Action
R = TypeVar("R")

# A call that meets a VM live-paused automatically after our state check wakes it and tries
# again (at most this many times).
WAKE_RETRIES = 2
AUTO_RESUME_EVENT = "auto_resume"

# The two resumes a wake may take (the caller holds the VM's operation lock): live.py's
# (vm id, trigger, why) and pause_resume.py's restore (vm id, trigger).
LiveResume = Callable[[str, str, str], Awaitable[VmRecord]]
SnapshotResume = Callable[[str, str], Awaitable[VmRecord]]


@dataclass(frozen=True)
class Waker:
    d: Deps
    live_resume: LiveResume
    snapshot_resume: SnapshotResume
    streams: StreamBudget  # long-lived calls per tenant and per VM (streams.py)

    async def ensure_running(self, tenant_id: str, vm_id: str) -> None:
        """Prerequisites: the tenant's VM (404). Success: running (EXEC allowed), after a
        transparent resume of an automatic pause (an auto_resume event says so). Failure:
        409 for any other state (an operator's pause: "resume it first"), or the resume's."""
        d = self.d
        vm = d.own(tenant_id, vm_id)
        if states.allowed(S(vm.state), A.EXEC):
            return
        async with d.op_lock(vm_id):
            vm = d.reload(vm_id)
            if states.allowed(S(vm.state), A.EXEC):
                return
            if vm.state == S.PAUSED and vm.marker in AUTO_LIVE_MARKERS:
                await self.live_resume(vm_id, "wake", "resumed for an exec or file request")
                d.store.add_event(
                    vm_id, vm.tenant_id, AUTO_RESUME_EVENT, reason="live-resumed for an exec or file request"
                )
                return
            if vm.paused_by == "idle" and states.allowed(S(vm.state), A.RESUME, vm.marker):
                await self.snapshot_resume(vm_id, "wake")
                d.store.add_event(
                    vm_id, vm.tenant_id, AUTO_RESUME_EVENT, reason="resumed for an exec or file request"
                )
                return
            hint = f"VM {vm_id} was paused by an operator; resume it first" if vm.state == S.PAUSED else None
            states.check(vm_id, vm.state, A.EXEC, vm.marker, hint=hint)

    @contextlib.asynccontextmanager
    async def request(self, tenant_id: str, vm_id: str, *, long: bool = False) -> AsyncIterator[None]:
        """A running VM for the duration of the context, counted in flight. ``long``: a
        long-lived call, which holds one of the tenant's and the VM's slots meanwhile (429
        when either has none left: streams.py)."""
        # Ownership first: a request naming another tenant's VM is 404 and leaves no trace
        # on it (no in-flight count, no activity stamp that would keep it awake).
        self.d.own(tenant_id, vm_id)
        with self.streams.lease(tenant_id, vm_id) if long else contextlib.nullcontext():
            # Counted in flight before ensure_running, so the sweeper cannot suspend it between.
            self.d.locks.enter(vm_id)
            try:
                await self.ensure_running(tenant_id, vm_id)
                self._stamp(vm_id)
                yield
            finally:
                self.d.locks.leave(vm_id)
                self._stamp(vm_id)

    def _stamp(self, vm_id: str) -> None:
        # Best effort: a store that cannot write (disk full) must not fail the request; the
        # in-flight count keeps the VM awake meanwhile.
        try:
            self.d.store.update_vm(vm_id, last_activity_unix_ms=self.d.now_ms())
        except Exception as exc:
            log.warning("could not stamp activity of %s: %s", vm_id, exc)

    async def woken_call(
        self, tenant_id: str, vm_id: str, call: Callable[[RuntimeManager], Awaitable[R]]
    ) -> R:
        """``call`` on the VM's node (inside ``request``), retried after a wake when an
        automatic live pause came between our check and the node (the node answers 409
        LIVE_PAUSED for a guest whose vCPUs are stopped)."""
        for attempt in range(WAKE_RETRIES + 1):
            try:
                return await call(self.d.node(self.d.reload(vm_id)))
            except PalError as exc:
                if not is_live_paused_error(exc) or attempt == WAKE_RETRIES:
                    raise
                await self.ensure_running(tenant_id, vm_id)
        raise AssertionError("unreachable")
