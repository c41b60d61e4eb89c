"""Guest processes (issue 22; docs/processes.md): the node's calls on the harness's
process table, next to exec and files (exec_files.py) and under the same rules:

- the VM must be running (``VmRegistry.running``: 409, or 409 LIVE_PAUSED, which the
  scheduler turns into a wake);
- a request enters the guest's channel only after ``require_running`` under the VM's
  ``op_lock``, and short ones count as file requests in flight (an operator's live pause
  waits for them); long polls (``pread``/``pwait`` with a wait) do not, so they never
  hold a pause back;
- it is host-observed activity (``LiveVm.touch``), and an attached output stream counts
  as an exec in flight (``active_execs``), so an attached reader keeps its VM awake;
- whatever the guest answers is hostile: checked by guest_input.py (offsets that follow
  each other, sizes within what was asked), its error codes mapped by guest_errors.py.

An output stream (``attach``) never makes up an exit: it ends with ``exit`` once the
process ended and all its output went out, else with ``detached`` and why (the VM
stopped, a live pause stopped its vCPUs, the guest detached it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Literal

from pal.errors import PalError, TooLarge, Unavailable
from pal.guest import protocol as p
from pal.manager import guest_input as gi
from pal.manager.channel import ChannelClosed, GuestError
from pal.manager.vm import LiveVm, VmRegistry
from pal.spec import ProcessStartRequest, SignalRequest, Terminal
from pal.wire.guest_errors import Op, to_pal_error
from pal.wire.processes import (
    MAX_READ_BYTES,
    MAX_STDIN_BYTES,
    MAX_WAIT_MS,
    OutputChunk,
    ProcessDeleted,
    ProcessEvent,
    ProcessInfo,
    ProcessOutput,
    StartedEvent,
    StdinWritten,
)

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0  # a guest that answers a process request later has lost it
LIVE_PAUSE_POLL_S = 0.25  # how often a silent output stream looks whether its VM still runs

STREAMS: dict[int, Literal["stdout", "stderr"]] = {1: "stdout", 2: "stderr"}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class GuestProcesses:
    def __init__(self, registry: VmRegistry) -> None:
        self.registry = registry

    async def _call(
        self, vm_id: str, msg: p.Message, data: bytes | None = None, *, op: Op = "process", wait_ms: int = 0
    ) -> tuple[p.Message, bytes]:
        lv = self.registry.running(vm_id)
        timeout = REQUEST_TIMEOUT_S + wait_ms / 1000
        try:
            return await lv.request_in_flight(msg, data, timeout=timeout, counted=not wait_ms)
        except GuestError as exc:
            raise to_pal_error(exc.guest_code, exc.message, op) from None

    async def start(self, vm_id: str, req: ProcessStartRequest) -> ProcessInfo:
        reply, _ = await self._call(vm_id, _start_message(req), op="exec")  # a missing executable is 400
        return _checked(vm_id, "pstart", lambda: ProcessInfo.model_validate(gi.process_reply(reply)))

    async def start_attached(self, vm_id: str, req: ProcessStartRequest) -> AsyncIterator[StartedEvent]:
        """A process started and followed from its first byte in one guest request: its id
        (``started``), then :meth:`attach`'s events; a stream closed early detaches it."""
        lv = self.registry.running(vm_id)
        msg = {**_start_message(req), "follow": True, "tok": lv.token}
        async with lv.exec_in_flight(msg, abandon=p.K_DETACH) as replies:
            stopped = self._stopped(lv)
            try:
                first = await replies.__anext__()
            except StopAsyncIteration:
                return
            if first["k"] == p.K_ERR:
                code, message = gi.error(first)
                raise to_pal_error(code, message, "exec")  # a missing executable is 400
            pid = first.get("pid")
            if first["k"] != p.K_STARTED or not isinstance(pid, int) or isinstance(pid, bool) or pid < 1:
                raise _bad_reply(vm_id, "pstart", gi.BadReply("no started reply first"))
            yield StartedEvent(type="started", process_id=pid)
            async for ev in _attach_events(lv, replies, 0, stopped):
                yield StartedEvent.model_validate(ev.model_dump())

    async def list(self, vm_id: str) -> list[ProcessInfo]:
        reply, _ = await self._call(vm_id, {"k": p.K_PLIST})
        procs = _checked(vm_id, "plist", lambda: gi.process_list(reply))
        return [ProcessInfo.model_validate(x) for x in procs]

    async def get(self, vm_id: str, pid: int) -> ProcessInfo:
        reply, _ = await self._call(vm_id, {"k": p.K_PGET, "pid": pid})
        return _checked(vm_id, "pget", lambda: ProcessInfo.model_validate(gi.process_reply(reply)))

    async def read(self, vm_id: str, pid: int, start: int, max_bytes: int, wait_ms: int) -> ProcessOutput:
        max_bytes = max(1, min(max_bytes, MAX_READ_BYTES))
        wait_ms = max(0, min(wait_ms, MAX_WAIT_MS))
        msg = {"k": p.K_PREAD, "pid": pid, "from": start, "max_bytes": max_bytes, "wait_ms": wait_ms}
        reply, data = await self._call(vm_id, msg, wait_ms=wait_ms)
        res = _checked(vm_id, "pread", lambda: gi.process_read(reply, data, start, max_bytes))
        chunks = [OutputChunk(stream=STREAMS[fd], offset=off, data=b64(d)) for off, fd, d in res["chunks"]]
        return ProcessOutput.model_validate({**res, "chunks": chunks})

    async def write_stdin(self, vm_id: str, pid: int, data: bytes, eof: bool) -> StdinWritten:
        if len(data) > MAX_STDIN_BYTES:
            raise TooLarge(f"a stdin write takes at most {MAX_STDIN_BYTES} bytes")
        reply, _ = await self._call(vm_id, {"k": p.K_PSTDIN, "pid": pid, "eof": eof}, data)
        written = _checked(vm_id, "pstdin", lambda: gi.stdin_result(reply, len(data)))
        return StdinWritten.model_validate(written)

    async def signal(self, vm_id: str, pid: int, req: SignalRequest) -> None:
        await self._call(vm_id, {"k": p.K_PSIGNAL, "pid": pid, "signal": req.signal})

    async def resize(self, vm_id: str, pid: int, size: Terminal) -> None:
        await self._call(vm_id, {"k": p.K_PRESIZE, "pid": pid, "cols": size.cols, "rows": size.rows})

    async def wait(self, vm_id: str, pid: int, timeout_ms: int) -> ProcessInfo:
        timeout_ms = max(0, min(timeout_ms, MAX_WAIT_MS))
        msg = {"k": p.K_PWAIT, "pid": pid, "timeout_ms": timeout_ms}
        reply, _ = await self._call(vm_id, msg, wait_ms=timeout_ms)
        return _checked(vm_id, "pwait", lambda: ProcessInfo.model_validate(gi.process_reply(reply)))

    async def delete(self, vm_id: str, pid: int) -> ProcessDeleted:
        await self._call(vm_id, {"k": p.K_PDELETE, "pid": pid})
        return ProcessDeleted(process_id=pid, deleted=True)

    # ------------------------------------------------------------------ output stream
    def _stopped(self, lv: LiveVm) -> Callable[[], str | None]:
        incarnation = lv.incarnation

        def stopped() -> str | None:
            # A snapshot pause may park the QEMU with its channel open (parked.py): the VM
            # is no longer this node's live one (or it came back as another incarnation).
            if self.registry.vms.get(lv.vm_id) is not lv or lv.incarnation != incarnation:
                return "vm-stopped"
            return "live-paused" if lv.live is not None else None

        return stopped

    async def attach(self, vm_id: str, pid: int, start: int) -> AsyncIterator[ProcessEvent]:
        """The process's output from ``start`` on, as it comes (see the module's doc)."""
        lv = self.registry.running(vm_id)
        msg: p.Message = {"k": p.K_PATTACH, "tok": lv.token, "pid": pid, "from": start}
        async with lv.exec_in_flight(msg) as replies:
            stopped = self._stopped(lv)
            async for ev in _attach_events(lv, replies, start, stopped):
                yield ev


