"""envd's processes (:class:`ops.ProcessOps`) over Pal's processes and their output
journals: each call is one guest verb through the scheduler's :class:`GuestCalls` (which
resolves the tenant's VM, wakes an automatically paused one, counts it in flight).

- ``Start``: a Pal process (stdin kept open unless the SDK said no, a terminal when asked)
  as E2B's user, in its home, with E2B's environment (conventions.py), followed from the
  first byte of its journal: one node call and one guest request (``start_attached``).
- ``Connect``: the same process followed again from the last byte this server handed to a
  stream of it (its journal holds everything since: a client whose stream broke on a
  pause loses nothing), or from now for a process no stream of this server followed.
- A stream that ends because the sandbox stopped (a pause) ends with ``unavailable``; one
  that ends for a live pause attaches again where it was.
- A process killed by a signal ends as envd says it: ``exited: false``, ``signal: killed``.
"""

from __future__ import annotations

import base64
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pal.errors import Conflict, NotFound, TooLarge, Unavailable
from pal.scheduler.guest import GuestCalls
from pal.spec import Terminal
from pal.wire import verbs
from pal.wire.models import VmRef
from pal.wire.processes import (
    MAX_STDIN_BYTES,
    AttachFrom,
    ProcessEvent,
    ProcessInfo,
    ProcessRef,
    ProcessResize,
    ProcessSignal,
    ProcessStart,
    StartedEvent,
    StdinWrite,
)

from . import conventions as conv
from . import ops

HIDDEN_TAG_PREFIX = "pal-e2b:"  # the surface's own helper processes (files.py)
MAX_PID = 2**53  # the wire's bound on a process id
MAX_FOLLOWED = 10_000  # (sandbox, pid) -> offset pairs kept for reconnects
REATTACH_TRIES = 20  # a stream detached by live pauses in a row
SIGNALS = {128 + 9: "signal: killed", 128 + 15: "signal: terminated", 128 + 2: "signal: interrupt"}
STDIN_TRIES = 100  # writes in a row the process takes nothing of
MORE, END, AGAIN = "more", "end", "again"  # a followed stream after an event


def ended(exit_code: int | None, timed_out: bool | None) -> ops.ProcessEnded:
    code = exit_code if exit_code is not None else -1
    if code in SIGNALS:
        return ops.ProcessEnded(-1, exited=False, status=SIGNALS[code], error=SIGNALS[code])
    if timed_out:
        return ops.ProcessEnded(code, exited=False, status="signal: killed", error="timed out")
    status = f"exit status {code}"
    return ops.ProcessEnded(code, exited=True, status=status, error=status if code else None)


