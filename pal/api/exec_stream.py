"""Exec over HTTP: buffered JSON, or Server-Sent Events flushed as the guest produces output.

A guest error ends the exec with the error of pal/manager/guest_errors.py (the one
mapping of guest codes): as the answer of a buffered exec, as an `error` event on SSE. A
timeout (ETIMEDOUT) is not an error: it is answered like `timeout(1)` does, `exitCode: 124,
timedOut: true` with the output so far, rather than 408, because the command did run and
its partial output is what the caller needs to see.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, Union

from fastapi.responses import StreamingResponse

from pal.errors import PalError
from pal.wire.guest_errors import to_pal_error
from pal.wire.models import ExecEvent

from .errors import error_response, public_error
from .exec_budget import ExecBudget, Lease, LeasedJSON
from .json_response import JSONResponse
from .models import ExecOut

TIMEOUT_EXIT_CODE = 124
# How long an SSE request waits for its first event before sending headers. Errors that
# come before it (404, 409, 402, missing executable) get their real HTTP status; after it
# they arrive as an `error` event on a 200 stream.
FIRST_EVENT_GRACE_S = 1.0
KEEPALIVE_S = 15.0

BUFFERED_OUTPUT_MAX = 8 * 1024 * 1024  # characters kept per stream in a buffered exec


def _is_timeout(ev: ExecEvent) -> bool:
    return ev.type == "error" and ev.code == "ETIMEDOUT"


class _Capped:
    """One output stream of a buffered exec, kept up to BUFFERED_OUTPUT_MAX characters and
    as far as the tenant's budget has room (exec_budget.py): a command printing without
    end must not grow the server's memory without end (stream it with SSE to get
    everything)."""

    def __init__(self, lease: Lease | None = None) -> None:
        self.parts: list[str] = []
        self.size = 0
        self.cut = False
        self.lease = lease

    def add(self, data: str) -> None:
        room = BUFFERED_OUTPUT_MAX - self.size
        if len(data) > room:
            data, self.cut = data[: max(room, 0)], True
        if self.lease is not None and data:
            granted = self.lease.take(len(data))
            if granted < len(data):
                data, self.cut = data[:granted], True
        self.parts.append(data)
        self.size += len(data)

    def text(self) -> str:
        return "".join(self.parts)


PROCESS_ID_HEADER = "X-Pal-Process-Id"  # every exec answer names its process (docs/processes.md)


def _out(code: int, out: _Capped, err: _Capped, pid: int | None, timed_out: bool | None = None) -> ExecOut:
    cut = (out.cut or err.cut) or None
    return ExecOut(
        exit_code=code,
        stdout=out.text(),
        stderr=err.text(),
        timed_out=timed_out,
        truncated=cut,
        process_id=pid,
    )


async def buffered_exec(events: AsyncIterator[ExecEvent], lease: Lease | None = None) -> ExecOut:
    """The exec's answer once it ends; its output counted against ``lease`` (the tenant's
    budget), which the caller releases once the answer is sent."""
    stdout, stderr = _Capped(lease), _Capped(lease)
    pid: int | None = None
    try:
        async for ev in events:
            if ev.type == "process":
                pid = ev.process_id
            elif ev.type == "stdout":
                stdout.add(ev.data or "")
            elif ev.type == "stderr":
                stderr.add(ev.data or "")
            elif ev.type == "exit":
                return _out(ev.exit_code if ev.exit_code is not None else -1, stdout, stderr, pid)
            elif _is_timeout(ev):
                return _out(TIMEOUT_EXIT_CODE, stdout, stderr, pid, timed_out=True)
            elif ev.type == "detached":
                raise _detached(ev, pid)
            else:
                raise to_pal_error(ev.code, ev.message, "exec")
    finally:
        await _aclose(events)
    raise PalError("exec stream ended without an exit status", code="GUEST_ERROR", status=503)


async def budgeted_exec(
    budget: ExecBudget, tenant: str, open_events: Callable[[], AsyncIterator[ExecEvent]]
) -> LeasedJSON:
    """A buffered exec under ``tenant``'s budget: 429 before anything runs when the budget
    is all held; the memory counted until the answer is sent."""
    lease = budget.lease(tenant)
    try:
        out = await buffered_exec(open_events(), lease)
    except BaseException:
        lease.release()
        raise
    resp = LeasedJSON(out.model_dump(mode="json", by_alias=True, exclude_none=True), lease)
    if out.process_id is not None:
        resp.headers[PROCESS_ID_HEADER] = str(out.process_id)
    return resp


def _detached(ev: ExecEvent, pid: int | None) -> PalError:
    return PalError(
        f"the exec's output stream was detached ({ev.reason}) before the command ended; it runs on"
        f" as process {pid}: read its output with GET .../processes/{pid}/output",
        code="DETACHED",
        status=503,
    )


def sse_frame(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def event_frame(ev: ExecEvent) -> bytes:
    if ev.type == "process":
        return sse_frame("process", {"processId": ev.process_id})
    if ev.type in ("stdout", "stderr"):
        return sse_frame(ev.type, {"data": ev.data or ""})
    if ev.type == "exit":
        return sse_frame("exit", {"exitCode": ev.exit_code if ev.exit_code is not None else -1})
    if _is_timeout(ev):
        return sse_frame("exit", {"exitCode": TIMEOUT_EXIT_CODE, "timedOut": True})
    if ev.type == "detached":  # the command runs on: its process id came first
        return sse_frame("detached", {"reason": ev.reason or "detached"})
    err = to_pal_error(ev.code, ev.message, "exec")
    return sse_frame("error", public_error(err.status, err.code, err.message))


class StreamEnd(enum.Enum):
    DONE = "done"


_DONE = StreamEnd.DONE  # the pump's last item: the stream ended
E = TypeVar("E")
# What a pump's queue carries: the stream's events, then a PalError if it failed, then _DONE.
Pumped = Union[E, PalError, StreamEnd]  # noqa: UP007 (a generic alias: `|` cannot take a TypeVar at runtime)


async def _aclose(events: AsyncIterator[Any]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


def start_pump(
    open_events: Callable[[], AsyncIterator[E]], what: str
) -> tuple[asyncio.Queue[Pumped[E]], asyncio.Task[None]]:
    """Drive ``open_events()`` in one task (the scheduler's iterator lives in a single
    task) into a small queue: its events, then a PalError if it failed, then ``_DONE``."""
    queue: asyncio.Queue[Pumped[E]] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        events = open_events()
        try:
            async for ev in events:
                await queue.put(ev)
        except PalError as exc:
            await queue.put(exc)
        except Exception as exc:
            await queue.put(PalError(f"{what} failed: {type(exc).__name__}: {exc}", status=503))
        finally:
            await _aclose(events)
            await queue.put(_DONE)

    return queue, asyncio.create_task(pump())


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel the pump once and let it clean up (close the manager stream, which cancels
    the command in the guest). Not ``await task``: when the client went away, Starlette's
    cancel scope cancels *us* again and again, and each cancel of a task blocked in
    ``await task`` is passed on to ``task``, interrupting its cleanup half-way (the
    connection to the manager was left open and the command kept running)."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.wait({task})


async def pumped_sse(
    open_events: Callable[[], AsyncIterator[E]],
    what: str,
    *,
    frame: Callable[[E], bytes],
    ends: Callable[[E], bool],
    done_frame: bytes,
    grace_s: float = FIRST_EVENT_GRACE_S,
    first_headers: Callable[[E], dict[str, str]] | None = None,
) -> StreamingResponse | JSONResponse:
    """A node stream as SSE, the one way exec, process output and code cells are streamed.

    One pump task drives the scheduler's iterator (so it lives in a single task) into a
    small queue; the response drains the queue, with keepalives. A refusal within
    ``grace_s`` keeps its HTTP status; a later one is an ``error`` event. ``frame`` renders
    an event (empty: nothing to send), ``ends`` says which event is the last, and
    ``done_frame`` is sent when the stream ends without one (never a made-up outcome). When
    the client goes away the response generator is cancelled, which cancels the pump, which
    closes the iterator."""
    queue, task = start_pump(open_events, what)
    first: Pumped[E] | None = None
    try:
        first = await asyncio.wait_for(queue.get(), timeout=grace_s)
    except TimeoutError:
        first = None
    if isinstance(first, PalError):
        await _stop(task)
        return error_response(first.status, first.code, first.message)

    async def body() -> AsyncIterator[bytes]:
        try:
            item: Pumped[E] | None = first
            while True:
                if item is None:
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout=KEEPALIVE_S)
                    except TimeoutError:
                        yield b": keepalive\n\n"
                        continue
                if isinstance(item, StreamEnd):
                    yield done_frame
                    return
                if isinstance(item, PalError):
                    yield sse_frame("error", public_error(item.status, item.code, item.message))
                    return
                data = frame(item)
                if data:
                    yield data
                if ends(item):
                    return
                item = None
        finally:
            await _stop(task)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if first_headers is not None and first is not None and not isinstance(first, StreamEnd):
        headers.update(first_headers(first))
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


def _process_header(first: ExecEvent) -> dict[str, str]:
    if first.type == "process":
        return {PROCESS_ID_HEADER: str(first.process_id)}
    return {}


async def sse_exec(
    open_events: Callable[[], AsyncIterator[ExecEvent]], grace_s: float = FIRST_EVENT_GRACE_S
) -> StreamingResponse | JSONResponse:
    """Stream exec events as SSE (pumped_sse). A guest-side failure (e.g. executable not
    found) is part of the exec's outcome and arrives as an ``error`` event; only
    control-plane refusals (404/409/402...) keep their HTTP status, since for those no exec
    ever started. The first event names the process (also in a header)."""
    return await pumped_sse(
        open_events,
        "exec",
        frame=event_frame,
        ends=lambda ev: ev.type in ("exit", "error", "detached"),
        done_frame=sse_frame(
            "error", {"code": "GUEST_ERROR", "message": "exec ended without an exit status"}
        ),
        grace_s=grace_s,
        first_headers=_process_header,
    )