async def _next_or_stop(
    replies: AsyncGenerator[p.Message, None], stopped: Callable[[], str | None]
) -> p.Message | str:
    """The stream's next reply, or why the VM stopped running first (a live pause, or a
    snapshot pause that parked the QEMU, keeps the channel open: the stream would just
    fall silent)."""
    task = asyncio.ensure_future(replies.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVE_PAUSE_POLL_S)
            if done:
                return task.result()
            why = stopped()
            if why is not None:
                return why
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _attach_events(
    lv: LiveVm, replies: AsyncGenerator[p.Message, None], offset: int, stopped: Callable[[], str | None]
) -> AsyncIterator[ProcessEvent]:
    while True:
        try:
            reply = await _next_or_stop(replies, stopped)
        except StopAsyncIteration:
            return
        except ChannelClosed:
            yield ProcessEvent(type="detached", reason="vm-stopped", offset=offset)
            return
        if isinstance(reply, str):
            yield ProcessEvent(type="detached", reason=reply, offset=offset)
            return
        kind = reply["k"]
        if kind == p.K_OUT:
            chunk = gi.stream_out(reply, offset)
            if chunk is None:
                raise _bad_reply(lv.vm_id, "pattach", gi.BadReply("an out chunk at the wrong offset"))
            fd, data = chunk
            offset += len(data)
            yield ProcessEvent(type="output", stream=STREAMS[fd], offset=offset, data=b64(data))
        elif kind == p.K_GAP:
            lost = gi.gap(reply)
            if lost is None:
                raise _bad_reply(lv.vm_id, "pattach", gi.BadReply("a gap without a size"))
            offset += lost
            yield ProcessEvent(type="gap", lost=lost, offset=offset)
        elif kind == p.K_EXIT:
            status = gi.exit_code(reply)
            yield ProcessEvent(type="exit", exit_code=status, timed_out=reply.get("timed_out") is True)
            return
        elif kind == p.K_ERR:
            code, message = gi.error(reply)
            raise to_pal_error(code, message, "process")
        elif kind == p.K_OK:
            res = reply.get("result")
            why = res.get("reason") if isinstance(res, dict) else None
            reason = gi.text(why, 32) if isinstance(why, str) and why else "detached"
            yield ProcessEvent(type="detached", reason=reason, offset=offset)
            return


def _start_message(req: ProcessStartRequest) -> p.Message:
    return {
        "k": p.K_PSTART,
        "argv": [req.command, *req.argv],
        "env": req.env,
        "cwd": req.cwd,
        "timeout": req.timeout_secs,
        "user": req.user,
        "stdin": req.stdin,
        "pty": req.pty.model_dump() if req.pty is not None else None,
        "tag": req.tag,
        "keep_awake": req.keep_awake,
        "journal_bytes": req.journal_bytes,
    }


def _checked(vm_id: str, kind: str, parse: Any) -> Any:
    try:
        return parse()
    except (gi.BadReply, ValueError) as exc:
        raise _bad_reply(vm_id, kind, exc) from None


def _bad_reply(vm_id: str, kind: str, exc: Exception) -> PalError:
    log.warning("VM %s: invalid %s reply from the guest: %s", vm_id, kind, gi.text(str(exc)))
    return Unavailable(f"VM {vm_id}: the guest sent an invalid reply to {kind}", code="GUEST_ERROR")