@dataclass
class PalProcesses:
    guest: GuestCalls
    # Where each process's last stream stopped: a Connect goes on from there.
    followed: OrderedDict[tuple[str, int], int] = field(default_factory=OrderedDict)

    def _mark(self, caller: ops.Caller, pid: int, offset: int) -> None:
        key = (caller.sandbox_id, pid)
        self.followed[key] = offset
        self.followed.move_to_end(key)
        while len(self.followed) > MAX_FOLLOWED:
            self.followed.popitem(last=False)

    async def _info(self, caller: ops.Caller, ref: ops.ProcessRef) -> ProcessInfo:
        if ref.pid is not None and not 1 <= ref.pid <= MAX_PID:
            raise NotFound(f"process {ref.pid} not found")
        if ref.pid is not None:
            at = ProcessRef(vm_id=caller.sandbox_id, pid=ref.pid)
            return await self.guest.call(caller.tenant, verbs.GET_PROCESS, at)
        listed = await self.guest.call(caller.tenant, verbs.LIST_PROCESSES, _vm(caller))
        for p in listed.processes:
            if p.tag == ref.tag and p.running:
                return p
        raise NotFound(f"no running process tagged {ref.tag!r}")

    async def _pid(self, caller: ops.Caller, ref: ops.ProcessRef) -> int:
        if ref.pid is not None and not 1 <= ref.pid <= MAX_PID:
            raise NotFound(f"process {ref.pid} not found")
        return ref.pid if ref.pid is not None else (await self._info(caller, ref)).process_id

    def start(self, caller: ops.Caller, spec: ops.ProcessSpec) -> AsyncIterator[ops.ProcessEvent]:
        req = ProcessStart.model_validate(
            {
                "vmId": caller.sandbox_id,
                "command": spec.cmd,
                "argv": list(spec.args),
                "env": conv.process_env(caller.sandbox_id, caller.user, spec.envs),
                "cwd": conv.absolute(caller.user, spec.cwd) if spec.cwd else conv.home_of(caller.user),
                "user": conv.pal_user(caller.user),
                "stdin": spec.stdin or spec.pty is not None,
                "pty": Terminal(cols=spec.pty[0], rows=spec.pty[1]) if spec.pty else None,
                "tag": spec.tag or "",
            }
        )

        async def events() -> AsyncIterator[ops.ProcessEvent]:
            # One guest request starts it and follows it (start_attached); a stream a live
            # pause detached goes on as Connect's does, from where it stopped.
            pid, pty, offset = 0, spec.pty is not None, 0
            stream = self.guest.stream(caller.tenant, verbs.START_ATTACHED, req)
            async with contextlib.aclosing(stream) as started:
                async for ev in started:
                    if ev.type == "started" and ev.process_id is not None:
                        pid = ev.process_id
                        self._mark(caller, pid, 0)
                        yield ops.ProcessStarted(pid)
                        continue
                    out, offset, how = self._step(caller, pid, offset, ev, pty)
                    if out is not None:
                        yield out
                    if how != MORE:
                        break
                else:
                    return
            if how == AGAIN:
                async for more in self._follow(caller, pid, offset, pty):
                    yield more

        return events()

    def connect(self, caller: ops.Caller, ref: ops.ProcessRef) -> AsyncIterator[ops.ProcessEvent]:
        async def events() -> AsyncIterator[ops.ProcessEvent]:
            info = await self._info(caller, ref)
            start = self.followed.get((caller.sandbox_id, info.process_id))
            if start is None:
                if not info.running:
                    raise NotFound(f"process {info.process_id} is not running")
                start = info.journal.end
            yield ops.ProcessStarted(info.process_id)
            async for ev in self._follow(caller, info.process_id, start, info.pty is not None):
                yield ev

        return events()

    def _step(
        self, caller: ops.Caller, pid: int, offset: int, ev: ProcessEvent | StartedEvent, pty: bool
    ) -> tuple[ops.ProcessEvent | None, int, str]:
        """One event of a followed process: what to hand on, the offset after it, and
        whether the stream goes on (MORE), ended (END) or must attach again (AGAIN)."""
        if ev.type == "output" and ev.data is not None:
            stream = "pty" if pty else (ev.stream or "stdout")
            offset = ev.offset if ev.offset is not None else offset
            self._mark(caller, pid, offset)
            return ops.ProcessOutput(stream, base64.b64decode(ev.data)), offset, MORE  # type: ignore[arg-type]
        if ev.type == "gap":
            offset = ev.offset if ev.offset is not None else offset
            self._mark(caller, pid, offset)
            return None, offset, MORE
        if ev.type == "exit":
            self.followed.pop((caller.sandbox_id, pid), None)
            return ended(ev.exit_code, ev.timed_out), offset, END
        if ev.type == "detached":
            if ev.reason not in ("live-paused", "detached"):
                raise Unavailable(f"the sandbox stopped running ({ev.reason}): connect to it again")
            return None, offset, AGAIN  # attach again where it stopped (the VM is woken)
        if ev.type == "error":
            raise Unavailable(f"the process's output broke off: {ev.message or ev.code}")
        return None, offset, MORE

    async def _follow(
        self, caller: ops.Caller, pid: int, start: int, pty: bool
    ) -> AsyncIterator[ops.ProcessEvent]:
        offset = start
        for _ in range(REATTACH_TRIES):
            req = AttachFrom(vm_id=caller.sandbox_id, pid=pid, start=offset)
            how = END
            async with contextlib.aclosing(self.guest.attach(caller.tenant, req)) as events:
                async for ev in events:
                    out, offset, how = self._step(caller, pid, offset, ev, pty)
                    if out is not None:
                        yield out
                    if how != MORE:
                        break
            if how != AGAIN:
                return
        raise Unavailable("the process's output keeps breaking off: connect to it again")

    async def list_processes(self, caller: ops.Caller) -> list[ops.ProcessInfo]:
        listed = await self.guest.call(caller.tenant, verbs.LIST_PROCESSES, _vm(caller))
        return [
            ops.ProcessInfo(
                p.process_id, p.argv[0] if p.argv else "", tuple(p.argv[1:]), {}, p.cwd, p.tag or None
            )
            for p in listed.processes
            if p.running and not p.tag.startswith(HIDDEN_TAG_PREFIX)
        ]

    async def send_input(self, caller: ops.Caller, ref: ops.ProcessRef, data: bytes, pty: bool) -> None:
        pid = await self._pid(caller, ref)
        rest, idle = data, 0
        while rest:
            chunk = rest[:MAX_STDIN_BYTES]
            req = StdinWrite(vm_id=caller.sandbox_id, pid=pid, data=chunk)
            try:
                got = await self.guest.call(caller.tenant, verbs.WRITE_STDIN, req)
            except Conflict as exc:
                raise NotFound(f"process {pid} takes no input: {exc.message}") from None
            rest = rest[got.written :]
            idle = idle + 1 if got.written == 0 else 0
            if idle >= STDIN_TRIES:
                raise TooLarge(f"process {pid} reads none of its input")

    async def close_stdin(self, caller: ops.Caller, ref: ops.ProcessRef) -> None:
        pid = await self._pid(caller, ref)
        req = StdinWrite(vm_id=caller.sandbox_id, pid=pid, eof=True)
        try:
            await self.guest.call(caller.tenant, verbs.WRITE_STDIN, req)
        except Conflict:
            pass  # already closed, or it exited: nothing left to close

    async def signal(self, caller: ops.Caller, ref: ops.ProcessRef, signal: ops.Signal) -> None:
        pid = await self._pid(caller, ref)
        name = "KILL" if signal == "SIGKILL" else "TERM"
        req = ProcessSignal.model_validate({"vmId": caller.sandbox_id, "pid": pid, "signal": name})
        try:
            await self.guest.call(caller.tenant, verbs.SIGNAL_PROCESS, req)
        except Conflict:
            raise NotFound(f"process {pid} is not running") from None

    async def resize(self, caller: ops.Caller, ref: ops.ProcessRef, cols: int, rows: int) -> None:
        pid = await self._pid(caller, ref)
        req = ProcessResize.model_validate(
            {"vmId": caller.sandbox_id, "pid": pid, "cols": cols, "rows": rows}
        )
        await self.guest.call(caller.tenant, verbs.RESIZE_PROCESS, req)


def _vm(caller: ops.Caller) -> VmRef:
    return VmRef(vm_id=caller.sandbox_id)
